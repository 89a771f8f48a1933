"""Issue #18's closing table from an ``offload_cal_device_check.py`` JSON: cache fraction x M x prefetch per
stream, each mode's tok/s, hit rate, floor and step / floor, the simulator's hit rate, "auto" over the
better pure mode, and prefetch's hit-rate gain on the skewed stream. The floor pairs each step with its all-hit
twin in the same round (``offload_cells._floors``); the ranges by the twin's median step, the floor before
session 23, are listed beside it where the JSON has them.

    python3 benchmarks/offload_issue_table.py benchmarks/results/raw/<file>.json [<more>.json ...]   (markdown)

Several JSONs (one table run split into invocations by ``--cells``) are joined, in the order given; a cell
(stream, cache %, prefetch, M, mode) found in two of them is an error, not a silent pick.
"""

from __future__ import annotations

import json
import statistics
import sys

from moekit.bench.offload_report import auto_vs_best, modes_by_cell

MODES = ("gpu", "cpu", "auto")


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: one row per (stream, cache %, prefetch, M) in the JSON's order."""
    head = ["stream", "cache", "prefetch", "M"] + [f"{m} {f}" for m in MODES for f in ("tok/s", "hit", "floor ms", "x floor")]
    out = ["| " + " | ".join(head + ["sim hit (gpu)", "auto / best"]) + " |", "|" + " --- |" * (len(head) + 2)]
    for (stream, fraction, _, prefetch, m), modes in modes_by_cell(rows).items():
        cells = [stream, f"{fraction:.0%}", prefetch, str(m)]
        for mode in MODES:
            r = modes.get(mode)
            cells += ["-"] * 4 if r is None else [f"{r['tok_s']:.1f}", f"{r['hit_rate']:.3f}", f"{r['floor_ms']:.2f}",
                                                  f"{r['x_floor']:.2f}"]
        sim = modes.get("gpu", {}).get("sim_hit_rate")
        q = auto_vs_best(modes)
        cells += ["-" if sim is None else f"{sim:.3f}", "-" if q is None else f"{q:.3f}"]
        out.append("| " + " | ".join(cells) + " |")
    return out


def targets(rows: list[dict]) -> list[str]:
    """The issue's four targets over the table."""
    out = []
    for mode in MODES:
        xs = [r["x_floor"] for r in rows if r["compute_misses_on"] == mode]
        if xs:
            out.append(f"{mode}: x floor {min(xs):.2f}-{max(xs):.2f}, {sum(x > 1.2 for x in xs)} of {len(xs)} > 1.2")
        med = [r["x_floor_median"] for r in rows if r["compute_misses_on"] == mode and r.get("x_floor_median")]
        if med:  # the floor before session 23: the group's fixed cost (the all-hit stack's median step) throughout
            out.append(f"{mode}: x floor by the all-hit stack's median step throughout {min(med):.2f}-{max(med):.2f}, "
                       f"{sum(x > 1.2 for x in med)} of {len(med)} > 1.2")
    if rows:
        out.append(f"largest |hit - sim| {max(abs(r['hit_rate'] - r['sim_hit_rate']) for r in rows):.4f}")
    cells = modes_by_cell(rows)
    q = [v for modes in cells.values() if (v := auto_vs_best(modes)) is not None]
    if q:
        out.append(f"auto / best pure: worst {max(q):.3f}, mean {statistics.fmean(q):.3f}, {sum(v > 1.0 for v in q)} of {len(q)} > 1")
    gains = [on["hit_rate"] - cells[k[:3] + ("none",) + k[4:]][mode]["hit_rate"] for k, modes in cells.items()
             if k[3] == "router" and k[:3] + ("none",) + k[4:] in cells for mode, on in modes.items()
             if mode in MODES and mode in cells[k[:3] + ("none",) + k[4:]]]
    if gains:
        out.append(f"prefetch (router) hit gain on skewed: mean {statistics.fmean(gains):+.3f}, least {min(gains):+.3f}")
    return out


def joined(paths: list[str]) -> list[dict]:
    """The rows of every JSON in ``paths``, in order; a (stream, cache fraction, prefetch, M, mode) twice raises."""
    rows, seen = [], {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["rows"]:
                key = (r["stream"], r["cache_fraction"], r["prefetch"], r["M"], r["compute_misses_on"])
                if key in seen:
                    raise SystemExit(f"cell {key} is in both {seen[key]} and {path}")
                seen[key] = path
                rows.append(r)
    return rows


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: offload_issue_table.py RUN.json [RUN2.json ...]")
    rows = joined(argv)
    print("\n".join(table(rows)))
    print()
    print("\n".join(f"- {line}" for line in targets(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

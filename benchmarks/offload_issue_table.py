"""Issue #18's closing table from an ``offload_cal_device_check.py`` JSON: cache fraction x M x prefetch per
stream, each mode's tok/s, hit rate, floor and step / floor, the simulator's hit rate, "auto" over the
better pure mode, and prefetch's hit-rate gain on the skewed stream. The floor pairs each step with its all-hit
twin in the same round (``offload_cells._floors``); the ranges by the twin's median step, the floor before
session 23, are listed beside it where the JSON has them.

"Measured step time" is the mean step (a decode run's time is the sum of its steps; tok/s = M / mean): the
"x floor" columns and the 1.2 target read it. Beside it, where the JSON has each step's floor
(``floor_times_ms``), the median step over the median floor ("med") and the steps over 1.5x their own floor
("stalled"): a stall a few steps in a run take shows as mean over median, not hidden by it.

"auto" against the better pure mode (the one with the lower mean, ``best``), per cell: auto's steps less
best's, paired by step (the stacks take turns: step i of each ran in the same round), d_i, over best's mean
step; auto is slower where mean(d) > 2 sqrt(sem(d)^2 + t^2), t the twin's noise at that M (``twin_rms``:
gpu2 and gpu, one stack run twice, differ by this beyond the pairing; on b89fbea the paired 2-sem test alone
called 4 of 27 twin cells slower). Per M ("at each M" of the issue's target): the cells' relative mean(d)
averaged, against 2 sqrt(s^2 + t^2 / n), s = sqrt(sum of sem^2) / n over the n cells. The same test runs on
the twin (gpu2 against gpu), where every "slower" is a false alarm.

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


def median_x(r: dict) -> float | None:
    """The median step over the median floor, where the row has each step's floor."""
    if not r.get("floor_times_ms") or not r.get("step_times_ms"):
        return None
    return statistics.median(r["step_times_ms"]) / statistics.median(r["floor_times_ms"])


def stalled(r: dict) -> int | None:
    """Steps over 1.5x their own floor."""
    if not r.get("floor_times_ms"):
        return None
    return sum(s > 1.5 * f for s, f in zip(r["step_times_ms"], r["floor_times_ms"]))


def paired(modes: dict[str, dict], mode: str, base: str) -> tuple[float, float, int] | None:
    """(mean of ``mode``'s step less ``base``'s, its standard error, both over base's mean step; steps), paired
    by step (module docstring); None without both or two steps."""
    if mode not in modes or base not in modes:
        return None
    d = [a - b for a, b in zip(modes[mode].get("step_times_ms", []), modes[base].get("step_times_ms", []))]
    if len(d) < 2:
        return None
    return (statistics.fmean(d) / modes[base]["step_ms"], statistics.stdev(d) / len(d) ** 0.5 / modes[base]["step_ms"],
            len(d))


def paired_vs_best(modes: dict[str, dict]) -> tuple[float, float, int] | None:
    """``paired`` of auto against the better pure mode (the lower mean); None without the three modes."""
    if not {"gpu", "cpu", "auto"} <= set(modes):
        return None
    return paired(modes, "auto", min(("gpu", "cpu"), key=lambda m: modes[m]["step_ms"]))


def _auto_text(modes: dict[str, dict]) -> str:
    """auto / best by means (by medians), paired relative difference ± sem, "slower" past 2 sem."""
    q, p = auto_vs_best(modes), paired_vs_best(modes)
    if q is None:
        return "-"
    best = min(("gpu", "cpu"), key=lambda m: modes[m]["step_ms"])
    med = [modes[m].get("step_times_ms") for m in ("auto", best)]
    text = f"{q:.3f}" + (f" ({statistics.median(med[0]) / statistics.median(med[1]):.3f})" if all(med) else "")
    if p is not None:
        text += f" {p[0]:+.3f}±{p[1]:.3f}" + (" slower" if p[0] > 2 * p[1] else "")
    return text


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: one row per (stream, cache %, prefetch, M) in the JSON's order."""
    head = ["stream", "cache", "prefetch", "M"] + [f"{m} {f}" for m in MODES
                                                   for f in ("tok/s", "hit", "floor ms", "x floor")]
    head += ["x floor med (gpu/cpu/auto)", "stalled (gpu/cpu/auto)"]
    out = ["| " + " | ".join(head + ["sim hit (gpu)", "auto / best: means (medians) paired ±sem"]) + " |",
           "|" + " --- |" * (len(head) + 2)]
    for (stream, fraction, _, prefetch, m), modes in modes_by_cell(rows).items():
        cells = [stream, f"{fraction:.0%}", prefetch, str(m)]
        for mode in MODES:
            r = modes.get(mode)
            cells += ["-"] * 4 if r is None else [f"{r['tok_s']:.1f}", f"{r['hit_rate']:.3f}", f"{r['floor_ms']:.2f}",
                                                  f"{r['x_floor']:.2f}"]
        meds = [median_x(modes[m]) if m in modes else None for m in MODES]
        stall = [stalled(modes[m]) if m in modes else None for m in MODES]
        steps = len(modes.get("auto", {}).get("step_times_ms", []))
        cells += ["/".join("-" if v is None else f"{v:.2f}" for v in meds),
                  "/".join("-" if v is None else str(v) for v in stall) + f" of {steps}"]
        sim = modes.get("gpu", {}).get("sim_hit_rate")
        cells += ["-" if sim is None else f"{sim:.3f}", _auto_text(modes)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def targets(rows: list[dict]) -> list[str]:
    """The issue's four targets over the table."""
    out = []
    for mode in MODES:
        xs = [r["x_floor"] for r in rows if r["compute_misses_on"] == mode]
        if xs:
            out.append(f"{mode}: x floor {min(xs):.2f}-{max(xs):.2f}, {sum(x > 1.2 for x in xs)} of {len(xs)} > 1.2")
        by_median = [v for r in rows if r["compute_misses_on"] == mode and (v := median_x(r)) is not None]
        if by_median:
            out.append(f"{mode}: median step over median floor {min(by_median):.2f}-{max(by_median):.2f}, "
                       f"{sum(x > 1.2 for x in by_median)} of {len(by_median)} > 1.2; steps over 1.5x their floor: "
                       f"{sum(stalled(r) or 0 for r in rows if r['compute_misses_on'] == mode)} of "
                       f"{sum(len(r['step_times_ms']) for r in rows if r['compute_misses_on'] == mode)}")
        med = [r["x_floor_median"] for r in rows if r["compute_misses_on"] == mode and r.get("x_floor_median")]
        if med:  # the floor before session 23: the group's fixed cost (the all-hit stack's median step) throughout
            out.append(f"{mode}: x floor by the all-hit stack's median step throughout {min(med):.2f}-{max(med):.2f}, "
                       f"{sum(x > 1.2 for x in med)} of {len(med)} > 1.2")
    if rows:
        out.append(f"largest |hit - sim| {max(abs(r['hit_rate'] - r['sim_hit_rate']) for r in rows):.4f}")
    cells = modes_by_cell(rows)
    q = [v for modes in cells.values() if (v := auto_vs_best(modes)) is not None]
    if q:
        out.append(f"auto / best pure: worst {max(q):.3f}, mean {statistics.fmean(q):.3f}, {sum(v > 1.0 for v in q)} "
                   f"of {len(q)} > 1")
    out += never_slower(cells)
    gains = [on["hit_rate"] - cells[k[:3] + ("none",) + k[4:]][mode]["hit_rate"] for k, modes in cells.items()
             if k[3] == "router" and k[:3] + ("none",) + k[4:] in cells for mode, on in modes.items()
             if mode in MODES and mode in cells[k[:3] + ("none",) + k[4:]]]
    if gains:
        out.append(f"prefetch (router) hit gain on skewed: mean {statistics.fmean(gains):+.3f}, "
                   f"least {min(gains):+.3f}")
    return out


def twin_rms(cells: dict) -> dict[int, float]:
    """M -> the root mean square over the cells at M of gpu2's mean step over gpu's, less 1: the two runs of one
    stack differ by this much beyond what pairing their steps removes (drift, placement)."""
    by_m: dict[int, list[float]] = {}
    for key, modes in cells.items():
        if "gpu2" in modes and "gpu" in modes:
            by_m.setdefault(key[4], []).append(modes["gpu2"]["step_ms"] / modes["gpu"]["step_ms"] - 1.0)
    return {m: statistics.fmean(v * v for v in vs) ** 0.5 for m, vs in by_m.items()}


def never_slower(cells: dict) -> list[str]:
    """The target "auto never slower than the better pure mode at each M", per cell and per M pooled, with the
    margin of the module docstring; beside it the same test on the twin (gpu2 against gpu, one stack twice),
    where every "slower" is a false alarm of the margin."""
    rms, out = twin_rms(cells), []
    for label, test in (("auto vs best pure", paired_vs_best),
                        ("twin gpu2 vs gpu (null)", lambda c: paired(c, "gpu2", "gpu"))):
        pairs = {key: p for key, modes in cells.items() if (p := test(modes)) is not None}
        for m in sorted({key[4] for key in pairs}):
            at = {key: p for key, p in pairs.items() if key[4] == m}
            noise = rms.get(m, 0.0)
            slower = [k for k, p in at.items() if p[0] > 2 * (p[1] ** 2 + noise ** 2) ** 0.5]
            mean = statistics.fmean(p[0] for p in at.values())
            sem = sum(p[1] ** 2 for p in at.values()) ** 0.5 / len(at)
            margin = 2 * (sem ** 2 + noise ** 2 / len(at)) ** 0.5
            out.append(f"{label} at M = {m}: pooled {mean:+.3f} of the base's step over {len(at)} cells, margin "
                       f"{margin:.3f} (sem {sem:.3f}, twin rms {noise:.3f}): "
                       f"{'SLOWER' if mean > margin else 'not slower'}; cells slower beyond their margin: {len(slower)}"
                       + (": " + ", ".join(
                           f"{k[0]}/{k[1]:.0%}/{k[3]} {at[k][0]:+.3f}±{at[k][1]:.3f}" for k in slower) if slower
                          else "")
                       + f"; worst cell {max(p[0] for p in at.values()):+.3f}")
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

"""``moekit bench --offload``'s tables: a row's line, the cells (each mode of one setting side by side,
"auto" over the faster pure mode) and the summary against issue #18's targets."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moekit.bench.offload_measure import OffloadRow

NOISE = 0.03  # step-time differences below this fraction are reported as within noise


def format_row(r: OffloadRow) -> str:
    """One table line: stream, cache %, policy, prefetch, mode, M, step ms, floor ms, x floor, hit, sim hit, tok/s."""
    return (f"{r.stream:>7} {r.cache_fraction:5.0%} {r.policy:>4} {r.prefetch:>6} {r.compute_misses_on:>4} "
            f"{r.M:>3} {r.step_ms:9.2f} {r.floor_ms:9.2f} {r.x_floor:6.2f} {r.hit_rate:6.3f} {r.sim_hit_rate:6.3f} "
            f"{r.tok_s:9.1f}")


HEADER = (f"{'stream':>7} {'cache':>5} {'pol':>4} {'prefet':>6} {'mode':>4} {'M':>3} {'step ms':>9} {'floor ms':>9} "
          f"{'xfloor':>6} {'hit':>6} {'sim':>6} {'tok/s':>9}")


def modes_by_cell(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """(stream, cache %, policy, prefetch, M) -> {mode: row}, in the rows' order."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["stream"], r["cache_fraction"], r["policy"], r["prefetch"], r["M"]),
                         {})[r["compute_misses_on"]] = r
    return cells


def auto_vs_best(modes: dict[str, dict]) -> float | None:
    """auto's step over the faster pure mode's (None unless the cell ran all three)."""
    if not {"gpu", "cpu", "auto"} <= set(modes):
        return None
    return modes["auto"]["step_ms"] / min(modes["gpu"]["step_ms"], modes["cpu"]["step_ms"])


def by_cell(rows: list[dict]) -> list[dict]:
    """Per (stream, cache %, policy, prefetch, M): each mode's step ms and step / floor, and auto / best pure."""
    return [{"stream": k[0], "cache_fraction": k[1], "policy": k[2], "prefetch": k[3], "M": k[4],
             "step_ms": {mode: r["step_ms"] for mode, r in modes.items()},
             "x_floor": {mode: r["x_floor"] for mode, r in modes.items()}, "auto_vs_best": auto_vs_best(modes)}
            for k, modes in modes_by_cell(rows).items()]


def compact_table(rows: list[dict]) -> list[str]:
    """One line per (stream, cache %, policy, prefetch, M): each mode's step ms, x floor, hit / sim hit;
    auto / the better pure mode last."""
    out = []
    for (stream, fraction, policy, prefetch, m), modes in modes_by_cell(rows).items():
        parts = [f"{mode} {r['step_ms']:8.2f} {r['x_floor']:4.2f}x {r['hit_rate']:.2f}/{r['sim_hit_rate']:.2f}"
                 for mode, r in modes.items()]
        q = auto_vs_best(modes)
        out.append(f"{stream:>7} {fraction:4.0%} {policy} {prefetch:>6} M={m:<2} | " + " | ".join(parts)
                   + ("" if q is None else f" | auto/best {q:4.2f}"))
    return out


def summary(rows: list[dict]) -> list[str]:
    """The targets over the table: worst x floor (overall and per mode), largest hit-rate gap to the
    what-if, "auto" against the better pure mode, prefetch's hit-rate gain on skewed streams."""
    out = []
    if rows:
        worst = max(rows, key=lambda r: r["x_floor"])
        gap = max(rows, key=lambda r: abs(r["hit_rate"] - r["sim_hit_rate"]))
        out.append(f"worst x floor {worst['x_floor']:.2f} ({_key(worst)}); largest |hit - sim| "
                   f"{abs(gap['hit_rate'] - gap['sim_hit_rate']):.3f} ({_key(gap)})")
        per_mode = {}
        for r in rows:
            per_mode.setdefault(r["compute_misses_on"], []).append(r["x_floor"])
        out.append("x floor by mode: " + ", ".join(f"{mode} {min(v):.2f}-{max(v):.2f} ({sum(x > 1.2 for x in v)} of "
                                                    f"{len(v)} > 1.2)" for mode, v in per_mode.items()))
    cells = modes_by_cell(rows)
    ratios = [(q, key) for key, modes in cells.items() if (q := auto_vs_best(modes)) is not None]
    if ratios:
        worst_q, worst_key = max(ratios)
        slower = sum(q > 1.0 for q, _ in ratios)
        beyond = sum(q > 1.0 + NOISE for q, _ in ratios)
        out.append(f"auto / better pure mode: worst {worst_q:.2f} ({' '.join(map(str, worst_key))}), mean "
                   f"{statistics.fmean(q for q, _ in ratios):.2f}; {slower} of {len(ratios)} cells slower, "
                   f"{beyond} by more than {NOISE:.0%}")
    gains = [(on["hit_rate"] - off[mode]["hit_rate"]) for k, modes in cells.items()
             if k[3] == "router" and (off := cells.get(k[:3] + ("none",) + k[4:])) is not None
             for mode, on in modes.items() if mode in off]  # a subset of cells may lack the twin without prefetch
    if gains:
        out.append(f"prefetch (router) on skewed streams: hit rate +{statistics.fmean(gains):.3f} mean, "
                   f"{min(gains):+.3f} worst over {len(gains)} cells")
    return out


def _key(r: dict) -> str:
    return (f"{r['stream']} {r['cache_fraction']:.0%} {r['policy']} prefetch {r['prefetch']} {r['compute_misses_on']} "
            f"M={r['M']}")

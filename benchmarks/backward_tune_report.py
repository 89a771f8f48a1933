"""The printout of ``backward_tune.py``'s results: the best tile per kernel and cell against its dense
twin and the bf16 matmul rate, forward + backward against the baseline, and the ``TUNED`` entries.
A cell row is ``backward_tune.tune_shape``'s dict.
"""

from __future__ import annotations

from dataclasses import asdict

from moekit.experts.triton_backward_launch import BackwardTiles

KERNELS = ("grad", "dx", "dw13", "dw2")
WEIGHT_KERNELS = ("dw13", "dw2")  # timed at one layout block (their time does not depend on it)


def heuristic_rows(timed: dict, heuristic: BackwardTiles) -> dict:
    """{kernel: the timed row of the heuristic's tile, or None where it was not a candidate}."""
    found = {}
    for kernel in KERNELS:
        want = asdict(getattr(heuristic, kernel))
        found[kernel] = next((r for r in timed[kernel]["rows"] if r["tile"] == want and "ms" in r
                              and (kernel in WEIGHT_KERNELS or r["block_m"] == heuristic.block_m)), None)
    return found


def tile_text(block_m: int, t: dict) -> str:
    rows = f"{t['rows']}x" if t["rows"] else f"{block_m}x"
    extra = (" desc" if t["desc"] else "") + (f" split{t['split'] or '*'}" if t["rows"] else "")
    extra += f" contiguous g{t['group']}" if t.get("contiguous") else ""
    return f"{rows}{t['cols']} k{t['red']} w{t['num_warps']} s{t['num_stages']}{extra}"


def table(rows: list, matmul: float) -> None:
    """Per cell: each kernel's best tile, its ms, TFLOP/s, the dense twin's TFLOP/s, the % of the twin and
    of the 8192^3 matmul, the heuristic tile's ms; then forward + backward, and the grads' largest
    rel-L2 against the heuristic's ("vs heur")."""
    print(f"\nbf16 matmul 8192^3: {matmul:.0f} TFLOP/s")
    print(f"{'shape':<14}{'M':>6} {'kernel':<6}{'best tile':<34}{'ms':>8}{'TFLOP/s':>9}{'dense':>7}{'%dense':>7}"
          f"{'%mm':>5}{'heur ms':>9}")
    for r in rows:
        for kernel in KERNELS:
            b, h = r["best_rows"][kernel], r["heuristic_rows"][kernel]
            pct_mm = 100 * b["tflops"] / matmul if matmul else 0.0
            print(f"{r['shape']:<14}{r['m']:>6} {kernel:<6}{tile_text(b['block_m'], b['tile']):<34}{b['ms']:>8.3f}"
                  f"{b['tflops']:>9.0f}{r['kernels'][kernel]['dense_tflops']:>7.0f}{b['pct_dense']:>7.0f}{pct_mm:>5.0f}"
                  f"{h['ms'] if h else float('nan'):>9.3f}")
    print(f"\n{'shape':<14}{'M':>6}  fwd+bwd ms: {'tuned':>8}{'heuristic':>10}{'autograd':>9}{'baseline':>9}"
          f"{'tuned/base':>11}{'heur/base':>10}{'TFLOP/s':>8}{'vs heur':>9}")
    for r in rows:
        e = r["e2e"]
        print(f"{r['shape']:<14}{r['m']:>6}  "
              f"{'':<12}{e['tuned_ms']:>8.2f}{e['heuristic_ms']:>10.2f}{e['autograd_ms']:>9.2f}{e['baseline_ms']:>9.2f}"
              f"{e['baseline_ms'] / e['tuned_ms']:>10.2f}x{e['baseline_ms'] / e['heuristic_ms']:>9.2f}x"
              f"{e['fwd_bwd_tflops_tuned']:>8.0f}{max(e['rel_l2_vs_heuristic'].values()):>9.1e}")
    print(f"baseline: {rows[0]['e2e']['baseline'] if rows else '-'}")
    print("\nTUNED entries for moekit/experts/triton_backward_launch.py (one per shape class):")
    for r in rows:
        print(f"    {r['shape_class']!r}: {r['best_repr']},  # {r['shape']} M={r['m']}")

"""Issue 19 at prefill: the route's bf16 Gluon GEMMs at the M >= 4096 cells, against 70% of the matmul rate, timed as
``moekit bench`` times them (``prefill6_device_check``'s machinery). Session 27 (branch `pre7`) built it to time the
expert-aligned tile order against the route; the order was removed in session 28 (no default took it): what stays is
the route's whole call and each of its GEMMs alone.

    PYTHONPATH=$PWD python3 benchmarks/pre7_device_check.py --out $OUT/pre7 [--deadline 55] [--rounds 7]
        [--cells deepseek-v3:16384 qwen3-30b-a3b:16384 ...] [--parts whole alone dense]

First the ceilings (copy, bf16 mm 8192^3: % of mm is against this run's rate). Per cell (preset, M; the bench's
weights, two rotated input sets, uniform routing): the route's plan and its layout's padding; the route against the
Gluon twin (rel L2 < 2e-3, PASS/FAIL); the route's kernels (profiler); whole calls in ``--rounds`` rounds (the bench's
``time_stats``: events over passes, median); each GEMM alone under uniform and balanced routing (x = uniform µs /
balanced µs: what the padding rows cost); cuBLAS on the cell's two GEMM shapes. JSON to ``--out``/pre7.json after
every cell, the table LAST. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import prefill6_device_check as p6  # noqa: E402  (the log, checks, rounds and table: its module state is the run's)
from bench_rounds import rotated_rounds, versus  # noqa: E402

CELLS = ("deepseek-v3:16384", "qwen3-30b-a3b:16384", "qwen3-30b-a3b:4096", "mixtral-8x7b:4096", "deepseek-v3:4096")


def alone(name: str, s, sets, w, plan, dev, budget_s: float, stop_at: float) -> dict:
    """{label: [µs per round]} of each GEMM alone (``pre7_variants.gemms_alone``), 3 interleaved rounds."""
    import pre7_variants as v7
    from prefill_variants import balanced_routing

    x, ids = sets[0].x, sets[0].topk_ids
    bal_ids, _ = balanced_routing(x.shape[0], s.num_experts, s.top_k, dev)
    fns = v7.gemms_alone(x, ids, bal_ids, w.w13, w.w2, plan)
    return rotated_rounds(f"{name} alone", list(fns), 3, lambda k: p6.timed([fns[k]], dev, budget_s / 2),
                          lambda r: r >= 1 and time.perf_counter() - p6.T0 > stop_at, p6.log, say_stop=False)


def run_cell(spec: str, dev, ceil: dict, args) -> None:
    import pre7_variants as v7

    c = p6.open_cell(spec, dev, ceil)
    name, s, sets, cell = c.name, c.s, c.sets, c.record
    passing = p6.checked(name, v7.whole_call_variants(c.w.w13, c.w.w2, c.plan), sets, c.w, cell, 3)
    if "whole" in args.parts:
        cell["rounds_us"] = p6.whole_calls(name, passing, sets, dev, args.rounds, args.budget_s, args.deadline)
    if "alone" in args.parts and c.plan.gluon and time.perf_counter() - p6.T0 < args.deadline:
        cell["alone_us"] = alone(name, s, sets, c.w, c.plan, dev, args.budget_s, args.deadline)
    if "dense" in args.parts and time.perf_counter() - p6.T0 < args.deadline:
        cell["dense"] = p6.dense(name, s, c.m, dev, ceil["bf16_mm_TFLOPs"])
    p6.RESULTS["cells"].append(cell)
    (args.out / "pre7.json").write_text(json.dumps(p6.RESULTS, indent=1))
    summarize(name, cell)


def summarize(name: str, cell: dict) -> None:
    """The route (median, % of mm), then each GEMM alone (balanced against uniform routing)."""
    rounds = cell.get("rounds_us", {})
    if rounds.get("route"):
        p6.SUMMARY.append(f"{name}: 70% of mm needs <= {cell['target_us_70pct']:.0f} us; layout {cell['layout']}")
        for n, t in rounds.items():
            med = statistics.median(t)
            pct = 100 * cell["flops"] / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
            p6.SUMMARY.append(f"  {n:12s} median {med:9.1f} us {pct:5.1f}% mm, min {min(t):9.1f} us  "
                              f"variant vs route {versus(t, rounds['route'])}")
    al = cell.get("alone_us", {})
    for n, t in al.items():
        share = 2 / 3 if n.startswith("up") else 1 / 3
        pct = 100 * share * cell["flops"] / (statistics.median(t) * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        padding = f"  uniform / balanced {versus(t, al[n.replace(' balanced', '')])}" if "balanced" in n else ""
        p6.SUMMARY.append(f"  alone {n:22s} {statistics.median(t):8.1f} us {pct:5.1f}% mm{padding}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=55.0, help="no new timing after this many seconds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=0.05, help="seconds of passes a timing (the bench's 0.05)")
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--parts", nargs="+", default=["whole", "alone", "dense"])
    args = parser.parse_args()
    p6.STALL_S = 30.0  # the watchdog's silence limit, well inside the 70 s budget
    return p6.run_cells(args, run_cell, args.deadline)


if __name__ == "__main__":
    sys.exit(main())

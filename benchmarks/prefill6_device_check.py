"""Issue 19 at prefill (branch `pre6`): the bf16 M >= 4096 cells against 70% of the matmul rate, timed as
``moekit bench`` times them, with the variants of ``prefill6_variants``.

    PYTHONPATH=$PWD python3 benchmarks/prefill6_device_check.py --out $OUT/pre6 [--deadline-s 130] [--rounds 5]
        [--cells qwen3-30b-a3b:16384 qwen3-30b-a3b:4096 deepseek-v3:4096 ...] [--parts whole alone dense]

First the ceilings (the bench's own: copy, bf16 mm 8192^3), so % of mm is against this run's rate. Per cell (preset,
M; the bench's weights, input sets and uniform routing):
  1. the route's plan (which kernels, tiles) and its layout's padding (rows per real row, mostly empty last blocks);
  2. correctness: every variant against the Gluon path's torch twin (rel L2 < 2e-3, the fused kernels < 1e-2), and
     bit for bit against the variant it must equal (PASS/FAIL);
  3. the route's kernels (torch.profiler, device µs each);
  4. whole calls: the bench's timing helper (``time_stats``: events around passes over the rotated input sets,
     median of passes, ~``--budget-s`` a timing), ``--rounds`` interleaved rounds, each round starting with the next
     variant; per variant median and min, and route vs it: x = variant µs / route µs, the rounds the route won by
     >= 3%;
  5. alone: each Gluon GEMM under uniform and balanced routing (no padding), the gate-up GEMM reading x's rows the
     other way, the combine at other program tiles (bit-equal checked);
  6. dense: cuBLAS on the cell's two GEMM shapes (A = M*k rows) without MoE.
Prints as it goes, JSON to ``--out``/prefill6.json after every cell, the table LAST. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rounds import rotated_rounds, versus  # noqa: E402  (versus: pre7's too)
from bench_run import RunLog, ceilings, rel_l2  # noqa: E402

CELLS = ("qwen3-30b-a3b:16384", "qwen3-30b-a3b:4096", "deepseek-v3:4096", "deepseek-v3:16384", "mixtral-8x7b:4096",
         "mixtral-8x7b:16384")
STALL_S = 100.0  # the watchdog ends the run (table so far printed) when nothing was logged for this long
RUN = RunLog("medians of the rounds (bench timing: events over rotated sets); x = base µs / variant µs")
RESULTS: dict = {"cells": []}
# the run's module state, as ``pre7_device_check`` (and the scripts made from it) use it
T0, FAILED, SUMMARY, log, print_table = RUN.t0, RUN.failed, RUN.summary, RUN.log, RUN.print_table


def watchdog() -> None:
    RUN.watchdog(lambda: STALL_S)


def timed(fns: list, dev, budget_s: float) -> float:
    from moekit.bench.timing import time_stats

    return time_stats(fns, dev, graph=False, budget_s=budget_s).us


def check(name: str, v, s0, ref, outs: dict) -> bool:
    try:
        out = v.call(s0.x, s0.topk_ids, s0.topk_weights)
        torch.cuda.synchronize()
        err = rel_l2(out, ref)
    except Exception as exc:  # noqa: BLE001 (a variant that does not build is reported, the rest go on)
        log(f"FAIL {name} {v.name}: {type(exc).__name__}: {str(exc)[-600:]}")
        FAILED.append(f"{name} {v.name}")
        return False
    tol = 1e-2 if v.name == "fused" else 2e-3
    ok = err < tol
    if v.same_as in outs:
        same = torch.equal(out, outs[v.same_as])
        ok = ok and same
        log(f"{name} {v.name} vs {v.same_as}: bit-equal {same}")
    outs[v.name] = out
    log(f"{'PASS' if ok else 'FAIL'} {name} {v.name}: rel L2 vs twin {err:.2e} (< {tol:g})")
    if not ok:
        FAILED.append(f"{name} {v.name}")
    return ok


def whole_calls(name: str, variants, sets, dev, rounds: int, budget_s: float, stop_at: float) -> dict:
    calls = {v.name: [lambda v=v, s=s: v.call(s.x, s.topk_ids, s.topk_weights) for s in sets] for v in variants}
    return rotated_rounds(name, list(calls), rounds, lambda n: timed(calls[n], dev, budget_s),
                          lambda r: r >= 3 and time.perf_counter() - T0 > stop_at, log)


def alone(name: str, s, sets, w, plan, dev, budget_s: float, stop_at: float) -> dict:
    """Each Gluon GEMM under uniform and balanced routing (no padding rows), the gate-up GEMM reading x's rows the
    other way (in-loader gather / gather kernel + TMA), the gather kernel, the narrow down GEMM at GROUP_M 2 / 4, the
    combine at each tile: {label: [µs per round]}."""
    from dataclasses import replace

    import prefill6_variants as pv
    from prefill_variants import balanced_routing

    from moekit.experts.triton_gluon_launch import down_tile

    x, ids, rw = sets[0].x, sets[0].topk_ids, sets[0].topk_weights
    down = down_tile(w.w2.shape[2])  # the plain down GEMM (the pair's launch has no tail)
    bal_ids, _ = balanced_routing(x.shape[0], s.num_experts, s.top_k, dev)
    other = "up TMA" if plan.in_loader else "up in-loader"
    fns = {}
    fns["up"], fns["down"] = pv.gemms_alone(x, ids, w.w13, w.w2, plan.up, down, plan.in_loader)
    fns["up balanced"], fns["down balanced"] = pv.gemms_alone(x, bal_ids, w.w13, w.w2, plan.up, down, plan.in_loader)
    fns[other], _ = pv.gemms_alone(x, ids, w.w13, w.w2, plan.up, down, not plan.in_loader)
    fns["gather kernel"] = pv.gather_call(x, ids, s.num_experts)
    if down.group_m == 1:  # narrow experts' down GEMM (row blocks in plain order): two neighbours, never timed
        for gm in (2, 4):
            _, fns[f"down gm{gm}"] = pv.gemms_alone(x, ids, w.w13, w.w2, plan.up, replace(down, group_m=gm),
                                                    plan.in_loader)
    y, dst, weights = pv.combine_inputs(x, ids, rw, s.num_experts)
    outs = {}
    for tile in pv.sum_tiles():
        label = f"combine {pv.tile_label(tile)}"
        o = torch.empty_like(x)
        fns[label] = pv.combine_call(y, dst, weights, o, tile)
        fns[label]()
        outs[label] = o
    first = next(iter(outs))
    for label, o in outs.items():
        if not torch.equal(o, outs[first]):
            log(f"FAIL {name} {label}: not bit-equal to {first}")
            FAILED.append(f"{name} {label}")
    return rotated_rounds(f"{name} alone", list(fns), 3, lambda k: timed([fns[k]], dev, budget_s / 2),
                          lambda r: r >= 1 and time.perf_counter() - T0 > stop_at, log, rotate=False, say_stop=False)


@dataclass
class OpenCell:
    """A "preset:M" cell's inputs (``open_cell``)."""

    name: str  # "preset M=m", the log's and the table's
    s: object  # the preset's ``Shape``
    m: int
    w: object  # the bench's bf16 weights (``make_weights``)
    sets: list  # two input sets (``make_sets``)
    plan: object  # the route's plan (``prefill6_variants.route_plan``)
    record: dict  # the cell's JSON record, filled as it runs


def open_cell(spec: str, dev, ceil: dict) -> OpenCell:
    """A "preset:M" cell (the bench's weights, two input sets, the route's plan), its plan and layout logged."""
    import prefill6_variants as pv
    from moekit.bench.cells import Shape, make_sets, make_weights

    preset, m = spec.split(":")
    m = int(m)
    s = Shape.from_preset(preset)
    w = make_weights(s, torch.bfloat16, dev)
    sets = make_sets(s, m, 2, torch.bfloat16, dev)
    s0 = sets[0]
    name = f"{preset} M={m}"
    plan = pv.route_plan(s0.x, w.w13, w.w2, s0.topk_ids, s0.topk_weights)
    counts = pv.layout_counts(s0.x, s0.topk_ids, s.num_experts)
    log(f"{name} plan: {plan.words()}; layout {counts}")
    flops = 6 * m * s.top_k * s.n * s.k
    cell = {"cell": spec, "mm_TFLOPs": ceil["bf16_mm_TFLOPs"], "flops": flops, "plan": plan.words(), "layout": counts,
            "target_us_70pct": flops / (0.7 * ceil["bf16_mm_TFLOPs"] * 1e12) * 1e6}
    return OpenCell(name, s, m, w, sets, plan, cell)


def checked(name: str, variants: list, sets, w, cell: dict, profiled_calls: int) -> list:
    """The variants that PASS against the Gluon twin on sets[0]; the route's kernels (profiler) into the record."""
    from fp8_kernel_breakdown import describe, kernel_breakdown

    from moekit.experts.triton_gluon import experts_gluon_twin

    s0 = sets[0]
    ref = experts_gluon_twin(s0.x, w.w13, w.w2, s0.topk_ids, s0.topk_weights)
    outs: dict = {}
    passing = [v for v in variants if check(name, v, s0, ref, outs)]
    del ref, outs
    kernels = describe(kernel_breakdown(lambda: variants[0].call(s0.x, s0.topk_ids, s0.topk_weights),
                                        calls=profiled_calls))
    log(f"{name} route kernels: {kernels}")
    cell["route_kernels"] = kernels
    return passing


def dense(name: str, s, m: int, dev, mm: float) -> dict:
    """cuBLAS on the cell's two GEMM shapes (``prefill6_variants.dense_refs``), logged with % of ``mm``."""
    import prefill6_variants as pv

    got = pv.dense_refs(m, s.top_k, s.n, s.k, dev)
    log(f"{name} dense cuBLAS: " + ", ".join(f"{k} {v['us']:.1f} us ({100 * v['TFLOPs'] / mm:.1f}% mm)"
                                             for k, v in got.items()))
    return got


def run_cell(spec: str, dev, ceil: dict, args) -> None:
    import prefill6_variants as pv

    c = open_cell(spec, dev, ceil)
    name, s, sets, cell = c.name, c.s, c.sets, c.record
    variants = pv.whole_call_variants(c.w.w13, c.w.w2, c.plan, with_fused=(s.name == "qwen3-30b-a3b" and c.m == 4096))
    passing = checked(name, variants, sets, c.w, cell, 5)
    if "whole" in args.parts:
        cell["rounds_us"] = whole_calls(name, passing, sets, dev, args.rounds, args.budget_s, args.deadline_s)
    if "alone" in args.parts and c.plan.gluon and time.perf_counter() - T0 < args.deadline_s:
        cell["alone_us"] = alone(name, s, sets, c.w, c.plan, dev, args.budget_s, args.deadline_s)
    if "dense" in args.parts and time.perf_counter() - T0 < args.deadline_s:
        cell["dense"] = dense(name, s, c.m, dev, ceil["bf16_mm_TFLOPs"])
    RESULTS["cells"].append(cell)
    (args.out / "prefill6.json").write_text(json.dumps(RESULTS, indent=1))
    summarize(name, cell)


def summarize(name: str, cell: dict) -> None:
    rounds = cell.get("rounds_us", {})
    if rounds.get("route"):
        SUMMARY.append(f"{name}: 70% of mm needs <= {cell['target_us_70pct']:.0f} us; {cell['plan']}")
        for n, t in rounds.items():
            med = statistics.median(t)
            pct = 100 * cell["flops"] / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
            SUMMARY.append(f"  {n:12s} median {med:9.1f} us {pct:5.1f}% mm, min {min(t):9.1f} us  "
                           f"route vs it {versus(rounds['route'], t)}")
    al = cell.get("alone_us", {})
    for n, t in al.items():
        gemm = n.split()[0]
        base = gemm if gemm in ("up", "down") else next((k for k in al if k.startswith("combine")), n)
        base = n if gemm == "gather" else base
        share = {"up": 2 / 3, "down": 1 / 3}.get(gemm)
        pct = f" {100 * share * cell['flops'] / (statistics.median(t) * 1e-6) / 1e12 / cell['mm_TFLOPs']:5.1f}% mm" \
            if share else ""
        SUMMARY.append(f"  alone {n:22s} {statistics.median(t):8.1f} us{pct}  vs {base} {versus(t, al[base])}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=130.0, help="no new timing after this many seconds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=0.05, help="seconds of passes a timing (the bench's 0.05)")
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--parts", nargs="+", default=["whole", "alone", "dense"])
    args = parser.parse_args()
    return run_cells(args, run_cell, args.deadline_s)


def run_cells(args, cell_fn, deadline: float) -> int:
    """The watchdog, this run's ceilings, then ``cell_fn(spec, dev, ceilings, args)`` for each of ``args.cells``
    that starts before ``deadline`` (s), the launch caches cleared after each; the table last. Exit 1 on a FAIL."""
    from moekit.experts.triton import clear_launch_caches

    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    threading.Thread(target=watchdog, daemon=True).start()
    ceil = ceilings(dev)
    RESULTS["ceilings"] = ceil
    log(f"ceilings: {ceil}; torch {torch.__version__}")

    def after() -> None:
        clear_launch_caches()
        torch.cuda.empty_cache()

    RUN.each_cell(args.cells, lambda spec: cell_fn(spec, dev, ceil, args), deadline, after)
    print_table()
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

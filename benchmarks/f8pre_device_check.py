"""Issue 15 at prefill, session 27 (branch `f8pre`): where an fp8_block call at M >= 4096 spends its time, and the
block-scaled Gluon GEMM's [128, 256] down tile (``wide``) and the 4-group gather, against today's route. A read from
registers (``a_regs``; "ar up", "ar both", "ar both gq4") lost at checkpoint 1 (0.93-0.98x, the gate-up alone
1.04-1.07x the time) and in the merged run: removed. Session 28 (branch `f8wide`): the route's plan takes "wide gq4"
from 4096 rows per expert (Mixtral M = 16384), so there "route" reads "wide gq4" and "lean" stays the old base.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/f8pre_device_check.py --out $OUT/f8pre --deadline 70
        [--rounds 5] [--cells fp8:qwen3-30b-a3b:4096 ...] [--variants route,lean,wide,...] [--no-gemms]

Variants: route, lean, wide, wide gq4.

1. Ceilings in this run: copy bandwidth (``measure_ceilings``) and the fp8 mm rate (``torch._scaled_mm`` 8192^3).
2. Per cell (the bench's weights quantized, uniform routing; ``prefill_device_check``'s harness): every variant
   against the Gluon path's torch twin (rel L2 < 1e-2) and bit for bit against "lean" (today's kernels through the
   lean launch: the variants change where operands live, not the products); the route's kernels and BREAKDOWN_OF's
   (profiler µs: align, gather-quant, gate-up, down, combine; each GEMM's TFLOP/s and % of the fp8 mm
   rate); whole calls in ``--rounds`` CUDA-graph rounds interleaved replay by replay (``replay_rounds``);
   each variant's GEMMs alone under uniform and balanced routing; then the SM clock and board power while the
   route replays and while the fp8 mm runs, and the fp8 mm rate measured again (hot: the route's % of it).
The table is printed last: per variant median µs, % of the fp8 mm rate, % of the byte-model floor, x against the
route and against "lean" with the rounds won by >= 3%. JSON to ``--out``/f8pre.json after each cell.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import prefill_device_check as pdc  # noqa: E402
import prefill_variants as pv  # noqa: E402
from bench_rounds import versus  # noqa: E402

# checkpoint 1 (654b456) ran the first three cells of this order with every variant; the rest first since then
CELLS = ("fp8:qwen3-30b-a3b:16384", "fp8:deepseek-v3:4096", "fp8:mixtral-8x7b:16384", "fp8:deepseek-v3:16384",
         "fp8:qwen3-30b-a3b:4096", "fp8:mixtral-8x7b:4096")
DEFAULT_VARIANTS = "route,lean,wide,wide gq4"
BREAKDOWN_OF = ("route", "wide gq4")  # the variants whose kernels the profiler splits
ROUND_S = 0.3  # seconds of replays a round, all variants together
RESULTS: dict = {"cells": []}
log = pdc.log


def variants(q: tuple) -> list:
    """route; lean (the [128, 128] down tile and the 1-group gather, the base); the wide down tile; and that with
    the 4-group gather (the route's plan from 4096 rows per expert: ``triton_gluon_fp8_launch.wants_wide_down``)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.experts.triton_gluon_fp8_launch import (
        DOWN_TILE, GATHER_GROUPS, UP_TILE, WIDE_DOWN_TILE, WIDE_GATHER_GROUPS,
    )
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))

    def lean(up, down, groups: int = GATHER_GROUPS):
        return lambda x, i, r: experts_gluon_fp8(x, *q, i, r, up=up, down=down, gather_groups=groups)

    return [pv.Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            pv.Variant("lean", "gluon", lean(UP_TILE, DOWN_TILE), (UP_TILE, DOWN_TILE)),
            pv.Variant("wide", "gluon", lean(UP_TILE, WIDE_DOWN_TILE), (UP_TILE, WIDE_DOWN_TILE), same_as="lean"),
            pv.Variant("wide gq4", "gluon", lean(UP_TILE, WIDE_DOWN_TILE, WIDE_GATHER_GROUPS),
                       same_as="lean")]


def kernels(name: str, v, x, ids, rw, flops: dict, mm: float) -> dict:
    """Device µs per kernel (profiler, 5 eager calls); the GEMM kernel's two launches a call split in call order
    (gate-up, then down), each with its TFLOP/s and % of the fp8 mm rate."""
    v.call(x, ids, rw)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            v.call(x, ids, rw)
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    seen: dict = defaultdict(list)
    for e in events:
        label = e.name[:32]
        if label.startswith("grouped_gemm_fp8"):
            label = ("gate-up", "down")[sum(len(t) for k, t in seen.items() if k in ("gate-up", "down")) % 2]
        seen[label].append(e.time_range.elapsed_us())
    got = {label: sum(t) / 5 for label, t in seen.items()}  # µs per call
    parts = []
    for label, us in got.items():
        extra = ""
        if label in flops:
            tf = flops[label] / (us * 1e-6) / 1e12
            extra = f" ({tf:.0f} TFLOP/s, {100 * tf / mm:.1f}% mm)"
        parts.append(f"{label} {us:.1f}{extra}")
    log(f"{name} {v.name} kernels: " + ", ".join(parts) + f"; sum {sum(got.values()):.1f} us")
    return got


def hot_clocks(name: str, route, x, ids, rw, cell: dict) -> dict:
    """Right after the cell's rounds (the GPU as warm as they left it): the SM clock and board power while the
    route's graph replays back to back and while the fp8 mm runs, and the fp8 mm rate measured again now: the
    route's % of that hot rate beside the % of the run's first (cool) one."""
    from mid_tile_clocks import graph_clocks, sample_while
    from moekit.bench.ceilings import measure_fp8_mm

    med = statistics.median(cell["rounds_us"]["route"]) if cell["rounds_us"].get("route") else None
    if med is None:
        return {}
    route = graph_clocks(lambda: route.call(x, ids, rw), med)
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    mm_clock = sample_while(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True), 0.8e-3)
    hot = measure_fp8_mm(torch.device("cuda")).TFLOPs
    got = {"route_MHz": route.sm_mhz, "route_W": route.power_w, "mm_MHz": mm_clock.sm_mhz, "mm_W": mm_clock.power_w,
           "source": route.source, "hot_fp8_mm_TFLOPs": hot}
    pct = 100 * cell["flops"] / (med * 1e-6) / 1e12 / hot if hot else float("nan")
    log(f"{name} clocks ({route.source}): route graph {route.sm_mhz} MHz {route.power_w} W, fp8 mm {mm_clock.sm_mhz} "
        f"MHz {mm_clock.power_w} W; fp8 mm now {hot:.0f} TFLOP/s (run start {cell['mm_TFLOPs']:.0f}): route "
        f"{pct:.1f}% of it")
    pdc.SUMMARY.append(f"{name:26s} hot fp8 mm {hot:.0f} TFLOP/s: route {pct:.1f}% of it; route {route.sm_mhz} MHz "
                       f"{route.power_w} W, mm {mm_clock.sm_mhz} MHz {mm_clock.power_w} W")
    return got


def replay_rounds(name: str, wanted: list, x, ids, rw, rounds: int, stop_at: float) -> dict:
    """name -> µs per round: each round replays every variant's graph in turn, one replay each, ~ROUND_S in all
    (every replay between its own two events, enqueued back to back, one sync a round; the order rotated each
    round), a variant's round value the median of its replays. The variants share the GPU's state (clock,
    temperature) replay by replay; timed one after another for 0.08 s each (``prefill_device_check.whole_calls``,
    checkpoint 1) the state drifted between them (rounds 5-35% apart at DeepSeek-V3 16384)."""
    graphs = {}
    for v in wanted:
        try:
            graphs[v.name] = pdc.capture(lambda v=v: v.call(x, ids, rw))
        except Exception as exc:  # noqa: BLE001
            log(f"capture failed {name} {v.name}: {type(exc).__name__}: {str(exc)[-300:]}")
    names = list(graphs)
    once_s = sum(pdc.replay_us(graphs[n], budget_s=0.0) for n in names) * 1e-6  # one turn over every variant
    turns = max(3, min(60, int(ROUND_S / max(once_s, 1e-6))))
    per: dict = {n: [] for n in names}
    for r in range(rounds):
        if time.perf_counter() - pdc.T0 > stop_at and r >= 1:
            log(f"{name}: deadline, {r} rounds")
            break
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            graphs[n].replay()  # untimed: the round starts warm
        events = [(n, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(turns) for n in order]
        for n, start, end in events:
            start.record()
            graphs[n].replay()
            end.record()
        torch.cuda.synchronize()
        got = defaultdict(list)
        for n, start, end in events:
            got[n].append(start.elapsed_time(end) * 1e3)
        for n in names:
            per[n].append(statistics.median(got[n]))
        log(f"{name} round {r} ({turns} turns): " + ", ".join(f"{n} {t[-1]:.1f}" for n, t in per.items()))
    del graphs
    return per


def summarize(name: str, cell: dict) -> None:
    rounds = cell["rounds_us"]
    for n, t in rounds.items():
        if not t:
            continue
        med = statistics.median(t)
        pct = 100 * cell["flops"] / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        line = f"{name:26s} {n:12s} {med:9.1f} us {pct:5.1f}% mm {100 * cell['floor_us'] / med:5.1f}% floor"
        if n != "route" and rounds.get("route"):
            line += f"  vs route {versus(t, rounds['route'])}"
        if n not in ("route", "lean") and rounds.get("lean"):
            line += f"  vs lean {versus(t, rounds['lean'])}"
        pdc.SUMMARY.append(line)


def floor_us(s, m: int, ids, ceil) -> float:
    """The bench's byte model for fp8_block: touched experts' e4m3 weights and float32 block scales, bf16 x and out,
    at the copy rate; FLOPs at the fp8 mm rate; the larger."""
    from moekit.bench.cells import cell_model, measured_experts_touched

    scales = 4 * 3 * (s.n // 128) * (s.k // 128)
    touched = measured_experts_touched(ids, s.num_experts)
    return cell_model(s, m, touched, 2, ceil.copy_TBps, ceil.fp8_mm_TFLOPs, s.expert_bytes(1) + scales).floor_us


def run_cell(spec: str, ceil, opts) -> None:
    from moekit.bench.cells import Shape, make_weights, uniform_routing
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    dev = torch.device("cuda")
    _, preset, m = spec.split(":")
    m = int(m)
    s = Shape.from_preset(preset)
    w = make_weights(s, torch.bfloat16, dev)
    q = (*pdc.quantize_chunked(w.w13), *pdc.quantize_chunked(w.w2))
    del w
    routing = uniform_routing(m, s, dev, seed=m)
    ids, rw = routing.topk_ids, routing.topk_weights
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    ref = experts_gluon_fp8_twin(x, *q, ids, rw)
    name = f"fp8 {preset} M={m}"
    log(f"{name}: weights quantized, twin done")
    wanted = [v for v in variants(q) if v.name in opts.variants.split(",")]
    outs: dict = {}
    passing = [v for v in wanted if pdc.check(name, v, x, ids, rw, ref, "fp8", outs)]
    del ref, outs
    mm = ceil.fp8_mm_TFLOPs
    flops = {"gate-up": 4 * m * s.top_k * s.n * s.k, "down": 2 * m * s.top_k * s.n * s.k}
    cell = {"cell": spec, "mm_TFLOPs": mm, "copy_TBps": ceil.copy_TBps, "flops": 6 * m * s.top_k * s.n * s.k,
            "floor_us": floor_us(s, m, ids, ceil), "kernels": {}}
    for v in passing:
        if v.name in BREAKDOWN_OF:
            cell["kernels"][v.name] = kernels(name, v, x, ids, rw, flops, mm)
    cell["rounds_us"] = replay_rounds(name, passing, x, ids, rw, opts.rounds, opts.deadline - 8)
    summarize(name, cell)
    route = next((v for v in passing if v.name == "route"), None)
    try:
        cell["clocks"] = hot_clocks(name, route, x, ids, rw, cell) if route is not None else {}
    except Exception as exc:  # noqa: BLE001 (a diagnostic: the cell's timings stand without it)
        log(f"{name} clocks: {type(exc).__name__}: {str(exc)[-300:]}")
    RESULTS["cells"].append(cell)
    (opts.out / "f8pre.json").write_text(json.dumps(RESULTS, indent=1))
    if opts.gemms and time.perf_counter() - pdc.T0 < opts.deadline - 15:
        cell["gemms"] = pdc.gemms_apart(name, s, x, ids, passing, q, "fp8", mm, opts.deadline - 15)
        (opts.out / "f8pre.json").write_text(json.dumps(RESULTS, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=70.0, help="seconds: no new cell or timing after ~this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="*", default=list(CELLS))
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated variant names")
    parser.add_argument("--no-gemms", dest="gemms", action="store_false", help="no GEMMs alone")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    pdc.STALL_S = 45.0  # a hung kernel: the table so far, inside the run's limit
    # timed replays per variant per round: 0.08 s (prefill_device_check's 0.04 s is 3 replays at DeepSeek-V3 16384)
    pdc.replay_us = functools.partial(pdc.replay_us, budget_s=0.08)
    threading.Thread(target=pdc.watchdog, daemon=True).start()
    from moekit.bench.ceilings import measure_ceilings, measure_fp8_mm

    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    ceil = replace(ceil, fp8_mm_TFLOPs=measure_fp8_mm(dev).TFLOPs)
    RESULTS["ceilings"] = {"copy_TBps": ceil.copy_TBps, "fp8_mm_TFLOPs": ceil.fp8_mm_TFLOPs}
    log(f"copy {ceil.copy_TBps:.2f} TB/s, fp8 mm {ceil.fp8_mm_TFLOPs:.0f} TFLOP/s (torch._scaled_mm 8192^3, fast "
        f"accumulation); torch {torch.__version__}")
    pdc.RUN.each_cell(opts.cells, lambda spec: run_cell(spec, ceil, opts), opts.deadline - 20, pdc.free_memory)
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

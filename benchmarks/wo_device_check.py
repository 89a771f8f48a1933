"""GPU check of the weight-only quantized Triton experts (issue #16): correctness at real shapes against
the torch twin, CUDA-graph replay with new routing, and CUDA-graph timings of the decodes (``gemv``, the
word decode, only where the chooser may pick it: int4 at M <= 8; ``tile``:
the whole dequantized tile per step; ``register``: decoded in the MMA operand's registers) against each
other, moekit's bf16 Triton path and the packed-byte floor; which decode the plan's chooser
(``triton_wo_plan.choose_decode``) picks per cell, and whether that is the faster one here.

    PYTHONPATH=. python benchmarks/wo_device_check.py [--presets P ...] [--schemes S ...] [--batches M ...]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/wo_device_check.py --tiny   # the script's own smoke test, CPU

Cells: each scheme (int8_w8a16; int4_w4a16 with group 128 and zero points; mxfp4) at the DeepSeek-V3,
Mixtral-8x7B and Qwen3-30B-A3B expert shapes, M in {1, 8, 64, 1024}. The weights are random bytes in
the scheme's layout with scales that keep each GEMM's output near unit size; x and routing as
``moekit bench`` makes them (uniform routing), SETS input sets per cell rotated so that successive calls
touch different experts and stream their weights from HBM rather than L2.

Floor = (touched experts x packed bytes per expert, scales and zero points included, + x and out) /
copy bandwidth (measured here, read + write, like ``moekit bench``). Targets (issue #16): DeepSeek and
Mixtral >= 80% of the floor at M <= 64; Qwen3 int4 at M = 1 <= 0.45 x bf16; M >= 1024 <= bf16 / 0.9.

Also: a CUDA graph of one call replayed with new tokens and routing (equal to eager), split-K
cells (one local expert of Mixtral's shape, M = 1 and 4: the down GEMM's reduction split; correct, and
timed against the unsplit call), and the register decode at int4 group 32 (four scale chunks a step)
with bf16 (inline PTX) and fp16 (the pure-Triton bit placement) activations, against the twin.

Prints a PASS/FAIL line per check, the table last (per cell: µs of each decode, the chooser's pick and
the faster one, the pick's % of the floor and x bf16, each decode's error against the twin); JSON to
$OUT/wo.json when OUT is set. Exit 1 on any failure. Whole run: < 2 min on an H200 (mostly compiling).

Sweep (``sweep_cells``): the register decode at Qwen3 M = 1 (few programs: the issue's 0.45 x bf16 target)
under a few gate-up tiles and down tiles / splits, each against the twin, one line each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch

from moekit.bench.cells import PRESETS, Shape, make_sets, make_weights, measured_experts_touched
from moekit.bench.timing import time_stats
from moekit.experts.triton import experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_wo import WoWeight, fused_experts_wo, fused_experts_wo_torch, run_experts_wo, weight_args
from moekit.experts.configs import GemmTile
from moekit.experts.triton_wo_configs import wo_heuristic_config
from moekit.experts.triton_wo_plan import choose_decode, wo_plan_for
from bench_run import RunLog

SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4")
GROUP = {"int8_w8a16": 0, "int4_w4a16": 128, "mxfp4": 32}
BATCHES = (1, 8, 64, 1024)
SETS = 4  # input sets per cell
TIMING = dict(budget_s=0.05)  # per cell (at least 5 passes); --tiny: one pass
TOL = 1e-2  # rel-L2 against the twin
SPLIT_SHAPE = Shape("mixtral-1-local", 1, 14336, 4096, 1)  # split-K cells: one local expert (EP over 8)
SPLIT_BATCHES = (1, 4)
SWEEP = (("qwen3-30b-a3b", "int4_w4a16", 1), ("qwen3-30b-a3b", "mxfp4", 1))  # (preset, scheme, M), register decode
SWEEP_UP = ((16, 128, 4), (32, 256, 3), (64, 128, 4), (16, 256, 3))  # gate-up (BLOCK_N, BLOCK_K, stages)
SWEEP_DOWN = ((64, 128, 4, None), (128, 128, 4, 1), (128, 128, 4, 4), (128, 256, 3, None))  # down (.., split-K)
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check


def decodes(scheme: str, m: int) -> tuple:
    """The decodes a cell times: tile and register, and gemv where the chooser may pick it (int4 at
    M <= 8; session 9's ``wo_speed_device_check`` timed it everywhere else, where it lost)."""
    return ("tile", "register") + (("gemv",) if scheme == "int4_w4a16" and m <= 8 else ())


@dataclass
class Cell:
    preset: str
    scheme: str
    m: int
    rel_err: dict  # decode -> rel-L2 against the twin
    times: dict  # decode -> median µs per call, CUDA graph
    spread_pct: dict  # decode -> spread of the timed passes
    pick: str  # the chooser's decode for this cell
    us: float  # the pick's µs
    bf16_us: float  # moekit's bf16 Triton path, same inputs
    touched: float  # mean distinct experts per call
    floor_us: float  # packed bytes / copy bandwidth
    target: str  # the target for this cell and whether it is met ("-" where none applies)


def guarded(name: str, step, *args):
    """``step(*args)``; an exception is printed and counted as a failure, and the run goes on."""
    try:
        return step(*args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        check(name, False, "raised")
        return None


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def quantized(scheme: str, e: int, r: int, c: int, dev, seed: int | None, group: int | None = None) -> WoWeight:
    """Random bytes in ``scheme``'s layout for a weight [E, R, C] whose product with a unit-variance
    vector has about unit variance; ``seed`` None: the layout alone, uninitialised (for compiling);
    ``group`` None: GROUP's."""
    group = GROUP[scheme] if group is None else group

    def ints(low: int, high: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        if seed is None:
            return torch.empty(shape, device=dev, dtype=dtype)
        g = torch.Generator(device=dev).manual_seed(seed)
        return torch.randint(low, high, shape, generator=g, device=dev, dtype=dtype)

    if scheme == "int8_w8a16":
        q = ints(-128, 128, (e, r, c), torch.int8)
        return WoWeight(scheme, q, torch.full((e, r), 1 / (74 * c**0.5), device=dev))  # std(q) ~ 74
    groups, packed = -(-c // group), -(-c // 2)
    q = ints(0, 256, (e, r, packed), torch.uint8)
    if scheme == "int4_w4a16":
        scale = torch.full((e, r, groups), 1 / (4.6 * c**0.5), device=dev)  # std(q - 8) ~ 4.6
        return WoWeight(scheme, q, scale, torch.full((e, r, groups), 8, device=dev, dtype=torch.uint8), group)
    exponent = round(127 - math.log2(2.9 * c**0.5))  # std(e2m1 value) ~ 2.9
    return WoWeight(scheme, q, torch.full((e, r, groups), exponent, device=dev, dtype=torch.uint8), None, group)


def precompile(jobs: list[tuple], dev) -> None:
    """Compile the weight-only GEMMs of ``jobs`` ((shape, scheme, M, decode or None for the chooser's,
    config or None, split-K or None), grouped by shape and scheme) at once in a thread pool (Triton's
    AsyncCompileMode, Triton >= 3.5) instead of one at a time on first use: the default run has some
    150 kernels, most of its time otherwise. Without AsyncCompileMode the cells compile as they come."""
    try:
        from triton import AsyncCompileMode
    except ImportError:
        return
    options = LaunchOptions(reuse_workspace=False)  # what the custom op runs with
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for (s, scheme), group in itertools.groupby(jobs, key=lambda job: job[:2]):
                w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=None)
                w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=None)
                a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
                for _, _, m, decode, config, split in group:
                    c = make_sets(s, m, 1, torch.bfloat16, dev)[0]
                    plan = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", config, options,
                                       split, decode)
                    _warm(plan, c, a13, a2, dev)
    except Exception as e:  # noqa: BLE001  (the cells compile, and report, on first use)
        print(f"precompile: {type(e).__name__}: {e}", flush=True)


def _warm(plan, c, a13, a2, dev) -> None:
    """Submit the compiles of ``plan``'s two GEMMs (``warmup``: nothing runs; a split gate-up on its partials p)."""
    b, h = plan.workspace.allocate(dev), "p" if plan.glu_fold else "h"  # a folded gate-up's down GEMM reads p
    rows = (None,) * 3 if plan.align is None else (b["sorted_ids"], b["expert_ids"], b["num_padded"])
    for launch, pointers in ((plan.gate_up, (c.x, a13.q, a13.scale, a13.zero, b.get("p", b["h"]), c.topk_ids)),
                             (plan.down, (b[h], a2.q, a2.scale, a2.zero, b["y"], c.topk_weights, c.topk_ids))):
        launch.kernel.warmup(*pointers, *rows, *launch.tail, grid=launch.grid, **launch.options)


def packed_bytes(w: WoWeight) -> int:
    """Bytes of one expert of ``w``: packed values, scales and zero points."""
    parts = [w.q, w.scale] + ([w.zero] if w.zero is not None else [])
    return sum(t.numel() * t.element_size() for t in parts) // w.q.shape[0]


def copy_tbps(dev) -> float:
    """Device copy bandwidth in 1e12 B/s, read + write (``moekit.bench.ceilings``' convention)."""
    src = torch.empty(1 << (30 if dev.type == "cuda" else 24), dtype=torch.uint8, device=dev)  # past the L2
    dst = torch.empty_like(src)
    us = time_stats([lambda: dst.copy_(src)], dev, budget_s=0.1).us
    return 2 * src.numel() / (us * 1e-6) / 1e12


def target(preset: str, scheme: str, m: int, us: float, bf16_us: float, floor_us: float) -> str:
    if m >= 1024:
        return f"<= bf16/0.9: {'met' if us <= bf16_us / 0.9 else 'MISSED'}"
    if preset == "qwen3-30b-a3b" and scheme == "int4_w4a16" and m == 1:
        return f"<= 0.45 bf16: {'met' if us <= 0.45 * bf16_us else 'MISSED'}"
    if preset != "qwen3-30b-a3b" and m <= 64:
        return f">= 80% floor: {'met' if floor_us / us >= 0.8 else 'MISSED'}"
    return "-"


def bf16_times(s: Shape, sets: dict, dev) -> dict[int, float]:
    """µs per call of moekit's bf16 Triton path per M (CUDA graph; the same rotated inputs)."""
    weights = make_weights(s, torch.bfloat16, dev)
    times = {}
    for m, inputs in sets.items():
        fns = [lambda c=c: experts_triton(c.x, weights.w13, weights.w2, c.topk_ids, c.topk_weights) for c in inputs]
        times[m] = time_stats(fns, dev, graph=dev.type == "cuda", **TIMING).us
    del weights
    return times


def scheme_cells(s: Shape, scheme: str, sets: dict, bf16: dict, bw: float, dev) -> list[Cell]:
    """Every M of one shape and scheme: each decode against the twin and timed on the same inputs."""
    w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
    w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
    per_expert = packed_bytes(w13) + packed_bytes(w2)
    cells = []
    for m, inputs in sets.items():
        c0 = inputs[0]
        want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
        errs, times, spreads = {}, {}, {}
        for decode in decodes(scheme, m):
            errs[decode] = rel_err(fused_experts_wo(c0.x, w13, w2, c0.topk_ids, c0.topk_weights, decode=decode), want)
            check(f"{s.name} {scheme} M={m} {decode} vs twin", errs[decode] < TOL, f"rel_err={errs[decode]:.2e}")
            fns = [lambda c=c, d=decode: fused_experts_wo(c.x, w13, w2, c.topk_ids, c.topk_weights, decode=d)
                   for c in inputs]
            t = time_stats(fns, dev, graph=dev.type == "cuda", **TIMING)
            times[decode], spreads[decode] = t.us, t.spread_pct
        pick = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
        touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
        floor_us = (touched * per_expert + 2 * m * s.k * 2) / (bw * 1e12) * 1e6
        cells.append(Cell(s.name, scheme, m, errs, times, spreads, pick, times[pick], bf16[m], touched, floor_us,
                          target(s.name, scheme, m, times[pick], bf16[m], floor_us)))
    del w13, w2
    return cells


def graph_replay(dev, schemes) -> None:
    """One captured call replayed on new tokens and new routing equals the eager call."""
    s = Shape("graph", 64, 256, 512, 4)
    for scheme, decode in itertools.product(schemes, ("tile", "register", "gemv")):
        w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=3)
        w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=4)
        first, *others = make_sets(s, 33, 4, torch.bfloat16, dev, seed=5)
        x, ids, w = first.x.clone(), first.topk_ids.clone(), first.topk_weights.clone()
        worst = replay_worst(lambda: fused_experts_wo(x, w13, w2, ids, w, decode=decode), x, ids, w, others)
        check(f"cuda graph replay, new routing, {scheme} {decode}", worst < 1e-6, f"max rel diff vs eager {worst:.1e}")


def replay_worst(call, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, others: list) -> float:
    """``call()`` (which reads x, ids and w) run once eagerly (it compiles outside the capture), captured in
    a CUDA graph, then for each of ``others`` (``make_sets``' sets) its tokens and routing copied in and the
    graph replayed: the largest ``rel_err`` of a replay's output against the eager call's."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    worst = 0.0
    for c in others:
        x.copy_(c.x)
        ids.copy_(c.topk_ids)
        w.copy_(c.topk_weights)
        graph.replay()
        worst = max(worst, rel_err(out, call()))
    return worst


def split_k_cells(dev, schemes) -> None:
    """One local expert of Mixtral's shape (expert parallelism over 8 GPUs), M = 1 and 4: few enough
    down tiles that ``decode_split_k`` splits the reduction. Correct against the twin, and timed against
    the same call without the split."""
    s = SPLIT_SHAPE
    for scheme in schemes:
        w13 = quantized(scheme, 1, 2 * s.n, s.k, dev, seed=6)
        w2 = quantized(scheme, 1, s.k, s.n, dev, seed=7)
        a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
        for m in SPLIT_BATCHES:
            c = make_sets(s, m, 1, torch.bfloat16, dev, seed=8)[0]
            args = (c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme)
            err = rel_err(run_experts_wo(*args), fused_experts_wo_torch(c.x, w13, w2, c.topk_ids, c.topk_weights))
            split = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", None,
                                LaunchOptions()).split_k
            us = {k: time_stats([lambda k=k: run_experts_wo(*args, split_k=k)], dev, graph=True, **TIMING).us
                  for k in (None, 1)}
            check(f"split-K {s.name} {scheme} M={m}: {split} splits vs twin", err < TOL and split > 1,
                  f"rel_err={err:.2e}  {us[None]:.1f} µs split, {us[1]:.1f} µs unsplit")


def register_decode_cells(dev, schemes, small: Shape = Shape("groups", 16, 1024, 2048, 4)) -> None:
    """The register decode of the packed schemes at group 32 (four scale chunks a 128-wide step): bf16
    activations through the inline PTX, fp16 through the pure-Triton bit placement (what the
    interpreter tests run), each against the twin."""
    for scheme in [x for x in schemes if x != "int8_w8a16"]:
        w13 = quantized(scheme, small.num_experts, 2 * small.n, small.k, dev, seed=9, group=32)
        w2 = quantized(scheme, small.num_experts, small.k, small.n, dev, seed=10, group=32)
        for dtype, m in ((torch.bfloat16, 8), (torch.bfloat16, 64), (torch.float16, 8)):
            c = make_sets(small, m, 1, dtype, dev, seed=11)[0]
            err = rel_err(fused_experts_wo(c.x, w13, w2, c.topk_ids, c.topk_weights, decode="register"),
                          fused_experts_wo_torch(c.x, w13, w2, c.topk_ids, c.topk_weights))
            check(f"register decode {scheme} g=32 {dtype} M={m} vs twin", err < TOL, f"rel_err={err:.2e}")


def sweep_configs(s: Shape, scheme: str, m: int) -> list[tuple]:
    """(config, split-K or None) of the register decode: its heuristic, then SWEEP_UP's gate-up tiles and
    SWEEP_DOWN's down tiles each beside the heuristic's other GEMM."""
    base = wo_heuristic_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, "register")
    return ([(base, None)] + [(replace(base, up=GemmTile(bn, bk, 1, 4, st)), None) for bn, bk, st in SWEEP_UP]
            + [(replace(base, down=GemmTile(bn, bk, 1, 4, st)), split) for bn, bk, st, split in SWEEP_DOWN])


def sweep_cells(dev, presets, schemes) -> None:
    """SWEEP's cells under ``sweep_configs``: each against the twin and timed (CUDA graph), one line each."""
    for preset, scheme, m in [c for c in SWEEP if c[0] in presets and c[1] in schemes]:
        s = Shape.from_preset(preset)
        w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
        w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
        a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
        inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
        want = fused_experts_wo_torch(inputs[0].x, w13, w2, inputs[0].topk_ids, inputs[0].topk_weights)
        for config, split in sweep_configs(s, scheme, m):
            def call(c, config=config, split=split):
                return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=config,
                                      split_k=split, decode="register")
            err = rel_err(call(inputs[0]), want)
            us = time_stats([lambda c=c: call(c) for c in inputs], dev, graph=True, **TIMING).us
            up, down = config.up, config.down
            check(f"sweep {preset} {scheme} M={m} register up {up.BLOCK_N}x{up.BLOCK_K}/{up.num_stages} down "
                  f"{down.BLOCK_N}x{down.BLOCK_K}/{down.num_stages} split {split or 'auto'}", err < TOL,
                  f"rel_err={err:.2e}  {us:.1f} µs")


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<14} {'scheme':<10} {'M':>5} {'tile µs':>8} {'reg µs':>8} {'pick':>8} {'faster':>8} "
             f"{'bf16 µs':>8} {'x bf16':>6} {'floor µs':>8} {'%floor':>6} {'err tile':>8} {'err reg':>8}  target"]
    for c in cells:
        faster = min(c.times, key=c.times.get)
        lines.append(f"{c.preset:<14} {c.scheme:<10} {c.m:>5} {c.times['tile']:>8.1f} {c.times['register']:>8.1f} "
                     f"{c.pick:>8} {faster:>8} {c.bf16_us:>8.1f} {c.us / c.bf16_us:>6.2f} {c.floor_us:>8.1f} "
                     f"{100 * c.floor_us / c.us:>5.0f}% {c.rel_err['tile']:>8.1e} {c.rel_err['register']:>8.1e}  "
                     f"{c.target}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=PRESETS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--tiny", action="store_true", help="one tiny shape, M in {1, 8}: a smoke test (CPU interpreter)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.tiny:
        TIMING.update(budget_s=0.0, min_reps=1, max_reps=1)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    bw = copy_tbps(dev)
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    shapes = [Shape("tiny", 8, 64, 128, 2)] if args.tiny else [Shape.from_preset(p) for p in args.presets]
    batches = (1, 8) if args.tiny else tuple(args.batches)
    if dev.type == "cuda":
        t0 = time.perf_counter()
        jobs = [(s, scheme, m, decode, None, None) for s in shapes + [SPLIT_SHAPE] for scheme in args.schemes
                for m in (SPLIT_BATCHES if s is SPLIT_SHAPE else batches)
                for decode in ((None,) if s is SPLIT_SHAPE else decodes(scheme, m))]
        jobs += [(Shape.from_preset(p), scheme, m, "register", *c) for p, scheme, m in SWEEP
                 if p in args.presets and scheme in args.schemes
                 for c in sweep_configs(Shape.from_preset(p), scheme, m)]
        precompile(jobs, dev)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
        guarded("graph replay", graph_replay, dev, args.schemes)
        guarded("split-K cells", split_k_cells, dev, args.schemes)
        guarded("register decode cells", register_decode_cells, dev, args.schemes)
        guarded("sweep", sweep_cells, dev, args.presets, args.schemes)
    cells = []
    for s in shapes:
        sets = {m: make_sets(s, m, SETS, torch.bfloat16, dev, seed=m) for m in batches}
        bf16 = bf16_times(s, sets, dev)
        for scheme in args.schemes:
            cells += guarded(f"{s.name} {scheme}", scheme_cells, s, scheme, sets, bf16, bw, dev) or []
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw,
                       "cells": [asdict(c) for c in cells], "failed": FAILED}, f, indent=1)
    print("FAILED:", FAILED if FAILED else "none")
    wrong = [f"{c.preset} {c.scheme} M={c.m} ({c.pick}: {c.us:.1f} µs, other: {min(c.times.values()):.1f})"
             for c in cells if c.times[c.pick] > min(c.times.values())]
    print(f"chooser picked the faster decode in {len(cells) - len(wrong)} of {len(cells)} cells; slower:",
          "; ".join(wrong) or "none")
    print(table(cells), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

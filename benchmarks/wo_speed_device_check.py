"""GPU checkpoint of the word decode (``decode="gemv"``, ``_kernels/gemm_wo_gemv.py``) and of taller tile-decode
configs at M = 1024 (issue #16's speed targets): every variant against the torch twin at real shapes, and
timed (CUDA-graph replay, rotated input sets so the weights stream from HBM) against the current decodes
(tile, register) and moekit's bf16 path, with % of the packed-byte floor.

    PYTHONPATH=$PWD python benchmarks/wo_speed_device_check.py [--presets P ..] [--schemes S ..] [--batches M ..]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/wo_speed_device_check.py --tiny   # smoke test, CPU

Cells: int4_w4a16 (g 128, zero points), mxfp4, int8_w8a16 at Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3,
M in {1, 8, 64, 1024}. Variants (each guarded: an error is printed, the run goes on):
    M <= 64   tile, register (the chooser's configs); int4 also gemv (its heuristic) and GEMV_VARIANTS'
    M = 1024  tile, and TALL_VARIANTS' tile-decode configs (BLOCK_M 128 / 256, BLOCK_K 128 / 64)
All shapes' M <= 64 cells run before any M = 1024 cell; a hard time limit (LIMIT_S) skips the cells
left, naming them. Prints a PASS/FAIL line per variant
(rel-L2 against the twin < TOL), then the table last: per cell bf16 µs, tile, register, gemv and the best
variant's µs and name, its % of the floor and x bf16, the chooser's decode, the issue's target. JSON to
$OUT/wo_speed.json.

Floor = (touched experts x packed bytes per expert, scales and zeros included, + x and out) / copy
bandwidth (measured here, read + write), as ``wo_device_check``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import PRESETS, Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.bench.timing import time_stats  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args  # noqa: E402
from moekit.experts.triton_wo_gemv import PER, gemv_heuristic_config  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode  # noqa: E402
from wo_device_check import bf16_times, copy_tbps, packed_bytes, precompile, quantized, rel_err, target  # noqa: E402
from bench_run import RunLog  # noqa: E402

SCHEMES = ("int4_w4a16", "mxfp4", "int8_w8a16")
PRESET_ORDER = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")  # cheapest first (LIMIT_S cut Qwen3 at 19af4d7)
BATCHES = (1, 8, 64, 1024)
SETS = 4
TIMING = dict(budget_s=0.03)
TOL = 1e-2
LIMIT_S = 88.0  # whole run, compiles included; the lead's limit is 100 s
# name -> (gate-up BLOCK_N, words a step, down BLOCK_N, words a step, warps)
# name -> (gate-up BLOCK_N, words a step, down BLOCK_N, words a step, warps); int4 only: the 19af4d7
# checkpoint timed the gemv on mxfp4 and int8 too, and it lost every cell there (1.1-7x)
GEMV_VARIANTS = {"w2r64k32": (64, 32, 64, 32, 2)}
TALL_VARIANTS = {
    "t128k": KernelConfig(128, GemmTile(64, 128, 8, 8, 3), GemmTile(128, 128, 8, 8, 3)),
    "t256": KernelConfig(256, GemmTile(64, 64, 8, 8, 3), GemmTile(128, 64, 8, 8, 3)),
}
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check
SKIPPED: list[str] = []
START = time.perf_counter()


@dataclass
class Cell:
    preset: str
    scheme: str
    m: int
    bf16_us: float
    floor_us: float
    touched: float
    times: dict = field(default_factory=dict)  # variant -> µs (graph replay)
    errors: dict = field(default_factory=dict)  # variant -> rel-L2 against the twin
    best: str = ""
    pick: str = ""  # the chooser's decode (``choose_decode``)
    target: str = "-"


def left_s() -> float:
    return LIMIT_S - (time.perf_counter() - START)


def gemv_config(variant: tuple, s: Shape, scheme: str, m: int) -> KernelConfig:
    """GEMV_VARIANTS' tiles at the heuristic's BLOCK_M for this cell."""
    up_bn, up_w, down_bn, down_w, warps = variant
    base = gemv_heuristic_config(m, s.num_experts, s.n, s.k, s.top_k, scheme)
    block_m, group_m, per = base.BLOCK_M, base.up.GROUP_M, PER[scheme]
    return KernelConfig(block_m, GemmTile(up_bn, up_w * per, group_m, warps, 1),
                        GemmTile(down_bn, down_w * per, group_m, warps, 1))


def variants(s: Shape, scheme: str, m: int) -> dict:
    """name -> (decode, config or None) of one cell."""
    if m >= 1024:
        return {"tile": ("tile", None), **{k: ("tile", c) for k, c in TALL_VARIANTS.items()}}
    out = {"tile": ("tile", None), "register": ("register", None)}
    if scheme == "int4_w4a16":
        out["gemv"] = ("gemv", None)
        out.update({k: ("gemv", gemv_config(v, s, scheme, m)) for k, v in GEMV_VARIANTS.items()})
    return out


def run_cell(s: Shape, scheme: str, m: int, w13, w2, inputs, bf16_us: float, bw: float) -> Cell:
    """Every variant of one cell against the twin, then timed; the best one named."""
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    floor_us = (touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2) / (bw * 1e12) * 1e6
    cell = Cell(s.name, scheme, m, bf16_us, floor_us, touched,
                pick=choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k))
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    for name, (decode, config) in variants(s, scheme, m).items():
        if left_s() < 0:
            SKIPPED.append(f"{s.name} {scheme} M={m} {name}")
            continue

        def call(c, decode=decode, config=config):
            return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=config, decode=decode)

        try:
            err = rel_err(call(c0), want)
            check(f"{s.name} {scheme} M={m} {name}", err < TOL, f"rel_err={err:.2e}")
            cell.errors[name] = err
            if err < TOL:
                cell.times[name] = time_stats([lambda c=c: call(c) for c in inputs], s_dev(),
                                              graph=s_dev().type == "cuda",
                                              **TIMING).us
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the run)
            traceback.print_exc(limit=2)
            check(f"{s.name} {scheme} M={m} {name}", False, f"raised {type(e).__name__}")
    if cell.times:
        cell.best = min(cell.times, key=cell.times.get)
        cell.target = target(s.name, scheme, m, cell.times[cell.best], bf16_us, floor_us)
    return cell


def s_dev() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compile_all(shapes, schemes, batches, dev) -> None:
    """Every variant's kernels compiled at once in a thread pool (``wo_device_check.precompile``)."""
    jobs = [(s, scheme, m, decode, config, None) for s in shapes for scheme in schemes for m in batches
            for decode, config in variants(s, scheme, m).values()]
    precompile(jobs, dev)


def table(cells: list[Cell]) -> str:
    def us(c: Cell, name: str) -> str:
        return f"{c.times[name]:8.1f}" if name in c.times else f"{'-':>8}"

    lines = [f"{'shape':<14} {'scheme':<10} {'M':>5} {'bf16':>8} {'tile':>8} {'reg':>8} {'gemv':>8} {'best':>8} "
             f"{'variant':<9} {'%floor':>6} {'x bf16':>6} {'floor':>7} {'pick':>8}  target"]
    for c in cells:
        best = c.times.get(c.best, float("nan"))
        lines.append(f"{c.preset:<14} {c.scheme:<10} {c.m:>5} {c.bf16_us:8.1f} {us(c, 'tile')} {us(c, 'register')} "
                     f"{us(c, 'gemv')} {best:8.1f} {c.best:<9} {100 * c.floor_us / best:5.0f}% {best / c.bf16_us:6.2f} "
                     f"{c.floor_us:7.1f} {c.pick:>8}  {c.target}")
    return "\n".join(lines)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESET_ORDER), choices=PRESETS)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--tiny", action="store_true", help="one tiny shape, M in {1, 8}: a smoke test (CPU interpreter)")
    return p.parse_args(argv)


def shape_cells(s: Shape, schemes, batches, bw: float, dev) -> list[Cell]:
    sets = {m: make_sets(s, m, SETS, torch.bfloat16, dev, seed=m) for m in batches}
    bf16 = bf16_times(s, sets, dev)
    cells = []
    for scheme in schemes:
        if left_s() < 0:
            SKIPPED.append(f"{s.name} {scheme}")
            continue
        w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
        w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
        cells += [run_cell(s, scheme, m, w13, w2, sets[m], bf16[m], bw) for m in batches]
        del w13, w2
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return cells


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = s_dev()
    if args.tiny:
        TIMING.update(budget_s=0.0, min_reps=1, max_reps=1)
        GEMV_VARIANTS.clear()
        TALL_VARIANTS.clear()
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    bw = copy_tbps(dev)
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    shapes = [Shape("tiny", 8, 64, 128, 2)] if args.tiny else [Shape.from_preset(p) for p in args.presets]
    batches = (1, 8) if args.tiny else tuple(args.batches)
    if dev.type == "cuda":
        t0 = time.perf_counter()
        compile_all(shapes, args.schemes, batches, dev)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    cells = []
    for group in ([m for m in batches if m <= 64], [m for m in batches if m > 64]):  # decode sizes first
        for s in [s for s in shapes if group]:
            if left_s() < 0:
                SKIPPED.append(f"{s.name} M={group}")
                continue
            try:
                cells += shape_cells(s, args.schemes, group, bw, dev)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                check(f"{s.name}", False, "raised")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_speed.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw,
                       "cells": [asdict(c) for c in cells], "failed": FAILED, "skipped": SKIPPED}, f, indent=1)
    print(f"total {time.perf_counter() - START:.1f} s; FAILED:", FAILED or "none", "; SKIPPED:", SKIPPED or "none")
    for c in cells:
        print(f"{c.preset} {c.scheme} M={c.m}: " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(c.times.items(),
                                                                                                 key=lambda kv: kv[1])))
    print(table(cells), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

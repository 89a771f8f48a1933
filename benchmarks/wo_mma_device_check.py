"""GPU check of the reworked word MMA decode (issue #16, session 26, brief w6: ``decode="mma"``,
``_kernels/gemm_wo_mma.py``: each step's packed words decoded where they land into ONE tensor-core operand in a
permuted K order, the step's activation tile read once as one contiguous tile and permuted alike, one dot a step,
1-warp programs) against the chooser's pick (today's default) at the 4-bit decode cells.

    PYTHONPATH=$PWD timeout 200 python3 benchmarks/wo_mma_device_check.py --out $OUT/w6      # H200, <= 150 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/wo_mma_device_check.py --smoke     # CPU, tiny shapes
    ... --eager: each variant's eager host µs a call (enqueued behind ~1 ms of GPU work) and wall µs a call too

Cells (in this order; the deadline cuts the last): int4_w4a16 (g 128) DeepSeek-V3 M = 1, Qwen3-30B-A3B M = 1,
DeepSeek-V3 M = 8, Mixtral-8x7B M = 8, Qwen3 M = 8, mxfp4 DeepSeek-V3 M = 1, 8; each in a child process of its own
(a fault loses only its cell). Variants: "pick" (what a call runs now), "prev" (the decode picked before this
branch, where PREVIOUS names one), "mma" (the mma decode's heuristic config: 32-row tiles in 1 warp, 3 stages),
"m64" (64-row tiles in 2 warps), "m4s" (the heuristic's tiles with 4 stages: more bytes in flight), "ms2" (the
heuristic's tiles, the gate-up's reduction split in 2: twice its programs, float32 partials and one more launch;
"m64s2": m64 split so, "ms4": split in 4; --merged: EXPLORE's variants).
(16-row tiles were dropped before the run: on Triton 3.6 their operand goes through shared memory, sm_90 SASS.)
Each variant against the torch twin (rel-L2 < TOL, PASS/FAIL); then CUDA-graph replay of the whole call over rotated
input sets, every graph in turn in ROUNDS interleaved rounds (median), % of the packed-byte floor (the
touched experts' packed bytes, scales and zeros over the measured copy bandwidth) and the achieved TB/s (those bytes
over the time). Look for: every line PASS; "wins" (rounds a variant took <= 0.97 x the pick). JSON <out>/wo_mma.json;
the table printed last.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig, device_key  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode  # noqa: E402
from bench_rounds import graph_of, wins  # noqa: E402,F401  (graph_of: scripts copied from dec7 import it here)
from bench_run import RunLog, cells_in_children  # noqa: E402
from wo_cells import ROUNDS, Cell, child, dump, measure_cell  # noqa: E402

CELLS = (("deepseek-v3", "int4_w4a16", 1), ("qwen3-30b-a3b", "int4_w4a16", 1), ("deepseek-v3", "int4_w4a16", 8),
         ("mixtral-8x7b", "int4_w4a16", 8), ("qwen3-30b-a3b", "int4_w4a16", 8), ("deepseek-v3", "mxfp4", 1),
         ("deepseek-v3", "mxfp4", 8))
# --merged (the merged-main check): the cells the branch's default changed, "pick" (now the mma decode) against
# "prev" (the decode picked there before, PREVIOUS) with eager host / wall µs; and the decode each CELLS cell picks
# checked against GUARD (unchanged by the branch).
MERGED_CELLS = (("mixtral-8x7b", "int4_w4a16", 8), ("mixtral-8x7b", "int4_w4a16", 16),
                ("mixtral-8x7b", "int4_w4a16", 4))
# then, for the notes only (no default rides on them): the mma decode where the register decode is the pick at
# 2-4 rows an expert (M = 64, as Mixtral M = 8), Mixtral mxfp4 M = 8, and the split gate-up (never run before) where
# the mma lost at M = 1
EXPLORE = {("deepseek-v3", "int4_w4a16", 64): ("mma", "m64"), ("qwen3-30b-a3b", "int4_w4a16", 64): ("mma", "m64"),
           ("mixtral-8x7b", "mxfp4", 8): ("mma", "m64"),  # the tile decode's pick; mma mxfp4 beat register elsewhere
           ("deepseek-v3", "int4_w4a16", 1): ("ms2", "ms4", "m64s2"),
           ("qwen3-30b-a3b", "int4_w4a16", 1): ("ms2", "ms4", "m64s2")}
EXPLORE_CELLS = tuple(EXPLORE)
# --confirm (after the merged run): the defaults it suggested (int4 M=64, mxfp4 Mixtral M=8), a wider M of one of
# them, and Mixtral int4 M=8's eager host time again, "pick" against "prev" with eager times
CONFIRM_CELLS = (("deepseek-v3", "int4_w4a16", 64), ("qwen3-30b-a3b", "int4_w4a16", 64), ("mixtral-8x7b", "mxfp4", 8),
                 ("deepseek-v3", "int4_w4a16", 256), ("mixtral-8x7b", "int4_w4a16", 8))
# (preset, scheme, M) -> the decode the chooser picked there before this branch's DECODE_MEASURED rows ("prev")
PREVIOUS: dict[tuple, str] = {cell: "register" for cell in MERGED_CELLS + CONFIRM_CELLS}
PREVIOUS[("mixtral-8x7b", "mxfp4", 8)] = "tile"
GUARD = {("deepseek-v3", "int4_w4a16", 1): "gemv", ("qwen3-30b-a3b", "int4_w4a16", 1): "gemv",
         ("deepseek-v3", "int4_w4a16", 8): "gemv", ("mixtral-8x7b", "int4_w4a16", 8): "mma",
         ("qwen3-30b-a3b", "int4_w4a16", 8): "gemv", ("deepseek-v3", "mxfp4", 1): "gemv",
         ("deepseek-v3", "mxfp4", 8): "gemv", ("mixtral-8x7b", "int4_w4a16", 32): "tile",
         ("mixtral-8x7b", "int4_w4a16", 1): "gemv", ("deepseek-v3", "int4_w4a16", 64): "mma",
         ("qwen3-30b-a3b", "int4_w4a16", 64): "mma", ("mixtral-8x7b", "mxfp4", 8): "mma",
         ("deepseek-v3", "int4_w4a16", 16): "register", ("mixtral-8x7b", "mxfp4", 1): "register",
         ("deepseek-v3", "mxfp4", 64): "register", ("qwen3-30b-a3b", "mxfp4", 64): "register"}
MMA_TILES = {"m64": (64, 2, 3), "m4s": (32, 1, 4)}  # name -> (rows, warps, stages), both GEMMs; name + "s2": split
EAGER, EAGER_CALLS = False, 12  # --eager: each variant's eager host and wall µs a call too
MERGED = False  # --merged or --confirm
RUN = RunLog()


def variants(s: Shape, scheme: str, m: int, dev) -> dict:
    """name -> (decode, config)."""
    decode = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
    out = {"pick": (decode, wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), decode))}
    prev = PREVIOUS.get((s.name, scheme, m))
    if prev is not None:
        out["prev"] = (prev, wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), prev))
    if MERGED and prev is not None:
        return out
    mma = wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), "mma")
    out["mma"] = ("mma", mma)
    for name, (rows, warps, stages) in MMA_TILES.items():
        tile = GemmTile(rows, 128, 1, warps, stages)
        out[name] = ("mma", KernelConfig(16, tile, tile))
        out[name + "s2"] = ("mma", WordConfig(16, tile, tile, up_split=2))  # the gate-up split in 2
    out["ms2"] = ("mma", WordConfig(mma.BLOCK_M, mma.up, mma.down, up_split=2))
    out["ms4"] = ("mma", WordConfig(mma.BLOCK_M, mma.up, mma.down, up_split=4))
    keep = EXPLORE.get((s.name, scheme, m)) if MERGED else ("mma", "m64", "m4s", "ms2")
    return {k: v for k, v in out.items() if k == "pick" or k in (keep or ())}


def run_cell(s: Shape, scheme: str, m: int, dev, bw: float) -> Cell:
    """The cell with this mode's variants; eager times with --eager (--merged / --confirm: where "prev" runs)."""
    found = variants(s, scheme, m, dev)
    eager = EAGER_CALLS if EAGER and (not MERGED or "prev" in found) else 0
    return measure_cell(s, scheme, m, dev, bw, found, RUN, eager)


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<13} {'scheme':<10} {'M':>2} {'floor':>6} {'pick':>14}  variants µs (% floor, TB/s, "
             f"wins/{ROUNDS}, beaten: rounds the pick won)"]
    for c in cells:
        pick = c.times.get("pick", float("nan"))
        tbps = {k: c.bytes / (v * 1e-6) / 1e12 for k, v in c.times.items()}
        base = c.rounds.get("pick", ())  # beaten: the rounds the pick took <= 0.97 x the variant
        rest = "  ".join(f"{k} {v:.1f} ({100 * c.floor_us / v:.0f}%, {tbps[k]:.2f}, {wins(c.rounds[k], base)}, "
                         f"beaten {wins(base, c.rounds[k])})" for k, v in c.times.items() if k != "pick")
        lines.append(f"{c.preset:<13} {c.scheme:<10} {c.m:>2} {c.floor_us:6.1f} {pick:7.1f} "
                     f"{tbps.get('pick', 0):.2f}TB/s  {rest}")
        if c.eager:
            lines.append(" " * 14 + "eager host / wall µs a call: " + "  ".join(
                f"{k} {v['host_us']:.1f} / {v['wall_us']:.1f}" for k, v in c.eager.items()))
    return "\n".join(lines)


def run_cells(args) -> tuple:
    """The (preset, scheme, M) cells of this run's mode."""
    if args.smoke:
        return CELLS[:2]
    return CONFIRM_CELLS if args.confirm else MERGED_CELLS + EXPLORE_CELLS if args.merged else CELLS


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/wo_mma")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--eager", action="store_true", help="each variant's eager host and wall µs a call too")
    p.add_argument("--deadline", type=float, default=140.0, help="wall-clock seconds; cells past it are skipped")
    p.add_argument("--cell", type=int, help="run one cell in this process (the parent starts one per cell)")
    p.add_argument("--merged", action="store_true", help="the merged-main check: MERGED_CELLS, pick against prev, "
                   "eager times, the GUARD picks")
    p.add_argument("--confirm", action="store_true", help="CONFIRM_CELLS, pick against prev, eager times, GUARD")
    args = p.parse_args(argv)
    global EAGER, MERGED
    EAGER, MERGED = args.eager or args.merged or args.confirm, args.merged or args.confirm
    if args.cell is not None:
        return child(run_cells(args)[args.cell], args, "wo_mma", args.cell, run_cell, RUN)
    if MERGED:
        for (preset, scheme, m), want in GUARD.items():
            s = Shape.from_preset(preset)
            got = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
            RUN.check(f"guard {preset} {scheme} M={m} picks {want}", got == want, f"got {got}")
    import triton

    print(torch.__version__, "triton", triton.__version__, flush=True)
    flags = ["--smoke"] * args.smoke + ["--eager"] * args.eager + ["--merged"] * args.merged + \
        ["--confirm"] * args.confirm
    labels = [f"{preset} {scheme} M={m}" for preset, scheme, m in run_cells(args)]
    min_left = 12 if args.confirm else 20  # a cell takes ~10-14 s (the confirm's are all medium-sized)
    got, skipped = cells_in_children(__file__, labels, args.out, "wo_mma", RUN, args.deadline, min_left,
                                     lambda left: flags)
    cells = [Cell(**c) for c in got]
    dump(os.path.join(args.out, "wo_mma.json"), cells, float("nan"), RUN)
    print(f"total {RUN.elapsed():.1f} s; FAILED:", RUN.failed or "none", "; SKIPPED:", skipped or "none")
    print(table(cells), flush=True)
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the packed-half word decode (``decode="gemv_half"``, ``_kernels/gemm_wo_half.py``: fp16x2
products, two 4-bit weights an instruction) against the decodes it may replace, at issue #16's decode
cells: every variant against the torch twin (the dequantize-then-float definition of ``reference``) at
the real shapes, timed by CUDA-graph replay over rotated input sets (weights stream from HBM), with
moekit's bf16 path, the chooser's old default, % of the packed-byte floor and the targets' verdicts.

    PYTHONPATH=$PWD python benchmarks/wo_decode_device_check.py            # H200, ~150 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/wo_decode_device_check.py --smoke   # CPU, tiny

Cells: DeepSeek-V3, Mixtral-8x7B, Qwen3-30B-A3B (in that order: the time limit cuts the last) x int4_w4a16
(g 128, zero points), mxfp4, int8_w8a16 x M = 1, 8, 64. Variants (an error in one is printed, the run goes
on): tile, register, gemv (the previous decodes; "pick" is the chooser's, the old default) and, for the
4-bit schemes, gemv_half at its heuristic config (``triton_wo_gemv.half_heuristic_config``: at M*k <= 16
32-row 2-warp tiles with an L2 prefetch 4 steps ahead, else gemv's) and HALF_VARIANTS' tiles (64 rows 2
warps no prefetch; 32 rows 1 warp, prefetch 4: sm_90 SASS 3.8 instructions a weight, 5.2 at 32 x 2 warps,
where each thread's activation work serves 8 rows, not 16; gate-up 32 rows and down 64, 2 warps, prefetch 4:
down's many output rows fill the SMs at 64). Machinery (timing,
floor, twin, verdicts, the time limit): ``wo_speed_device_check``. Table last; JSON to
$OUT/wo_decode.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import wo_speed_device_check as base  # noqa: E402
from moekit.bench.cells import Shape  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_wo_gemv import gemv_heuristic_config  # noqa: E402

PRESET_ORDER = ("deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b")  # the checkpoint run (b067aca) timed Qwen3 fully
SCHEMES = ("int4_w4a16", "mxfp4", "int8_w8a16")
BATCHES = (1, 8, 64)
LIMIT_S = 140.0  # whole run, compiles included
# name -> (gate-up BLOCK_N, words a step, down BLOCK_N, words a step, warps, L2 prefetch steps ahead)
HALF_VARIANTS = {"half64w2": (64, 16, 64, 16, 2, 0), "half32w1pf4": (32, 16, 32, 16, 1, 4),
                 "half_up32dn64": (32, 16, 64, 16, 2, 4)}
OLD = ("tile", "register", "gemv")


def half_config(variant: tuple, s: Shape, scheme: str, m: int) -> KernelConfig:
    up_bn, up_w, down_bn, down_w, warps, prefetch = variant  # gemv_half: num_stages = 1 + prefetch steps
    base_cfg = gemv_heuristic_config(m, s.num_experts, s.n, s.k, s.top_k, scheme)
    return KernelConfig(base_cfg.BLOCK_M, GemmTile(up_bn, up_w * 8, base_cfg.up.GROUP_M, warps, 1 + prefetch),
                        GemmTile(down_bn, down_w * 8, base_cfg.up.GROUP_M, warps, 1 + prefetch))


def variants(s: Shape, scheme: str, m: int) -> dict:
    """name -> (decode, config or None) of one cell."""
    out = {"tile": ("tile", None), "register": ("register", None)}
    if scheme != "int8_w8a16":
        out["gemv"] = ("gemv", None)
        out["gemv_half"] = ("gemv_half", None)
        out.update({k: ("gemv_half", half_config(v, s, scheme, m)) for k, v in HALF_VARIANTS.items()})
    return out


def table(cells) -> str:
    def us(c, name: str) -> str:
        return f"{c.times[name]:8.1f}" if name in c.times else f"{'-':>8}"

    lines = [f"{'shape':<14} {'scheme':<10} {'M':>3} {'bf16':>7} {'old':>8} {'gemv':>8} {'half':>8} {'new best':>8} "
             f"{'variant':<10} {'%floor':>6} {'x bf16':>6} {'floor':>7} {'old pick':>9}  target (best of all)"]
    for c in cells:
        new = {k: v for k, v in c.times.items() if k not in OLD}
        nb = min(new, key=new.get) if new else ""
        best = c.times.get(c.best, float("nan"))
        new_us = new.get(nb, float("nan"))
        lines.append(f"{c.preset:<14} {c.scheme:<10} {c.m:>3} {c.bf16_us:7.1f} {us(c, c.pick)} {us(c, 'gemv')} "
                     f"{us(c, 'gemv_half')} {new_us:8.1f} {nb:<10} {100 * c.floor_us / new_us:5.0f}% "
                     f"{new_us / c.bf16_us:6.2f} {c.floor_us:7.1f} {c.pick:>9}  {c.target} ({c.best} {best:.1f})")
    return "\n".join(lines)


def main(argv=None) -> int:
    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    base.variants, base.LIMIT_S = variants, LIMIT_S
    dev = base.s_dev()
    if smoke:
        base.TIMING.update(budget_s=0.0, min_reps=1, max_reps=1)
        base.LIMIT_S = 1e9  # the interpreter: every cell, however slow
        for name in ("half64w2", "half32w1pf4"):
            HALF_VARIANTS.pop(name)
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    bw = base.copy_tbps(dev)
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    shapes = [Shape("tiny", 8, 64, 128, 2)] if smoke else [Shape.from_preset(p) for p in PRESET_ORDER]
    batches = (1, 8) if smoke else BATCHES
    schemes = ("int4_w4a16", "mxfp4") if smoke else SCHEMES
    if dev.type == "cuda":
        t0 = time.perf_counter()
        base.compile_all(shapes, schemes, batches, dev)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    cells = []
    for s in shapes:
        if base.left_s() < 0:
            base.SKIPPED.append(s.name)
            continue
        cells += base.shape_cells(s, schemes, batches, bw, dev)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_decode.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw,
                       "cells": [vars(c) for c in cells], "failed": base.FAILED, "skipped": base.SKIPPED}, f, indent=1)
    print(f"total {time.perf_counter() - base.START:.1f} s; FAILED:", base.FAILED or "none", "; SKIPPED:",
          base.SKIPPED or "none")
    for c in cells:
        print(f"{c.preset} {c.scheme} M={c.m}: " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(c.times.items(),
                                                                                                 key=lambda kv: kv[1])))
    print(table(cells), flush=True)
    return 1 if base.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of taller tile-decode and register-decode configs at Mixtral-8x7B M = 64 (128 slots over 8
experts: ~16 rows an expert), the worst 4-bit cells left after branch wo-decode2's second run (H200, µs: int4
tile 1034 = 1.57x bf16 660, 18% of the packed floor; mxfp4 tile 857 = 1.30x). The chooser's 32-row tiles
dequantize each weight tile once per M-block, and with ~16 rows an expert (uneven) many experts take 2
blocks: the dequantization's instructions, not the bytes, set the time. A 64- or 128-row tile covers an
expert's rows in one block (each weight dequantized once; the wasted MMA rows are cheap), and the register
decode's inline PTX dequantizes in fewer instructions a weight.

    PYTHONPATH=$PWD python benchmarks/wo_tall_decode_device_check.py            # H200, ~40 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/wo_tall_decode_device_check.py --smoke   # CPU, tiny

Every variant against the torch twin at the real shapes, timed by CUDA-graph replay over rotated inputs
(machinery: ``wo_speed_device_check``); the table last; JSON to $OUT/wo_tall_decode.json.
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
from moekit.experts.triton_wo_winners import tile  # noqa: E402

LIMIT_S = 100.0
# name -> (decode, config): tiles as (BLOCK_N, BLOCK_K, GROUP_M, warps, stages) of gate-up and down
VARIANTS = {
    "t64": ("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4))),  # Qwen3 M=1024's winner
    "t64a": ("tile", tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4), True)),
    "t64k128": ("tile", tile(64, (64, 128, 1, 4, 3), (64, 128, 1, 4, 3))),
    "t128": ("tile", tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3))),
    "t32w8": ("tile", tile(32, (64, 128, 1, 8, 3), (128, 128, 1, 8, 3))),
    "r64": ("register", KernelConfig(64, GemmTile(32, 64, 1, 4, 4), GemmTile(64, 64, 1, 4, 4))),
    "r16": ("register", KernelConfig(16, GemmTile(64, 128, 1, 4, 4), GemmTile(128, 128, 1, 4, 4))),
}


def variants(s: Shape, scheme: str, m: int) -> dict:
    return {"pick": (None, None), **VARIANTS}


def main(argv=None) -> int:
    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    base.variants, base.LIMIT_S = variants, LIMIT_S
    dev = base.s_dev()
    if smoke:
        base.TIMING.update(budget_s=0.0, min_reps=1, max_reps=1)
        base.LIMIT_S = 1e9
        for name in ("t64a", "t64k128", "t128", "t32w8"):
            VARIANTS.pop(name)
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    bw = base.copy_tbps(dev)
    shapes = [Shape("tiny", 4, 64, 128, 2)] if smoke else [Shape.from_preset("mixtral-8x7b")]
    batches, schemes = ((16,), ("int4_w4a16",)) if smoke else ((64,), ("int4_w4a16", "mxfp4"))
    if dev.type == "cuda":
        t0 = time.perf_counter()
        base.compile_all(shapes, schemes, batches, dev)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    cells = [c for s in shapes for c in base.shape_cells(s, schemes, batches, bw, dev)]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_tall_decode.json"), "w") as f:
            json.dump({"device": name, "copy_TBps": bw, "cells": [vars(c) for c in cells], "failed": base.FAILED,
                       "skipped": base.SKIPPED}, f, indent=1)
    print(f"total {time.perf_counter() - base.START:.1f} s; FAILED:", base.FAILED or "none", "; SKIPPED:",
          base.SKIPPED or "none")
    for c in cells:
        times = "  ".join(f"{k} {v:.1f}" for k, v in sorted(c.times.items(), key=lambda kv: kv[1]))
        print(f"{c.preset} {c.scheme} M={c.m} (bf16 {c.bf16_us:.1f}, floor {c.floor_us:.1f}, pick {c.pick}): {times}")
    return 1 if base.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

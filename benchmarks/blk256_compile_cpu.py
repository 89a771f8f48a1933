"""Compile the 256-row bf16 Gluon gate-up GEMM (``_kernels/gluon_gemm_blk256.py``) for sm_90 on a machine without a GPU
(Gluon does not run in the interpreter): layout and SMEM errors before a device run, ptxas's spills and wgmma
serialization, the SMEM the compiler allocated against ``GluonTile.shared_bytes``.

    PYTHONPATH=$PWD python3 benchmarks/blk256_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=<its dir>:$PWD)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_sm90(kernel, args: dict, const: dict) -> str:
    """Compile ``kernel`` (a Gluon jit function) for sm_90 with these runtime ``args`` and ``const`` constexprs."""
    from gluon_fp8_compile_cpu import compile_gluon_sm90, sm90_summary

    from moekit.experts.triton_gluon_blk256 import CONSUMER_WARPS, MAX_REGISTERS

    t0 = time.perf_counter()
    out = compile_gluon_sm90(kernel, args, const, CONSUMER_WARPS, MAX_REGISTERS)
    return sm90_summary(out, time.perf_counter() - t0)


def gemm_args(tile) -> tuple[dict, dict]:
    """(args, constexprs) of the kernel at a small shape (E=2, N=512, K=512)."""
    from gluon_fp8_compile_cpu import _descriptor

    from moekit.experts.triton_gluon_blk256 import CONSUMER_REGS, SUB_M, out_cols

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    cols = out_cols(tile)
    int32 = torch.empty(1, dtype=torch.int32)
    args = dict(a_desc=_descriptor([t, k], [SUB_M, tile.block_k], bf16),
                w_desc=_descriptor([e * 2 * n, k], [cols, tile.block_k], bf16),
                c_desc=_descriptor([t, n], [SUB_M, cols], bf16), experts_ptr=int32, used_ptr=int32,
                sorted_ptr=int32, num_assignments=t, reduce_dim=k, num_col_blocks=n // cols)
    const = dict(W_ROWS=2 * n, GATE_OFFSET=n, STAGES=tile.stages, GROUP_M=tile.group_m, SEARCH_STEPS=4,
                 CONSUMER_REGS=CONSUMER_REGS, num_warps=4)
    return args, const


def main() -> int:
    from blk256_variants import UP_VARIANTS
    from gluon_fp8_compile_cpu import report_each

    from moekit.experts._kernels.gluon_gemm_blk256 import blk256_gemm_kernel

    return report_each([(f"{name} {tile} (model SMEM {tile.shared_bytes(True)} B)",
                         lambda t=tile: compile_sm90(blk256_gemm_kernel, *gemm_args(t)))
                        for name, tile in UP_VARIANTS.items()], tail=3000)


if __name__ == "__main__":
    sys.exit(main())

"""Compile the bf16 Gluon down GEMM with merged tails (``_kernels/gluon_gemm_tail.py``) for sm_90 without a GPU, at
the route's down tiles with the tail (wide and narrow experts): layout and SMEM errors before a device run, ptxas's
spills and wgmma serialization.

    PYTHONPATH=$PWD python3 benchmarks/tail_compile_cpu.py      (Triton 3.9; 3.6: PYTHONPATH=<its dir>:$PWD)
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def tail_down_args(tile, e: int, n: int, k: int, t: int) -> tuple[dict, dict]:
    """(args, const) of ``tail_down_kernel`` for a compile: the down GEMM of ``e`` experts over t assignment rows,
    reducing n (h [t, n]), k output columns (w2 as [e * k, n]), at ``tile`` with its tail rows."""
    from gluon_fp8_compile_cpu import _descriptor

    from moekit.experts.triton_gluon_launch import BLOCK_M, NUM_WARPS

    bf16, int32 = torch.bfloat16, torch.empty(1, dtype=torch.int32)
    args = dict(a_desc=_descriptor([t, n], [BLOCK_M, tile.block_k], bf16),
                t_desc=_descriptor([t, n], [tile.tail, tile.block_k], bf16),
                w_desc=_descriptor([e * k, n], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, k], [BLOCK_M, tile.block_n], bf16),
                ct_desc=_descriptor([t, k], [tile.tail, tile.block_n], bf16), experts_ptr=int32, sorted_ptr=int32,
                used_ptr=int32, num_assignments=t, reduce_dim=n, num_col_blocks=k // tile.block_n)
    return args, dict(W_ROWS=k, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=NUM_WARPS)


def compile_tail_down(tile) -> str:
    from gluon_fp8_compile_cpu import compile_gluon_sm90, sm90_summary

    from moekit.experts._kernels.gluon_gemm_tail import tail_down_kernel as kernel
    from moekit.experts.triton_gluon_launch import MAX_REGISTERS, NUM_WARPS

    args, const = tail_down_args(tile, 2, 512, 512, 1024)
    t0 = time.perf_counter()
    out = compile_gluon_sm90(kernel, args, const, NUM_WARPS, MAX_REGISTERS)
    return f"{tile}: {sm90_summary(out, time.perf_counter() - t0)}"


def main() -> int:
    from gluon_fp8_compile_cpu import report_each

    from moekit.experts.triton_gluon_launch import down_tile

    return report_each([(f"N={inter} down tail 64", partial(compile_tail_down, down_tile(inter, tail=True)))
                        for inter in (2048, 768)])


if __name__ == "__main__":
    sys.exit(main())

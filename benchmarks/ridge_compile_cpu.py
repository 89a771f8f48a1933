"""Compile every bf16 Gluon tile of ``ridge_variants`` for sm_90 on a machine without a GPU (Gluon does not run in
the interpreter): catches layout and shared-memory errors before a device run and reads ptxas's spills.

    PYTHONPATH=$PWD python benchmarks/ridge_compile_cpu.py

Needs a Triton whose Gluon has ``GluonASTSource`` (3.9 here); reuses ``gluon_fp8_compile_cpu``'s descriptor and
ptxas helpers. Prints one line per (variant, GEMM): seconds, SMEM bytes, the partitions' setmaxnreg, spill bytes.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def compile_bf16_gemm(tile, gated: bool) -> str:
    """One GEMM of the bf16 Gluon kernel at a small shape (E=2, N=512, K=512; W_ROWS, GATE_OFFSET constexprs)."""
    from gluon_fp8_compile_cpu import _descriptor, compile_gluon_sm90, sm90_summary

    from moekit.experts._kernels.gluon_gemm import grouped_gemm_kernel as kernel
    from moekit.experts.triton_gluon_launch import BLOCK_M, MAX_REGISTERS, NUM_WARPS

    e, n, k, t, bf16 = 2, 512, 512, 1024, torch.bfloat16
    w_rows, r, c = (2 * n, k, n) if gated else (k, n, k)
    int32 = torch.empty(1, dtype=torch.int32)
    args = dict(a_desc=_descriptor([t, r], [BLOCK_M, tile.block_k], bf16),
                w_desc=_descriptor([e * w_rows, r], [tile.block_n, tile.block_k], bf16),
                c_desc=_descriptor([t, c], [BLOCK_M, tile.block_n], bf16), experts_ptr=int32, used_ptr=int32,
                reduce_dim=r, num_col_blocks=c // tile.block_n)
    const = dict(W_ROWS=w_rows, GATE_OFFSET=n if gated else 0, GATED=gated, STAGES=tile.stages,
                 GROUP_M=tile.group_m, num_warps=NUM_WARPS)
    t0 = time.perf_counter()
    out = compile_gluon_sm90(kernel, args, const, NUM_WARPS, MAX_REGISTERS)
    return sm90_summary(out, time.perf_counter() - t0)


def main() -> int:
    from gluon_fp8_compile_cpu import report_each
    from ridge_variants import bf16_gluon_tiles

    jobs = [(f"N={inter} {name} {gemm} {tile}", partial(compile_bf16_gemm, tile, gated)) for inter in (14336, 768)
            for name, (up, down) in bf16_gluon_tiles(inter).items()
            for gemm, tile, gated in (("gate-up", up, True), ("down", down, False))]
    return report_each(jobs, tail=1500)


if __name__ == "__main__":
    sys.exit(main())

"""The end the down GEMMs share (bf16 / fp32 ``gemm.down_kernel``, fp8 ``gemm_fp8.down_fp8_kernel``, the
weight-only ``gemm_wo._down_epilogue`` of the tile, register and mma decodes): the routed-weighted store of a
program's y tile, then, KSUM, the folded k-sum's arrivals (``combine.ksum_epilogue``).

Torch twin: the down step of ``moekit.experts.reference`` (y[a] = routed weight[a] * (h[a] w2[e]^T)); each
kernel's own twin holds it whole.

Straight-line code in the order the kernels wrote it inline: each kernel compiles to the same sm_90 SASS as
before (session 30, ``benchmarks/wo_sass_diff_cpu.py``, Triton 3.6 and 3.9, 34 kernels identical).

Shapes: A = M*k assignments, BM the block's rows, BN its output columns (of K, the hidden size).
"""

import triton
import triton.language as tl

from moekit.experts._kernels.combine import ksum_epilogue


@triton.jit
def store_routed(acc, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, split_rows, row_ok,
                 arrivals, pid_n, offs_out, out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N: tl.constexpr,
                 KSUM: tl.constexpr, TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr, SUM_ROWS: tl.constexpr):
    """y rows program_id(1) * split_rows + safe_rows = the routed weight of each row (``weights_ptr`` at safe_rows
    [BM], 0 on padding rows, masked by row_ok) x acc [BM, BN] (float32), in y's dtype, columns offs_out [BN]
    (out_ok). split_rows: A for the weight-only kernels' split-K partials (grid axis 1 the split), 0 for one split
    (the product folds away at compile time). Then, KSUM, this program's arrivals (``combine.ksum_epilogue``;
    ``arrivals`` [BM] int32: each row's token's routed slots)."""
    acc = acc * tl.load(weights_ptr + safe_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]  # routed weight
    y_rows = tl.program_id(1) * split_rows + safe_rows  # [BM] int64
    y_ptrs = y_ptr + y_rows[:, None] * stride_ym + offs_out[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])
    if KSUM:
        ksum_epilogue(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok, arrivals, pid_n, offs_out,
                      out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD, HAS_MAP, SUM_ROWS)

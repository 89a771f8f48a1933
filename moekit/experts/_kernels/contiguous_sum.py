"""The k-slot combine of the contiguous layout: out[t] = sum_j w[t, j] * y[dst[t, j]] over the slots
routed here (dst >= 0), in float32 from 0, one slot at a time in slot order; padding rows of y are
never read. Torch twin: ``moekit.layouts.contiguous.combine_contiguous``.

Shapes: y [T, K] (the down GEMM's rows in layout order), dst [M, k] int32 (``src_to_dst``),
w [M, k] (routing weights), out [M, K]; BT tokens x BK columns per program.
"""

import triton
import triton.language as tl


@triton.jit
def contiguous_sum_kernel(
    y_ptr, dst_ptr, w_ptr, out_ptr,
    num_tokens, K, stride_ym, stride_om,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    t_ok = tokens < num_tokens
    c_ok = cols < K
    tok = tl.where(t_ok, tokens, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: the k row loads go out together
        dst = tl.load(dst_ptr + tok * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)  # [BT]
        weight = tl.load(w_ptr + tok * TOP_K + j, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
        ok = t_ok & (dst >= 0)
        rows = tl.load(y_ptr + tl.where(ok, dst, 0)[:, None] * stride_ym + cols[None, :],
                       mask=ok[:, None] & c_ok[None, :], other=0.0)  # [BT, BK]
        acc += rows.to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + tok[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

"""The row moves of the contiguous layout, around the Gluon GEMMs (``moekit.experts.triton_gluon``).

gather_rows_kernel: x_perm[r] = x[sorted_ids[r] // k] for the real rows (sorted_ids[r] < A) and
    dst[sorted_ids[r]] = r; padding rows are not written (their GEMM rows are computed and never read).
    Torch twin: ``moekit.layouts.contiguous.permute_contiguous`` (same rows up to order within an expert).
contiguous_sum_kernel: out[t] = sum_j w[t, j] * y[dst[t, j]] over the slots routed here (dst >= 0), in
    float32 from 0, one slot at a time in slot order. Torch twin: ``combine_contiguous``. FROM_IDS: the slots
    routed here are those whose id (through the map with HAS_MAP) is a local expert, the alignment's rule
    (``local_expert_ids``), and dst is read only for them: the lean launch's dst is never filled with -1.

Shapes: x [M, K], sorted_ids [R] (the block-aligned layout's; padding = sentinel A = M*k), x_perm [R, K],
dst [M, k] int32 (-1 = not routed here), y [R, K], w [M, k], out [M, K], ids [M, k], map [E_global].
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids


@triton.jit
def gather_rows_kernel(
    x_ptr, sorted_ptr, x_perm_ptr, dst_ptr,
    num_rows, num_assignments, K, stride_xm, stride_pm,
    TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    r_ok = rows < num_rows
    a = tl.load(sorted_ptr + rows, mask=r_ok, other=num_assignments).to(tl.int64)  # [BR]
    real = r_ok & (a < num_assignments)
    if tl.program_id(1) == 0:
        tl.store(dst_ptr + a, rows.to(tl.int32), mask=real)
    tokens = tl.where(real, a // TOP_K, 0)
    mask = real[:, None] & (cols < K)[None, :]
    v = tl.load(x_ptr + tokens[:, None] * stride_xm + cols[None, :], mask=mask)
    tl.store(x_perm_ptr + rows.to(tl.int64)[:, None] * stride_pm + cols[None, :], v, mask=mask)


@triton.jit
def contiguous_sum_kernel(
    y_ptr, dst_ptr, w_ptr, out_ptr, ids_ptr, map_ptr,
    num_tokens, K, stride_ym, stride_om, num_experts, num_global,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, FROM_IDS: tl.constexpr = False,
    HAS_MAP: tl.constexpr = False,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    t_ok = tokens < num_tokens
    c_ok = cols < K
    tok = tl.where(t_ok, tokens, 0).to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: the k row loads go out together
        if FROM_IDS:  # routed here by the alignment's own rule: only those slots' dst were written by this call
            ids = tl.load(ids_ptr + tok * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)  # [BT]
            ok = t_ok & (local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP) < num_experts)
            dst = tl.load(dst_ptr + tok * TOP_K + j, mask=ok, other=-1).to(tl.int64)  # [BT]
        else:
            dst = tl.load(dst_ptr + tok * TOP_K + j, mask=t_ok, other=-1).to(tl.int64)  # [BT]
            ok = t_ok & (dst >= 0)
        weight = tl.load(w_ptr + tok * TOP_K + j, mask=t_ok, other=0.0).to(tl.float32)  # [BT]
        rows = tl.load(y_ptr + tl.where(ok, dst, 0)[:, None] * stride_ym + cols[None, :],
                       mask=ok[:, None] & c_ok[None, :], other=0.0)  # [BT, BK]
        acc += rows.to(tl.float32) * weight[:, None]
    out_ptrs = out_ptr + tok[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

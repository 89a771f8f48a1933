"""The backward of the fused experts path: grouped GEMMs over the block-aligned layout that gather their
rows by index (never permuted), as ``gemm.py`` does.

Torch twins: the float64 autograd of ``moekit.experts.reference`` (the tests), and
``moekit.experts.grouped_mm``'s autograd (the device check).

Per assignment a = t*k + j routed to expert e, with weight w_a (the forward:
h_a = w13[e] x_t [2N], g_a = act(gate_a) * up_a [N], y_a = w2[e] g_a [K], out_t = sum_j w_a y_a):

    grad_gate_up_kernel  dg_a = w2[e]^T dout_t (the dY @ W2 GEMM, dy_a = w_a dout_t never written) and,
                         in its epilogue, the act-and-mul backward: dh_a [2N], w_a g_a [N] (dW2's right
                         operand) and the partial <dg_a, g_a> = <dout_t, y_a> of d w_a per N tile.
                         gate and up are recomputed in the same K loop (the kept h_p of
                         ``BackwardOptions(recompute=False)`` is read by ``gemm_backward_sorted`` only).
    gather_gemm_kernel   out_a = scale_a * W[e] a_src for any strides of W: dX's "dH @ W13" rows
                         (summed over k afterwards by ``combine.sum_slots_kernel``).
    weight_grad_kernel   dW[e] = sum over e's rows of L_row^T R_row: dW2 = dout^T (w g), dW13 = dh^T x.
                         A program owns one output tile of one expert and loops over that expert's
                         M-blocks (every SPLIT-th one; SPLIT > 1 writes fp32 partials that the host sums
                         in a fixed order). No atomics anywhere: every result is deterministic.

W_DESC (grad_gate_up, gather_gemm): the weights come as TMA tensor descriptors over [E*rows, cols]
(``gemm.py``'s convention) instead of pointer tiles; the host passes them only for contiguous 16-bit
weights whose reduction tiles never cross an expert's last row (a reduction over rows needs rows % BK
== 0; a reduction over columns reads zeros past the last one). An output tile past the expert's last
row reads the next expert's rows: those columns are never stored (and meet zeros in every dot product
whose result is kept).

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, N intermediate; BM = the layout's block.
Every row index is int64 before it meets a stride.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import grouped_tile
from moekit.experts._kernels.gemm import _dot, _grid_position


@triton.jit
def _layout_block(pid_m, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, BLOCK_M: tl.constexpr):
    """(assignment of each row of M-block pid_m [BM] int64, A on padding rows; its expert, -1 = unused)."""
    in_use = pid_m * BLOCK_M < tl.load(num_padded_ptr)
    expert = tl.where(in_use, tl.load(expert_ids_ptr + pid_m).to(tl.int64), -1)
    rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return rows, expert


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32; ACT as ``gemm._activation`` (``ACTIVATIONS[name].kernel_id``)."""
    if ACT == 0:  # silu: s + g s (1 - s)
        s = tl.sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACT == 1:  # gelu (erf): Phi(g) + g phi(g)
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        return g * cdf, cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    elif ACT == 2:  # gelu, tanh approximation: 0.5 (1 + t) + 0.5 g (1 - t^2) u'
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        du = 0.7978845608028654 * (1.0 + 0.134145 * g * g)
        return 0.5 * g * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * du
    else:  # relu
        return tl.maximum(g, 0.0), tl.where(g > 0.0, 1.0, 0.0)


@triton.jit
def grad_gate_up_kernel(
    dout_ptr, x_ptr, w13_ptr, w2_ptr, weights_ptr,  # dout, x [M, K]; w13, w2; weights [A]
    dh_ptr, gw_ptr, dw_part_ptr,  # out: dh [A, 2N], gw [A, N] = w g, dw_part [A, num_pid_n] fp32
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_assignments, top_k, num_pid_m,
    stride_dm, stride_xm, stride_ae, stride_an, stride_ak, stride_be, stride_bk, stride_bn, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    W_DESC: tl.constexpr, OUT_SORTED: tl.constexpr,
):
    """W_DESC: w13_ptr a descriptor over w13 as [E*2N, K], block [BN, BK]; w2_ptr over w2 as [E*K, N],
    block [BK, BN] (K % BK == 0, so a K step never reads the next expert's rows). OUT_SORTED: dh and gw
    rows are the layout's rows (padding rows 0), for the contiguous weight grads; else assignments (row stride 2N)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grid_position(num_pid_m, num_pid_n, GROUP_M)
    rows, expert = _layout_block(pid_m, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, BLOCK_M)
    if expert < 0:
        return
    row_ok = rows < num_assignments  # [BM]
    safe = tl.where(row_ok, rows, 0)
    token = safe // top_k  # [BM] the dout and x row of each assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    d_ptrs = dout_ptr + token[:, None] * stride_dm + offs_k[None, :]  # [BM, BK]
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
    if W_DESC:
        gate_row = (expert * 2 * N + pid_n * BLOCK_N).to(tl.int32)  # w13 row of the tile's first gate row
        w2_row = (expert * K).to(tl.int32)
    else:
        w2_ptrs = w2_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
        wg_ptrs = w13_ptr + expert * stride_ae + offs_n[None, :].to(tl.int64) * stride_an + offs_k[:, None] * stride_ak
        wu_ptrs = wg_ptrs + N * stride_an  # [BK, BN] up rows follow the N gate rows
    acc_dg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # w2[e]^T dout_t, unweighted
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        d = tl.load(d_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            wb = w2_ptr.load([w2_row + k0, pid_n * BLOCK_N])  # [BK, BN]; columns past N read 0
        else:
            wb = tl.load(w2_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            w2_ptrs += BLOCK_K * stride_bk
        acc_dg = _dot(d, wb, acc_dg, UPCAST, PRECISION)
        # the gate-up GEMM again, in the same K loop: x and dout share the token gather
        xa = tl.load(x_ptrs + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:  # past K the descriptor reads 0; a last N tile's extra rows are never stored
            wg = w13_ptr.load([gate_row, k0]).T  # [BK, BN]
            wu = w13_ptr.load([gate_row + N, k0]).T
        else:
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wg_ptrs += BLOCK_K * stride_ak
            wu_ptrs += BLOCK_K * stride_ak
        acc_gate = _dot(xa, wg, acc_gate, UPCAST, PRECISION)
        acc_up = _dot(xa, wu, acc_up, UPCAST, PRECISION)
    out_rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M) if OUT_SORTED else safe  # [BM] dh, gw rows
    _store_grads(acc_dg, acc_gate, acc_up, safe, row_ok, n_ok, offs_n, pid_n, num_pid_n, N, stride_hm,
                 weights_ptr, dh_ptr, gw_ptr, dw_part_ptr, out_rows, ACT, OUT_SORTED)


@triton.jit
def _store_grads(acc_dg, gate, up, safe, row_ok, n_ok, offs_n, pid_n, num_pid_n, N, stride_hm,
                 weights_ptr, dh_ptr, gw_ptr, dw_part_ptr, out_rows, ACT: tl.constexpr, OUT_SORTED: tl.constexpr):
    """grad_gate_up's epilogue: from acc_dg = w2[e]^T dout_t and the forward's gate and up [BM, BN] (fp32,
    recomputed or read from the kept h_p), the act-and-mul backward of dg = w acc_dg into dh (row stride
    stride_hm), w g into gw (rows ``out_rows``; OUT_SORTED: every row of the block, padding rows 0), and
    <acc_dg, g> over this N tile into column pid_n of the d-weight partials."""
    mask = row_ok[:, None] & n_ok[None, :]
    act, dact = _act_and_grad(gate, ACT)
    g = tl.where(mask, act * up, 0.0)  # [BM, BN] the forward's g; 0 on masked rows and columns
    weight = tl.load(weights_ptr + safe, mask=row_ok, other=0.0).to(tl.float32)  # [BM]
    tl.store(dw_part_ptr + safe * num_pid_n + pid_n, tl.sum(acc_dg * g, axis=1), mask=row_ok)
    dg = acc_dg * weight[:, None]  # [BM, BN] dL/dg_a
    dh_ty = dh_ptr.dtype.element_ty
    out_mask = n_ok[None, :] if OUT_SORTED else mask  # OUT_SORTED: padding rows hold zeros
    dh_offs = out_rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(dh_ptr + dh_offs, (dg * up * dact).to(dh_ty), mask=out_mask)  # d gate
    tl.store(dh_ptr + dh_offs + N, (dg * act).to(dh_ty), mask=out_mask)  # d up
    tl.store(gw_ptr + out_rows[:, None] * N + offs_n[None, :], (g * weight[:, None]).to(gw_ptr.dtype.element_ty),
             mask=out_mask)


@triton.jit
def gather_gemm_kernel(
    a_ptr, w_ptr, out_ptr, scale_ptr,  # a [S, RED] rows a // A_DIV; w [E, ..] by strides; out [A, OUT]; scale [A]
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    OUT, RED, num_assignments, a_div, num_pid_m,
    stride_am, stride_we, stride_wo, stride_wr, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_SCALE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_DESC: tl.constexpr,
    RED_ROWS: tl.constexpr, A_SORTED: tl.constexpr,
):
    """out[a, o] = scale[a] * sum_r a_src[a // a_div, r] * W[e, o, r], W[e, o, r] at w + e*stride_we +
    o*stride_wo + r*stride_wr. Rows of assignments not routed here are never written. W_DESC: w_ptr a
    descriptor over the weight as [E*rows, cols]: RED_ROWS (the reduction runs over its rows, dX's
    w13 [E, 2N, K]) block [BK, BN], else block [BN, BK] (the saving forward's w13 and w2). A_SORTED:
    a_src's rows are the layout's rows (grad_gate_up's OUT_SORTED dh, padding rows 0), a_div unused."""
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(OUT, BLOCK_N), GROUP_M)
    rows, expert = _layout_block(pid_m, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, BLOCK_M)
    if expert < 0:
        return
    row_ok = rows < num_assignments
    safe = tl.where(row_ok, rows, 0)
    offs_o = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ok = offs_o < OUT
    offs_r = tl.arange(0, BLOCK_K)
    a_rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M) if A_SORTED else safe // a_div  # [BM]
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_r[None, :]  # [BM, BK]
    if W_DESC:
        w_row = (expert * (RED if RED_ROWS else OUT)).to(tl.int32)  # the expert's first row
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_o[None, :].to(tl.int64) * stride_wo + offs_r[:, None] * stride_wr
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, RED, BLOCK_K):
        r_ok = offs_r < RED - r0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        if W_DESC and RED_ROWS:
            w = w_ptr.load([w_row + r0, pid_n * BLOCK_N])  # [BK, BN]
        elif W_DESC:
            w = w_ptr.load([w_row + pid_n * BLOCK_N, r0]).T  # [BK, BN]
        else:
            w = tl.load(w_ptrs, mask=r_ok[:, None] & o_ok[None, :], other=0.0)
            w_ptrs += BLOCK_K * stride_wr
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + safe, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + safe[:, None] * stride_om + offs_o[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & o_ok[None, :])


@triton.jit
def _expert_rows(counts_ptr, e, num_experts, block_m, E_PAD: tl.constexpr):
    """Expert e's rows in the layout: (its first row, the rows past every earlier expert's padding to block_m;
    its real row count), from counts [E] (E_PAD >= E, a power of two)."""
    ee = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + ee, mask=ee < num_experts, other=0)  # [EP] real rows per expert
    padded = (counts + block_m - 1) // block_m * block_m
    start = tl.sum(tl.where(ee < e, padded, 0), axis=0)
    count = tl.sum(tl.where(ee == e, counts, 0), axis=0)
    return start, count


@triton.jit
def _store_wgrad(acc, out_ptr, s, e, offs_r, offs_c, r_ok, c_ok, stride_os, stride_oe, stride_or):
    """The weight grads' end: acc [BR, BC] float32 into out[s, e] (split s's partials, or the grad itself with one
    split: stride_os 0) at rows offs_r [BR], columns offs_c [BC], in out's dtype."""
    out_ptrs = (out_ptr + s.to(tl.int64) * stride_os + e * stride_oe + offs_r[:, None].to(tl.int64) * stride_or
                + offs_c[None, :])
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def weight_grad_kernel(
    l_ptr, r_ptr, out_ptr,  # l [S_l, R] rows a // l_div, r [S_r, C] rows a // r_div; out [SPLIT, E, R, C]
    sorted_ids_ptr, counts_ptr,
    R, C, num_assignments, num_experts, l_div, r_div, split, block_m,
    stride_lm, stride_rm, stride_os, stride_oe, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
    E_PAD: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[s, e] = sum over expert e's row steps s, s + split, ... (BLOCK_K rows of the layout each; the
    layout pads experts to block_m, a runtime value: one compile serves every layout): L[rows]^T R[rows]
    (a zero tile for an expert with no rows).
    Program (pid, s): pid walks the experts' tiles row-major, so neighbours share their L tile."""
    tiles_c = tl.cdiv(C, BLOCK_C)
    per_expert = tl.cdiv(R, BLOCK_R) * tiles_c
    pid, s = tl.program_id(0), tl.program_id(1)
    e, tile = (pid // per_expert).to(tl.int64), pid % per_expert  # e * stride_oe passes 2^31 (DeepSeek-V3)
    start, count = _expert_rows(counts_ptr, e, num_experts, block_m, E_PAD)  # e's first row in sorted_ids
    offs_r = (tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = offs_r < R, offs_c < C
    lanes = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for b in range(s * BLOCK_K, count, split * BLOCK_K):
        in_expert = b + lanes < count  # a step longer than the padding would reach the next expert's rows
        rows = tl.load(sorted_ids_ptr + start + b + lanes, mask=in_expert, other=num_assignments).to(tl.int64)  # [BK]
        row_ok = rows < num_assignments
        safe = tl.where(row_ok, rows, 0)
        lt = tl.load(l_ptr + (safe // l_div)[None, :] * stride_lm + offs_r[:, None],
                     mask=row_ok[None, :] & r_ok[:, None], other=0.0)  # [BR, BK]
        rt = tl.load(r_ptr + (safe // r_div)[:, None] * stride_rm + offs_c[None, :],
                     mask=row_ok[:, None] & c_ok[None, :], other=0.0)  # [BK, BC]
        if UPCAST:
            lt, rt = lt.to(tl.float32), rt.to(tl.float32)
        acc = tl.dot(lt, rt, acc, input_precision=PRECISION)
    _store_wgrad(acc, out_ptr, s, e, offs_r, offs_c, r_ok, c_ok, stride_os, stride_oe, stride_or)


@triton.jit
def permute_rows_kernel(
    src_ptr, out_ptr, sorted_ids_ptr, num_padded_ptr,  # src [S, C] rows a // div; out [P, C] in layout order
    C, num_assignments, div, stride_sm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """out[p] = src[sorted_ids[p] // div] for the layout's rows in use (p < num_padded), zeros on its
    padding rows (the contiguous weight grads read them); rows past num_padded are never written."""
    num_padded = tl.load(num_padded_ptr)
    if tl.program_id(0) * BLOCK_M >= num_padded:
        return
    offs_p = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    p_ok = offs_p < num_padded  # sorted_ids past num_padded are not the layout's (never read)
    rows = tl.load(sorted_ids_ptr + offs_p, mask=p_ok, other=num_assignments).to(tl.int64)  # [BM]
    row_ok = rows < num_assignments
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    src = tl.where(row_ok, rows // div, 0)
    vals = tl.load(src_ptr + src[:, None] * stride_sm + offs_c[None, :], mask=row_ok[:, None] & c_ok[None, :],
                   other=0.0)
    tl.store(out_ptr + offs_p[:, None].to(tl.int64) * stride_om + offs_c[None, :], vals,
             mask=p_ok[:, None] & c_ok[None, :])


@triton.jit
def weight_grad_contiguous_kernel(
    l_ptr, r_ptr, out_ptr,  # l [P, R], r [P, C] in layout order (padding rows 0), or TMA descriptors over them
    counts_ptr,
    R, C, num_experts, split, block_m,
    stride_lm, stride_rm, stride_os, stride_oe, stride_or,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_R: tl.constexpr,
    E_PAD: tl.constexpr, DESC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """``weight_grad_kernel`` on operands already permuted into the layout's rows: expert e's rows are the
    contiguous range [start, start + padded) (block_m % BLOCK_K == 0, so no step crosses an expert); the
    loop stops at the first step past its real rows.
    DESC: l_ptr / r_ptr are descriptors with blocks [BK, BR] / [BK, BC] (TMA loads); else pointer tiles.
    Program (pid, s): within an expert, GROUP_R row tiles sweep the column tiles together (their R
    tiles and the shared L tiles stay in L2)."""
    tiles_r, tiles_c = tl.cdiv(R, BLOCK_R), tl.cdiv(C, BLOCK_C)
    pid, s = tl.program_id(0), tl.program_id(1)
    e, tile = (pid // (tiles_r * tiles_c)).to(tl.int64), pid % (tiles_r * tiles_c)
    tile_r, tile_c = grouped_tile(tile, tiles_r, tiles_c, GROUP_R)
    start, count = _expert_rows(counts_ptr, e, num_experts, block_m, E_PAD)
    end = start + (count + BLOCK_K - 1) // BLOCK_K * BLOCK_K  # the steps that hold a real row (the rest: zeros)
    offs_r = tile_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tile_c * BLOCK_C + tl.arange(0, BLOCK_C)
    r_ok, c_ok = offs_r < R, offs_c < C
    lanes = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for b in range(start + s * BLOCK_K, end, split * BLOCK_K):
        if DESC:  # columns past R / C read 0
            lt = l_ptr.load([b, tile_r * BLOCK_R]).T  # [BR, BK]; int32 coordinates
            rt = r_ptr.load([b, tile_c * BLOCK_C])  # [BK, BC]
        else:
            rows = (b + lanes).to(tl.int64)  # [BK]
            lt = tl.load(l_ptr + rows[None, :] * stride_lm + offs_r[:, None], mask=r_ok[:, None], other=0.0)
            rt = tl.load(r_ptr + rows[:, None] * stride_rm + offs_c[None, :], mask=c_ok[None, :], other=0.0)
        if UPCAST:
            lt, rt = lt.to(tl.float32), rt.to(tl.float32)
        acc = tl.dot(lt, rt, acc, input_precision=PRECISION)
    _store_wgrad(acc, out_ptr, s, e, offs_r, offs_c, r_ok, c_ok, stride_os, stride_oe, stride_or)

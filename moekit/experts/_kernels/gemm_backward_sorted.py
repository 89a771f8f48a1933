"""grad_gate_up on operands already permuted into the block-aligned layout's rows (``permute_rows_kernel``):
each expert's rows are one contiguous range, so dout and x come in through TMA (no per-row gather) and
a program's M-block may be any divisor of the layout's block.

Torch twin: ``grad_gate_up_kernel`` (``gemm_backward.py``, the gathering kernel these replace) and, in
the tests, the float64 autograd of a per-token loop.

    sorted_gemm_kernel          dg = dout_p W2[e] over the layout's rows ([P, N] float32, unweighted): the
                                dY @ W2 GEMM on its own, so it takes a wide tile (one accumulator); and
                                (SCATTER) dX's dh_p W13[e] into per-assignment rows [A, K].
    grad_gate_up_sorted_kernel  gate and up recomputed from x_p (two accumulators), and either dg read from
                                ``sorted_gemm_kernel``'s output (DG_IN) or computed in the same K loop from
                                dout_p (three accumulators: narrower tiles); H_IN: gate and up read from the
                                forward's kept h_p [P, 2N] instead (the K loop is dY @ W2 alone, one
                                accumulator); the epilogue is ``gemm_backward._store_grads`` with its rows in
                                the layout's order.

DESC: dout_p / x_p are descriptors over [P, K] with block [BM, BK], the weights as in ``gemm_backward``
(w13 over [E*2N, K] block [BN, BK]; w2 over [E*K, N] block [BK, BN], K % BK == 0); else pointer tiles
(float32 under the interpreter). Rows of a block past num_padded are never touched; the layout's padding
rows are zeros in dout_p and x_p, so they produce zero rows of dh and w*g.

Shapes: P rows of the layout, K hidden, N intermediate, E experts; BM the program's rows (divides block_m).
"""

import triton
import triton.language as tl

from moekit.experts._kernels.gemm import _dot, _grid_position
from moekit.experts._kernels.gemm_backward import _store_grads


@triton.jit
def _block_expert(pid_m, expert_ids_ptr, num_padded_ptr, block_m, BLOCK_M: tl.constexpr):
    """(the block's first layout row int64, its expert int64; -1 past the rows in use)."""
    first = pid_m.to(tl.int64) * BLOCK_M
    expert = tl.load(expert_ids_ptr + first // block_m).to(tl.int64)
    return first, tl.where(first < tl.load(num_padded_ptr), expert, -1)


@triton.jit
def _rows_tile(p_ptr, first, k0, K, stride_pm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DESC: tl.constexpr):
    """[BM, BK] of a [P, K] operand in the layout's rows: rows first.., columns k0.. (zeros past K)."""
    if DESC:  # (an if / else: Triton 3.6 compiles the statements after a constexpr branch's return too)
        tile = p_ptr.load([first.to(tl.int32), k0])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        rows = first + tl.arange(0, BLOCK_M)
        tile = tl.load(p_ptr + rows[:, None] * stride_pm + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
    return tile


@triton.jit
def _w_red_rows(w_ptr, expert, k0, col0, RED, OUT, stride_we, stride_wr, stride_wo,
                BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr):
    """[BK, BN] of W[e] [RED, OUT] (reduction over its rows): rows k0.., columns col0.. (zeros past either)."""
    if DESC:
        tile = w_ptr.load([(expert * RED + k0).to(tl.int32), col0])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wr + offs_n[None, :].to(tl.int64) * stride_wo
        tile = tl.load(ptrs, mask=(offs_k[:, None] < RED) & (offs_n[None, :] < OUT), other=0.0)
    return tile


@triton.jit
def _w13_tile(w13_ptr, expert, k0, col0, row0, N, K, stride_ae, stride_an, stride_ak,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr):
    """[BK, BN] of w13[e]^T: rows row0 + col0.. of w13[e] (row0 0 gate, N up), columns k0.. (zeros past K;
    a last N tile's extra rows, read past the gate rows under DESC, are never stored)."""
    if DESC:
        tile = w13_ptr.load([(expert * 2 * N + row0 + col0).to(tl.int32), k0]).T
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        ptrs = (w13_ptr + expert * stride_ae + (row0 + offs_n[None, :]).to(tl.int64) * stride_an
                + offs_k[:, None] * stride_ak)
        tile = tl.load(ptrs, mask=(offs_k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
    return tile


@triton.jit
def sorted_gemm_kernel(
    a_ptr, w_ptr, out_ptr,  # a [P, RED] in the layout's rows (or a descriptor); w [E, RED, OUT]; out [P or A, OUT]
    expert_ids_ptr, num_padded_ptr, sorted_ids_ptr,
    OUT, RED, num_pid_m, block_m, num_assignments, stride_am, stride_we, stride_wr, stride_wo, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DESC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, SCATTER: tl.constexpr,
):
    """out[p] = a[p] W[e(p)] for the layout's rows in use (padding rows: zeros in, zeros out); SCATTER: row
    p goes to out row sorted_ids[p] (dX's per-assignment rows, [A, OUT]; padding rows not stored)."""
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(OUT, BLOCK_N), GROUP_M)
    first, expert = _block_expert(pid_m, expert_ids_ptr, num_padded_ptr, block_m, BLOCK_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, RED, BLOCK_K):
        a = _rows_tile(a_ptr, first, k0, RED, stride_am, BLOCK_M, BLOCK_K, DESC)
        w = _w_red_rows(w_ptr, expert, k0, pid_n * BLOCK_N, RED, OUT, stride_we, stride_wr, stride_wo, BLOCK_K, BLOCK_N,
                        DESC)
        acc = _dot(a, w, acc, UPCAST, PRECISION)
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows >= 0  # [BM] every layout row of the block
    if SCATTER:
        rows = tl.load(sorted_ids_ptr + rows).to(tl.int64)  # [BM] assignments, A on padding rows
        row_ok = rows < num_assignments
        rows = tl.where(row_ok, rows, 0)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < OUT))


@triton.jit
def grad_gate_up_sorted_kernel(
    dout_ptr, x_ptr, w13_ptr, w2_ptr, dg_ptr, h_ptr, weights_ptr,  # dout_p, x_p [P, K]; w13, w2; dg [P, N] fp32;
    # h_p [P, 2N] (H_IN); weights [A]
    dh_ptr, gw_ptr, dw_part_ptr,  # out: dh [P, 2N], gw [P, N] in the layout's rows, dw_part [A, num_pid_n] fp32
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_assignments, num_pid_m, block_m,
    stride_pm, stride_ae, stride_an, stride_ak, stride_be, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, DG_IN: tl.constexpr, H_IN: tl.constexpr, DESC: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """``grad_gate_up_kernel`` (recompute) on the permuted operands; DG_IN: dg = w2[e]^T dout_t comes from
    dg_ptr (``sorted_gemm_kernel``), else it is accumulated here from dout_p and w2; H_IN (not with DG_IN):
    gate and up come from h_p (the forward's, ``gemm_train_forward.gate_up_train_kernel``), x_p is unread."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grid_position(num_pid_m, num_pid_n, GROUP_M)
    first, expert = _block_expert(pid_m, expert_ids_ptr, num_padded_ptr, block_m, BLOCK_M)
    if expert < 0:
        return
    out_rows = first + tl.arange(0, BLOCK_M)  # [BM] layout rows: dh, gw, dg
    rows = tl.load(sorted_ids_ptr + out_rows).to(tl.int64)  # [BM] assignments, A on padding rows
    row_ok = rows < num_assignments
    safe = tl.where(row_ok, rows, 0)
    col0 = pid_n * BLOCK_N
    offs_n = col0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc_dg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if not H_IN:
            xa = _rows_tile(x_ptr, first, k0, K, stride_pm, BLOCK_M, BLOCK_K, DESC)
            wg = _w13_tile(w13_ptr, expert, k0, col0, 0, N, K, stride_ae, stride_an, stride_ak, BLOCK_K, BLOCK_N,
                           DESC)
            wu = _w13_tile(w13_ptr, expert, k0, col0, N, N, K, stride_ae, stride_an, stride_ak, BLOCK_K, BLOCK_N,
                           DESC)
            acc_gate = _dot(xa, wg, acc_gate, UPCAST, PRECISION)
            acc_up = _dot(xa, wu, acc_up, UPCAST, PRECISION)
        if not DG_IN:
            d = _rows_tile(dout_ptr, first, k0, K, stride_pm, BLOCK_M, BLOCK_K, DESC)
            wb = _w_red_rows(w2_ptr, expert, k0, col0, K, N, stride_be, stride_bk, stride_bn, BLOCK_K, BLOCK_N, DESC)
            acc_dg = _dot(d, wb, acc_dg, UPCAST, PRECISION)
    if DG_IN:
        acc_dg = tl.load(dg_ptr + out_rows[:, None] * N + offs_n[None, :], mask=n_ok[None, :], other=0.0)
    if H_IN:  # every row of a block in use was written by the forward (padding rows: zeros)
        h_ptrs = h_ptr + out_rows[:, None] * (2 * N) + offs_n[None, :]
        acc_gate = tl.load(h_ptrs, mask=n_ok[None, :], other=0.0).to(tl.float32)
        acc_up = tl.load(h_ptrs + N, mask=n_ok[None, :], other=0.0).to(tl.float32)
    _store_grads(acc_dg, acc_gate, acc_up, safe, row_ok, n_ok, offs_n, pid_n, num_pid_n, N, 2 * N,
                 weights_ptr, dh_ptr, gw_ptr, dw_part_ptr, out_rows, ACT, True)

"""The training forward of the experts on x permuted into the block-aligned layout's rows
(``permute_rows_kernel``): each expert's rows one contiguous range, read through TMA like the sorted
grad_gate_up (``gemm_backward_sorted.py``), and the permuted x kept for the backward, which needs it anyway.

Torch twin: ``moekit.experts.reference`` (the tests: a float64 per-token loop; the device check: the
inference forward ``triton.fused_experts``).

    gate_up_train_kernel  g_p = act(x_p W13[e]_gate^T) * (x_p W13[e]_up^T)   [P, N], every row of a block in
                          use (padding rows: x_p zeros, so g zeros); H_OUT: also h_p = [gate, up] [P, 2N]
                          (the pre-activation, kept for the backward: ``BackwardOptions(recompute=False)``)
    down_train_kernel     y[a] = w_a * g_p[p] W2[e]^T                      [A, K], row a = sorted_ids[p]
                          (padding rows not stored); the k-sum is the forward's ``combine.sum_slots_kernel``

DESC: x_p / g_p are descriptors over [P, K] / [P, N] with block [BM, BK]; w13 over [E*2N, K] block [BN, BK],
w2 over [E*K, N] block [BN, BK] (a tile's rows past the expert's read the next expert's: those output
columns are never stored); else pointer tiles (float32 under the interpreter).

Shapes: P layout rows, A = M*k assignments, E experts, K hidden, N intermediate; BM rows per program
(divides the layout's block).
"""

import triton
import triton.language as tl

from moekit.experts._kernels.gemm import _dot, _grid_position
from moekit.experts._kernels.gemm_backward import _act_and_grad
from moekit.experts._kernels.gemm_backward_sorted import _block_expert, _rows_tile, _w13_tile


@triton.jit
def _w2t_tile(w2_ptr, expert, n0, col0, K, N, stride_be, stride_bk, stride_bn,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr):
    """[BK, BN] of w2[e]^T: rows n0.. of the reduction (w2's columns, zeros past N), columns col0.. (w2's rows)."""
    if DESC:
        tile = w2_ptr.load([(expert * K + col0).to(tl.int32), n0]).T
    else:
        offs_n = n0 + tl.arange(0, BLOCK_K)
        offs_k = col0 + tl.arange(0, BLOCK_N)
        ptrs = w2_ptr + expert * stride_be + offs_k[None, :].to(tl.int64) * stride_bk + offs_n[:, None] * stride_bn
        tile = tl.load(ptrs, mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
    return tile


@triton.jit
def gate_up_train_kernel(
    x_ptr, w13_ptr, g_ptr, h_ptr,  # x_p [P, K] (or a descriptor); w13 [E, 2N, K]; out g_p [P, N], h_p [P, 2N]
    expert_ids_ptr, num_padded_ptr,
    N, K, num_pid_m, block_m, stride_xm, stride_ae, stride_an, stride_ak, stride_gm, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, DESC: tl.constexpr, H_OUT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """g_p rows of M-block pid_m, columns pid_n*BN..: act(gate) * up, gate and up from one K loop; H_OUT:
    gate and up themselves into h_p's columns col.. and N + col.. (rounded to h_p's dtype)."""
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    first, expert = _block_expert(pid_m, expert_ids_ptr, num_padded_ptr, block_m, BLOCK_M)
    if expert < 0:
        return
    col0 = pid_n * BLOCK_N
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xa = _rows_tile(x_ptr, first, k0, K, stride_xm, BLOCK_M, BLOCK_K, DESC)
        wg = _w13_tile(w13_ptr, expert, k0, col0, 0, N, K, stride_ae, stride_an, stride_ak, BLOCK_K, BLOCK_N, DESC)
        wu = _w13_tile(w13_ptr, expert, k0, col0, N, N, K, stride_ae, stride_an, stride_ak, BLOCK_K, BLOCK_N, DESC)
        acc_gate = _dot(xa, wg, acc_gate, UPCAST, PRECISION)
        acc_up = _dot(xa, wu, acc_up, UPCAST, PRECISION)
    act, _ = _act_and_grad(acc_gate, ACT)
    rows = first + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    tl.store(g_ptr + rows[:, None] * stride_gm + offs_n[None, :], (act * acc_up).to(g_ptr.dtype.element_ty),
             mask=offs_n[None, :] < N)
    if H_OUT:
        h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
        tl.store(h_ptrs, acc_gate.to(h_ptr.dtype.element_ty), mask=offs_n[None, :] < N)
        tl.store(h_ptrs + N, acc_up.to(h_ptr.dtype.element_ty), mask=offs_n[None, :] < N)


@triton.jit
def down_train_kernel(
    g_ptr, w2_ptr, out_ptr, weights_ptr,  # g_p [P, N] (or a descriptor); w2 [E, K, N]; out y [A, K]; weights [A]
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    K, N, num_assignments, num_pid_m, block_m, stride_gm, stride_be, stride_bk, stride_bn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DESC: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """y rows of M-block pid_m's assignments, columns pid_n*BN..: w_a * g_p W2[e]^T (rows of assignments
    not routed here, and padding rows, never written)."""
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(K, BLOCK_N), GROUP_M)
    first, expert = _block_expert(pid_m, expert_ids_ptr, num_padded_ptr, block_m, BLOCK_M)
    if expert < 0:
        return
    col0 = pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_K):
        ga = _rows_tile(g_ptr, first, n0, N, stride_gm, BLOCK_M, BLOCK_K, DESC)
        wb = _w2t_tile(w2_ptr, expert, n0, col0, K, N, stride_be, stride_bk, stride_bn, BLOCK_K, BLOCK_N, DESC)
        acc = _dot(ga, wb, acc, UPCAST, PRECISION)
    rows = tl.load(sorted_ids_ptr + first + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] assignments, A on padding
    row_ok = rows < num_assignments
    safe = tl.where(row_ok, rows, 0)
    weight = tl.load(weights_ptr + safe, mask=row_ok, other=0.0).to(tl.float32)
    offs_k = col0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + safe[:, None] * stride_om + offs_k[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_k[None, :] < K))

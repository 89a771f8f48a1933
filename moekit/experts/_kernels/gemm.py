"""Grouped GEMMs over the block-aligned layout, gathering activation rows by index (never permuted).

Torch twins: ``moekit.experts.reference`` (per-expert loop) and ``moekit.experts.grouped_mm``.

Shapes: M tokens, k slots, A = M*k assignments (a = t*k + j), E local experts, K hidden, N
intermediate; BM/BN/BK the tile. Program (pid_m, pid_n) owns M-block pid_m of the layout (one expert,
up to BM assignment rows) and output columns pid_n*BN ..; every row index is int64 before it is
multiplied by a stride (A*K and E*2N*K pass 2^31 at real sizes).

PDL: programmatic dependent launch (``_common``), set by the host on Hopper. A GEMM lets the next kernel
launch only after its main loop: signalling right after the wait let the next grid's programs take SM
slots while this one still streamed (Mixtral-8x7B M=1 on the H200: 175 -> 189 µs; 173 µs signalling late).

W_DESC: the weights come as TMA tensor descriptors (Hopper's bulk tile copies) instead of pointer
tiles; the host picks it for 16-bit weights when the strides allow (``triton.py``). Activation rows
are gathered by index either way.

NAIVE (the tiny-batch shortcut, A*4 <= E, no expert map): block pid_m is assignment pid_m alone, its
expert read straight from topk_ids, so no alignment runs at all (the host passes None for
sorted_ids, expert_ids and num_padded; the NAIVE branch never touches them).

PRECISION: "ieee" for float32 inputs (the fp32 contract is 1e-5; tf32 lands near 3e-4), "tf32"
otherwise (ignored for 16-bit operands).

UPCAST: operands are converted to float32 before ``tl.dot``. Only the CPU interpreter needs it: its
bf16 ``tl.dot`` returns garbage (seen with Triton 3.9: max error 2.7e10 on a 16x16 product).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def _grid_position(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M M-blocks (usually one expert's) sweep the N tiles together, so an
    expert's weight tile is read from HBM once and from L2 by the other blocks."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                num_assignments, num_experts, BLOCK_M: tl.constexpr, NAIVE: tl.constexpr):
    """(assignment of each row of M-block pid_m [BM] int64, with A on padding rows; its expert, -1 = none)."""
    lanes = tl.arange(0, BLOCK_M)
    if NAIVE:
        eid = tl.load(ids_ptr + pid_m).to(tl.int64)
        expert = tl.where((eid >= 0) & (eid < num_experts), eid, -1)
        rows = tl.where(lanes == 0, pid_m, num_assignments).to(tl.int64)
    else:
        in_use = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        expert = tl.where(in_use, tl.load(expert_ids_ptr + pid_m).to(tl.int64), -1)
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + lanes).to(tl.int64)  # the buffer holds whole blocks
    return rows, expert


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """ACT is ``moekit.activations.ACTIVATIONS[name].kernel_id``; the torch twin is its ``fn``."""
    if ACT == 0:  # silu
        return g * tl.sigmoid(g)
    elif ACT == 1:  # gelu (erf)
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == 2:  # gelu, tanh approximation; tanh(u) = 2*sigmoid(2u) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g * tl.sigmoid(2.0 * u)
    else:  # relu
        return tl.maximum(g, 0.0)


@triton.jit
def gate_up_kernel(
    x_ptr, w13_ptr, h_ptr,  # x [M, K], w13 [E, 2N, K], h [A, N] out: act(x w_gate^T) * (x w_up^T)
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_assignments, top_k, num_experts, num_pid_m,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, NAIVE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_DESC: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return  # past the rows in use, or (naive) an assignment not routed here: nothing reads its h row
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)  # [BM] int64: the gather, x row of each assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BM, BK]
    if W_DESC:  # w13_ptr is a tensor descriptor over w13 as [E*2N, K], block [BN, BK]
        gate_row = (expert * 2 * N + pid_n * BLOCK_N).to(tl.int32)  # up rows follow the N gate rows
    else:
        wg_ptrs = w13_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
        wu_ptrs = wg_ptrs + N * stride_wn  # [BK, BN] up rows follow the N gate rows
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W_DESC:
            # A last N tile reads past N into the next rows (up, or the next expert's gate): those
            # columns are never stored. Past K, and past the last row, the descriptor reads zeros.
            wg = w13_ptr.load([gate_row, k0]).T  # [BK, BN]
            wu = w13_ptr.load([gate_row + N, k0]).T
        else:
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
        if UPCAST:
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_gate = tl.dot(xa, wg, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(xa, wu, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
    let_next_kernel_launch(PDL)  # after the main loop: see PDL above
    h = _activation(acc_gate, ACT) * acc_up  # [BM, BN] fp32; the [A, 2N] product is never written
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_kernel(
    h_ptr, w2_ptr, y_ptr, weights_ptr,  # h [A, N], w2 [E, K, N], y [A, K] out: weight * (h w2^T)
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    K, N, num_assignments, num_experts, num_pid_m,
    stride_hm, stride_we, stride_wk, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_DESC: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Here the output columns are K (hidden) and the reduction runs over N: BLOCK_N tiles K, BLOCK_K tiles N.
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(K, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments
    safe_rows = tl.where(row_ok, rows, 0)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    offs_red = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + safe_rows[:, None] * stride_hm + offs_red[None, :]  # [BM, BK]
    if W_DESC:  # w2_ptr is a tensor descriptor over w2 as [E*K, N], block [BN, BK]
        w_row = (expert * K + pid_n * BLOCK_N).to(tl.int32)
    else:
        w_ptrs = w2_ptr + expert * stride_we + offs_out[None, :].to(tl.int64) * stride_wk + offs_red[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_K):
        red_ok = offs_red < N - n0
        ha = tl.load(h_ptrs, mask=row_ok[:, None] & red_ok[None, :], other=0.0)
        if W_DESC:
            wb = w2_ptr.load([w_row, n0]).T  # [BK, BN]; rows past K are never stored, columns past N read 0
        else:
            wb = tl.load(w_ptrs, mask=red_ok[:, None] & out_ok[None, :], other=0.0)
            w_ptrs += BLOCK_K * stride_wn
        if UPCAST:
            ha, wb = ha.to(tl.float32), wb.to(tl.float32)
        acc = tl.dot(ha, wb, acc, input_precision=PRECISION)
        h_ptrs += BLOCK_K
    let_next_kernel_launch(PDL)  # after the main loop: see PDL above
    weight = tl.load(weights_ptr + safe_rows, mask=row_ok, other=0.0).to(tl.float32)  # [BM] routed weight
    acc = acc * weight[:, None]
    y_ptrs = y_ptr + safe_rows[:, None] * stride_ym + offs_out[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


"""Grouped GEMMs with weight-only quantized experts: the weights stay packed in HBM and are dequantized
in registers, tile by tile, right before ``tl.dot``; activations stay bf16 (or fp16), accumulation fp32.

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch`` (dequantize, then the float32 loop).

Schemes (the SCHEME constexpr; layouts as in ``triton_wo``'s module docstring), weight [E, R, C] quantized
along C, the reduction dim (gate-up: R = 2N, C = K; down: R = K, C = N):
    0 int8_w8a16  q int8 [E, R, C], scale fp32 [E, R]: the tile is converted (exact in bf16: |q| <= 128)
                  and the per-row scale multiplies the accumulator once, in the epilogue.
    1 int4_w4a16  q uint8 [E, R, ceil(C/2)] (element 2i low nibble, 2i+1 high), scale fp32 and zero uint8
                  [E, R, ceil(C/g)]: w = (nibble - zero) * scale.
    2 mxfp4       q as int4 (e2m1 codes), scale uint8 e8m0 [E, R, ceil(C/32)]: w = e2m1(nibble) * 2^(s-127).

Packed schemes never interleave the two nibbles back along K: one packed tile [SUB/2, BN] gives the
even-K weights (low nibbles) and the odd-K weights (high nibbles), and the activation tile [BM, SUB] is
split into its even and odd columns instead (a register-local split of a contiguous load), so
    acc += dot(a_even, w_even) + dot(a_odd, w_odd).
Each reduction step of BLOCK_K runs BLOCK_K / SUB sub-tiles (a static loop), SUB = min(BLOCK_K, g), so
every sub-tile lies inside one scale group: its scale (and zero) is one [BN] vector load.

Past C (an odd C, a group tail, a last partial step) the activations load as 0 and the weights too; a
high nibble past an odd C multiplies a zero activation, and no scheme decodes to inf or NaN.

Split-K (down only, SPLIT > 1, decode sizes where the touched experts' output tiles are too few to
fill the GPU): grid axis 1 splits the reduction, each split writes fp32 partial rows, and
``combine.sum_slots_kernel`` (SPLIT > 1) sums them with the k slots (atomic-free, so the result does not depend on timing).

Alignment, NAIVE, PDL and UPCAST as in ``gemm.py`` (whose grid order, block rows and activations these
kernels share).

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN/BK the tile, SUB the
sub-tile width along the reduction.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.gemm import _block_rows, _glu, _grid_position


@triton.jit
def _e2m1(code):
    """e2m1 code (0..15, int) -> float32: sign bit 3; magnitude [0, 0.5, 1, 1.5, 2, 3, 4, 6] by bits 0-2
    (exponent e = bits 1-2, mantissa m = bit 0: e = 0 -> m/2, else 2^(e-1) * (1 + m/2))."""
    mag = (code & 7).to(tl.int32)
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    value = tl.where(e == 0, 0.5 * m, (1 << e).to(tl.float32) * (0.5 + 0.25 * m))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _dequant_dot(acc, a, q_rows, s_rows, z_rows, kk, C, n_ok, stride_qc, stride_sg, stride_zg,
                 BLOCK_M: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr, SCHEME: tl.constexpr):
    """acc [BM, BN] += a [BM, SUB] @ W[rows, kk : kk + SUB]^T, W dequantized here. q_rows, s_rows, z_rows
    [BN]: pointers to each weight row's start in q, scale and zero."""
    if SCHEME == 0:
        k = kk + tl.arange(0, SUB)
        w = tl.load(q_rows[None, :] + k[:, None] * stride_qc, mask=(k < C)[:, None] & n_ok[None, :], other=0)
        return tl.dot(a, w.to(a.dtype), acc)  # [SUB, BN]; the scale waits for the epilogue
    kb = kk // 2 + tl.arange(0, SUB // 2)  # packed columns of this sub-tile
    packed = tl.load(q_rows[None, :] + kb[:, None] * stride_qc,
                     mask=(kb < (C + 1) // 2)[:, None] & n_ok[None, :], other=0)  # [SUB/2, BN] uint8
    lo, hi = packed & 15, packed >> 4  # elements kk + 2i, kk + 2i + 1
    group_ok = tl.where(kk < C, n_ok, False)  # past C no scale is read (its weights are 0 already)
    if SCHEME == 1:
        scale = tl.load(s_rows + (kk // GROUP) * stride_sg, mask=group_ok, other=0.0)[None, :]  # [1, BN]
        zero = tl.load(z_rows + (kk // GROUP) * stride_zg, mask=group_ok, other=0).to(tl.float32)[None, :]
        w_even = (lo.to(tl.float32) - zero) * scale
        w_odd = (hi.to(tl.float32) - zero) * scale
    else:
        exponent = tl.load(s_rows + (kk // GROUP) * stride_sg, mask=group_ok, other=127).to(tl.float32)
        factor = tl.exp2(exponent - 127.0)[None, :]  # e8m0
        w_even = _e2m1(lo) * factor
        w_odd = _e2m1(hi) * factor
    a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, SUB // 2, 2]))  # [BM, SUB/2] each
    acc = tl.dot(a_even, w_even.to(a.dtype), acc)
    return tl.dot(a_odd, w_odd.to(a.dtype), acc)


@triton.jit
def gate_up_wo_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, num_assignments, top_k, num_experts, num_pid_m,
    stride_xm, stride_xk, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,
    stride_ze, stride_zr, stride_zg, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    """h = act(x w_gate^T) * (x w_up^T) per assignment row, w13 dequantized in registers."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)  # [BM] int64: the x row of each assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate, up = offs_n.to(tl.int64), offs_n.to(tl.int64) + N  # [BN] w13 rows; up rows follow the N gate rows
    qg, qu = q_ptr + expert * stride_qe + gate * stride_qr, q_ptr + expert * stride_qe + up * stride_qr
    sg, su = s_ptr + expert * stride_se + gate * stride_sr, s_ptr + expert * stride_se + up * stride_sr
    zg, zu = z_ptr + expert * stride_ze + gate * stride_zr, z_ptr + expert * stride_ze + up * stride_zr
    x_rows = x_ptr + token[:, None] * stride_xm  # [BM, 1]
    offs_k = tl.arange(0, SUB)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB):
            kk = k0 + sub * SUB
            k = kk + offs_k
            a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
            acc_gate = _dequant_dot(acc_gate, a, qg, sg, zg, kk, K, n_ok, stride_qc, stride_sg, stride_zg,
                                    BLOCK_M, SUB, GROUP, SCHEME)
            acc_up = _dequant_dot(acc_up, a, qu, su, zu, kk, K, n_ok, stride_qc, stride_sg, stride_zg,
                                  BLOCK_M, SUB, GROUP, SCHEME)
    let_next_kernel_launch(PDL)
    if SCHEME == 0:  # int8: the per-row scale, once
        acc_gate *= tl.load(sg, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(su, mask=n_ok, other=0.0)[None, :]
    h = _glu(acc_gate, acc_up, ACT, 1.0, None, 0.0)  # [BM, BN] fp32: act(gate) * up
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_wo_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    K, N, num_assignments, num_experts, num_pid_m, split_len,
    stride_hm, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    """y = routed weight * (h w2^T) per assignment row, w2 dequantized in registers. BLOCK_N tiles the
    output columns (K), the reduction runs over N. Split-K (SPLIT > 1, grid axis 1 = split s): program
    (.., s) reduces N in [s * split_len, (s + 1) * split_len) (split_len a multiple of BLOCK_K, so no
    step straddles two splits) into its own partial rows y[s * A + a]; ``combine.sum_slots_kernel`` sums them."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(K, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments
    safe_rows = tl.where(row_ok, rows, 0)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    out = offs_out.to(tl.int64)
    q_rows = q_ptr + expert * stride_qe + out * stride_qr  # [BN]
    s_rows = s_ptr + expert * stride_se + out * stride_sr
    z_rows = z_ptr + expert * stride_ze + out * stride_zr
    h_rows = h_ptr + safe_rows[:, None] * stride_hm  # [BM, 1]
    offs_red = tl.arange(0, SUB)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_start = tl.program_id(1) * split_len
    for n0 in range(n_start, tl.minimum(n_start + split_len, N), BLOCK_K):
        for sub in tl.static_range(BLOCK_K // SUB):
            nn = n0 + sub * SUB
            red = nn + offs_red
            a = tl.load(h_rows + red[None, :], mask=row_ok[:, None] & (red < N)[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
            acc = _dequant_dot(acc, a, q_rows, s_rows, z_rows, nn, N, out_ok, stride_qc, stride_sg, stride_zg,
                               BLOCK_M, SUB, GROUP, SCHEME)
    let_next_kernel_launch(PDL)
    if SCHEME == 0:
        acc *= tl.load(s_rows, mask=out_ok, other=0.0)[None, :]
    weight = tl.load(weights_ptr + safe_rows, mask=row_ok, other=0.0).to(tl.float32)  # [BM] routed weight
    acc = acc * weight[:, None]
    y_rows = tl.program_id(1) * num_assignments + safe_rows  # [BM] int64: this split's partial rows
    y_ptrs = y_ptr + y_rows[:, None] * stride_ym + offs_out[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])

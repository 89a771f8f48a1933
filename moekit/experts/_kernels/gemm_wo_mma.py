"""Grouped GEMMs with weight-only 4-bit experts (int4, mxfp4), the word MMA decode (decode "mma", issue #16
session 24): the packed weights read as 32-bit words straight into registers (no byte shuffles), each word's
eight values decoded to bf16 pairs in registers (``wo_mma_values``: int4 one prmt and one lop3 a pair plus a
shift for the high nibbles; mxfp4 the bits placed, then one bf16x2 fma by the word's scale), and summed on
the tensor cores by eight dots a step, one per value position T of the words: the dot's reduction order is free,
so value T of words j = 0 .. BKW-1 is one dot's K, against the activation columns 8j + T. Built for decode-sized
blocks (16 rows, mostly one real row at M*k < E), where the register decode's byte tiles cost ~9 SASS
instructions a weight (``benchmarks/wo_reg_sass_cpu.py``), most of them layout changes.

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. Layout: ``triton_wo``'s int4 (element 2i the low
nibble of byte i), read as little-endian words (``triton_wo_gemv.words_ok``): element t of word j in bits 4t..4t+3.

int4: decoded value = 128 + code, exact in bf16; one step spans BLOCK_K = 8 * BKW <= g columns, so one group:
its (scale s, zero z) apply to the step's fp32 partial product p [BM, BN] as acc += p * s - rowsum(x) * (128 + z)
* s (``gemm_wo_reg``'s chunk form; the cancellation is ~2^-24 * 128 * sum|x| * s, far below the bf16 rounding of
the output). mxfp4: decoded value = the weight times 2^-64 (exact for e8m0 scales 2^-61 .. 2^65,
``wo_mma_values``), the activations times 2^64 (exact): p is the step's sum of w x. ASM (NVIDIA sm_80+, bf16,
compiled): ``wo_mma_values``' inline PTX; else its Triton twin (the interpreter; UPCAST decodes to float32).

SWAP_AB: acc^T [BN, BM] = W @ x^T (the weights the MMA's M side), transposed back for the epilogue.
Split-K (down), KSUM, alignment, NAIVE, PDL and UPCAST as in ``gemm_wo_reg``. Past C the words load as 0, x as 0
and the scales as 0: nothing leaks in.

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN the tile, BKW words a step.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import ksum_epilogue, routed_slot_count, zero_unrouted_tokens
from moekit.experts._kernels.gemm import _block_rows, _glu, _grid_position
from moekit.experts._kernels.gemm_fp8 import acc_zeros, unswap
from moekit.experts._kernels.gemm_wo import _store_y
from moekit.experts._kernels.wo_mma_values import X_SCALE, pair_values

@triton.jit
def _dot(x, v, part, SWAP_AB: tl.constexpr):
    """part + x @ v^T [BM, BN] (SWAP_AB: part + v @ x^T [BN, BM]) for x [BM, BKW], v [BN, BKW]."""
    if SWAP_AB:
        part = tl.dot(v, tl.trans(x), part)
    else:
        part = tl.dot(x, tl.trans(v), part)
    return part


@triton.jit
def _x_t(x_rows, row_ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr):
    """x_T [BM, BKW]: the activation columns k0 + 8j + T of the rows ``x_rows`` [BM, 1] (0 past C)."""
    k = k0 + tl.arange(0, BKW) * 8 + T
    return tl.load(x_rows + k[None, :] * stride_xc, mask=row_ok[:, None] & (k < C)[None, :], other=0.0)


@triton.jit
def _words(q_rows, w0, KW, n_ok, BKW: tl.constexpr):
    """Words w0 .. w0 + BKW of the rows q_rows [BN] (int32 pointers) -> [BN, BKW] int32, 0 past KW."""
    j = w0 + tl.arange(0, BKW)
    return tl.load(q_rows[:, None] + j[None, :], mask=n_ok[:, None] & (j < KW)[None, :], other=0)


@triton.jit
def _group(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, GROUP: tl.constexpr):
    """(scale, -(128 + zero) * scale) [BN] float32 of the group holding column k0 (0 past C)."""
    ok = tl.where(k0 < C, n_ok, False)
    scale = tl.load(s_rows + (k0 // GROUP) * stride_sg, mask=ok, other=0.0)
    zero = tl.load(z_rows + (k0 // GROUP) * stride_zg, mask=ok, other=0).to(tl.float32)
    return scale, -(128.0 + zero) * scale


@triton.jit
def _scaled(acc, part, rowsum, scale, add, SWAP_AB: tl.constexpr):
    """acc + part * scale + rowsum * add (the step's group applied to its partial product)."""
    if SWAP_AB:
        acc += part * scale[:, None] + add[:, None] * rowsum[None, :]
    else:
        acc += part * scale[None, :] + rowsum[:, None] * add[None, :]
    return acc


@triton.jit
def _word_scales(s_rows, w0, C, n_ok, stride_sg, BKW: tl.constexpr, GROUP: tl.constexpr):
    """mxfp4: the e8m0 scale byte of each word w0 .. w0 + BKW of the rows [BN] -> [BN, BKW] int32 (0 past C)."""
    first = (w0 + tl.arange(0, BKW)) * 8  # [BKW] each word's first column
    ok = n_ok[:, None] & (first < C)[None, :]
    return tl.load(s_rows[:, None] + (first // GROUP)[None, :] * stride_sg, mask=ok, other=0).to(tl.int32)


@triton.jit
def _t_dots(part, part2, xsum, v, u, x_rows, row_ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr,
            DTYPE: tl.constexpr, SCHEME: tl.constexpr, SWAP_AB: tl.constexpr, TWO: tl.constexpr):
    """Value position T: x_T loaded once (mxfp4: times X_SCALE, exact), its dots with v (and u where TWO),
    xsum [BM, BKW] + x_T (int4)."""
    x = _x_t(x_rows, row_ok, k0, C, stride_xc, T, BKW).to(tl.float32)
    if SCHEME == 2:
        xd = (x * X_SCALE).to(DTYPE)
    else:
        xd = x.to(DTYPE)
        xsum += x
    part = _dot(xd, v, part, SWAP_AB)
    if TWO:
        part2 = _dot(xd, u, part2, SWAP_AB)
    return part, part2, xsum


@triton.jit
def _step(w, s, w2, s2, x_rows, row_ok, k0, C, stride_xc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          BKW: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr, SWAP_AB: tl.constexpr,
          TWO: tl.constexpr):
    """One step's partial products of the words w [BN, BKW] (s: their scale bytes, mxfp4; and w2, s2 where TWO:
    gate-up's up words, against the same x columns, each x_T loaded once) and the activation rows' sums [BM]
    over the step's columns (int4; mxfp4: zeros)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = pair_values(w, s, DTYPE, SCHEME, ASM)
    if TWO:
        u0, u1, u2, u3, u4, u5, u6, u7 = pair_values(w2, s2, DTYPE, SCHEME, ASM)
    else:
        u0, u1, u2, u3, u4, u5, u6, u7 = v0, v1, v2, v3, v4, v5, v6, v7
    p = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    p2, xs = p, tl.zeros([BLOCK_M, BKW], dtype=tl.float32)
    p, p2, xs = _t_dots(p, p2, xs, v0, u0, x_rows, row_ok, k0, C, stride_xc, 0, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v1, u1, x_rows, row_ok, k0, C, stride_xc, 1, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v2, u2, x_rows, row_ok, k0, C, stride_xc, 2, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v3, u3, x_rows, row_ok, k0, C, stride_xc, 3, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v4, u4, x_rows, row_ok, k0, C, stride_xc, 4, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v5, u5, x_rows, row_ok, k0, C, stride_xc, 5, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v6, u6, x_rows, row_ok, k0, C, stride_xc, 6, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v7, u7, x_rows, row_ok, k0, C, stride_xc, 7, BKW, DTYPE, SCHEME, SWAP_AB, TWO)
    return p, p2, tl.sum(xs, axis=1)


@triton.jit
def _apply(acc, part, rowsum, s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, GROUP: tl.constexpr,
           SCHEME: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + the step's partial product: int4 scaled by its group (``_group``); mxfp4 as it is (scaled per weight)."""
    if SCHEME == 1:
        scale, add = _group(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, GROUP)
        acc = _scaled(acc, part, rowsum, scale, add, SWAP_AB)
    else:
        acc += part
    return acc


@triton.jit
def gate_up_wo_mma_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, KW, num_assignments, top_k, num_experts, num_pid_m,  # KW: words of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, SWAP_AB: tl.constexpr = False,
):
    """h = act(x w_gate^T) * (x w_up^T) per assignment row (SCHEME 1 int4 or 2 mxfp4; SPAN: unused, the launch's)."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate, up = offs_n.to(tl.int64), offs_n.to(tl.int64) + N  # [BN] w13 rows; up rows follow the N gate rows
    words = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe
    qg, qu = words + gate * stride_qr, words + up * stride_qr
    sg, su = s_ptr + expert * stride_se + gate * stride_sr, s_ptr + expert * stride_se + up * stride_sr
    zg, zu = z_ptr + expert * stride_ze + gate * stride_zr, z_ptr + expert * stride_ze + up * stride_zr
    x_rows = x_ptr + token[:, None] * stride_xm  # [BM, 1]
    dtype = x_ptr.dtype.element_ty
    if UPCAST:  # the weights then decode to float32 too (the interpreter truncates float32 -> bf16)
        dtype = tl.float32
    acc_gate = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for w0 in range(0, KW, BLOCK_K // 8):
        k0 = w0 * 8
        wg, wu = _words(qg, w0, KW, n_ok, BLOCK_K // 8), _words(qu, w0, KW, n_ok, BLOCK_K // 8)
        if SCHEME == 2:
            s_g = _word_scales(sg, w0, K, n_ok, stride_sg, BLOCK_K // 8, GROUP)
            s_u = _word_scales(su, w0, K, n_ok, stride_sg, BLOCK_K // 8, GROUP)
        else:
            s_g, s_u = wg, wu  # unread
        part_g, part_u, rowsum = _step(wg, s_g, wu, s_u, x_rows, row_ok, k0, K, stride_xk, BLOCK_M, BLOCK_N,
                                       BLOCK_K // 8, dtype, SCHEME, ASM, SWAP_AB, True)
        acc_gate = _apply(acc_gate, part_g, rowsum, sg, zg, k0, K, n_ok, stride_sg, stride_zg, GROUP, SCHEME, SWAP_AB)
        acc_up = _apply(acc_up, part_u, rowsum, su, zu, k0, K, n_ok, stride_sg, stride_zg, GROUP, SCHEME, SWAP_AB)
    let_next_kernel_launch(PDL)
    h = _glu(unswap(acc_gate, SWAP_AB), unswap(acc_up, SWAP_AB), ACT, 1.0, None, 0.0)  # [BM, BN] fp32
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_wo_mma_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    K, N, NW, num_assignments, num_experts, num_pid_m, split_len,  # NW: words of a w2 row
    stride_hm, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
    KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (``gemm.down_kernel``'s, SPLIT 1)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
    SWAP_AB: tl.constexpr = False,
):
    """y = routed weight * (h w2^T) per assignment row (split-K, KSUM: ``gemm_wo_reg``'s; split_len in columns)."""
    wait_for_previous_kernel(PDL)
    if KSUM:
        if tl.program_id(0) >= num_pid_m * tl.cdiv(K, BLOCK_N):  # the programs after the GEMM's
            zero_unrouted_tokens(out_ptr, ids_ptr, map_ptr, num_pid_m * tl.cdiv(K, BLOCK_N), K, num_assignments,
                                 top_k, num_experts, num_global, BLOCK_N, TOPK_PAD, HAS_MAP, ZERO_T)
            return
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(K, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments
    safe_rows = tl.where(row_ok, rows, 0)
    if KSUM:  # [BM] routed slots of each row's token, loaded before the main loop (the epilogue needs them)
        arrivals = routed_slot_count(safe_rows // top_k, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD, HAS_MAP)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    out = offs_out.to(tl.int64)
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe + out * stride_qr  # [BN]
    s_rows = s_ptr + expert * stride_se + out * stride_sr
    z_rows = z_ptr + expert * stride_ze + out * stride_zr
    h_rows = h_ptr + safe_rows[:, None] * stride_hm  # [BM, 1]
    dtype = h_ptr.dtype.element_ty
    if UPCAST:
        dtype = tl.float32
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    w_start = tl.program_id(1) * (split_len // 8)
    for w0 in range(w_start, tl.minimum(w_start + split_len // 8, NW), BLOCK_K // 8):
        k0 = w0 * 8
        w = _words(q_rows, w0, NW, out_ok, BLOCK_K // 8)
        if SCHEME == 2:
            s_w = _word_scales(s_rows, w0, N, out_ok, stride_sg, BLOCK_K // 8, GROUP)
        else:
            s_w = w  # unread
        part, _, rowsum = _step(w, s_w, w, s_w, h_rows, row_ok, k0, N, 1, BLOCK_M, BLOCK_N, BLOCK_K // 8, dtype, SCHEME,
                                ASM, SWAP_AB, False)
        acc = _apply(acc, part, rowsum, s_rows, z_rows, k0, N, out_ok, stride_sg, stride_zg, GROUP, SCHEME, SWAP_AB)
    let_next_kernel_launch(PDL)
    _store_y(unswap(acc, SWAP_AB), s_rows, weights_ptr, y_ptr, safe_rows, row_ok, offs_out, out_ok, num_assignments,
             stride_ym, SCHEME)
    if KSUM:
        ksum_epilogue(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok, arrivals, pid_n, offs_out,
                      out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD, HAS_MAP, SUM_ROWS)

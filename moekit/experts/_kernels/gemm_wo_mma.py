"""Grouped GEMMs with weight-only int4 experts, the word MMA decode (decode "mma", issue #16 session 24): the
packed weights read as 32-bit words straight into registers (no shared memory, no byte shuffles), each word's
eight values decoded to bf16 pairs by one prmt and one lop3 (plus a shift for the high nibbles), and summed on
the tensor cores by eight dots a step, one per value position T of the words: the dot's reduction order is free,
so value T of words j = 0 .. BKW-1 is one dot's K, against the activation columns 8j + T. Built for decode-sized
blocks (16 rows, mostly one real row at M*k < E), where the register decode's byte tiles cost ~9 SASS
instructions a weight (``benchmarks/wo_reg_sass_cpu.py``), most of them layout changes.

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. Layout: ``triton_wo``'s int4 (element 2i the low
nibble of byte i), read as little-endian words (``triton_wo_gemv.words_ok``): element t of word j in bits 4t..4t+3.

Decoded value = 128 + code, exact in bf16 (the code in the low mantissa bits of 128.0); one step spans
BLOCK_K = 8 * BKW <= g columns, so one group: its (scale s, zero z) apply to the step's fp32 partial product p
[BM, BN] as acc += p * s - rowsum(x) * (128 + z) * s (``gemm_wo_reg``'s chunk form; the cancellation is ~2^-24 *
128 * sum|x| * s, far below the bf16 rounding of the output). ASM (NVIDIA sm_80+, bf16, compiled): inline PTX on
two words at a time (pack 2: the two words' value T form one bf16x2 register, the MMA operand's pair); else the
same bit placement in Triton (``_twin_value``: the interpreter; UPCAST decodes to float32).

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

# Two words ($8, $9) -> value T of both as one bf16x2 ($T: word $8 low half, $9 high half), 128 + code: prmt puts
# byte T/2 of each word in bytes 0 and 2, lop3 ((t & 0x000F000F) | 0x43004300) places the low nibbles, a shift the high.
_INT4_PAIR_ASM = tl.constexpr("""{
.reg .b32 t, u;
prmt.b32 t, $8, $9, 0x0400;
lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA;
shr.b32 u, t, 4;
lop3.b32 $1, u, 0x000F000F, 0x43004300, 0xEA;
prmt.b32 t, $8, $9, 0x0501;
lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xEA;
shr.b32 u, t, 4;
lop3.b32 $3, u, 0x000F000F, 0x43004300, 0xEA;
prmt.b32 t, $8, $9, 0x0602;
lop3.b32 $4, t, 0x000F000F, 0x43004300, 0xEA;
shr.b32 u, t, 4;
lop3.b32 $5, u, 0x000F000F, 0x43004300, 0xEA;
prmt.b32 t, $8, $9, 0x0703;
lop3.b32 $6, t, 0x000F000F, 0x43004300, 0xEA;
shr.b32 u, t, 4;
lop3.b32 $7, u, 0x000F000F, 0x43004300, 0xEA;
}""")


@triton.jit
def _twin_value(w, T: tl.constexpr, DTYPE: tl.constexpr):
    """Value T of each word of w [BN, BKW] int32 as 128 + code in DTYPE (the PTX's placement in Triton)."""
    code = (w >> (4 * T)) & 0xF
    if DTYPE == tl.bfloat16:
        value = (code.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
    else:
        value = (code + 128).to(tl.float32).to(DTYPE)
    return value


@triton.jit
def _values(w, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """The eight values (T = 0..7) of each word of w [BN, BKW], 128 + code in DTYPE."""
    if ASM and DTYPE == tl.bfloat16:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _INT4_PAIR_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        v0, v1, v2, v3 = _twin_value(w, 0, DTYPE), _twin_value(w, 1, DTYPE), _twin_value(w, 2, DTYPE), _twin_value(w, 3, DTYPE)
        v4, v5, v6, v7 = _twin_value(w, 4, DTYPE), _twin_value(w, 5, DTYPE), _twin_value(w, 6, DTYPE), _twin_value(w, 7, DTYPE)
    return v0, v1, v2, v3, v4, v5, v6, v7


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
def _t_dots(part, part2, xsum, v, u, x_rows, row_ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr,
            DTYPE: tl.constexpr, SWAP_AB: tl.constexpr, TWO: tl.constexpr):
    """Value position T: x_T loaded once, its dots with v (and u where TWO), xsum [BM, BKW] + x_T."""
    x = _x_t(x_rows, row_ok, k0, C, stride_xc, T, BKW)
    xd = x.to(DTYPE)
    part = _dot(xd, v, part, SWAP_AB)
    if TWO:
        part2 = _dot(xd, u, part2, SWAP_AB)
    return part, part2, xsum + x.to(tl.float32)


@triton.jit
def _step(w, w2, x_rows, row_ok, k0, C, stride_xc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr,
          DTYPE: tl.constexpr, ASM: tl.constexpr, SWAP_AB: tl.constexpr, TWO: tl.constexpr):
    """One step's partial products of the words w [BN, BKW] (and w2 where TWO: gate-up's up words, against the
    same x columns, each x_T loaded once) and the activation rows' sums [BM] over the step's columns."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _values(w, DTYPE, ASM)
    if TWO:
        u0, u1, u2, u3, u4, u5, u6, u7 = _values(w2, DTYPE, ASM)
    else:
        u0, u1, u2, u3, u4, u5, u6, u7 = v0, v1, v2, v3, v4, v5, v6, v7
    p = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    p2, xs = p, tl.zeros([BLOCK_M, BKW], dtype=tl.float32)
    p, p2, xs = _t_dots(p, p2, xs, v0, u0, x_rows, row_ok, k0, C, stride_xc, 0, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v1, u1, x_rows, row_ok, k0, C, stride_xc, 1, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v2, u2, x_rows, row_ok, k0, C, stride_xc, 2, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v3, u3, x_rows, row_ok, k0, C, stride_xc, 3, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v4, u4, x_rows, row_ok, k0, C, stride_xc, 4, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v5, u5, x_rows, row_ok, k0, C, stride_xc, 5, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v6, u6, x_rows, row_ok, k0, C, stride_xc, 6, BKW, DTYPE, SWAP_AB, TWO)
    p, p2, xs = _t_dots(p, p2, xs, v7, u7, x_rows, row_ok, k0, C, stride_xc, 7, BKW, DTYPE, SWAP_AB, TWO)
    return p, p2, tl.sum(xs, axis=1)


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
    """h = act(x w_gate^T) * (x w_up^T) per assignment row (int4: SCHEME 1 only; SPAN: unused, the launch's)."""
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
        scale_g, add_g = _group(sg, zg, k0, K, n_ok, stride_sg, stride_zg, GROUP)
        scale_u, add_u = _group(su, zu, k0, K, n_ok, stride_sg, stride_zg, GROUP)
        part_g, part_u, rowsum = _step(wg, wu, x_rows, row_ok, k0, K, stride_xk, BLOCK_M, BLOCK_N,
                                       BLOCK_K // 8, dtype, ASM, SWAP_AB, True)
        acc_gate = _scaled(acc_gate, part_g, rowsum, scale_g, add_g, SWAP_AB)
        acc_up = _scaled(acc_up, part_u, rowsum, scale_u, add_u, SWAP_AB)
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
        scale, add = _group(s_rows, z_rows, k0, N, out_ok, stride_sg, stride_zg, GROUP)
        part, _, rowsum = _step(_words(q_rows, w0, NW, out_ok, BLOCK_K // 8), 0, h_rows, row_ok, k0, N, 1,
                                BLOCK_M, BLOCK_N, BLOCK_K // 8, dtype, ASM, SWAP_AB, False)
        acc = _scaled(acc, part, rowsum, scale, add, SWAP_AB)
    let_next_kernel_launch(PDL)
    _store_y(unswap(acc, SWAP_AB), s_rows, weights_ptr, y_ptr, safe_rows, row_ok, offs_out, out_ok, num_assignments,
             stride_ym, SCHEME)
    if KSUM:
        ksum_epilogue(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok, arrivals, pid_n, offs_out,
                      out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD, HAS_MAP, SUM_ROWS)

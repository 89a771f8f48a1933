"""Grouped GEMMs with 4-bit weight-only experts, the packed-half word decode ("gemv_half"): as ``gemm_wo_gemv``
(32-bit words of packed weights straight into registers, CUDA cores, M-blocks of 1-2 rows) but two
weights per instruction: each word's 8 codes become four fp16x2 pairs and multiply-add in fp16x2
(``fma.rn.f16x2``) against fp16x2 pairs of prescaled activations; each word's fp16x2 sum becomes one
float32 (its halves added), multiplied by the group scale into a float32 accumulator [BN, BKW] per row
(summed over the words at the end): scales per word, never per weight.

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. Schemes: int4_w4a16 (SCHEME 1) and mxfp4
(SCHEME 2); int8's products do not fit fp16's 11 bits (``triton_wo_gemv.check_gemv_config`` refuses it).

Words (``triton_wo``'s layouts: element 8j+t of a row in bits 4t..4t+3 of word j): pair t (0..3) of a word
holds elements 8j+t (low half) and 8j+t+4 (high half), taken by one mask of (word >> 4t) (``_word_asm``):
    int4   lop3 ((w >> 4t) & 0x000F000F) | 0x64006400 = 1024 + code in each fp16 half (exact), then
           sub.f16x2 of 1024 + zero: code - zero, exact; one fma.rn.f16x2 a pair; 3 shifts + 4 lop3 +
           4 sub + 4 fma + 4 to float32 = 19 instructions a word (2.4 a weight; sm_90 SASS of the whole
           loop, Triton 3.9, 64 x 16-word tiles, 2 warps: 3.5 a weight, the float32 word decode 3.9).
    mxfp4  the magnitude bits to fp16 bits 9-11 (e2m1 * 2^-14; the code 0.5 an fp16 subnormal, which
           fp16x2 arithmetic keeps), the sign to bit 15: two shifts, an and, a lop3 a pair; then the fma
           (loop: ~5 a weight, the float32 word decode 7.3).
    2-row M-blocks decode each word once for both rows (``_word_asm(scheme, 2)``).
Activations: each step's x of a row (loaded a step ahead, ``_x_rows``) is scaled by 2^sh, sh from the
step's largest |x| (``_x_scaled``), so |x'| < 2^TOP: int4 TOP 4 (|code - zero| <= 15: a product <= 240, a
word's 4 products a half <= 960 < 65504), mxfp4 TOP 15 (a product <= 12). A scaled x is exact in fp16
unless it falls below 2^-14 (then its product errs by <= 2^-25 absolute, against the step's largest
product's 2^7: nothing at bf16's resolution). Each word's sum is multiplied by its group scale times
2^(EXTRA - sh) (EXTRA 14 for mxfp4's 2^-14, else 0). (The first form, one prescale a row from a pass over
the whole row before the loop, put that pass's serial loads ahead of every program: slower on the H200.)
Precision: an int4 product rounds once to fp16 (code - zero, 4 bits, times an 8-bit bf16 mantissa: 12
bits into 11; mxfp4's e2m1 values have 2, so its products are exact); a word's 4 products a half summed
in fp16 (3 roundings at 2^-11 relative of the partial sum), then float32: the layer output errs ~2^-12
relative, below its bf16 rounding (tests: rel-L2 against the float64 loop as the float32 decodes').

Paths: ASM (NVIDIA, compiled) the inline PTX on fp16x2 words (int32 tensors); else (the interpreter) the
same decode and fp16 products in Triton on separate low and high fp16 tensors (``_plain_sum``: a product
rounded, then the sum, where the PTX fuses them: results agree to fp16 rounding, both tested against the
reference: tests/test_triton_wo_half.py here, benchmarks/wo_decode_device_check.py on the GPU).

A step of BKW words lies in one group (BKW * 8 <= g: scales per row, loaded as [BN]) or holds whole groups
(scales per word [BN, BKW]). Past C the words load as 0 and x as 0; scales 0.
PREFETCH > 0 (ASM only): each step also prefetches into L2 the words PREFETCH steps ahead (more bytes in
flight than the registers' one step; the config's num_stages - 1, ``triton_wo_gemv``). Split-K (both GEMMs),
KSUM, alignment, NAIVE, PDL: as ``gemm_wo_gemv``. Shapes: A = M*k, K hidden, N intermediate,
BN weight rows a program, BKW words a step.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import ksum_epilogue, routed_slot_count, zero_unrouted_tokens
from moekit.experts._kernels.gemm import _block_rows, _glu, _grid_position
from moekit.experts._kernels.gemm_wo_gemv import _row, gate_up_operands
from moekit.experts._kernels.wo_split import h_words, split_range, store_partials
from moekit.experts._kernels.wo_words import load_words


def _word_asm(scheme: int, rows: int) -> str:
    """Inline PTX: one word -> for each of ``rows`` activation rows, the sum over the word's 4 pairs of
    value * x in fp16x2, then its two halves added in float32. Operands: $0 .. $rows-1 the rows' sums
    (float32 bits), then the word w, the zero (int4: 1024 + zero in both fp16 halves; mxfp4: unused),
    then each row's x pairs of t = 0..3. Pair t's values: int4 lop3 ((w >> 4t) & 0x000F000F) | 0x64006400
    (1024 + code) minus the zero; mxfp4 the magnitudes (w << 9 - 4t) & 0x0E000E00 or'd with the signs
    (w << 12 - 4t) & 0x80008000. The decode is shared by the rows."""
    w, zero = f"${rows}", f"${rows + 1}"
    lines = ["{", ".reg .b32 a, m, g, v;", ".reg .b16 l, h;", ".reg .f32 fl, fh;",
             ".reg .b32 " + ", ".join(f"p{r}" for r in range(rows)) + ";"]
    for t in range(4):
        if scheme == 1:
            src = w if t == 0 else "a"
            if t:
                lines.append(f"shr.u32 a, {w}, {4 * t};")
            lines += [f"lop3.b32 v, {src}, 0x000F000F, 0x64006400, 0xEA;", f"sub.f16x2 v, v, {zero};"]
        else:
            lines.append(f"shl.b32 m, {w}, {9 - 4 * t};" if t < 3 else f"shr.u32 m, {w}, 3;")
            if t < 3:
                lines += [f"shl.b32 g, {w}, {12 - 4 * t};", "and.b32 g, g, 0x80008000;"]
            else:
                lines.append(f"and.b32 g, {w}, 0x80008000;")
            lines.append("lop3.b32 v, m, 0x0E000E00, g, 0xEA;")
        for r in range(rows):
            x = f"${rows + 2 + 4 * r + t}"
            lines.append(f"mul.rn.f16x2 p{r}, v, {x};" if t == 0 else f"fma.rn.f16x2 p{r}, v, {x}, p{r};")
    for r in range(rows):
        lines += [f"mov.b32 {{l, h}}, p{r};", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fh, h;", f"add.f32 ${r}, fl, fh;"]
    return "\n".join(lines + ["}"])


_ASM = {(scheme, rows): _word_asm(scheme, rows) for scheme in (1, 2) for rows in (1, 2)}
_INT4_ASM1, _INT4_ASM2 = tl.constexpr(_ASM[1, 1]), tl.constexpr(_ASM[1, 2])
_MXFP4_ASM1, _MXFP4_ASM2 = tl.constexpr(_ASM[2, 1]), tl.constexpr(_ASM[2, 2])


@triton.jit
def _prefetch_l2(q_words, w0, KW, BKW: tl.constexpr):
    """prefetch.global.L2 of words w0 .. w0+BKW of each row [BN] (pointers to the rows' first words; the
    callers prefetch only tiles whose rows all exist; words clamped to the row's last step: every address
    lies inside the weight): the bytes PREFETCH steps ahead, in flight without registers."""
    j = tl.minimum(w0, tl.maximum(KW - BKW, 0)) + tl.arange(0, BKW)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.b32 $0, 0;", "=r,l", [q_words[:, None] + j[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _pow2(e):
    """2^e as float32 for int32 e in [-126, 127] (its bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pair(lo, hi):
    """Two fp16 tensors -> fp16x2 words (lo in the low half)."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _codes_half(w, zero, T: tl.constexpr, SCHEME: tl.constexpr):
    """The interpreter's decode: element T of each word [BN, BKW] as fp16, code - zero (int4) or
    e2m1 * 2^-14 (mxfp4); ``zero`` fp16 [BN, 1] or [BN, BKW]."""
    code = (w >> (4 * T)) & 0xF
    if SCHEME == 1:
        value = code.to(tl.float16) - zero
    else:
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        value = bits.to(tl.int16).to(tl.float16, bitcast=True)
    return value


@triton.jit
def _x_scaled(xs, TOP: tl.constexpr, EXTRA: tl.constexpr):
    """One row's step of x (``_x_rows``) -> (its 8 fp16 tensors x * 2^sh, 2^(EXTRA - sh)): sh from the step's
    largest |x| so that |x * 2^sh| < 2^TOP (clamped so both powers are normal floats)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    e = ((tl.max(m, axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 max); 0 -> -127
    sh = tl.minimum(tl.maximum(TOP - 1 - e, EXTRA - 126), 100)
    scale = _pow2(sh)
    return ((x0 * scale).to(tl.float16), (x1 * scale).to(tl.float16), (x2 * scale).to(tl.float16),
            (x3 * scale).to(tl.float16), (x4 * scale).to(tl.float16), (x5 * scale).to(tl.float16),
            (x6 * scale).to(tl.float16), (x7 * scale).to(tl.float16)), _pow2(EXTRA - sh)


@triton.jit
def _x_pairs(xs, shape):
    """The fp16x2 pairs (t, t + 4), t = 0..3, of one row's x halves, broadcast to the words' shape."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    return (tl.broadcast_to(_pair(x0, x4)[None, :], shape), tl.broadcast_to(_pair(x1, x5)[None, :], shape),
            tl.broadcast_to(_pair(x2, x6)[None, :], shape), tl.broadcast_to(_pair(x3, x7)[None, :], shape))


@triton.jit
def _plain_sum(w, zero, xs, SCHEME: tl.constexpr):
    """The interpreter's twin of one row's ``_word_asm``: each word's 8 products in fp16, halves summed in float32."""
    x0, x1, x2, x3, x4, x5, x6, x7 = xs
    lo = _codes_half(w, zero, 0, SCHEME) * x0[None, :] + _codes_half(w, zero, 1, SCHEME) * x1[None, :]
    lo = lo + _codes_half(w, zero, 2, SCHEME) * x2[None, :] + _codes_half(w, zero, 3, SCHEME) * x3[None, :]
    hi = _codes_half(w, zero, 4, SCHEME) * x4[None, :] + _codes_half(w, zero, 5, SCHEME) * x5[None, :]
    hi = hi + _codes_half(w, zero, 6, SCHEME) * x6[None, :] + _codes_half(w, zero, 7, SCHEME) * x7[None, :]
    return lo.to(tl.float32) + hi.to(tl.float32)


@triton.jit
def _step_sums(w, zero, xa, xb, TWO: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr):
    """Each word's sum [BN, BKW] float32 for row a (x halves ``xa``) and, if TWO, row b (else row a's
    again), the words decoded once. ``zero`` (int4): int32 1024 + zero per fp16 half (ASM) or the fp16
    zero; [BN, 1] or [BN, BKW]."""
    if ASM:
        z = tl.broadcast_to(zero, w.shape)
        a0, a1, a2, a3 = _x_pairs(xa, w.shape)
        if TWO:
            b0, b1, b2, b3 = _x_pairs(xb, w.shape)
            part_a, part_b = tl.inline_asm_elementwise(
                _INT4_ASM2 if SCHEME == 1 else _MXFP4_ASM2, "=r,=r" + ",r" * 10, [w, z, a0, a1, a2, a3, b0, b1, b2, b3],
                dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
            part_b = part_b.to(tl.float32, bitcast=True)
        else:
            part_a = tl.inline_asm_elementwise(_INT4_ASM1 if SCHEME == 1 else _MXFP4_ASM1, "=r" + ",r" * 6,
                                               [w, z, a0, a1, a2, a3], dtype=tl.int32, is_pure=True, pack=1)
        part_a = part_a.to(tl.float32, bitcast=True)
        if not TWO:
            part_b = part_a
    else:
        part_a = _plain_sum(w, zero, xa, SCHEME)
        part_b = part_a
        if TWO:
            part_b = _plain_sum(w, zero, xb, SCHEME)
    return part_a, part_b


@triton.jit
def _scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, BKW: tl.constexpr, GROUP: tl.constexpr,
            SCHEME: tl.constexpr, ASM: tl.constexpr):
    """(mul float32, zero) of the step at k0 (``_step_sum``): [BN, 1] where the step lies in one group
    (BKW * 8 <= g), else [BN, BKW] (each word's group); mxfp4's zero unused (0)."""
    if BKW * 8 <= GROUP:  # loaded as [BN] (a 2D [BN, 1] load would anchor a layout of one row a thread)
        ok = tl.where(k0 < C, n_ok, False)
        s_ptrs, z_ptrs = s_rows + (k0 // GROUP) * stride_sg, z_rows + (k0 // GROUP) * stride_zg
    else:
        first = k0 + tl.arange(0, BKW) * 8  # [BKW] each word's first element
        ok = n_ok[:, None] & (first < C)[None, :]
        s_ptrs = s_rows[:, None] + (first // GROUP)[None, :] * stride_sg
        z_ptrs = z_rows[:, None] + (first // GROUP)[None, :] * stride_zg
    if SCHEME == 1:
        mul = tl.load(s_ptrs, mask=ok, other=0.0)
        z = tl.load(z_ptrs, mask=ok, other=0).to(tl.int32)
        if ASM:
            zero = z * 0x10001 + 0x64006400  # 1024 + z in both fp16 halves (z <= 15: no carry)
        else:
            zero = z.to(tl.float16)
    else:
        e = tl.load(s_ptrs, mask=ok, other=0).to(tl.int32)
        mul = (e << 23).to(tl.float32, bitcast=True)  # masked: e = 0, 0.0
        zero = e
    if BKW * 8 <= GROUP:
        mul, zero = mul[:, None], zero[:, None]
    return mul, zero


@triton.jit
def _x_rows(x0, ok0, x1, ok1, k0, C, stride, BLOCK_M: tl.constexpr, BKW: tl.constexpr, fs=0,
            UP_SPLIT: tl.constexpr = 1, ACT: tl.constexpr = 0, ROUND: tl.constexpr = 0):
    """``wo_split.h_words`` of the block's rows at the step k0, loaded a step ahead of their use (row 1: row 0's
    where BLOCK_M is 1)."""
    xa = h_words(x0, ok0, k0, C, stride, BKW, fs, UP_SPLIT, ACT, ROUND)
    xb = xa
    if BLOCK_M > 1:
        xb = h_words(x1, ok1, k0, C, stride, BKW, fs, UP_SPLIT, ACT, ROUND)
    return xa, xb


@triton.jit
def _tile_step(acc0, acc1, w, s_rows, z_rows, xa, fa, xb, fb, k0, C, n_ok, stride_sg, stride_zg,
               BLOCK_M: tl.constexpr, BKW: tl.constexpr, GROUP: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr):
    """One weight tile's step for the block's rows (scaled x ``xa``, ``xb`` and their factors ``fa``, ``fb``):
    acc [BN, BKW] + each word's sum times its group scale and the row's factor."""
    mul, zero = _scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, BKW, GROUP, SCHEME, ASM)
    part_a, part_b = _step_sums(w, zero, xa, xb, BLOCK_M > 1, SCHEME, ASM)
    return acc0 + part_a * (mul * fa), acc1 + part_b * (mul * fb)


@triton.jit
def _scaled_rows(xa_raw, xb_raw, BLOCK_M: tl.constexpr, SCHEME: tl.constexpr):
    """``_x_scaled`` of the block's rows (int4: TOP 4, EXTRA 0; mxfp4: TOP 15, EXTRA 14)."""
    TOP: tl.constexpr = 4 if SCHEME == 1 else 15
    EXTRA: tl.constexpr = 0 if SCHEME == 1 else 14
    xa, fa = _x_scaled(xa_raw, TOP, EXTRA)
    xb, fb = xa, fa
    if BLOCK_M > 1:
        xb, fb = _x_scaled(xb_raw, TOP, EXTRA)
    return xa, fa, xb, fb


@triton.jit
def gate_up_wo_half_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, KW, num_assignments, top_k, num_experts, num_pid_m,  # KW: words of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_hm, split_words,  # split_words: a split's words (SPLIT > 1)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr, PREFETCH: tl.constexpr = 0, SPLIT: tl.constexpr = 1,
):
    """h = act(x w_gate^T) * (x w_up^T) per assignment row (BLOCK_M 1 or 2), w13 decoded in fp16x2; SPLIT:
    ``gemm_wo_gemv``'s split-K gate-up."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    a0, ok0, a1, ok1, x0, x1, offs_n, n_ok, qg, qu, sg, su, zg, zu = gate_up_operands(
        x_ptr, q_ptr, s_ptr, z_ptr, rows, expert, pid_n, N, num_assignments, top_k, stride_xm, stride_qe, stride_qr,
        stride_se, stride_sr, stride_ze, stride_zr, BLOCK_M, BLOCK_N)
    acc_g0 = tl.zeros([BLOCK_N, BKW], dtype=tl.float32)
    acc_u0, acc_g1, acc_u1 = tl.zeros_like(acc_g0), tl.zeros_like(acc_g0), tl.zeros_like(acc_g0)
    w_start, w_end = split_range(KW, split_words, SPLIT)
    wg, wu = load_words(qg, w_start, w_end, n_ok, BKW), load_words(qu, w_start, w_end, n_ok, BKW)
    next_a, next_b = _x_rows(x0, ok0, x1, ok1, w_start * 8, K, stride_xk, BLOCK_M, BKW)
    for w0 in range(w_start, w_end, BKW):
        next_g = load_words(qg, w0 + BKW, w_end, n_ok, BKW)
        next_u = load_words(qu, w0 + BKW, w_end, n_ok, BKW)
        if ASM and PREFETCH > 0:
            if pid_n * BLOCK_N + BLOCK_N <= N:  # every row of the tile exists
                _prefetch_l2(qg, w0 + PREFETCH * BKW, w_end, BKW)
                _prefetch_l2(qu, w0 + PREFETCH * BKW, w_end, BKW)
        xa, fa, xb, fb = _scaled_rows(next_a, next_b, BLOCK_M, SCHEME)
        next_a, next_b = _x_rows(x0, ok0, x1, ok1, (w0 + BKW) * 8, K, stride_xk, BLOCK_M, BKW)
        acc_g0, acc_g1 = _tile_step(acc_g0, acc_g1, wg, sg, zg, xa, fa, xb, fb, w0 * 8, K, n_ok, stride_sg, stride_zg,
                                    BLOCK_M, BKW, GROUP, SCHEME, ASM)
        acc_u0, acc_u1 = _tile_step(acc_u0, acc_u1, wu, su, zu, xa, fa, xb, fb, w0 * 8, K, n_ok, stride_sg, stride_zg,
                                    BLOCK_M, BKW, GROUP, SCHEME, ASM)
        wg, wu = next_g, next_u
    let_next_kernel_launch(PDL)
    _gate_up_out(acc_g0, acc_u0, h_ptr, a0, ok0, offs_n, n_ok, N, num_assignments, stride_hm, ACT, SPLIT)
    if BLOCK_M > 1:
        _gate_up_out(acc_g1, acc_u1, h_ptr, a1, ok1, offs_n, n_ok, N, num_assignments, stride_hm, ACT, SPLIT)


@triton.jit
def _gate_up_out(acc_g, acc_u, h_ptr, row, ok, offs_n, n_ok, N, num_assignments, stride_hm, ACT: tl.constexpr,
                 SPLIT: tl.constexpr):
    """Row ``row`` of h [BN] from its accumulators [BN, BKW]; SPLIT > 1: this split's partials (``wo_split``)."""
    gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    if SPLIT > 1:
        store_partials(h_ptr, gate, up, row, ok, offs_n, n_ok, N, num_assignments, stride_hm)
    else:
        h = _glu(gate, up, ACT, 1.0, None, 0.0)
        tl.store(h_ptr + row * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=tl.where(ok, n_ok, False))


@triton.jit
def _down_out(acc, out_ok, weights_ptr, y_ptr, row, ok, num_assignments, offs_out, stride_ym):
    """Row ``row``'s routed-weighted output [BN] into this split's partial row."""
    y = tl.sum(acc, axis=1) * tl.load(weights_ptr + row, mask=ok, other=0.0).to(tl.float32)
    y_row = tl.program_id(1) * num_assignments + row
    tl.store(y_ptr + y_row * stride_ym + offs_out, y.to(y_ptr.dtype.element_ty), mask=tl.where(ok, out_ok, False))


@triton.jit
def down_wo_half_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    K, N, NW, num_assignments, num_experts, num_pid_m, split_words,  # NW: words of a w2 row
    stride_hm, stride_qe, stride_qr, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr,
    KSUM: tl.constexpr = False, top_k=1, num_global=0,
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
    PREFETCH: tl.constexpr = 0, UP_SPLIT: tl.constexpr = 1, ACT: tl.constexpr = 0, ROUND: tl.constexpr = 0,
):
    """y = routed weight * (h w2^T) per assignment row, w2 decoded in fp16x2 (split-K, KSUM, the folded h of
    UP_SPLIT > 1: ``gemm_wo_gemv``)."""
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
    if KSUM:  # [BM] routed slots of each row's token, loaded before the main loop (the epilogue needs them)
        row_ok = rows < num_assignments
        safe_rows = tl.where(row_ok, rows, 0)
        arrivals = routed_slot_count(safe_rows // top_k, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD, HAS_MAP)
    a0, ok0 = _row(rows, num_assignments, 0, BLOCK_M)
    a1, ok1 = _row(rows, num_assignments, 1, BLOCK_M)
    a0, a1 = tl.where(ok0, a0, 0), tl.where(ok1, a1, 0)
    h0, h1, fs = h_ptr + a0 * stride_hm, h_ptr + a1 * stride_hm, num_assignments * stride_hm
    w_start, w_end = tl.program_id(1) * split_words, tl.minimum(tl.program_id(1) * split_words + split_words, NW)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe + offs_out.to(tl.int64) * stride_qr
    s_rows, z_rows = s_ptr + expert * stride_se + offs_out * stride_sr, z_ptr + expert * stride_ze + offs_out * stride_zr
    acc0, acc1 = tl.zeros([BLOCK_N, BKW], dtype=tl.float32), tl.zeros([BLOCK_N, BKW], dtype=tl.float32)
    w = load_words(q_rows, w_start, NW, out_ok, BKW)
    next_a, next_b = _x_rows(h0, ok0, h1, ok1, w_start * 8, N, 1, BLOCK_M, BKW, fs, UP_SPLIT, ACT, ROUND)
    for w0 in range(w_start, w_end, BKW):
        next_w = load_words(q_rows, w0 + BKW, NW, out_ok, BKW)
        if ASM and PREFETCH > 0:
            if pid_n * BLOCK_N + BLOCK_N <= K:  # every row of the tile exists
                _prefetch_l2(q_rows, w0 + PREFETCH * BKW, NW, BKW)
        xa, fa, xb, fb = _scaled_rows(next_a, next_b, BLOCK_M, SCHEME)
        next_a, next_b = _x_rows(h0, ok0, h1, ok1, (w0 + BKW) * 8, N, 1, BLOCK_M, BKW, fs, UP_SPLIT, ACT, ROUND)
        acc0, acc1 = _tile_step(acc0, acc1, w, s_rows, z_rows, xa, fa, xb, fb, w0 * 8, N, out_ok, stride_sg, stride_zg,
                                BLOCK_M, BKW, GROUP, SCHEME, ASM)
        w = next_w
    let_next_kernel_launch(PDL)
    _down_out(acc0, out_ok, weights_ptr, y_ptr, a0, ok0, num_assignments, offs_out, stride_ym)
    if BLOCK_M > 1:
        _down_out(acc1, out_ok, weights_ptr, y_ptr, a1, ok1, num_assignments, offs_out, stride_ym)
    if KSUM:
        ksum_epilogue(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok, arrivals, pid_n, offs_out,
                      out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD, HAS_MAP, SUM_ROWS)

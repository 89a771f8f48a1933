"""Values of 32-bit words of packed weights as float32, by placing bits (the word decode of
``gemm_wo_gemv``; layouts in ``moekit.experts.triton_wo``): inline PTX on NVIDIA GPUs (ASM), else the
same placements in Triton (``_value``, what the interpreter runs); the words' loads and group scales.
Exact: each float32 is a fixed affine function of the stored code, undone by ``gemm_wo_gemv``'s scales.

A 4-bit word holds elements 8j .. 8j+7 of a row, element t in bits 4t .. 4t+3; an int8 word elements
4j .. 4j+3, element t in bits 8t .. 8t+7.
"""

import triton
import triton.language as tl

from moekit.experts._kernels.e2m1_ptx import e2m1_place

# Inline PTX (NVIDIA, ASM): one word -> its values' float32 bits ($0 .. $7), the placements of ``_value``.
# int4: four shifts and one lop3 ((a & mask) | 1.0f) a value: 12 instructions for 8 weights.
_INT4_ASM = tl.constexpr("""{
.reg .b32 a, b, c, d;
shl.b32 c, $8, 16;
shl.b32 a, $8, 8;
shr.u32 b, $8, 8;
shr.u32 d, $8, 16;
lop3.b32 $0, c, 0x000F0000, 0x3F800000, 0xEA;
lop3.b32 $1, a, 0x0000F000, 0x3F800000, 0xEA;
lop3.b32 $2, a, 0x000F0000, 0x3F800000, 0xEA;
lop3.b32 $3, $8, 0x0000F000, 0x3F800000, 0xEA;
lop3.b32 $4, $8, 0x000F0000, 0x3F800000, 0xEA;
lop3.b32 $5, b, 0x0000F000, 0x3F800000, 0xEA;
lop3.b32 $6, b, 0x000F0000, 0x3F800000, 0xEA;
lop3.b32 $7, d, 0x0000F000, 0x3F800000, 0xEA;
}""")
# mxfp4: per value T a shift of the magnitude to bits 22..24, of the sign to bit 31, a mask, one lop3 (``_value``'s).
_MXFP4_ASM = tl.constexpr("{\n.reg .b32 m, g;\n" + "".join(
    e2m1_place(f"${t}", "$8", 22 - 4 * t, 28 - 4 * t, "0x01C00000", "0x80000000") for t in range(8)) + "}")
# int8: the sign bits flipped once (byte + 128), then one prmt a value: byte t between 0x00 and 0x3F80.
_INT8_ASM = tl.constexpr("""{
.reg .b32 u, k;
xor.b32 u, $4, 0x80808080;
mov.b32 k, 0x3F800000;
prmt.b32 $0, u, k, 0x7604;
prmt.b32 $1, u, k, 0x7614;
prmt.b32 $2, u, k, 0x7624;
prmt.b32 $3, u, k, 0x7634;
}""")


@triton.jit
def _shifted(w, SHIFT: tl.constexpr):
    """w << SHIFT, or w >> -SHIFT for a negative SHIFT (arithmetic: callers mask the bits they keep)."""
    if SHIFT >= 0:
        out = w << SHIFT
    else:
        out = w >> -SHIFT
    return out


@triton.jit
def _value(w, T: tl.constexpr, SCHEME: tl.constexpr):
    """Value T of each word of w [BN, BKW] int32 as float32 bits placed so (the twin of the PTX above):
    int4 even T the nibble in bits 16..19 of 1.0f (1 + q/128), odd T in bits 12..15 (1 + q/2048);
    int8 the byte + 128 in bits 8..15 of 1.0f (1 + (q + 128)/2^15); mxfp4 the magnitude in bits
    22..24 and the sign in bit 31 (e2m1 * 2^-126)."""
    if SCHEME == 1:
        if T % 2 == 0:
            bits = (_shifted(w, 16 - 4 * T) & 0x000F0000) | 0x3F800000
        else:
            bits = (_shifted(w, 12 - 4 * T) & 0x0000F000) | 0x3F800000
    elif SCHEME == 0:
        bits = (_shifted(w ^ -2139062144, 8 - 8 * T) & 0x0000FF00) | 0x3F800000  # 0x80808080: byte + 128
    else:
        bits = (_shifted(w, 22 - 4 * T) & 0x01C00000) | (_shifted(w, 28 - 4 * T) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def word_values(w, SCHEME: tl.constexpr, ASM: tl.constexpr):
    """Every value of each word of w [BN, BKW] int32: eight float32 tensors (int8: four, then the same
    four again, never read). ASM (NVIDIA): the inline PTX above; else ``_value``."""
    f32 = tl.float32
    if ASM and SCHEME != 0:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            _INT4_ASM if SCHEME == 1 else _MXFP4_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 8,
            is_pure=True, pack=1)
        v0, v1, v2, v3 = (v0.to(f32, bitcast=True), v1.to(f32, bitcast=True), v2.to(f32, bitcast=True),
                          v3.to(f32, bitcast=True))
        v4, v5, v6, v7 = (v4.to(f32, bitcast=True), v5.to(f32, bitcast=True), v6.to(f32, bitcast=True),
                          v7.to(f32, bitcast=True))
    elif ASM and SCHEME == 0:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(_INT8_ASM, "=r,=r,=r,=r,r", [w], dtype=(tl.int32,) * 4,
                                                   is_pure=True, pack=1)
        v0, v1, v2, v3 = (v0.to(f32, bitcast=True), v1.to(f32, bitcast=True), v2.to(f32, bitcast=True),
                          v3.to(f32, bitcast=True))
        v4, v5, v6, v7 = v0, v1, v2, v3
    else:
        v0, v1, v2, v3 = _value(w, 0, SCHEME), _value(w, 1, SCHEME), _value(w, 2, SCHEME), _value(w, 3, SCHEME)
        if SCHEME == 0:
            v4, v5, v6, v7 = v0, v1, v2, v3
        else:
            v4, v5, v6, v7 = _value(w, 4, SCHEME), _value(w, 5, SCHEME), _value(w, 6, SCHEME), _value(w, 7, SCHEME)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def word_scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, BKW: tl.constexpr, PER: tl.constexpr,
                GROUP: tl.constexpr, SCHEME: tl.constexpr):
    """(mul, add_even, add_odd) float32 of the step at k0 (``gemm_wo_gemv._accumulate``): [BN] where the step
    lies in one group (BKW * PER <= GROUP), else [BN, BKW] (a group per word); int8 unused zeros (constants in
    ``_accumulate``, its per-row scale at the end); mxfp4 adds nothing. Past C the x are 0: the masked 0 scales
    change nothing."""
    if SCHEME == 0:  # constants, in ``_accumulate``
        mul = tl.zeros([1], dtype=tl.float32)
        add_even = mul
        add_odd = mul
    else:
        if BKW * PER <= GROUP:
            ok = tl.where(k0 < C, n_ok, False)
            s_ptrs, z_ptrs = s_rows + (k0 // GROUP) * stride_sg, z_rows + (k0 // GROUP) * stride_zg
        else:
            first = k0 + tl.arange(0, BKW) * PER  # [BKW] the first element of each word
            ok = n_ok[:, None] & (first < C)[None, :]
            s_ptrs = s_rows[:, None] + (first // GROUP)[None, :] * stride_sg
            z_ptrs = z_rows[:, None] + (first // GROUP)[None, :] * stride_zg
        if SCHEME == 1:
            sc = tl.load(s_ptrs, mask=ok, other=0.0)
            z = tl.load(z_ptrs, mask=ok, other=0).to(tl.float32)
            mul = sc * 128.0
            add_even = sc * (128.0 + z)
            add_odd = sc * (128.0 + z * 0.0625)  # X_odd sums x * 16
        else:
            e = tl.load(s_ptrs, mask=ok, other=0).to(tl.int32)
            mul = (e << 23).to(tl.float32, bitcast=True) * 4.611686018427388e18  # * 2^62
            add_even = tl.zeros_like(mul)
            add_odd = add_even
    return mul, add_even, add_odd


@triton.jit
def load_words(q_words, w0, KW, n_ok, BKW: tl.constexpr):
    """Words w0 .. w0+BKW of each row [BN] (pointers to the rows' first words) -> [BN, BKW] int32, 0
    past the row's KW words."""
    j = w0 + tl.arange(0, BKW)
    return tl.load(q_words[:, None] + j[None, :], mask=n_ok[:, None] & (j < KW)[None, :], other=0)

"""The weight-only Gluon GEMM's FAST decode (``gluon_gemm_wo``, issue #16 session 28): a stored int4 / mxfp4 tile
read as int32 words of 8 codes (code p at bits 4p: K order) -> its bf16 tile, two weights a 32-bit register in K
order (weights 2j, 2j + 1 of a word: the low and the high half), stored as int32 pairs through an int32 view of the
decoded slot (the same bytes and swizzle). One inline-PTX instance a word (pack 1: its meaning does not depend on
the register layout); the values are bit-equal to the session-27 decode (``gluon_gemm_wo._decode_tile``):

    int4   code p moved to bits 16-19 of float32 128.0 (one shift, one lop3 with the magic 0x43000000 held in a
           register: with it an immediate, ptxas materialised the mask before every lop3), then the same
           fma.rn.f32 (128 + code) * scale + (-(128 + zero) * scale) and one cvt.rn.bf16x2.f32 a pair.
    mxfp4  the magnitude (code & 7) through two byte tables (prmt: the high and the low byte of e2m1's bf16 bits),
           the two bytes of each weight interleaved (prmt), the sign (code bit 3) replicated from its byte's top bit
           (prmt sign mode on the word and the word << 4) into bit 15 of each half, then one fma.rn.bf16x2 by
           2^(e8m0 - 127) and -0: exact for every e8m0 0 .. 254 (2^-127 is a bf16 subnormal, which bf16x2
           arithmetic keeps; 6 * 2^127 overflows to inf as it does in float32).

Gluon does not run in the interpreter (CUDA sm_90 only); offline SASS counts: ``benchmarks/wo8_compile_cpu.py``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# A shared-memory view as another dtype: ``reinterpret`` in Triton 3.9, ``_reinterpret`` in 3.6
_PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))

# $0..$3: the pairs (codes 0,1) .. (6,7) as bf16x2; $4 the word; $5 / $6 the row's float32 scale and
# -(128 + zero) * scale as bits; $7 0x43000000 (float32 128.0)
_INT4_ASM = gl.constexpr("""{
.reg .b32 t<8>;
.reg .f32 f<8>, m, a;
mov.b32 m, $5;
mov.b32 a, $6;
shl.b32 t0, $4, 16;
shl.b32 t1, $4, 12;
shl.b32 t2, $4, 8;
shl.b32 t3, $4, 4;
shr.u32 t5, $4, 4;
shr.u32 t6, $4, 8;
shr.u32 t7, $4, 12;
lop3.b32 t0, t0, 0x000F0000, $7, 0xEA;
lop3.b32 t1, t1, 0x000F0000, $7, 0xEA;
lop3.b32 t2, t2, 0x000F0000, $7, 0xEA;
lop3.b32 t3, t3, 0x000F0000, $7, 0xEA;
lop3.b32 t4, $4, 0x000F0000, $7, 0xEA;
lop3.b32 t5, t5, 0x000F0000, $7, 0xEA;
lop3.b32 t6, t6, 0x000F0000, $7, 0xEA;
lop3.b32 t7, t7, 0x000F0000, $7, 0xEA;
mov.b32 f0, t0;
mov.b32 f1, t1;
mov.b32 f2, t2;
mov.b32 f3, t3;
mov.b32 f4, t4;
mov.b32 f5, t5;
mov.b32 f6, t6;
mov.b32 f7, t7;
fma.rn.f32 f0, f0, m, a;
fma.rn.f32 f1, f1, m, a;
fma.rn.f32 f2, f2, m, a;
fma.rn.f32 f3, f3, m, a;
fma.rn.f32 f4, f4, m, a;
fma.rn.f32 f5, f5, m, a;
fma.rn.f32 f6, f6, m, a;
fma.rn.f32 f7, f7, m, a;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
cvt.rn.bf16x2.f32 $2, f5, f4;
cvt.rn.bf16x2.f32 $3, f7, f6;
}""")

# $0..$3: the pairs (codes 0,1) .. (6,7) as bf16x2; $4 the word; $5 2^(e8m0 - 127) twice as bf16x2 bits.
# Tables by code & 7 (0, 0.5, 1, 1.5, 2, 3, 4, 6): high bytes 00 3F 3F 3F 40 40 40 40, low bytes 00 00 80 C0 00 40 80 C0
_MXFP4_ASM = gl.constexpr("""{
.reg .b32 c, d, hl, hh, ll, lh, hi, lo, t, s, z;
mov.b32 hl, 0x3F3F3F00;
mov.b32 hh, 0x40404040;
mov.b32 ll, 0xC0800000;
mov.b32 lh, 0xC0804000;
mov.b32 z, 0x80008000;
and.b32 c, $4, 0x7777;
shr.u32 d, $4, 16;
and.b32 d, d, 0x7777;
shl.b32 t, $4, 4;
prmt.b32 hi, hl, hh, c;
prmt.b32 lo, ll, lh, c;
prmt.b32 $0, lo, hi, 0x5140;
prmt.b32 $1, lo, hi, 0x7362;
prmt.b32 hi, hl, hh, d;
prmt.b32 lo, ll, lh, d;
prmt.b32 $2, lo, hi, 0x5140;
prmt.b32 $3, lo, hi, 0x7362;
prmt.b32 s, t, $4, 0xC080;
lop3.b32 $0, s, 0x80008000, $0, 0xEA;
prmt.b32 s, t, $4, 0xD090;
lop3.b32 $1, s, 0x80008000, $1, 0xEA;
prmt.b32 s, t, $4, 0xE0A0;
lop3.b32 $2, s, 0x80008000, $2, 0xEA;
prmt.b32 s, t, $4, 0xF0B0;
lop3.b32 $3, s, 0x80008000, $3, 0xEA;
fma.rn.bf16x2 $0, $0, $5, z;
fma.rn.bf16x2 $1, $1, $5, z;
fma.rn.bf16x2 $2, $2, $5, z;
fma.rn.bf16x2 $3, $3, $5, z;
}""")


@gluon.jit
def e8m0_pair(exponent):
    """e8m0 bytes (int32) -> 2^(e8m0 - 127) twice as bf16x2 bits (int32): the bf16 exponent field e8m0, or for
    e8m0 = 0 the subnormal 2^-127 (bits 0x40)."""
    bits = gl.where(exponent == 0, 0x40, exponent << 7)
    return bits | (bits << 16)


@gluon.jit
def decode_words(raw, dst, mul, add, magic, SCHEME: gl.constexpr):
    """A thread's words ``raw`` [BN, W] int32 (int4: mul / add [BN] float32, the rows' scale and -(128 + zero) *
    scale; mxfp4: raw [BN, W / VEC, VEC] in ``_decode_tile``'s groups layout, mul [BN, W / VEC] ``e8m0_pair``s)
    -> bf16 ``dst`` [BN, 8 W], stored as [BN, 4 W] int32 pairs. ``magic``: int32 0x43000000, a runtime value."""
    BN: gl.constexpr = dst.type.shape[0]
    if SCHEME == 1:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _INT4_ASM, "=r,=r,=r,=r,r,r,r,r",
            [raw, mul.to(gl.int32, bitcast=True)[:, None], add.to(gl.int32, bitcast=True)[:, None], magic],
            dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _MXFP4_ASM, "=r,=r,=r,=r,r,r", [raw, mul[:, :, None]], dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
            is_pure=True, pack=1)
    # [.., 2, 2]: the inner joins' dim is the pair's bit 1, the outer join's (the last dim) its bit 0 -> the word's 4
    # pairs in K order (joined the other way round, pairs 1 and 2 trade places: CK1's 1.05-1.3 rel-L2)
    pairs = gl.reshape(gl.join(gl.join(o0, o2), gl.join(o1, o3)), [BN, dst.type.shape[1] // 2])
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, dst.type.shape[1] // 2], gl.int32)
    if _PUBLIC_REINTERPRET:
        words = dst.reinterpret(gl.int32, [BN, dst.type.shape[1] // 2], layout)
    else:
        words = dst._reinterpret(gl.int32, [BN, dst.type.shape[1] // 2], layout)
    words.store(pairs)

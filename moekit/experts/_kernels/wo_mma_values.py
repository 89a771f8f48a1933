"""The word MMA decode's operands (``gemm_wo_mma``, issue #16 session 26; int8 session 28): a step's packed 4-bit
words [BN, BKW] (element T of word j in bits 4T .. 4T+3) -> one MMA operand [BN, 8 * BKW] in the "MMA order" of K (int8:
element T of word j in bits 8T .. 8T+7 -> [BN, 4 * BKW], below), and the
step's activations [BM, 8 * BKW] (read as one contiguous tile) put in that same order, so one ``tl.dot`` a step
sums them and no decoded weight moves between threads.

The MMA order: the dot's reduction order is free, so K is permuted so that the thread that loaded word j holds
exactly the eight K indices Triton's 16-bit mma.sync operand layout gives one thread over a k32 block, two values
(PAIRS 1: pairs 2q, 2q + 1 and 2q + 8, 2q + 9 of each k16) or four (PAIRS 2: 4q .. 4q + 3 of each k16) a thread:
    PAIRS 1  logical k = 32 b + 16 h + 8 g + 2 q + p
    PAIRS 2  logical k = 32 b + 16 h + 4 q + 2 g + p
holds value T = t + 4 p (t = 2 h + g) of word j = 4 b + q, i.e. activation column 8 j + T = 32 b + 8 q + 4 p + 2 h +
g. Which layout Triton picks depends on its version (``triton_wo_mma.operand_pairs``); the other order costs a
shared-memory hop of the decoded operand, never a wrong sum. Each operand register (a bf16 pair p = 0, 1) is values
t and t + 4 of one word, the nibbles at bits 4t and 4t + 16: one shift, one lop3 and one bf16x2 fma for two int4
weights, one and, one multiply, one and and one bf16x2 fma for two mxfp4 weights (sm_90 SASS:
``benchmarks/wo_mma_sass_cpu.py``).

Values (exact):
    int4   code - z (z the row's zero point in the step's group): the code placed in the low mantissa bits of
           bf16 128.0 (one lop3 a pair), then one fma.rn.bf16x2 adding -(128 + z); the group's scale applies to the
           step's partial product (``gemm_wo_mma``), so the activations need no row sums.
    mxfp4  e2m1(code) * 2^(s - 127) * 2^-64 (s the word's e8m0 scale byte): the magnitude bits to bf16 bits 6-8
           and the sign to bit 15 (e2m1 * 2^-126; the code 0.5 a bf16 subnormal, which bf16x2 arithmetic keeps),
           then one fma.rn.bf16x2 by 2^(s - 65). Exact for s in 66 .. 192 (scales 2^-61 .. 2^65); the kernel
           multiplies its float32 accumulator by X_SCALE = 2^64 at the end (products below 2^-126 in float32, i.e.
           |w x| < 2^-62, are lost: far below the bf16 rounding of any output they could change). The bits placed
           by a multiply (session 29): the pair's two nibbles masked, one multiply by 2^6 + 2^12 copying each to
           bits 6-9 and 12-15, one mask keeping bits 6-8 of the first copy and the sign of the second; each group
           decoded apart with its scale broadcast along its words (``mxfp4_mul_operand``). (Session 28's placement,
           two shifts, an and and a lop3 a pair, read 1.5-1.7x slower on the H200 in sessions 29 and 31: removed.)
int8 (SCHEME 0): a thread holds two words of a k32 block (j = 8b + 2q + e, e = h: 8 contiguous bytes), each operand
register values t and t + 2 of one word (the bytes at bits 8t and 8t + 16):
    PAIRS 1  logical k = 32 b + 16 e + 8 t + 2 q + p;  PAIRS 2  logical k = 32 b + 16 e + 4 q + 2 t + p
hold value t + 2p of word 8b + 2q + e, activation column 32 b + 8 q + 4 e + 2 p + t. Value: the code itself (exact in
bf16; the row's scale applies to the accumulator), made as (128 + low 7 bits) + (-128 or -256 by the sign bit): two
lop3 and one bf16x2 fma for two weights, plus one shift a word.
FAST (the launch's ASM: NVIDIA sm_80+, compiled) with bf16: the inline PTX, one instance a word and pair (pack 1:
its meaning does not depend on the register layout); else the float twin (``_twin``: the interpreter, fp16, float32
with UPCAST), the same values.
"""

import triton
import triton.language as tl

X_SCALE = tl.constexpr(1.8446744073709552e19)  # 2^64: the mxfp4 accumulator's factor (``gemm_wo_mma._finish``)
MULT_BIAS = tl.constexpr(127 - 65)  # the bf16 / float32 exponent field of 2^(s - 65) is s + MULT_BIAS

# int4: $1 the word shifted right by 4t, $2 the bf16x2 bits of -(128 + z) twice -> code - z of values t, t + 4
_INT4_PAIR_ASM = tl.constexpr("""{
.reg .b32 a, one;
lop3.b32 a, $1, 0x000F000F, 0x43004300, 0xEA;
mov.b32 one, 0x3F803F80;
fma.rn.bf16x2 $0, a, one, $2;
}""")
# mxfp4 by a multiply: $1 the word (values t, t + 4 for t = 0, 1) or the word >> 8 (t = 2, 3), the pair's
# two nibbles masked clean, one multiply by 2^6 + 2^12 (t even; odd: 2^2 + 2^8, the nibbles 4 bits higher) copying
# each nibble to bits 6-9 and 12-15 of its half (no carries: the copies do not overlap), the magnitude of the first
# copy and the sign of the second kept, then the fma as above


def _mxfp4_mul_asm(nibbles: str, multiplier: str) -> str:
    """The PTX above for the nibbles under the mask ``nibbles``, copied by the multiply ``multiplier``."""
    return f"""{{
.reg .b32 a, z;
and.b32 a, $1, {nibbles};
mul.lo.u32 a, a, {multiplier};
and.b32 a, a, 0x81C081C0;
mov.b32 z, 0x80008000;
fma.rn.bf16x2 $0, a, $2, z;
}}"""


_MXFP4_MUL_EVEN_ASM = tl.constexpr(_mxfp4_mul_asm("0x000F000F", "0x1040"))
_MXFP4_MUL_ODD_ASM = tl.constexpr(_mxfp4_mul_asm("0x00F000F0", "0x104"))
# int8: $1 the word shifted right by 8t -> the signed bytes at bits 0 and 16 as bf16x2: 128 + (b & 127) from one lop3,
# -128 - 128 * (b >> 7) (bf16 0xC300, 0xC380) from another, summed exactly
_INT8_PAIR_ASM = tl.constexpr("""{
.reg .b32 a, b, one;
lop3.b32 a, $1, 0x007F007F, 0x43004300, 0xEA;
lop3.b32 b, $1, 0x00800080, 0xC300C300, 0xEA;
mov.b32 one, 0x3F803F80;
fma.rn.bf16x2 $0, a, one, b;
}""")


@triton.jit
def _halves(o, DTYPE: tl.constexpr):
    """int32 [BN, BKW] holding a bf16x2 pair -> [BN, BKW, 2] bf16 (low half first)."""
    lo = o.to(tl.int16).to(DTYPE, bitcast=True)
    hi = (o >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _twin(w, s, T: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr):
    """Value T of each word of w int32 in DTYPE, through float32 (s, w's shape: int4 the rows' zero points, mxfp4
    the words' e8m0 bytes)."""
    code = (w >> (4 * T)) & 0xF
    if SCHEME == 1:
        value = (code - s).to(tl.float32)
    else:
        placed = (((code & 7) << 22) | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # e2m1 * 2^-126
        value = placed * ((s + MULT_BIAS) << 23).to(tl.float32, bitcast=True)  # * 2^(s - 65)
    return value.to(DTYPE)


@triton.jit
def _pair(w, c, t: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr, FAST: tl.constexpr):
    """Values t and t + 4 of each word of w [BN, b, q] -> [BN, b, q, 2] DTYPE. c (w's shape): with FAST and bf16 (int4
    only: mxfp4's PTX is ``mxfp4_mul_operand``'s) the PTX's constant, the bf16x2 bits of -(128 + z), else ``_twin``'s
    s."""
    if FAST and DTYPE == tl.bfloat16:
        o = tl.inline_asm_elementwise(_INT4_PAIR_ASM, "=r,r,r", [w >> (4 * t), c], dtype=tl.int32, is_pure=True,
                                      pack=1)
        pair = _halves(o, DTYPE)
    else:
        pair = tl.join(_twin(w, c, t, DTYPE, SCHEME), _twin(w, c, t + 4, DTYPE, SCHEME))
    return pair


@triton.jit
def _mxfp4_mul_pair(w, c, t: tl.constexpr):
    """mxfp4 values t and t + 4 of each word of w as bf16x2 bits (int32), by the multiply; c: 2^(s - 65) twice
    as bf16x2 bits. The word >> 8 (t >= 2) is made once for both of its pairs (the same expression)."""
    src = w
    if t >= 2:
        src = w >> 8
    if t % 2 == 0:
        o = tl.inline_asm_elementwise(_MXFP4_MUL_EVEN_ASM, "=r,r,r", [src, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        o = tl.inline_asm_elementwise(_MXFP4_MUL_ODD_ASM, "=r,r,r", [src, c], dtype=tl.int32, is_pure=True, pack=1)
    return o


@triton.jit
def _int8_pair(w, t: tl.constexpr, DTYPE: tl.constexpr, FAST: tl.constexpr):
    """Values t and t + 2 of each int8 word of w [BN, b, q, e] -> [BN, b, q, e, 2] DTYPE (the signed bytes)."""
    if FAST and DTYPE == tl.bfloat16:
        o = tl.inline_asm_elementwise(_INT8_PAIR_ASM, "=r,r", [w >> (8 * t)], dtype=tl.int32, is_pure=True, pack=1)
        pair = _halves(o, DTYPE)
    else:
        pair = tl.join(((w << (24 - 8 * t)) >> 24).to(tl.float32).to(DTYPE),
                       ((w << (8 - 8 * t)) >> 24).to(tl.float32).to(DTYPE))
    return pair


@triton.jit
def _int8_operand(w, BN: tl.constexpr, BKW: tl.constexpr, DTYPE: tl.constexpr, FAST: tl.constexpr,
                  PAIRS: tl.constexpr):
    """int8 words w [BN, BKW] (BKW a multiple of 8) -> [BN, 4 * BKW] DTYPE in the int8 MMA order (module doc)."""
    w = tl.reshape(w, (BN, BKW // 8, 4, 2))  # [BN, b, q, e]
    d = tl.join(_int8_pair(w, 0, DTYPE, FAST), _int8_pair(w, 1, DTYPE, FAST))  # [BN, b, q, e, p, t]
    if PAIRS == 2:
        d = tl.permute(d, (0, 1, 3, 2, 5, 4))  # [BN, b, e, q, t, p]
    else:
        d = tl.permute(d, (0, 1, 3, 5, 2, 4))  # [BN, b, e, t, q, p]
    return tl.reshape(d, (BN, 4 * BKW))


@triton.jit
def weight_operand(w, s, BN: tl.constexpr, BKW: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr,
                   FAST: tl.constexpr, PAIRS: tl.constexpr = 1):
    """The step's words w [BN, BKW] int32 -> the MMA operand in DTYPE: int4 / mxfp4 (BKW a multiple of 4) [BN, 8 * BKW]
    (``_nibble_operand``), int8 (SCHEME 0, BKW a multiple of 8; s unused) [BN, 4 * BKW] (``_int8_operand``)."""
    if SCHEME == 0:
        d = _int8_operand(w, BN, BKW, DTYPE, FAST, PAIRS)
    else:
        d = _nibble_operand(w, s, BN, BKW, DTYPE, SCHEME, FAST, PAIRS)
    return d


@triton.jit
def _nibble_operand(w, s, BN: tl.constexpr, BKW: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr,
                    FAST: tl.constexpr, PAIRS: tl.constexpr = 1):
    """4-bit words w [BN, BKW] int32 (BKW a multiple of 4) -> [BN, 8 * BKW] DTYPE in the MMA order. s: int4 the
    rows' zero points [BN, 1], mxfp4 the groups' e8m0 bytes [BN, BKW / 4] (int32); FAST only takes effect with
    DTYPE bf16 (mxfp4: ``mxfp4_mul_operand``; int4: the PTX's constant made once a row). The words are taken as
    [BN, b, q] (word j = 4b + q) and the constants as [BN, b or 1, 1], so a group's constant meets its words without
    a layout change."""
    if SCHEME == 2 and FAST and DTYPE == tl.bfloat16:
        return mxfp4_mul_operand(w, s, BN, PAIRS, DTYPE, True)
    if FAST and DTYPE == tl.bfloat16:  # int4
        c = (-128.0 - s.to(tl.float32)).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        c = c | (c << 16)
    else:
        c = s
    w = tl.reshape(w, (BN, BKW // 4, 4))  # [BN, b, q]
    c = tl.broadcast_to(c[:, :, None], w.shape)
    v0 = _pair(w, c, 0, DTYPE, SCHEME, FAST)  # [BN, b, q, p]
    v1 = _pair(w, c, 1, DTYPE, SCHEME, FAST)
    v2 = _pair(w, c, 2, DTYPE, SCHEME, FAST)
    v3 = _pair(w, c, 3, DTYPE, SCHEME, FAST)
    d = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [BN, b, q, p, g, h]: t = 2h + g
    if PAIRS == 2:
        d = tl.permute(d, (0, 1, 5, 2, 4, 3))  # [BN, b, h, q, g, p]
    else:
        d = tl.permute(d, (0, 1, 5, 4, 2, 3))  # [BN, b, h, g, q, p]
    return tl.reshape(d, (BN, 8 * BKW))


@triton.jit
def _mxfp4_group(w, s, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """One group's words w [BN, q] and e8m0 bytes s [BN] -> [BN, q, p, g, h] DTYPE (value t = 2h + g + 4p of word
    q). ASM: the PTX, its bf16x2 scale 2^(s - 65) twice by one multiply-add ((s + 62) << 7 in each half; s <= 193:
    no carry); else ``_twin``'s float32 values."""
    if ASM:
        c = (s * 0x00800080 + (MULT_BIAS * 0x00800080))[:, None]
        v0 = _halves(_mxfp4_mul_pair(w, c, 0), DTYPE)  # [BN, q, p]
        v1 = _halves(_mxfp4_mul_pair(w, c, 1), DTYPE)
        v2 = _halves(_mxfp4_mul_pair(w, c, 2), DTYPE)
        v3 = _halves(_mxfp4_mul_pair(w, c, 3), DTYPE)
    else:
        v0 = tl.join(_twin(w, s[:, None], 0, DTYPE, 2), _twin(w, s[:, None], 4, DTYPE, 2))
        v1 = tl.join(_twin(w, s[:, None], 1, DTYPE, 2), _twin(w, s[:, None], 5, DTYPE, 2))
        v2 = tl.join(_twin(w, s[:, None], 2, DTYPE, 2), _twin(w, s[:, None], 6, DTYPE, 2))
        v3 = tl.join(_twin(w, s[:, None], 3, DTYPE, 2), _twin(w, s[:, None], 7, DTYPE, 2))
    return tl.join(tl.join(v0, v1), tl.join(v2, v3))


@triton.jit
def mxfp4_mul_operand(w, s, BN: tl.constexpr, PAIRS: tl.constexpr, DTYPE: tl.constexpr, ASM: tl.constexpr):
    """mxfp4 by the multiply (the launch's ASM): a dot's words w [BN, 16] int32 and their groups' e8m0 bytes s
    [BN, 4] -> [BN, 128] DTYPE in the MMA order, each group b = 2 b1 + b0 decoded apart (split out of the words and
    bytes along b): its scale a [BN] vector broadcast along the words, as int4's zero point, so Triton lays the decode
    out as the MMA reads it (a [BN, 4, 1] scale put the operand through shared memory at BLOCK_K 128, sm_90 SASS:
    3.89 / 4.38 instructions a weight, gate-up / down, against 3.27 / 3.70 so). ASM False: ``_twin``'s values (the
    interpreter's order test)."""
    wb = tl.permute(tl.reshape(w, (BN, 2, 2, 4)), (0, 3, 1, 2))  # [BN, q, b1, b0]
    w0, w1 = tl.split(wb)  # [BN, q, b1] at b0 = 0, 1
    w00, w10 = tl.split(w0)  # [BN, q] at (b1, b0) = (0, 0), (1, 0)
    w01, w11 = tl.split(w1)
    s0, s1 = tl.split(tl.reshape(s, (BN, 2, 2)))  # [BN, b1] at b0 = 0, 1
    s00, s10 = tl.split(s0)
    s01, s11 = tl.split(s1)
    d = tl.join(tl.join(_mxfp4_group(w00, s00, DTYPE, ASM), _mxfp4_group(w01, s01, DTYPE, ASM)),
                tl.join(_mxfp4_group(w10, s10, DTYPE, ASM), _mxfp4_group(w11, s11, DTYPE, ASM)))
    # d: [BN, q, p, g, h, b0, b1]
    if PAIRS == 2:
        d = tl.permute(d, (0, 6, 5, 4, 1, 3, 2))  # [BN, b1, b0, h, q, g, p]
    else:
        d = tl.permute(d, (0, 6, 5, 4, 3, 1, 2))  # [BN, b1, b0, h, g, q, p]
    return tl.reshape(d, (BN, 128))


@triton.jit
def x_operand(x, BM: tl.constexpr, BKW: tl.constexpr, PAIRS: tl.constexpr = 1, SCHEME: tl.constexpr = 1):
    """The step's activations x [BM, 8 * BKW] (columns in order) -> the MMA order (column 32b + 8q + 4p + 2h + g
    to logical k = 32b + 16h + 8g + 2q + p); SCHEME 0 (int8 words: x [BM, 4 * BKW]) the int8 order (module doc:
    column 32b + 8q + 4e + 2p + t to logical k = 32b + 16e + 8t + 2q + p, PAIRS 2 32b + 16e + 4q + 2t + p)."""
    if SCHEME == 0:
        x = tl.reshape(x, (BM, BKW // 8, 4, 2, 2, 2))  # [BM, b, q, e, p, t]
        if PAIRS == 2:
            x = tl.permute(x, (0, 1, 3, 2, 5, 4))  # [BM, b, e, q, t, p]
        else:
            x = tl.permute(x, (0, 1, 3, 5, 2, 4))  # [BM, b, e, t, q, p]
        x = tl.reshape(x, (BM, 4 * BKW))
    else:
        x = tl.reshape(x, (BM, BKW // 4, 4, 2, 2, 2))  # [BM, b, q, p, h, g]
        if PAIRS == 2:
            x = tl.permute(x, (0, 1, 4, 2, 5, 3))  # [BM, b, h, q, g, p]
        else:
            x = tl.permute(x, (0, 1, 4, 5, 2, 3))  # [BM, b, h, g, q, p]
        x = tl.reshape(x, (BM, 8 * BKW))
    return x

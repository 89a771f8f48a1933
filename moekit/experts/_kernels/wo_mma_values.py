"""The word MMA decode's values (``gemm_wo_mma``): each 32-bit word of packed 4-bit weights (element t in bits
4t .. 4t+3) -> its eight values as 16-bit MMA operands, by placing bits: inline PTX on NVIDIA GPUs (ASM, bf16:
two words at a time, pack 2, so value T of both words forms one bf16x2 register, the MMA operand's pair; prmt puts
byte T/2 of each word in bytes 0 and 2), else the same placement in Triton (``_twin``: the interpreter, fp16,
float32 with UPCAST). Exact:
    int4   128 + code (the code in the low mantissa bits of 128.0: one lop3 a pair, a shift for the high nibbles);
           the group's scale and zero point apply to the step's partial product (``gemm_wo_mma``).
    mxfp4  e2m1(code) * 2^(s - 127) * 2^-64, s the word's e8m0 scale byte (the weight itself, times
           2^-64; the activations are scaled by X_SCALE = 2^64 so each product is w * x): the magnitude bits to
           bf16 bits 6-8 and the sign to bit 15 (e2m1 * 2^-126; the code 0.5 a bf16 subnormal, which bf16x2
           arithmetic keeps), then one fma.rn.bf16x2 by 2^(s - 65) plus -0. Exact for s in 66 .. 192 (scales
           2^-61 .. 2^65; the gemv's 2^64 bound on |x| too): outside, the multiplier or the value leaves bf16's
           normal range. No default picks this decode for mxfp4 (it is only selectable: ``decode="mma"``).
"""

import triton
import triton.language as tl

X_SCALE = tl.constexpr(1.8446744073709552e19)  # 2^64: the mxfp4 activations' factor (``gemm_wo_gemv``'s too)
MULT_BIAS = tl.constexpr(127 - 65)  # the bf16 / float32 exponent field of 2^(s - 65) is s + MULT_BIAS

# int4: two words ($8, $9) -> value T of both as one bf16x2 ($T: word $8 low half, $9 high half), 128 + code.
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


def _mxfp4_byte(byte: int) -> str:
    """PTX for byte ``byte`` of both words: values 2 byte (low nibble) and 2 byte + 1 (high) into $2b, $2b+1."""
    out = f"prmt.b32 t, $8, $9, 0x0{4 + byte}0{byte};\n"
    for half, (mag, sign) in enumerate(((6, 12), (2, 8))):
        out += (f"shl.b32 u, t, {mag};\nshl.b32 g, t, {sign};\nand.b32 g, g, 0x80008000;\n"
                f"lop3.b32 u, u, 0x01C001C0, g, 0xEA;\nfma.rn.bf16x2 ${2 * byte + half}, u, c, z;\n")
    return out


# mxfp4: words $8, $9 and their multipliers' bf16 bits $10, $11 (low halves) -> value T of both as one bf16x2.
_MXFP4_PAIR_ASM = tl.constexpr("{\n.reg .b32 t, u, g, c, z;\nprmt.b32 c, $10, $11, 0x5410;\nmov.b32 z, 0x80008000;\n"
                               + "".join(_mxfp4_byte(b) for b in range(4)) + "}")


@triton.jit
def _twin(w, s, T: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr):
    """Value T of each word of w [BN, BKW] int32 (s [BN, BKW] int32 its e8m0 scale, mxfp4) in DTYPE."""
    code = (w >> (4 * T)) & 0xF
    if SCHEME == 1:
        if DTYPE == tl.bfloat16:
            value = (code.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        else:
            value = (code + 128).to(tl.float32).to(DTYPE)
    else:
        placed = (((code & 7) << 22) | ((code & 8) << 28)).to(tl.float32, bitcast=True)  # e2m1 * 2^-126
        value = (placed * ((s + MULT_BIAS) << 23).to(tl.float32, bitcast=True)).to(DTYPE)  # * 2^(s - 65)
    return value


@triton.jit
def pair_values(w, s, DTYPE: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr):
    """The eight values (T = 0..7) of each word of w [BN, BKW] int32 in DTYPE (module docstring; s [BN, BKW]
    int32: each word's e8m0 scale byte for mxfp4, unread for int4)."""
    if ASM and DTYPE == tl.bfloat16:
        if SCHEME == 1:
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                _INT4_PAIR_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            m = (s + MULT_BIAS) << 7  # the bf16 bits of 2^(s - 65)
            v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
                _MXFP4_PAIR_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w, m], dtype=(tl.bfloat16,) * 8, is_pure=True,
                pack=2)
    else:
        v0, v1, v2, v3 = _twin(w, s, 0, DTYPE, SCHEME), _twin(w, s, 1, DTYPE, SCHEME), _twin(w, s, 2, DTYPE, SCHEME), \
            _twin(w, s, 3, DTYPE, SCHEME)
        v4, v5, v6, v7 = _twin(w, s, 4, DTYPE, SCHEME), _twin(w, s, 5, DTYPE, SCHEME), _twin(w, s, 6, DTYPE, SCHEME), \
            _twin(w, s, 7, DTYPE, SCHEME)
    return v0, v1, v2, v3, v4, v5, v6, v7

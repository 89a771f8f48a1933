"""Inline-PTX text that places an mxfp4 (e2m1) code's bits, the piece the register decode (``gemm_wo_reg``) and the
word decode (``wo_words``) both repeat once per value: the magnitude bits (code & 7) and the sign bit (code & 8) of a
nibble shifted to where the output format wants them, then one lop3 that keeps the magnitude under its mask and ors in
the sign. Plain Python building strings (the kernels' ``tl.constexpr`` text is the same, character for character, as
the hand-written lines it replaced); no ``@triton.jit`` code here.
"""


def shifted(dst: str, src: str, shift: int) -> str:
    """A PTX line dst = src << shift, or src >> -shift (logical) for a negative shift."""
    if shift >= 0:
        return f"shl.b32 {dst}, {src}, {shift};\n"
    return f"shr.u32 {dst}, {src}, {-shift};\n"


def e2m1_place(out: str, word: str, magnitude_shift: int, sign_shift: int, magnitude_mask: str, sign_mask: str) -> str:
    """PTX lines: out = (word shifted by magnitude_shift) & magnitude_mask | (word shifted by sign_shift) & sign_mask,
    through the scratch registers m and g (the caller declares them); a sign shift of 0 masks the word itself."""
    if sign_shift == 0:
        sign = f"and.b32 g, {word}, {sign_mask};\n"
    else:
        sign = shifted("g", word, sign_shift) + f"and.b32 g, g, {sign_mask};\n"
    return shifted("m", word, magnitude_shift) + sign + f"lop3.b32 {out}, m, {magnitude_mask}, g, 0xEA;\n"

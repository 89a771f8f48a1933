"""The mxfp4 decode of the words loop (decode "gluon_words" on mxfp4, issue #16 target 1, session 46): each int32 word
of the checkpoint's packing (eight e2m1 codes, low nibble first, as int4's) decoded where it lies into four bf16x2
pairs, pair t = (code t, code t + 4): the same pairs as int4's ``gluon_wo_words._WORD_ASM``, so the same dot order,
the same activations (``x_words``) and the same renaming into the MMA operand.

    pair t: the code's magnitude bits (e1 e0 m) to bf16 bits 6..8 and its sign to bit 15 (each half): the value
    times 2^-126 (code 1, 0.5, a bf16 subnormal), then one fma.rn.bf16x2 by M = 2^(s - 1) plus -0: the value times
    the group's e8m0 factor 2^(s - 127), exactly (a power of two; bf16x2 arithmetic keeps subnormals, sm_80+).

Per word: 7 shifts, 8 lop3 / and (``e2m1_ptx.e2m1_place``: magnitude and sign) and 4 HFMA2. M is per thread and half
step: in the words' dot order a thread's words of a half step are the 32 columns 128 c + 32 q .. + 32 (module doc of
``gluon_wo_words``), exactly one mxfp4 group, so the scale is applied in the decode and the MMA accumulates across
groups with no partials. M is a normal bf16 for s <= MX_MAX_SCALE (2^(s - 1) <= 2^127); the host
refuses larger scales by name (``triton_wo_words.check_mx_scales``): a group whose weights reach 12.

Shapes: words [R, 32] int32 (a step of R rows), scales uint8 [R, K / 32] by row pointer. Torch twin of the bit
operations: ``triton_wo_words.mx_pairs_torch``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from moekit.experts._kernels.e2m1_ptx import e2m1_place

MX_GROUP = 32  # columns a scale
MX_MAX_SCALE = 128  # the largest e8m0 byte whose M = 2^(s - 1) is a normal bf16 (exponent field s + 126 <= 254)
MAGNITUDE_MASK, SIGN_MASK = 0x01C001C0, 0x80008000  # bf16x2 bits 6..8 and 15 of each half
# pair t's shifts of the word: its magnitude bits (code t at bits 4t..4t+2) to 6..8, its sign (4t + 3) to 15
MX_SHIFTS = tuple((6 - 4 * t, 12 - 4 * t) for t in range(4))
M_FIELDS = 0x00800080  # s + 126 times this: the bf16x2 of 2^(s - 1) in both halves
_M_FIELDS = gl.constexpr(M_FIELDS)

# $0..$3: pairs t = 0..3 of the word $4, times $5 (bf16x2 M) plus $6 (bf16x2 -0, in a register)
_MX_ASM = gl.constexpr("{\n.reg .b32 m, g;\n" + "".join(
    e2m1_place("m", "$4", magnitude, sign, hex(MAGNITUDE_MASK), hex(SIGN_MASK)) + f"fma.rn.bf16x2 ${t}, m, $5, $6;\n"
    for t, (magnitude, sign) in enumerate(MX_SHIFTS)) + "}")


@gluon.jit
def mx_multipliers(words, sc_rows, col, row_ok, num_warps: gl.constexpr):
    """The bf16x2 M = 2^(s - 1) of each word of a step at column ``col`` (int32, the words' shape [R, 32] and layout:
    thread (g, q) words 4q .. 4q + 3 and 16 + 4q .. of its rows): ``sc_rows`` [R] each row's e8m0 scales, in the
    words' row layout. Word i lies in group (col + 8 i) / 32: the step's 8 groups a row are loaded once (a thread its
    two, q and 4 + q), M made once a group, then repeated over its 4 words in registers (a renaming)."""
    R: gl.constexpr = words.type.shape[0]
    per_word: gl.constexpr = gl.BlockedLayout([1, 1, 4], [8, 4, 1], [num_warps, 1, 1], [2, 1, 0])
    groups: gl.constexpr = gl.SliceLayout(2, per_word)  # [R, 8]: the words' lanes and warps, one group a register
    rows = gl.convert_layout(sc_rows, gl.SliceLayout(1, groups))
    ok = gl.convert_layout(row_ok, gl.SliceLayout(1, groups))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, groups))
    s = gl.load(rows[:, None] + (col // 32 + g)[None, :], mask=ok[:, None], other=0)
    mul = (s.to(gl.int32) + 126) * _M_FIELDS  # [R, 8]
    mul = gl.expand_dims(mul, 2) + gl.zeros([R, 8, 4], gl.int32, per_word)  # [R, group, word in the group]
    return gl.convert_layout(gl.reshape(mul, [R, 32]), words.type.layout)


@gluon.jit
def mx_pairs(words, mul, negzero):
    """words [R, C] int32 and their multipliers (``mx_multipliers``) -> the four bf16x2 pairs of each word (int32;
    pair t: codes t and t + 4, decoded and scaled)."""
    return gl.inline_asm_elementwise(_MX_ASM, "=r,=r,=r,=r,r,r,r", [words, mul, negzero],
                                     dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)

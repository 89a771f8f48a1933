"""The int4 decode gate-up on Gluon with the packed words loaded straight into mma.sync's register operand (decode
"gluon_words", issue #16 target 1, session 45): no shared memory, no cp.async / TMA ring for the weights.

    h[a, j] = silu(x[t(a)] . w_gate[e(a), j]) * (x[t(a)] . w_up[e(a), j])       a: an assignment, t(a) = a // k

A warp owns 8 gate rows and their 8 up rows: the 16 rows of one ``mma.sync m16n8k16`` A operand (weight rows as M,
the block's tokens as N = 8 or 16), gate row i at operand row i and up row i at i + 8, so a thread's accumulator
holds the gate sum and the up sum of the same output (mma C rows g and g + 8) and the SiLU-and-mul moves nothing.
A program is ``num_warps`` such warps (8 num_warps gate rows of one expert) over the whole reduction, on one block of
BM rows of the block-aligned layout (NAIVE: assignment pid_m alone, the tiny-batch shortcut).

The words: a step is 32 int32 words of each row (256 columns, 128 bytes a row), loaded in the operand layout of
``k_width`` 4 on the [16 num_warps, 32] word tile: thread (g, q) of a warp (lane 4 g + q) holds words 4q .. 4q + 3
and 16 + 4q .. 16 + 4q + 3 of rows g and g + 8 (two LDG.128 a row), issued one step ahead in registers. Each word
decodes where it lies (``_WORD_ASM``: three shifts and four lop3 for eight weights, 128 + code as bf16, exact) and
the halves are put in the order of the bf16 operand layout (``k_width`` 2) by reshape / permute / split only, so the
``convert_layout`` to it is a register renaming (no SHFL, no STS / LDS: ``benchmarks/w4g45_sass_cpu.py``). The dot's
reduction order is free: within a step, dot column d (bits p = d0, q0 = d1, q1 = d2, g = d3, h = d4, j0 = d5,
j1 = d6, c = d7) holds value T = g + 2 h + 4 p of word 16 c + 4 q + j, i.e. the weight's column

    phys(d) = 128 c + 32 q + 8 j + 4 p + 2 h + g          (``triton_wo_words.dot_columns`` is its torch form)

and the activations come in that order too, stored so each thread's B fragment is contiguous (``x_words``: column
m = 64 (d1 + 2 d2) + d0 + 2 d3 + 4 d4 + 8 d5 + 16 d6 + 32 d7 of a 256-column step holds x[phys(d)]; 8 LDG.128 a
step, loaded in a blocked layout and renamed into the B operand the same way).

int4 with groups of a multiple of 128 columns: d7 = c is column bit 7, so each half step [128 c, 128 c + 128) lies
in one group. Its dot starts from zero and is corrected and scaled on the float32 partial:

    acc += scale * (sum_d (128 + code) x  -  (128 + zero) * xsum)    xsum: the half step's sum of x (float32)

(``xsum`` made with x_words on the host: one [M, K / 128] tensor). No bf16 fma in the decode: the code's bf16 is its
value plus 128, exact, and the zero point's term is one FFMA a partial element.

Shapes: A = M*k assignments, E experts, N intermediate, K hidden (a multiple of 256), W = num_warps, BM tokens a
block. Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch`` (this launch's h: ``triton_wo_words``).
Gluon does not run in the interpreter (CUDA sm_80+ only).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from moekit.experts._kernels.words_glu import store_h, stored_column  # noqa: F401  (stored_column: re-exported)
from moekit.experts._kernels.words_mx import mx_multipliers, mx_pairs

STEP_WORDS = gl.constexpr(32)  # words of a row a step: 256 int4 columns, 128 bytes
STEP = gl.constexpr(256)  # columns a step

# $0..$3: values (t, t + 4) of the word $4 for t = 0..3 as bf16x2 bits of 128 + code; $5 0x43004300 (bf16x2 128.0,
# a runtime value so ptxas keeps it in a register)
_WORD_ASM = gl.constexpr("""{
.reg .b32 a, b, c;
shr.u32 a, $4, 4;
shr.u32 b, $4, 8;
shr.u32 c, $4, 12;
lop3.b32 $0, $4, 0x000F000F, $5, 0xEA;
lop3.b32 $1, a, 0x000F000F, $5, 0xEA;
lop3.b32 $2, b, 0x000F000F, $5, 0xEA;
lop3.b32 $3, c, 0x000F000F, $5, 0xEA;
}""")


# $0..$3: values (t, t + 4) of the word $4 for t = 0..3 minus the row's zero point, bf16x2: 128 + code from the lop3
# with $5 (0x43004300), then one fma by $7 (bf16x2 1.0) adding $6 = -(128 + zero) twice (exact: integers -15..15)
_EXACT_ASM = gl.constexpr("""{
.reg .b32 a, b, c, t0, t1, t2, t3;
shr.u32 a, $4, 4;
shr.u32 b, $4, 8;
shr.u32 c, $4, 12;
lop3.b32 t0, $4, 0x000F000F, $5, 0xEA;
lop3.b32 t1, a, 0x000F000F, $5, 0xEA;
lop3.b32 t2, b, 0x000F000F, $5, 0xEA;
lop3.b32 t3, c, 0x000F000F, $5, 0xEA;
fma.rn.bf16x2 $0, t0, $7, $6;
fma.rn.bf16x2 $1, t1, $7, $6;
fma.rn.bf16x2 $2, t2, $7, $6;
fma.rn.bf16x2 $3, t3, $7, $6;
}""")


@gluon.jit
def _halves(o):
    """int32 [R, C] holding bf16x2 -> bf16 [R, C, 2] (the low half first)."""
    lo = o.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (o >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _operand_halves(o0, o1, o2, o3, a_layout: gl.constexpr):
    """A step's words [R, 32] (the k_width-4 operand layout) decoded as bf16x2 pairs o_t = values (t, t + 4) of each
    word (int32, the words' shape) -> its two half steps c = 0, 1 as the bf16 A operand [R, 128] each (dot order:
    module doc). int4: o_t from ``_WORD_ASM`` (128 + code); mxfp4: from ``words_mx.mx_pairs``."""
    R: gl.constexpr = o0.type.shape[0]
    v = gl.join(gl.join(_halves(o0), _halves(o1)), gl.join(_halves(o2), _halves(o3)))  # [R, 32, p, g, h]
    v = gl.reshape(v, [R, 2, 2, 2, 2, 2, 2, 2, 2])  # [R, c, q1, q0, j1, j0, p, g, h]
    v = gl.permute(v, [0, 4, 5, 8, 7, 2, 3, 6, 1])  # [R, j1, j0, h, g, q1, q0, p, c]
    lo, hi = gl.split(gl.reshape(v, [R, 128, 2]))
    return gl.convert_layout(lo, a_layout), gl.convert_layout(hi, a_layout)


@gluon.jit
def _exact_half(words, zc, magic, one):
    """One half step's words [R, 16] (word 4 q + j, the load's rows) and the rows' -(128 + zero) as bf16x2 bits [R]
    -> code - zero [R, 128] bf16 in the dot order (module doc), still in the load's rows."""
    R: gl.constexpr = words.type.shape[0]
    zc = gl.convert_layout(zc, gl.SliceLayout(1, words.type.layout))  # the same rows a thread: a renaming
    o0, o1, o2, o3 = gl.inline_asm_elementwise(_EXACT_ASM, "=r,=r,=r,=r,r,r,r,r", [words, magic, zc[:, None], one],
                                               dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    v = gl.join(gl.join(_halves(o0), _halves(o1)), gl.join(_halves(o2), _halves(o3)))  # [R, 16, p, g, h]
    v = gl.reshape(v, [R, 2, 2, 2, 2, 2, 2, 2])  # [R, q1, q0, j1, j0, p, g, h]
    return gl.reshape(gl.permute(v, [0, 3, 4, 7, 6, 1, 2, 5]), [R, 128])  # [R, j1, j0, h, g, q1, q0, p]


@gluon.jit
def exact_halves(words, zc0, zc1, magic, one, num_warps: gl.constexpr, a_layout: gl.constexpr):
    """A step's words [R, 32] as loaded and the rows' -(128 + zero) bf16x2 of each half step's group (zc0, zc1 [R]
    in the load's row layout) -> the two half steps' A operands [R, 128] (code - zero, exact; no x sums needed)."""
    R: gl.constexpr = words.type.shape[0]
    w0, w1 = gl.split(gl.permute(gl.reshape(words, [R, 2, 16]), [0, 2, 1]))  # half steps c = 0, 1: words 16 c + ..
    a0 = gl.convert_layout(operand_rows(_exact_half(w0, zc0, magic, one), num_warps), a_layout)
    a1 = gl.convert_layout(operand_rows(_exact_half(w1, zc1, magic, one), num_warps), a_layout)
    return a0, a1


@gluon.jit
def x_halves(xp, b_layout: gl.constexpr):
    """A step's activations as int32 bf16 pairs [BM, 128] in the stored order (module doc) -> the B operand
    [128, BM] of each half step. (Carried through the loop as int32: as bf16 the loop-carried halves cost a PRMT
    each, sm_90 SASS.)"""
    BM: gl.constexpr = xp.type.shape[0]
    v = gl.reshape(_halves(xp), [BM, 2, 2, 2, 2, 2, 2, 2, 2])  # [n, d2, d1, d7, d6, d5, d4, d3, d0]
    v = gl.permute(v, [4, 5, 6, 7, 1, 2, 8, 0, 3])  # [d6, d5, d4, d3, d2, d1, d0, n, d7]
    lo, hi = gl.split(gl.reshape(v, [128, BM, 2]))
    return gl.convert_layout(lo, b_layout), gl.convert_layout(hi, b_layout)


@gluon.jit
def operand_rows(t, W: gl.constexpr):
    """A loaded tile [16 W, C] (tile row 8 W v + 8 w + g) -> operand rows 16 w + 8 v + g: the MMA operand layouts'
    lanes and warps (a renaming)."""
    C: gl.constexpr = t.type.shape[1]
    return gl.reshape(gl.permute(gl.reshape(t, [2, W, 8, C]), [1, 0, 2, 3]), [16 * W, C])


@gluon.jit
def _group_terms(s_rows, z_rows, xs_rows, col, row_ok, tok_ok, GROUP: gl.constexpr):
    """The half step at column ``col``: its group's scales [R] and 128 + zero points [R] (float32) of the rows, and the
    tokens' sums of x over its 128 columns [BM]."""
    g = col // GROUP
    scale = gl.load(s_rows + g, mask=row_ok, other=0.0)
    zero = gl.load(z_rows + g, mask=row_ok, other=0).to(gl.float32) + 128.0
    xsum = gl.load(xs_rows + col // 128, mask=tok_ok, other=0.0)
    return scale, zero, xsum


@gluon.jit
def _corrected(acc, part, scale, zero, xsum):
    """acc + scale * (part - (128 + zero) * xsum) (module doc)."""
    return acc + (part - zero[:, None] * xsum[None, :]) * scale[:, None]


@gluon.jit
def _zero_pairs(z_rows, g, row_ok):
    """The rows' -(128 + zero) of group g as bf16x2 bits (int32 [R]): 0xC300 | zero in each half."""
    z = gl.load(z_rows + g, mask=row_ok, other=0).to(gl.int32)
    return (z | (z << 16)) | -0x3CFF3D00  # 0xC300C300 as int32


@gluon.jit
def _step(acc, zeros, words, xp, col, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok, GROUP: gl.constexpr,
          DECODE: gl.constexpr, num_warps: gl.constexpr):
    """acc [R, BM] (zeros: its shape, 0) + the step at column ``col``: its words [R, 32] (as loaded) decoded, times
    its activations [BM, 128] (int32 pairs). DECODE 0: int4, 128 + code, each half step's partial
    corrected by the x sums and scaled (``_corrected``; z_rows in the accumulator's rows, as s_rows); 1: int4 exact,
    code - zero in the decode (``exact_halves``; z_rows / z_ok in the load's rows), each partial scaled; 2: mxfp4, the
    e8m0 scales in the decode (``words_mx``; z_rows / z_ok: the scales in the load's rows, magic bf16x2 -0), the MMA
    accumulating straight into acc."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc.type.layout, k_width=2)
    b0, b1 = x_halves(xp, b_layout)
    if DECODE == 2:
        mul = mx_multipliers(words, z_rows, col, z_ok, num_warps)
        o0, o1, o2, o3 = mx_pairs(operand_rows(words, num_warps), operand_rows(mul, num_warps), magic)
        a0, a1 = _operand_halves(o0, o1, o2, o3, a_layout)
        acc = mma_v2(a1, b1, mma_v2(a0, b0, acc))
    elif DECODE == 1:
        s0 = gl.load(s_rows + col // GROUP, mask=row_ok, other=0.0)
        s1 = gl.load(s_rows + (col + 128) // GROUP, mask=row_ok, other=0.0)
        zc0, zc1 = _zero_pairs(z_rows, col // GROUP, z_ok), _zero_pairs(z_rows, (col + 128) // GROUP, z_ok)
        a0, a1 = exact_halves(words, zc0, zc1, magic, one, num_warps, a_layout)
        acc += mma_v2(a0, b0, zeros) * s0[:, None]
        acc += mma_v2(a1, b1, zeros) * s1[:, None]
    else:
        s0, z0, xs0 = _group_terms(s_rows, z_rows, xs_rows, col, row_ok, tok_ok, GROUP)
        s1, z1, xs1 = _group_terms(s_rows, z_rows, xs_rows, col + 128, row_ok, tok_ok, GROUP)
        rows = operand_rows(words, num_warps)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_WORD_ASM, "=r,=r,=r,=r,r,r", [rows, magic],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
        a0, a1 = _operand_halves(o0, o1, o2, o3, a_layout)
        acc = _corrected(acc, mma_v2(a0, b0, zeros), s0, z0, xs0)
        acc = _corrected(acc, mma_v2(a1, b1, zeros), s1, z1, xs1)
    return acc


@gluon.jit
def words_loop(acc, w_ptrs, x_ptrs, steps, col0, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok,
               GROUP: gl.constexpr, DECODE: gl.constexpr, num_warps: gl.constexpr, AHEAD: gl.constexpr = 1):
    """acc + ``steps`` steps (``_step``) from column col0 (w_ptrs [R, 32] / x_ptrs [BM, 128] at its first step).
    AHEAD 1: each step's words and activations loaded a step before its decode, two steps an iteration (ping-pong
    registers: no copies), an odd last one alone. AHEAD 2: the words two steps ahead (``_loop_ahead2``). The loads
    are unmasked: every row and step lies inside the weight (the host's checks); padding rows read token 0 and are
    never stored."""
    zeros = gl.zeros_like(acc)  # each half step's dot starts from zero
    if AHEAD == 2:
        acc = _loop_ahead2(acc, zeros, w_ptrs, x_ptrs, steps, col0, magic, one, s_rows, z_rows, xs_rows, row_ok,
                           z_ok, tok_ok, GROUP, DECODE, num_warps)
    else:
        acc = _loop_ahead1(acc, zeros, w_ptrs, x_ptrs, steps, col0, magic, one, s_rows, z_rows, xs_rows, row_ok,
                           z_ok, tok_ok, GROUP, DECODE, num_warps)
    return acc


@gluon.jit
def _loop_ahead1(acc, zeros, w_ptrs, x_ptrs, steps, col0, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok,
                 GROUP: gl.constexpr, DECODE: gl.constexpr, num_warps: gl.constexpr):
    """``words_loop`` with one step in flight (session 45, w4g45: the measured form)."""
    w_a, x_a = gl.load(w_ptrs), gl.load(x_ptrs)
    for s in range(0, steps - 2, 2):
        w_b, x_b = gl.load(w_ptrs + (s + 1) * STEP_WORDS), gl.load(x_ptrs + (s + 1) * (STEP // 2))
        acc = _step(acc, zeros, w_a, x_a, col0 + s * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok,
                    GROUP, DECODE, num_warps)
        w_a, x_a = gl.load(w_ptrs + (s + 2) * STEP_WORDS), gl.load(x_ptrs + (s + 2) * (STEP // 2))
        acc = _step(acc, zeros, w_b, x_b, col0 + (s + 1) * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok,
                    tok_ok, GROUP, DECODE, num_warps)
    last = col0 + (steps - 2 + steps % 2) * STEP  # the step w_a holds
    if steps % 2 == 0:
        w_b, x_b = gl.load(w_ptrs + (steps - 1) * STEP_WORDS), gl.load(x_ptrs + (steps - 1) * (STEP // 2))
        acc = _step(acc, zeros, w_a, x_a, last, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok, GROUP,
                    DECODE, num_warps)
        acc = _step(acc, zeros, w_b, x_b, last + STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok,
                    GROUP, DECODE, num_warps)
    else:
        acc = _step(acc, zeros, w_a, x_a, last, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok, GROUP,
                    DECODE, num_warps)
    return acc


@gluon.jit
def _loop_ahead2(acc, zeros, w_ptrs, x_ptrs, steps, col0, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok,
                 GROUP: gl.constexpr, DECODE: gl.constexpr, num_warps: gl.constexpr):
    """``words_loop`` with the words of two steps in flight (session 45, w4u45; selectable, no default takes it: on an
    H100 it lost, DeepSeek-V3 int4 M = 1 115.9 against AHEAD 1's 97.6 µs, and tied at M = 8, session 47's
    ``benchmarks/results/raw/NVIDIA_H100-2026-12-07-3bdb789-w4u45-aheads.json``; kept for an H200 A/B): three steps
    an iteration, the words in a 3-way rotation (w_a, w_b, w_c: each loaded two steps before its decode) and the
    activations still one step ahead (x_a, x_b, x_c: their 32 registers a step are L2 hits, the words the HBM
    stream), so the loop carries w_a, w_b, x_a and copies nothing. Word loads past the last step are clamped to it
    (a reload of bytes just read: at most two a program); steps % 3 trailing steps run after the loop."""
    last = steps - 1
    w_a, x_a = gl.load(w_ptrs), gl.load(x_ptrs)
    w_b = gl.load(w_ptrs + gl.minimum(last, 1) * STEP_WORDS)
    for s in range(0, steps - 2, 3):  # steps s, s + 1, s + 2 all inside
        w_c, x_b = gl.load(w_ptrs + (s + 2) * STEP_WORDS), gl.load(x_ptrs + (s + 1) * (STEP // 2))
        acc = _step(acc, zeros, w_a, x_a, col0 + s * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok, tok_ok,
                    GROUP, DECODE, num_warps)
        w_a, x_c = gl.load(w_ptrs + gl.minimum(last, s + 3) * STEP_WORDS), gl.load(x_ptrs + (s + 2) * (STEP // 2))
        acc = _step(acc, zeros, w_b, x_b, col0 + (s + 1) * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok,
                    tok_ok, GROUP, DECODE, num_warps)
        w_b = gl.load(w_ptrs + gl.minimum(last, s + 4) * STEP_WORDS)
        x_a = gl.load(x_ptrs + gl.minimum(last, s + 3) * (STEP // 2))
        acc = _step(acc, zeros, w_c, x_c, col0 + (s + 2) * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok,
                    tok_ok, GROUP, DECODE, num_warps)
    done = steps - steps % 3  # w_a / x_a hold step done, w_b step done + 1 (when inside)
    if steps % 3 != 0:
        x_b = gl.load(x_ptrs + gl.minimum(last, done + 1) * (STEP // 2))
        acc = _step(acc, zeros, w_a, x_a, col0 + done * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok, z_ok,
                    tok_ok, GROUP, DECODE, num_warps)
        if steps % 3 == 2:
            acc = _step(acc, zeros, w_b, x_b, col0 + (done + 1) * STEP, magic, one, s_rows, z_rows, xs_rows, row_ok,
                        z_ok, tok_ok, GROUP, DECODE, num_warps)
    return acc


@gluon.jit
def block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_assignments, BM: gl.constexpr,
               NAIVE: gl.constexpr, x_layout: gl.constexpr, acc_layout: gl.constexpr):
    """Block pid_m's expert (-1: none) and its rows' assignments (A past the end) [BM], in the activation load's
    layout and the accumulator's: NAIVE assignment pid_m alone (ids read), else the aligned layout's block."""
    tok_x = gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
    tok_c = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_layout))
    if NAIVE:
        expert = gl.load(ids_ptr + pid_m).to(gl.int32)
        rows_x = gl.where(tok_x == 0, pid_m, num_assignments)
        rows_c = gl.where(tok_c == 0, pid_m, num_assignments)
    else:
        expert = gl.where(pid_m * BM < gl.load(num_padded_ptr), gl.load(expert_ids_ptr + pid_m), -1)
        rows_x = gl.load(sorted_ids_ptr + pid_m * BM + tok_x)
        rows_c = gl.load(sorted_ids_ptr + pid_m * BM + tok_c)
    return expert, rows_x, rows_c


@gluon.jit
def gate_up_words_kernel(
    x_ptr, xsum_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x_words [M, K] bf16, xsum [M, K / 128] f32; w13; h [A, N]
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,  # the routing (NAIVE: ids alone) and aligned layout
    b13_ptr,  # the expert biases [E, 2N] (w13's row order) where BIASED, else unread
    N, K, num_assignments, top_k, num_experts,
    stride_xm, stride_xsm, stride_qe, stride_qr, stride_se, stride_sr, stride_ze, stride_zr, stride_hm, stride_be,
    BM: gl.constexpr, GROUP: gl.constexpr, NAIVE: gl.constexpr, num_warps: gl.constexpr,
    H_ORDER: gl.constexpr = False,  # h stored in the dot order the down GEMM reads (``stored_column``)
    SPLIT: gl.constexpr = 1,  # > 1: grid axis 1 = split s of K's steps; h_ptr the float32 partials p [SPLIT A, 2N]
    AHEAD: gl.constexpr = 1,  # steps of words in flight (``words_loop``): 2 selectable, unmeasured
    MXFP4: gl.constexpr = False,  # q mxfp4 codes, s_ptr its e8m0 scales (``words_mx``); z_ptr, xsum_ptr unread
    # the activation variant (``words_glu.store_h``; SPLIT 1 only): b13 added, w13's rows interleaved (gate i at 2i,
    # up i at 2i + 1: gpt-oss), gate <= LIMIT and |up| <= LIMIT (0: none), h = gate sigmoid(ALPHA gate) (up + UP_SHIFT);
    # LIMIT_AFTER: gate sigmoid(ALPHA gate) <= LIMIT instead of gate (Step-3.7, Bailing-Hybrid)
    BIASED: gl.constexpr = False, INTERLEAVED: gl.constexpr = False, LIMIT: gl.constexpr = 0.0,
    ALPHA: gl.constexpr = 1.0, UP_SHIFT: gl.constexpr = 0.0, LIMIT_AFTER: gl.constexpr = False,
):
    """h = silu(x w_gate^T) * (x w_up^T) of one block's rows and 8 num_warps gate columns (module doc). Grid:
    (blocks * N / (8 num_warps), SPLIT); N a multiple of 8 num_warps, K / 256 of SPLIT, GROUP of 128
    (``triton_wo_words``). SPLIT > 1: split s's gate sums at p[s A + a, n], its up sums at p[s A + a, N + n]
    (``wo_split.split_glu_kernel`` sums and activates them)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 32], [8, 4], [1, num_warps], [1, 0])
    num_pid_n = N // (8 * num_warps)
    pid_m = gl.program_id(0) // num_pid_n
    n0 = (gl.program_id(0) % num_pid_n) * (8 * num_warps)
    expert, rows_x, rows_c = block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                        num_assignments, BM, NAIVE, x_layout, mma)
    if (expert >= 0) & (expert < num_experts):
        _block(x_ptr, xsum_ptr, q_ptr, s_ptr, z_ptr, h_ptr, b13_ptr, expert, rows_x, rows_c, n0, N, K,
               num_assignments, top_k, stride_xm, stride_xsm, stride_qe, stride_qr, stride_se, stride_sr, stride_ze,
               stride_zr, stride_hm, stride_be, GROUP, num_warps, H_ORDER, SPLIT, AHEAD, MXFP4, BIASED, INTERLEAVED,
               LIMIT, ALPHA, UP_SHIFT, LIMIT_AFTER)


@gluon.jit
def _block(x_ptr, xsum_ptr, q_ptr, s_ptr, z_ptr, h_ptr, b13_ptr, expert, rows_x, rows_c, n0, N, K, num_assignments,
           top_k, stride_xm, stride_xsm, stride_qe, stride_qr, stride_se, stride_sr, stride_ze, stride_zr, stride_hm,
           stride_be, GROUP: gl.constexpr, num_warps: gl.constexpr, H_ORDER: gl.constexpr, SPLIT: gl.constexpr,
           AHEAD: gl.constexpr, MXFP4: gl.constexpr, BIASED: gl.constexpr, INTERLEAVED: gl.constexpr,
           LIMIT: gl.constexpr, ALPHA: gl.constexpr, UP_SHIFT: gl.constexpr, LIMIT_AFTER: gl.constexpr):
    """The program's h tile: rows_x / rows_c [BM] its block's assignments (A past the end) in the x load's and the
    accumulator's layouts, n0 its first gate column (module doc)."""
    BM: gl.constexpr = rows_x.type.shape[0]
    R: gl.constexpr = 16 * num_warps
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8])
    w_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])  # 16-byte loads
    x_layout: gl.constexpr = gl.BlockedLayout([1, 32], [8, 4], [1, num_warps], [1, 0])  # int32 pairs
    ok_x, ok_c = rows_x < num_assignments, rows_c < num_assignments
    # the words load [16 W, 32] as tile row u = 8 W v + 8 w + g (v: register, w: warp, g: lane group): operand row
    # 16 w + 8 v + g (``operand_rows``), i.e. w13 row n0 + 8 w + g, plus N for the up rows (v = 1)
    u = gl.arange(0, R, layout=gl.SliceLayout(1, w_layout))
    r_c = gl.arange(0, R, layout=gl.SliceLayout(1, mma))  # operand row 16 w + 8 v + g: the same w13 row
    if INTERLEAVED:  # gate i at w13 row 2i, up i at 2i + 1
        w13_w = 2 * (n0 + 8 * (u // 8 % num_warps) + u % 8) + u // (8 * num_warps)
        w13_c = 2 * (n0 + 8 * (r_c // 16) + r_c % 8) + r_c % 16 // 8
    else:
        w13_w = n0 + 8 * (u // 8 % num_warps) + u % 8 + (u // (8 * num_warps)) * N
        w13_c = n0 + 8 * (r_c // 16) + r_c % 8 + (r_c % 16 // 8) * N
    steps = K // STEP // SPLIT  # the split's steps
    col0 = gl.program_id(1) * steps * STEP  # this split's first column
    words = q_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + expert.to(gl.int64) * stride_qe + col0 // 8
    cols = gl.arange(0, STEP_WORDS, layout=gl.SliceLayout(0, w_layout))
    w_ptrs = words + (w13_w * stride_qr)[:, None] + cols[None, :]  # [R, 32] the step's words
    m = gl.arange(0, STEP // 2, layout=gl.SliceLayout(0, x_layout))  # bf16 pairs
    x_pairs = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + col0 // 2
    x_ptrs = x_pairs + (gl.where(ok_x, rows_x // top_k, 0) * (stride_xm // 2))[:, None] + m[None, :]  # [BM, 128]
    s_rows = s_ptr + expert * stride_se + w13_c * stride_sr  # [R] the rows' groups
    z_rows = z_ptr + expert * stride_ze + w13_c * stride_zr
    xs_rows = xsum_ptr + gl.where(ok_c, rows_c // top_k, 0) * stride_xsm  # [BM]
    row_ok = w13_c < 2 * N
    acc = gl.zeros([R, BM], gl.float32, mma)
    if MXFP4:  # the scales in the words' rows (the decode's), magic bf16x2 -0 (K >= 0: a value in a register)
        mx_rows = s_ptr + expert * stride_se + w13_w * stride_sr
        neg0 = (K >> 31) - 0x7FFF8000
        acc = words_loop(acc, w_ptrs, x_ptrs, steps, col0, neg0, neg0, s_rows, mx_rows, xs_rows, row_ok, w13_w < 2 * N,
                         ok_c, GROUP, 2, num_warps, AHEAD)
    else:
        magic = 0x43004300 + (K >> 31)  # bf16x2 128.0 (K >= 0), a value ptxas holds in a register
        acc = words_loop(acc, w_ptrs, x_ptrs, steps, col0, magic, magic, s_rows, z_rows, xs_rows, row_ok, row_ok, ok_c,
                         GROUP, 0, num_warps, AHEAD)
    store_h(acc, h_ptr, b13_ptr, expert, w13_c, row_ok, rows_c, ok_c, r_c % 16 // 8, n0, N, num_assignments,
            stride_hm, stride_be, num_warps, H_ORDER, SPLIT, BIASED, LIMIT, ALPHA, UP_SHIFT, LIMIT_AFTER)

"""Grouped GEMMs with weight-only experts (int4, mxfp4; int8 from session 28), the word MMA decode (decode "mma",
issue #16, reworked in session 26): the packed weights read as 32-bit words (pipelined into shared memory by Triton's
cp.async stages, then into registers), each step's words decoded where they land into one MMA operand
[BN, 8 * BKW] in the "MMA order" of K (``wo_mma_values``: int4 one shift and one lop3 for two weights; mxfp4 the
bits placed, then one bf16x2 fma by the word's scale), the step's activation tile read once (contiguous, then
permuted in registers to the same order) and summed with them by ONE tensor-core dot of K 128 (16 words) a
sub-step. A step loads BKW words of each row at once, BLOCK_K 128 or 256 (4-bit: 64 or 128 bytes a row, int8 128 or
256: session 27's reads in this geometry stream 2.5 TB/s at 64 bytes, 3.9-4.1 at 128) and runs one dot, or two on
its halves (``_part``; BLOCK_K 512 measured 1.7x slower in session 28: removed).
(Session 24's form ran eight dots a step, value position T of the words against x columns 8j + T, each x tile
through shared memory and all on one accumulator chain, with one 4-warp program an SM at decode sizes: 1.3-3.2x the
pick on the H200.)

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. Layout: ``triton_wo``'s int4 (element 2i the low
nibble of byte i), read as little-endian words (``triton_wo_gemv.words_ok``): element t of word j in bits 4t..4t+3.

int4: decoded value = code - z (exact in bf16; ``wo_mma_values``); one sub-step spans 128 <= g columns, so one
group: each sub-step's dot starts from zero (no chain across sub-steps) and its partial product
p [BM, BN] takes the group's scale: acc += p * s. No activation sums. int8 (PER 4 values a word, 32 words a dot):
the codes themselves (exact in bf16), all dots into acc, the row's scale on acc at the end. mxfp4: decoded value =
the weight times 2^-64 (exact for e8m0 scales 2^-61 .. 2^65, ``wo_mma_values``): the dot accumulates into acc, times
2^64 at the end.
ASM (NVIDIA sm_80+, compiled) with bf16 activations: ``wo_mma_values``' FAST placement; else its float twin (the
interpreter decodes to float32 with UPCAST).

Split-K (down; the gate-up's: float32 partials, SPLIT), KSUM, alignment, NAIVE, PDL and UPCAST as in
``gemm_wo_reg``. Past C the words load as 0, x as 0 and the scales as 0: nothing leaks in.
The gate-up in two forms: both sides a program (``gate_up_wo_mma_kernel``: two word tiles and accumulators, h
activated) or the gate rows and up rows in separate programs (``gate_up_halves_wo_mma_kernel``, session 29: one
of each, float32 partials activated by ``wo_split.split_glu_kernel``; fewer registers, more programs an SM).

Biases and the activation variant (gpt-oss's experts, session 40; ``gemm_wo``'s module docstring): b13_ptr [E, 2N]
and b2_ptr [E, K], contiguous, or None (constexpr-specialised: without them the kernels are the ones before). b13
is added to the finished gate and up sums (after int8's row scale and mxfp4's 2^64), by split 0 alone where the
gate-up splits along K (its partials then sum onto it in the split_glu launch, which runs the variant); b2 in
``_down_epilogue`` as the tile decode's (split 0 alone). INTERLEAVED: gate column j is w13 (and b13) row 2j, up j row
2j + 1 (read in place); ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER: ``gemm._glu``'s. Their defaults are the plain kernels.

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN the tile, BKW words a step (BLOCK_K / 8).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import routed_slot_count, zero_unrouted_tokens
from moekit.experts._kernels.gemm import _glu, program_tile
from moekit.experts._kernels.gemm_wo import _down_epilogue, add_b13
from moekit.experts._kernels.wo_mma_values import X_SCALE, weight_operand, x_operand

DOT_K = tl.constexpr(128)  # columns a dot (16 words of 4-bit values, 32 of int8): a step runs BLOCK_K / DOT_K dots


@triton.jit
def _words(q_rows, w0, KW, n_ok, BKW: tl.constexpr):
    """Words w0 .. w0 + BKW of the rows q_rows [BN] (int32 pointers) -> [BN, BKW] int32, 0 past KW."""
    j = w0 + tl.arange(0, BKW)
    return tl.load(q_rows[:, None] + j[None, :], mask=n_ok[:, None] & (j < KW)[None, :], other=0)


@triton.jit
def _part(t, i: tl.constexpr, R: tl.constexpr, C: tl.constexpr, SUB: tl.constexpr):
    """Columns [i C / SUB, (i + 1) C / SUB) of t [R, C] (SUB 1 or 2): a step's words of sub-step i, split in halves
    (each a [R, C / 2, 2] join's two sides: no data moves where a thread holds both)."""
    part = t
    if SUB > 1:
        lo, hi = tl.split(tl.permute(tl.reshape(t, (R, 2, C // 2)), (0, 2, 1)))  # [R, C / 2] each
        if i >= SUB // 2:
            part = hi
        else:
            part = lo
    return part


@triton.jit
def _bytes(base, offs, mask):
    """The bytes at base + offs (uint8 storage, base 4-byte aligned: ``check_mma``) as int32, each read as the aligned
    32-bit word holding it: a byte load feeding the dot operand makes Triton pick 8-wide operand layouts, which
    reach the MMA through shared memory (sm_90 SASS, ``benchmarks/wo_mma_sass_cpu.py``)."""
    word = tl.load(base.to(tl.pointer_type(tl.int32), bitcast=True) + (offs >> 2), mask=mask, other=0)
    return (word >> ((offs & 3) * 8).to(tl.int32)) & 0xFF


@triton.jit
def _word_scales(s_ptr, s_offs, w, w0, C, n_ok, stride_sg, BKW: tl.constexpr, GROUP: tl.constexpr,
                 SCHEME: tl.constexpr, SCALE_WORD: tl.constexpr):
    """mxfp4: the e8m0 scale bytes of the step's BKW / 4 groups (GROUP 32: 4 words each) of the rows at byte offsets
    s_offs [BN] -> [BN, BKW / 4] int32 (0 past C); SCALE_WORD (BKW 16, the launch's: scale rows 4-byte aligned and
    contiguous) all four read as one aligned 32-bit word a row, else one byte a group (``_bytes``). int4: the words w
    themselves (unread)."""
    if SCHEME == 2:
        groups = tl.arange(0, BKW // 4)
        if SCALE_WORD:  # [BN] one load a row: a [BN, 4] byte load puts the weights through shared memory (sm_90)
            word = tl.load(s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + ((s_offs + w0 // 4) >> 2),
                           mask=tl.where(w0 * 8 < C, n_ok, False), other=0)
            inside = tl.maximum(tl.minimum(tl.cdiv(C - w0 * 8, GROUP), BKW // 4), 1)  # the word's groups in the row
            word = word & (((1 << (8 * inside - 1)) << 1) - 1)  # its bytes past C 0: one mask a row, not a group
            w = (word[:, None] >> (8 * groups)[None, :]) & 0xFF
        else:
            ok = n_ok[:, None] & ((w0 + 4 * groups) * 8 < C)[None, :]
            w = _bytes(s_ptr, s_offs[:, None] + ((w0 + 4 * groups) * 8 // GROUP)[None, :] * stride_sg, ok)
    return w


@triton.jit
def _x_step(x_rows, row_ok, k0, C, stride_xc, BM: tl.constexpr, BKW: tl.constexpr, DTYPE: tl.constexpr,
            PAIRS: tl.constexpr, SCHEME: tl.constexpr, PER: tl.constexpr):
    """The dot's activation tile of the rows x_rows [BM, 1] (columns k0 .. k0 + PER BKW, 0 past C), read once as
    one contiguous tile -> the MMA-order operand [BM, PER BKW] in DTYPE (no conversion where DTYPE is x's)."""
    k = k0 + tl.arange(0, PER * BKW)
    x = tl.load(x_rows + k[None, :] * stride_xc, mask=row_ok[:, None] & (k < C)[None, :], other=0.0)
    return x_operand(x.to(DTYPE), BM, BKW, PAIRS, SCHEME)


@triton.jit
def _accumulate(acc, x, w, s, s_rows, z_ptr, z_offs, k0, C, n_ok, stride_sg, stride_zg, BN: tl.constexpr,
                BKW: tl.constexpr, GROUP: tl.constexpr, DTYPE: tl.constexpr, SCHEME: tl.constexpr,
                FAST: tl.constexpr, PAIRS: tl.constexpr):
    """acc [BM, BN] + the dot's x [BM, DOT_K] (MMA order) times the words w [BN, BKW] decoded: int4 code - zero,
    one dot from zero times the group's scale; mxfp4 (s: the words' e8m0 bytes) one dot into acc, each weight
    scaled in the decode (times 2^-64: ``finish`` undoes it); int8 the codes, one dot into acc (the row scale:
    ``_row_scaled``, ``gemm_wo._store_y``)."""
    if SCHEME == 1:
        ok = tl.where(k0 < C, n_ok, False)
        scale = tl.load(s_rows + (k0 // GROUP) * stride_sg, mask=ok, other=0.0)  # [BN]
        zero = _bytes(z_ptr, z_offs + (k0 // GROUP) * stride_zg, ok)
        part = tl.dot(x, tl.trans(weight_operand(w, zero[:, None], BN, BKW, DTYPE, SCHEME, FAST, PAIRS)))
        acc += part * scale[None, :]
    else:
        acc = tl.dot(x, tl.trans(weight_operand(w, s, BN, BKW, DTYPE, SCHEME, FAST, PAIRS)), acc)
    return acc


@triton.jit
def _mma_loop(acc, q_rows, s_ptr, s_rows, z_ptr, z_offs, b_offs, x_rows, row_ok, n_ok, w_start, w_len, KW, C,
              stride_xc, stride_sg, stride_zg, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr, SCALE_WORD: tl.constexpr,
              PAIRS: tl.constexpr, PER: tl.constexpr, DTYPE: tl.constexpr):
    """acc [BM, BN] + the words [w_start, w_start + w_len) of the rows q_rows [BN] (0 past KW) decoded, times the
    columns of x_rows [BM, 1] (C of them): one load of BLOCK_K / PER words of each row a step, then BLOCK_K / DOT_K
    dots on its parts (s_rows, z_offs, b_offs: the rows' scales, zero and scale byte offsets, ``_accumulate`` /
    ``_word_scales``)."""
    for w0 in range(w_start, tl.minimum(w_start + w_len, KW), BLOCK_K // PER):
        w_step = _words(q_rows, w0, KW, n_ok, BLOCK_K // PER)  # [BN, BKW]: one load of a row's words a step
        for i in tl.static_range(BLOCK_K // DOT_K):  # a dot's words each (DOT_K // PER)
            ws = w0 + i * (DOT_K // PER)
            w = _part(w_step, i, BLOCK_N, BLOCK_K // PER, BLOCK_K // DOT_K)  # [BN, DOT_K // PER]
            s_w = _word_scales(s_ptr, b_offs, w, ws, C, n_ok, stride_sg, DOT_K // PER, GROUP, SCHEME, SCALE_WORD)
            x = _x_step(x_rows, row_ok, ws * PER, C, stride_xc, BLOCK_M, DOT_K // PER, DTYPE, PAIRS, SCHEME, PER)
            acc = _accumulate(acc, x, w, s_w, s_rows, z_ptr, z_offs, ws * PER, C, n_ok, stride_sg, stride_zg,
                              BLOCK_N, DOT_K // PER, GROUP, DTYPE, SCHEME, ASM, PAIRS)
    return acc


@triton.jit
def _row_scaled(acc, s_rows, n_ok, SCHEME: tl.constexpr):
    """acc [BM, BN] times int8's per-row scales at s_rows [BN] (the gate-up's; other schemes: acc)."""
    if SCHEME == 0:
        acc = acc * tl.load(s_rows, mask=n_ok, other=0.0)[None, :]
    return acc


@triton.jit
def _finish(acc, SCHEME: tl.constexpr):
    """The accumulator as w x: mxfp4's decoded weights carry 2^-64 (``wo_mma_values``), undone here (exact)."""
    if SCHEME == 2:
        acc = acc * X_SCALE
    return acc


@triton.jit
def _gate_up_out(acc_gate, acc_up, sg, su, b13_ptr, expert, gate, up, h_ptr, rows, row_ok, offs_n, n_ok, N,
                 num_assignments, stride_hm, SCHEME: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr,
                 ALPHA: tl.constexpr, LIMIT: tl.constexpr, UP_SHIFT: tl.constexpr, LIMIT_AFTER: tl.constexpr):
    """The gate-up's end: the gate and up sums acc_gate, acc_up [BM, BN] float32 scaled (int8's rows, mxfp4's 2^64),
    + b13 at the w13 rows gate, up [BN] (split 0 alone), then h = glu(gate, up) stored, or (SPLIT > 1) this split's
    float32 partials: gate at p columns offs_n, up at N + offs_n."""
    acc_gate, acc_up = _row_scaled(acc_gate, sg, n_ok, SCHEME), _row_scaled(acc_up, su, n_ok, SCHEME)
    acc_gate, acc_up = _finish(acc_gate, SCHEME), _finish(acc_up, SCHEME)
    if b13_ptr is not None:  # split 0's partials alone take it (one split: all programs)
        acc_gate, acc_up = add_b13(acc_gate, acc_up, b13_ptr, expert, gate, up,
                                   tl.where(tl.program_id(1) == 0, n_ok, False), N)
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:
        p_rows = h_ptr + (tl.program_id(1) * num_assignments + rows.to(tl.int64))[:, None] * stride_hm
        tl.store(p_rows + offs_n[None, :], acc_gate, mask=mask)
        tl.store(p_rows + N + offs_n[None, :], acc_up, mask=mask)
    else:
        h = _glu(acc_gate, acc_up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)  # [BM, BN] fp32
        tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gate_up_wo_mma_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, b13_ptr,  # b13 [E, 2N] or None
    N, K, KW, num_assignments, top_k, num_experts, num_pid_m,  # KW: words of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_hm, split_words,  # split_words: a split's words (SPLIT > 1)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, SCALE_WORD: tl.constexpr = False,
    PAIRS: tl.constexpr = 1, SPLIT: tl.constexpr = 1, PER: tl.constexpr = 8,
    INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False,
):
    """h = glu(x w_gate^T + b13_gate, x w_up^T + b13_up) per assignment row (SCHEME 0 int8, 1 int4 or 2 mxfp4;
    SPAN: unused; b13 and the variant: module doc). SPLIT > 1 (grid axis 1 = split s): words [s * split_words,
    (s + 1) * split_words) of each row, h_ptr the float32 partials p [SPLIT * A, 2N] (gate then up, b13 in split 0's;
    ``wo_split.split_glu_kernel`` sums and activates them)."""
    wait_for_previous_kernel(PDL)
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(N, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate = offs_n.to(tl.int64) * (2 if INTERLEAVED else 1)  # [BN] w13 rows: gate j at j (INTERLEAVED: 2j)
    up = gate + (1 if INTERLEAVED else N)  # the up rows follow the N gate rows (INTERLEAVED: gpt-oss's 2j + 1)
    words = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe
    qg, qu = words + gate * stride_qr, words + up * stride_qr
    sg, su = s_ptr + expert * stride_se + gate * stride_sr, s_ptr + expert * stride_se + up * stride_sr
    zg, zu = expert * stride_ze + gate * stride_zr, expert * stride_ze + up * stride_zr  # [BN] zero byte offsets
    bg, bu = expert * stride_se + gate * stride_sr, expert * stride_se + up * stride_sr  # scale offsets (mxfp4 bytes)
    x_rows = x_ptr + token[:, None] * stride_xm  # [BM, 1]
    dtype = x_ptr.dtype.element_ty
    if UPCAST:  # the weights then decode to float32 too (the interpreter truncates float32 -> bf16)
        dtype = tl.float32
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_start = tl.multiple_of(tl.program_id(1) * split_words, BLOCK_K // PER)  # split_words: whole steps (>= KW: 1)
    for w0 in range(w_start, tl.minimum(w_start + split_words, KW), BLOCK_K // PER):
        wg_step, wu_step = _words(qg, w0, KW, n_ok, BLOCK_K // PER), _words(qu, w0, KW, n_ok, BLOCK_K // PER)
        for i in tl.static_range(BLOCK_K // DOT_K):  # a dot's words each (DOT_K // PER)
            ws = w0 + i * (DOT_K // PER)
            wg = _part(wg_step, i, BLOCK_N, BLOCK_K // PER, BLOCK_K // DOT_K)  # [BN, DOT_K // PER]
            wu = _part(wu_step, i, BLOCK_N, BLOCK_K // PER, BLOCK_K // DOT_K)
            s_g = _word_scales(s_ptr, bg, wg, ws, K, n_ok, stride_sg, DOT_K // PER, GROUP, SCHEME, SCALE_WORD)
            s_u = _word_scales(s_ptr, bu, wu, ws, K, n_ok, stride_sg, DOT_K // PER, GROUP, SCHEME, SCALE_WORD)
            x = _x_step(x_rows, row_ok, ws * PER, K, stride_xk, BLOCK_M, DOT_K // PER, dtype, PAIRS, SCHEME, PER)
            acc_gate = _accumulate(acc_gate, x, wg, s_g, sg, z_ptr, zg, ws * PER, K, n_ok, stride_sg, stride_zg,
                                   BLOCK_N, DOT_K // PER, GROUP, dtype, SCHEME, ASM, PAIRS)
            acc_up = _accumulate(acc_up, x, wu, s_u, su, z_ptr, zu, ws * PER, K, n_ok, stride_sg, stride_zg, BLOCK_N,
                                 DOT_K // PER, GROUP, dtype, SCHEME, ASM, PAIRS)
    let_next_kernel_launch(PDL)
    _gate_up_out(acc_gate, acc_up, sg, su, b13_ptr, expert, gate, up, h_ptr, rows, row_ok, offs_n, n_ok, N,
                 num_assignments, stride_hm, SCHEME, ACT, SPLIT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)


@triton.jit
def gate_up_halves_wo_mma_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, p_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); p [SPLIT * A, 2N] float32 out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, b13_ptr,  # b13 [E, 2N] or None
    N, K, KW, num_assignments, top_k, num_experts, num_pid_m,  # KW: words of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_pm, split_words,  # split_words: a split's words (>= KW: one split)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, SCALE_WORD: tl.constexpr = False,
    PAIRS: tl.constexpr = 1, SPLIT: tl.constexpr = 1, PER: tl.constexpr = 8,
    INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False,
):
    """p = x w13^T (+ b13 in split 0's) per assignment row, float32, the activation left to the split_glu launch
    (``wo_split``; ALPHA .. LIMIT_AFTER: its, unused here; INTERLEAVED: p column c < N reads w13 row 2c, column
    N + c row 2c + 1, so p holds gate then up as without it): a
    program owns BLOCK_N of the 2N w13 rows, so the gate rows and the up rows are separate programs (a block across
    row N holds both; p's columns are w13's rows: gate, then up), each with one accumulator and one [BN, BKW] word
    tile a step (``gate_up_wo_mma_kernel`` holds two of each). Grid
    (num_pid_m * cdiv(2N, BLOCK_N), SPLIT): split s sums words [s * split_words, (s + 1) * split_words) into
    rows s * A + a of p (SPAN, ACT: unused)."""
    wait_for_previous_kernel(PDL)
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(2 * N, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] w13 rows, p columns
    n_ok = offs_n < 2 * N
    r = offs_n.to(tl.int64)  # [BN] w13 rows
    if INTERLEAVED:
        r = tl.where(r < N, 2 * r, 2 * (r - N) + 1)
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe + r * stride_qr
    s_rows = s_ptr + expert * stride_se + r * stride_sr
    z_offs, b_offs = expert * stride_ze + r * stride_zr, expert * stride_se + r * stride_sr  # [BN] byte offsets
    dtype = x_ptr.dtype.element_ty
    if UPCAST:  # the weights then decode to float32 too (the interpreter truncates float32 -> bf16)
        dtype = tl.float32
    w_start = tl.multiple_of(tl.program_id(1) * split_words, BLOCK_K // PER)  # split_words: whole steps
    acc = _mma_loop(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), q_rows, s_ptr, s_rows, z_ptr, z_offs, b_offs,
                    x_ptr + token[:, None] * stride_xm, row_ok, n_ok, w_start, split_words, KW, K, stride_xk,
                    stride_sg, stride_zg, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, SCHEME, ASM, SCALE_WORD, PAIRS, PER, dtype)
    let_next_kernel_launch(PDL)
    p_rows = p_ptr + (tl.program_id(1) * num_assignments + rows.to(tl.int64))[:, None] * stride_pm  # [BM, 1]
    acc = _finish(_row_scaled(acc, s_rows, n_ok, SCHEME), SCHEME)
    if b13_ptr is not None:  # split 0's partials alone
        acc += tl.load(b13_ptr + expert * 2 * N + r, mask=tl.where(tl.program_id(1) == 0, n_ok, False),
                       other=0.0).to(tl.float32)[None, :]
    tl.store(p_rows + offs_n[None, :], acc, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_wo_mma_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    b2_ptr,  # b2 [E, K] or None
    K, N, NW, num_assignments, num_experts, num_pid_m, split_len,  # NW: words of a w2 row
    stride_hm, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, SCALE_WORD: tl.constexpr = False,
    PAIRS: tl.constexpr = 1, PER: tl.constexpr = 8,  # PER: values a word (int8 4)
    KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (``gemm.down_kernel``'s, SPLIT 1)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
):
    """y = routed weight * (h w2^T + b2) per assignment row (split-K, KSUM: ``gemm_wo_reg``'s; split_len in columns;
    b2: module doc)."""
    wait_for_previous_kernel(PDL)
    if KSUM:
        if tl.program_id(0) >= num_pid_m * tl.cdiv(K, BLOCK_N):  # the programs after the GEMM's
            zero_unrouted_tokens(out_ptr, ids_ptr, map_ptr, num_pid_m * tl.cdiv(K, BLOCK_N), K, num_assignments,
                                 top_k, num_experts, num_global, BLOCK_N, TOPK_PAD, HAS_MAP, ZERO_T)
            return
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(K, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments
    safe_rows = tl.where(row_ok, rows, 0)
    arrivals = 0  # KSUM: [BM] routed slots of each row's token, loaded before the main loop (the epilogue's)
    if KSUM:
        arrivals = routed_slot_count(safe_rows // top_k, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD,
                                     HAS_MAP)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    out = offs_out.to(tl.int64)
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe + out * stride_qr  # [BN]
    s_rows = s_ptr + expert * stride_se + out * stride_sr
    z_offs = expert * stride_ze + out * stride_zr  # [BN] zero byte offsets
    b_offs = expert * stride_se + out * stride_sr  # scale offsets (mxfp4 bytes)
    h_rows = h_ptr + safe_rows[:, None] * stride_hm  # [BM, 1]
    dtype = h_ptr.dtype.element_ty
    if UPCAST:
        dtype = tl.float32
    w_start = tl.multiple_of(tl.program_id(1) * (split_len // PER), BLOCK_K // PER)  # split_len: whole steps
    acc = _mma_loop(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), q_rows, s_ptr, s_rows, z_ptr, z_offs, b_offs,
                    h_rows, row_ok, out_ok, w_start, split_len // PER, NW, N, 1, stride_sg, stride_zg, BLOCK_M, BLOCK_N,
                    BLOCK_K, GROUP, SCHEME, ASM, SCALE_WORD, PAIRS, PER, dtype)
    let_next_kernel_launch(PDL)
    _down_epilogue(_finish(acc, SCHEME), s_rows, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows,
                   row_ok, arrivals, pid_n, offs_out, out_ok, K, num_assignments, top_k, num_experts, num_global,
                   stride_ym, b2_ptr, expert, BLOCK_N, SCHEME, KSUM, TOPK_PAD, HAS_MAP, SUM_ROWS)

"""Grouped GEMMs with weight-only quantized experts, the word decode for decode-sized batches: no tensor
cores, the packed weights read as 32-bit words straight into registers (no shared memory), each word's
values decoded by placing bits into a float32 and multiplied on the CUDA cores (one FMA per weight and
row); group scales and zero points applied to partial sums, not per weight. Built for M-blocks of one
or two rows (the tiny-batch shortcut's one row, or alignment blocks of 2), where a 16-row tensor-core
tile wastes most of its rows and the decode's instructions and latency set the time.

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. The other decodes: ``gemm_wo`` (tile),
``gemm_wo_reg`` (register); the plan (``triton_wo_plan.choose_decode``) picks per call kind.

Words: the stored bytes of a weight row (``triton_wo``'s layouts) read as int32 (little-endian), so the
host requires the row's bytes contiguous and a multiple of 4, and the strides multiples of 4 bytes
(``triton_wo_gemv.words_ok``). Value T of every word of a tile [BN, BKW] becomes a float32 v by bit
operations (``wo_words``); one row's step sums part = sum v * x' over the tile's words, per word column:
    int4   even T v = 1 + q/128, odd T v = 1 + q/2048 with x' = 16 x: part = X_even + X_odd + sum(q x)/128
           (X_even, X_odd: the sums of x' at even and odd T); the group (scale s, zero z) adds
           128 s part - s (128 + z) X_even - s (128 + z/16) X_odd.
    int8   v = 1 + (q + 128)/2^15: sum q x = 2^15 part - 32896 X; the per-row scale at the end.
    mxfp4  v = e2m1 * 2^-126 exactly (the code 0.5 a float32 subnormal, kept: these FMAs do not flush to
           zero); x' = 2^64 x (exact; |x| must stay below 2^64): part * 2^62 * 2^(s - 127).
Where a step lies in one group (BKW * PER <= g) the scales are per weight row and the X terms are summed
once a step into a per-row term; else per word column. The 1.0f base costs a cancellation of about
2^-24 * 128 * sum|x| a group (int8: 2^-24 * 256): far below the bf16 rounding of the output. ``part``
accumulates per (weight row, word column) [BN, BKW]; one sum over the word columns at the end. One warp
a program by default: each thread then holds several weight rows of the same words, so each activation
value it loads (and converts, and scales) serves them all.

Pipelining: each program loads step k+AHEAD's words before it computes step k (AHEAD 1: two steps in
registers; AHEAD 2: three, the config's num_stages).

Past C (an odd C, a group tail, the last step) the words load as 0 and x as 0, scales as 0: nothing leaks
in. Split-K: down (SPLIT > 1) as in ``gemm_wo_reg``; gate-up (SPLIT > 1) float32 partials per split, summed
with the activation by ``wo_split.split_glu_kernel`` (more programs where the touched experts' tiles are too
few to keep the SMs' loads in flight: M = 1). Alignment, NAIVE, PDL as in ``gemm.py``; BLOCK_M is the
M-block's rows (1 for the tiny-batch shortcut).

Biases and the activation variant (gpt-oss's experts, session 40; ``gemm_wo``'s module docstring): b13_ptr [E, 2N]
and b2_ptr [E, K], contiguous, or None (constexpr-specialised: without them the kernels are the ones before). b13 is
added to each row's finished gate and up sums (int8's row scale applied), by split 0 alone where the gate-up splits
(its partials then carry it once, into the split_glu launch or the down GEMM's fold); b2 to each output row before
the routed weight, by split 0 alone. INTERLEAVED: gate column j is w13 (and b13) row 2j, up j row 2j + 1; ALPHA,
LIMIT, UP_SHIFT, LIMIT_AFTER: ``gemm._glu``'s in the unsplit gate-up (a split one's: the split_glu launch's; the
fold, ``wo_split.load_h``, runs the plain activation only: the plan does not fold a variant).

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN the tile, BKW words a
step (PER = 8 values a word for the 4-bit schemes, 4 for int8).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import ksum_epilogue, routed_slot_count, zero_unrouted_tokens
from moekit.experts._kernels.gemm import _glu, program_tile
from moekit.experts._kernels.gemm_wo import add_b2, add_b13
from moekit.experts._kernels.wo_split import h_words, load_h, split_range, store_partials
from moekit.experts._kernels.wo_words import load_words, word_scales, word_values


@triton.jit
def _x_part(x_row, ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, SCHEME: tl.constexpr,
            fold_stride, UP_SPLIT: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr):
    """x [BKW] float32 of one activation row (``x_row`` its first element, ``ok`` whether it exists):
    element T of each word of the step at k0 (0 past C), scaled as ``wo_words``' placement needs: int4
    odd T times 16, mxfp4 times 2^64. The down GEMM's h folded from the split gate-up's partials where
    UP_SPLIT > 1 (``wo_split.load_h``; the gate-up passes UP_SPLIT 1)."""
    k = k0 + tl.arange(0, BKW) * PER + T
    x = load_h(x_row, k * stride_xc, k < tl.where(ok, C, 0), C, fold_stride, UP_SPLIT, ACT, ROUND)
    return _x_scale(x, T, SCHEME)


@triton.jit
def _x_scale(x, T: tl.constexpr, SCHEME: tl.constexpr):
    """x as ``wo_words``' placement needs it: int4 odd T times 16, mxfp4 times 2^64."""
    if SCHEME == 2:
        x = x * 1.8446744073709552e19
    elif SCHEME == 1 and T % 2 == 1:
        x = x * 16.0
    return x


@triton.jit
def _fma_x(p, xs, v, x, T: tl.constexpr, SCHEME: tl.constexpr):
    """``_fma`` on value T's loaded x [BKW]."""
    x = _x_scale(x, T, SCHEME)
    return p + v * x[None, :], xs + x


@triton.jit
def _fma(p, xs, v, x_row, ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr,
         SCHEME: tl.constexpr, fs, UP_SPLIT: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr):
    """p [BN, BKW] + v * x and xs [BKW] + x for value T of one row (fs .. ROUND: ``_x_part``'s fold)."""
    x = _x_part(x_row, ok, k0, C, stride_xc, T, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
    return p + v * x[None, :], xs + x


@triton.jit
def _row_part(p, xe, xo, w_values, x_row, ok, k0, C, stride_xc, BKW: tl.constexpr, PER: tl.constexpr,
              SCHEME: tl.constexpr, fs, UP_SPLIT: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr,
              XTILE: tl.constexpr = False):
    """One row's partial sums p [BN, BKW] and its x sums at even and odd T [BKW] over a step's values (fs ..
    ROUND: ``_x_part``'s fold; XTILE: x read as one [BKW, 8] tile a step too where not folded, 4-bit schemes)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = w_values
    if (UP_SPLIT > 1 or XTILE) and PER == 8:  # one [BKW, 8] tile a step, not 8 strided loads (folded h: 2x, H200)
        x0, x1, x2, x3, x4, x5, x6, x7 = h_words(x_row, ok, k0, C, stride_xc, BKW, fs, UP_SPLIT, ACT, ROUND)
        p, xe = _fma_x(p, xe, v0, x0, 0, SCHEME)
        p, xo = _fma_x(p, xo, v1, x1, 1, SCHEME)
        p, xe = _fma_x(p, xe, v2, x2, 2, SCHEME)
        p, xo = _fma_x(p, xo, v3, x3, 3, SCHEME)
        p, xe = _fma_x(p, xe, v4, x4, 4, SCHEME)
        p, xo = _fma_x(p, xo, v5, x5, 5, SCHEME)
        p, xe = _fma_x(p, xe, v6, x6, 6, SCHEME)
        p, xo = _fma_x(p, xo, v7, x7, 7, SCHEME)
        return p, xe, xo
    p, xe = _fma(p, xe, v0, x_row, ok, k0, C, stride_xc, 0, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
    p, xo = _fma(p, xo, v1, x_row, ok, k0, C, stride_xc, 1, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
    p, xe = _fma(p, xe, v2, x_row, ok, k0, C, stride_xc, 2, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
    p, xo = _fma(p, xo, v3, x_row, ok, k0, C, stride_xc, 3, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
    if PER == 8:
        p, xe = _fma(p, xe, v4, x_row, ok, k0, C, stride_xc, 4, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
        p, xo = _fma(p, xo, v5, x_row, ok, k0, C, stride_xc, 5, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
        p, xe = _fma(p, xe, v6, x_row, ok, k0, C, stride_xc, 6, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
        p, xo = _fma(p, xo, v7, x_row, ok, k0, C, stride_xc, 7, BKW, PER, SCHEME, fs, UP_SPLIT, ACT, ROUND)
    return p, xe, xo


@triton.jit
def _accumulate(acc, xterm, w_values, scales, x_row, ok, k0, C, stride_xc, BKW: tl.constexpr, PER: tl.constexpr,
                GROUP: tl.constexpr, SCHEME: tl.constexpr, fs=0, UP_SPLIT: tl.constexpr = 1, ACT: tl.constexpr = 0,
                ROUND: tl.constexpr = 0, XTILE: tl.constexpr = False):
    """One row's step: acc [BN, BKW] + part * mul, and the x terms X_even * add_even + X_odd * add_odd
    (subtracted at the end) into xterm [BN] where the scales are per row, else into acc per word; fs ..
    ROUND: ``_x_part``'s fold (the down GEMM's)."""
    mul, add_even, add_odd = scales
    p = tl.zeros_like(acc)
    xe = tl.zeros([BKW], dtype=tl.float32)
    p, xe, xo = _row_part(p, xe, tl.zeros_like(xe), w_values, x_row, ok, k0, C, stride_xc, BKW, PER, SCHEME, fs,
                          UP_SPLIT, ACT, ROUND, XTILE)
    if SCHEME == 0:  # sum q x = 2^15 part - 32896 X
        acc += p * 32768.0
        xterm += 32896.0 * (tl.sum(xe, axis=0) + tl.sum(xo, axis=0))
    elif BKW * PER <= GROUP:
        acc += p * mul[:, None]
        if SCHEME == 1:
            xterm += add_even * tl.sum(xe, axis=0) + add_odd * tl.sum(xo, axis=0)
    else:
        acc += p * mul
        if SCHEME == 1:
            acc -= xe[None, :] * add_even + xo[None, :] * add_odd
    return acc, xterm


@triton.jit
def _row(rows, num_assignments, r: tl.constexpr, BLOCK_M: tl.constexpr):
    """(assignment, exists) of row r of the M-block (``_block_rows``' rows [BM])."""
    a = tl.sum(tl.where(tl.arange(0, BLOCK_M) == r, rows, 0))
    exists = a < num_assignments
    if r >= BLOCK_M:
        exists = a < 0  # no such row
    return a, exists


@triton.jit
def gate_up_operands(x_ptr, q_ptr, s_ptr, z_ptr, rows, expert, pid_n, N, num_assignments, top_k, stride_xm,
                     stride_qe, stride_qr, stride_se, stride_sr, stride_ze, stride_zr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr = False):
    """What the word decode's gate-up program reads, from its block's rows and expert: (a0, ok0, a1, ok1) its
    rows' assignments and whether they exist, x0 / x1 their x rows,
    offs_n [BN] its h columns and n_ok, the gate and up rows' word pointers qg, qu (int32), scales sg, su
    and zeros zg, zu [BN] (the up rows follow the N gate rows; INTERLEAVED: gate j at w13 row 2j, up at 2j + 1),
    and those rows gate, up [BN] (b13's)."""
    a0, ok0 = _row(rows, num_assignments, 0, BLOCK_M)
    a1, ok1 = _row(rows, num_assignments, 1, BLOCK_M)
    x0 = x_ptr + tl.where(ok0, a0 // top_k, 0) * stride_xm
    x1 = x_ptr + tl.where(ok1, a1 // top_k, 0) * stride_xm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate = offs_n.to(tl.int64) * (2 if INTERLEAVED else 1)  # [BN] w13 rows
    up = gate + (1 if INTERLEAVED else N)
    words = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe
    qg, qu = words + gate * stride_qr, words + up * stride_qr
    sg, su = s_ptr + expert * stride_se + gate * stride_sr, s_ptr + expert * stride_se + up * stride_sr
    zg, zu = z_ptr + expert * stride_ze + gate * stride_zr, z_ptr + expert * stride_ze + up * stride_zr
    return a0, ok0, a1, ok1, x0, x1, offs_n, n_ok, qg, qu, sg, su, zg, zu, gate, up


@triton.jit
def _gate_up_out(acc_g, xt_g, acc_u, xt_u, sg, su, n_ok, h_ptr, row, ok, offs_n, N, num_assignments, stride_hm,
                 SCHEME: tl.constexpr, ACT: tl.constexpr, SPLIT: tl.constexpr, b13_ptr=None, expert=0, g_rows=0,
                 u_rows=0, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None, UP_SHIFT: tl.constexpr = 0.0,
                 LIMIT_AFTER: tl.constexpr = False):
    """Row ``row`` of h [BN] from its accumulators [BN, BKW] and x terms [BN] (int8: times the per-row
    scales), + b13 at the w13 rows g_rows, u_rows (split 0 alone), the spec's glu; SPLIT > 1: this split's gate and
    up partials instead (``wo_split.store_partials``)."""
    gate, up = tl.sum(acc_g, axis=1) - xt_g, tl.sum(acc_u, axis=1) - xt_u
    if SCHEME == 0:
        gate *= tl.load(sg, mask=n_ok, other=0.0)
        up *= tl.load(su, mask=n_ok, other=0.0)
    if b13_ptr is not None:
        gate, up = add_b13(gate, up, b13_ptr, expert, g_rows, u_rows, tl.where(tl.program_id(1) == 0, n_ok, False), N)
    if SPLIT > 1:
        store_partials(h_ptr, gate, up, row, ok, offs_n, n_ok, N, num_assignments, stride_hm)
    else:
        h = _glu(gate, up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
        tl.store(h_ptr + row * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=tl.where(ok, n_ok, False))


@triton.jit
def _gate_up_step(acc_g0, xt_g0, acc_u0, xt_u0, acc_g1, xt_g1, acc_u1, xt_u1, wg, wu, sg, su, zg, zu, x0, ok0, x1,
                  ok1, k0, K, n_ok, stride_xk, stride_sg, stride_zg, BLOCK_M: tl.constexpr, BKW: tl.constexpr,
                  PER: tl.constexpr, GROUP: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr,
                  XTILE: tl.constexpr = False):
    """One step of the gate and up tiles wg, wu [BN, BKW] for the block's rows (1 or 2): each value
    decoded once and used by every row."""
    scales_g = word_scales(sg, zg, k0, K, n_ok, stride_sg, stride_zg, BKW, PER, GROUP, SCHEME)
    scales_u = word_scales(su, zu, k0, K, n_ok, stride_sg, stride_zg, BKW, PER, GROUP, SCHEME)
    vg, vu = word_values(wg, SCHEME, ASM), word_values(wu, SCHEME, ASM)
    acc_g0, xt_g0 = _accumulate(acc_g0, xt_g0, vg, scales_g, x0, ok0, k0, K, stride_xk, BKW, PER, GROUP, SCHEME,
                                XTILE=XTILE)
    acc_u0, xt_u0 = _accumulate(acc_u0, xt_u0, vu, scales_u, x0, ok0, k0, K, stride_xk, BKW, PER, GROUP, SCHEME,
                                XTILE=XTILE)
    if BLOCK_M > 1:
        acc_g1, xt_g1 = _accumulate(acc_g1, xt_g1, vg, scales_g, x1, ok1, k0, K, stride_xk, BKW, PER, GROUP, SCHEME,
                                    XTILE=XTILE)
        acc_u1, xt_u1 = _accumulate(acc_u1, xt_u1, vu, scales_u, x1, ok1, k0, K, stride_xk, BKW, PER, GROUP, SCHEME,
                                    XTILE=XTILE)
    return acc_g0, xt_g0, acc_u0, xt_u0, acc_g1, xt_g1, acc_u1, xt_u1


@triton.jit
def gate_up_wo_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, b13_ptr,  # b13 [E, 2N] or None
    N, K, KW, num_assignments, top_k, num_experts, num_pid_m,  # KW: words of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_hm, split_words,  # split_words: a split's words (SPLIT > 1)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr, SPLIT: tl.constexpr = 1, AHEAD: tl.constexpr = 1, XTILE: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False,
):
    """h = glu(x w_gate^T + b13_gate, x w_up^T + b13_up) per assignment row (BLOCK_M 1 or 2 rows a block), w13
    decoded word by word (b13, the variant: module doc). SPLIT > 1 (grid axis 1 = split s): words [s * split_words,
    (s + 1) * split_words) of each row, h_ptr the float32 partials p [SPLIT * A, 2N] (``wo_split``)."""
    wait_for_previous_kernel(PDL)
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(N, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        return
    a0, ok0, a1, ok1, x0, x1, offs_n, n_ok, qg, qu, sg, su, zg, zu, gate, up = gate_up_operands(
        x_ptr, q_ptr, s_ptr, z_ptr, rows, expert, pid_n, N, num_assignments, top_k, stride_xm, stride_qe, stride_qr,
        stride_se, stride_sr, stride_ze, stride_zr, BLOCK_M, BLOCK_N, INTERLEAVED)
    acc_g0 = tl.zeros([BLOCK_N, BKW], dtype=tl.float32)
    acc_u0, acc_g1, acc_u1 = tl.zeros_like(acc_g0), tl.zeros_like(acc_g0), tl.zeros_like(acc_g0)
    xt_g0 = tl.zeros([BLOCK_N], dtype=tl.float32)  # the x terms of each accumulator (``_accumulate``)
    xt_u0, xt_g1, xt_u1 = tl.zeros_like(xt_g0), tl.zeros_like(xt_g0), tl.zeros_like(xt_g0)
    w_start, w_end = split_range(KW, split_words, SPLIT)
    wg, wu = load_words(qg, w_start, w_end, n_ok, BKW), load_words(qu, w_start, w_end, n_ok, BKW)
    if AHEAD > 1:  # the step after the first too: AHEAD steps' words in flight as a step decodes
        ng, nu = load_words(qg, w_start + BKW, w_end, n_ok, BKW), load_words(qu, w_start + BKW, w_end, n_ok, BKW)
    for w0 in range(w_start, w_end, BKW):
        far_g = load_words(qg, w0 + AHEAD * BKW, w_end, n_ok, BKW)
        far_u = load_words(qu, w0 + AHEAD * BKW, w_end, n_ok, BKW)
        acc_g0, xt_g0, acc_u0, xt_u0, acc_g1, xt_g1, acc_u1, xt_u1 = _gate_up_step(
            acc_g0, xt_g0, acc_u0, xt_u0, acc_g1, xt_g1, acc_u1, xt_u1, wg, wu, sg, su, zg, zu, x0, ok0, x1, ok1,
            w0 * PER, K, n_ok, stride_xk, stride_sg, stride_zg, BLOCK_M, BKW, PER, GROUP, SCHEME, ASM, XTILE)
        if AHEAD > 1:
            wg, wu, ng, nu = ng, nu, far_g, far_u
        else:
            wg, wu = far_g, far_u
    let_next_kernel_launch(PDL)
    _gate_up_out(acc_g0, xt_g0, acc_u0, xt_u0, sg, su, n_ok, h_ptr, a0, ok0, offs_n, N, num_assignments, stride_hm,
                 SCHEME, ACT, SPLIT, b13_ptr, expert, gate, up, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
    if BLOCK_M > 1:
        _gate_up_out(acc_g1, xt_g1, acc_u1, xt_u1, sg, su, n_ok, h_ptr, a1, ok1, offs_n, N, num_assignments,
                     stride_hm, SCHEME, ACT, SPLIT, b13_ptr, expert, gate, up, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)


@triton.jit
def _down_step(acc0, xt0, acc1, xt1, w, s_rows, z_rows, h0, ok0, h1, ok1, n0, N, out_ok, stride_sg, stride_zg, fs,
               BLOCK_M: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
               SCHEME: tl.constexpr, ASM: tl.constexpr, UP_SPLIT: tl.constexpr, ACT: tl.constexpr, ROUND: tl.constexpr,
               XTILE: tl.constexpr = False):
    """One step of the w2 tile w [BN, BKW] for the block's rows (1 or 2); h folded where UP_SPLIT > 1."""
    scales = word_scales(s_rows, z_rows, n0, N, out_ok, stride_sg, stride_zg, BKW, PER, GROUP, SCHEME)
    values = word_values(w, SCHEME, ASM)
    acc0, xt0 = _accumulate(acc0, xt0, values, scales, h0, ok0, n0, N, 1, BKW, PER, GROUP, SCHEME, fs, UP_SPLIT, ACT,
                            ROUND, XTILE)
    if BLOCK_M > 1:
        acc1, xt1 = _accumulate(acc1, xt1, values, scales, h1, ok1, n0, N, 1, BKW, PER, GROUP, SCHEME, fs, UP_SPLIT,
                                ACT, ROUND, XTILE)
    return acc0, xt0, acc1, xt1


@triton.jit
def _down_loop(q_rows, s_rows, z_rows, h0, ok0, h1, ok1, w_start, split_words, NW, N, out_ok, stride_sg, stride_zg, fs,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr,
               GROUP: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr, UP_SPLIT: tl.constexpr,
               ACT: tl.constexpr, ROUND: tl.constexpr, AHEAD: tl.constexpr, XTILE: tl.constexpr):
    """The down GEMM's accumulators (acc0, xt0, acc1, xt1: [BN, BKW], [BN] x terms) over words [w_start,
    w_start + split_words) of the rows q_rows [BN], each step's words loaded AHEAD steps before it decodes."""
    acc0, xt0 = tl.zeros([BLOCK_N, BKW], dtype=tl.float32), tl.zeros([BLOCK_N], dtype=tl.float32)
    acc1, xt1 = tl.zeros_like(acc0), tl.zeros_like(xt0)
    w = load_words(q_rows, w_start, NW, out_ok, BKW)
    if AHEAD > 1:
        nw = load_words(q_rows, w_start + BKW, NW, out_ok, BKW)
    for w0 in range(w_start, tl.minimum(w_start + split_words, NW), BKW):
        far_w = load_words(q_rows, w0 + AHEAD * BKW, NW, out_ok, BKW)
        acc0, xt0, acc1, xt1 = _down_step(acc0, xt0, acc1, xt1, w, s_rows, z_rows, h0, ok0, h1, ok1, w0 * PER, N,
                                          out_ok, stride_sg, stride_zg, fs, BLOCK_M, BKW, PER, GROUP, SCHEME, ASM,
                                          UP_SPLIT, ACT, ROUND, XTILE)
        if AHEAD > 1:
            w, nw = nw, far_w
        else:
            w = far_w
    return acc0, xt0, acc1, xt1


@triton.jit
def _down_out(acc, xt, s_rows, out_ok, weights_ptr, y_ptr, row, ok, num_assignments, offs_out, stride_ym,
              SCHEME: tl.constexpr, b2_ptr=None, expert=0, K=0):
    """Row ``row``'s routed-weighted output [BN] (+ b2 by split 0 alone: ``gemm_wo.add_b2``) into this split's
    partial row."""
    y = tl.sum(acc, axis=1) - xt
    if SCHEME == 0:
        y *= tl.load(s_rows, mask=out_ok, other=0.0)
    if b2_ptr is not None:
        y = add_b2(y, b2_ptr, expert, offs_out, out_ok, K)
    y *= tl.load(weights_ptr + row, mask=ok, other=0.0).to(tl.float32)
    y_row = tl.program_id(1) * num_assignments + row
    tl.store(y_ptr + y_row * stride_ym + offs_out, y.to(y_ptr.dtype.element_ty), mask=tl.where(ok, out_ok, False))


@triton.jit
def down_wo_gemv_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    b2_ptr,  # b2 [E, K] or None
    K, N, NW, num_assignments, num_experts, num_pid_m, split_words,  # NW: words of a w2 row
    stride_hm, stride_qe, stride_qr, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
    ASM: tl.constexpr,
    KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (``gemm.down_kernel``'s, SPLIT 1)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
    UP_SPLIT: tl.constexpr = 1, ACT: tl.constexpr = 0, ROUND: tl.constexpr = 0, AHEAD: tl.constexpr = 1,
    XTILE: tl.constexpr = False,
):
    """y = routed weight * (h w2^T + b2) per assignment row, w2 decoded word by word; BLOCK_N tiles the output
    columns (K). Split-K (SPLIT > 1, grid axis 1 = split s): words [s * split_words, (s + 1) *
    split_words) of each row (a multiple of BKW) into partial rows y[s * A + a]. KSUM: ``gemm_wo``'s docstring.
    UP_SPLIT > 1: h_ptr the split gate-up's partials p [UP_SPLIT * A, 2N] (stride_hm 2N), h folded as read
    (``load_h``)."""
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
    if KSUM:  # [BM] routed slots of each row's token, loaded before the main loop (the epilogue needs them)
        row_ok = rows < num_assignments
        safe_rows = tl.where(row_ok, rows, 0)
        arrivals = routed_slot_count(safe_rows // top_k, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD,
                                     HAS_MAP)
    a0, ok0 = _row(rows, num_assignments, 0, BLOCK_M)
    a1, ok1 = _row(rows, num_assignments, 1, BLOCK_M)
    a0, a1 = tl.where(ok0, a0, 0), tl.where(ok1, a1, 0)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    out = offs_out.to(tl.int64)
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe + out * stride_qr  # [BN]
    s_rows = s_ptr + expert * stride_se + out * stride_sr
    z_rows = z_ptr + expert * stride_ze + out * stride_zr
    acc0, xt0, acc1, xt1 = _down_loop(q_rows, s_rows, z_rows, h_ptr + a0 * stride_hm, ok0, h_ptr + a1 * stride_hm,
                                      ok1, tl.program_id(1) * split_words, split_words, NW, N, out_ok, stride_sg,
                                      stride_zg, num_assignments * stride_hm, BLOCK_M, BLOCK_N, BKW, PER, GROUP, SCHEME,
                                      ASM, UP_SPLIT, ACT, ROUND, AHEAD, XTILE)
    let_next_kernel_launch(PDL)
    _down_out(acc0, xt0, s_rows, out_ok, weights_ptr, y_ptr, a0, ok0, num_assignments, offs_out, stride_ym, SCHEME,
              b2_ptr, expert, K)
    if BLOCK_M > 1:
        _down_out(acc1, xt1, s_rows, out_ok, weights_ptr, y_ptr, a1, ok1, num_assignments, offs_out, stride_ym,
                  SCHEME, b2_ptr, expert, K)
    if KSUM:
        ksum_epilogue(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok, arrivals, pid_n, offs_out,
                      out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, TOPK_PAD, HAS_MAP, SUM_ROWS)

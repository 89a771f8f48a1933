"""Grouped GEMMs with weight-only quantized experts, the word decode for decode-sized batches: no tensor
cores, the packed weights read as 32-bit words straight into registers (no shared memory), each word's
values decoded by placing bits into a float32 and multiplied on the CUDA cores (one FMA per weight and
row); group scales and zero points applied per word column of partial sums, not per weight. Built for
M-blocks of a few rows (the tiny-batch shortcut's one row, or alignment blocks of 2-8 rows), where a
16-row tensor-core tile wastes most of its rows and the decode's latency sets the time.

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch``. The other decodes: ``gemm_wo`` (tile),
``gemm_wo_reg`` (register); the plan (``triton_wo_plan.choose_decode``) picks per call kind.

Words: the stored bytes of a weight row (``triton_wo``'s layouts) read as int32 (little-endian), so the
host requires the row's bytes contiguous and a multiple of 4, and the strides multiples of 4 bytes
(``triton_wo_gemv.words_ok``). A 4-bit word holds elements 8j .. 8j+7, element t in bits 4t .. 4t+3
(the layout's low-nibble-first order); an int8 word elements 4j .. 4j+3, element t in bits 8t .. 8t+7.
Value t of every word of a tile [BN, BKW] is one shift and one masked OR (``_value``):
    int4   the nibble into bits 16..19 of 1.0f: v = 1 + q/128, so sum v*x = X + sum(q*x)/128, X = sum x;
           the group (scale s, zero z) adds s*128*part - s*(128 + z)*X per word column.
    int8   the byte + 128 (sign bit flipped once per word) into bits 15..22 of 1.0f: v = 1 + (q+128)/256:
           sum q*x = 256*part - 384*X; the per-row scale multiplies once at the end.
    mxfp4  magnitude bits into float32 bits 22..24, sign into bit 31: v = e2m1 * 2^-126 exactly (the
           code 0.5 a float32 subnormal, kept: no flush to zero in these FMAs); x enters scaled by 2^64
           (exact, so |x| must stay below 2^64), part * 2^62 * 2^(s - 127) per word column.
The 1.0f base costs a cancellation of about 2^-24 * 128 * sum|x| per word column (int8: 2^-24 * 384):
far below the bf16 rounding of the output. ``part`` and X are per (row, weight row, word column)
[BM, BN, BKW]: no reduction inside the loop; one sum over the word columns at the end.

Pipelining: each program loads step k+1's words and scales before it computes step k (two steps in
flight, in registers).

Past C (an odd C, a group tail, the last step) the words load as 0 and x as 0, scales as 0: nothing leaks
in. Split-K (down, SPLIT > 1) as in ``gemm_wo_reg``. Alignment, NAIVE, PDL as in ``gemm.py``; BLOCK_M
is the M-block's rows (1 for the tiny-batch shortcut).

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN the tile, BKW words a
step (PER = 8 values a word for the 4-bit schemes, 4 for int8).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.gemm import _block_rows, _glu, _grid_position


@triton.jit
def _value(w, T: tl.constexpr, SCHEME: tl.constexpr):
    """Value T of each word of w [BN, BKW] int32 as float32 (module docstring: int4 1 + q/128, int8
    1 + (q + 128)/256 with w's sign bits already flipped, mxfp4 e2m1 * 2^-126)."""
    if SCHEME == 1:
        if T < 4:
            s = w << (16 - 4 * T)
        elif T > 4:
            s = w >> (4 * T - 16)
        else:
            s = w
        bits = (s & 0x000F0000) | 0x3F800000
    elif SCHEME == 0:
        if T < 2:
            s = w << (15 - 8 * T)
        else:
            s = w >> (8 * T - 15)
        bits = (s & 0x007F8000) | 0x3F800000
    else:
        if T < 6:
            magnitude = w << (22 - 4 * T)
        else:
            magnitude = w >> (4 * T - 22)
        if T < 7:
            sign = w << (28 - 4 * T)
        else:
            sign = w
        bits = (magnitude & 0x01C00000) | (sign & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _word_scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, BKW: tl.constexpr, PER: tl.constexpr,
                 GROUP: tl.constexpr, SCHEME: tl.constexpr):
    """(mul, add) [BN, BKW] float32 of the words of the step at k0: acc += part * mul - X * add
    (module docstring). Past C both 0; int8: the constants (its per-row scale comes at the end)."""
    first = k0 + tl.arange(0, BKW) * PER  # [BKW] the first element of each word
    ok = n_ok[:, None] & (first < C)[None, :]
    g = (first // GROUP)[None, :]
    if SCHEME == 1:
        s = tl.load(s_rows[:, None] + g * stride_sg, mask=ok, other=0.0)
        z = tl.load(z_rows[:, None] + g * stride_zg, mask=ok, other=0).to(tl.float32)
        mul = s * 128.0
        add = s * (128.0 + z)
    elif SCHEME == 2:
        e = tl.load(s_rows[:, None] + g * stride_sg, mask=ok, other=0).to(tl.int32)
        mul = tl.where(ok, (e << 23).to(tl.float32, bitcast=True), 0.0) * 4.611686018427388e18  # * 2^62
        add = tl.zeros_like(mul)
    else:
        mul = tl.where(ok, 256.0, 0.0)
        add = tl.where(ok, 384.0, 0.0)
    return mul, add


@triton.jit
def _load_words(q_words, w0, KW, n_ok, BKW: tl.constexpr, SCHEME: tl.constexpr):
    """Words w0 .. w0+BKW of each row [BN] (pointers to the rows' first words) -> [BN, BKW] int32, 0
    past the row's KW words; int8: sign bits flipped (byte + 128)."""
    j = w0 + tl.arange(0, BKW)
    w = tl.load(q_words[:, None] + j[None, :], mask=n_ok[:, None] & (j < KW)[None, :], other=0)
    if SCHEME == 0:
        w = w ^ -2139062144  # 0x80808080
    return w


@triton.jit
def _x_part(x_row, ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, SCHEME: tl.constexpr):
    """x [BKW] float32 of one activation row (``x_row`` its first element, ``ok`` whether it exists):
    element T of each word of the step at k0 (0 past C); mxfp4 times 2^64."""
    k = k0 + tl.arange(0, BKW) * PER + T
    x = tl.load(x_row + k * stride_xc, mask=k < tl.where(ok, C, 0), other=0.0).to(tl.float32)
    if SCHEME == 2:
        x = x * 1.8446744073709552e19
    return x


@triton.jit
def _row_fma2(pa, pb, xs, va, vb, x_row, ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr,
              PER: tl.constexpr, SCHEME: tl.constexpr):
    """One row's partial sums pa, pb [BN, BKW] and x sum xs [BKW] plus value T of the two tiles (va, vb)."""
    x = _x_part(x_row, ok, k0, C, stride_xc, T, BKW, PER, SCHEME)
    return pa + va * x[None, :], pb + vb * x[None, :], xs + x


@triton.jit
def _row_fma1(pa, xs, va, x_row, ok, k0, C, stride_xc, T: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr,
              SCHEME: tl.constexpr):
    """``_row_fma2`` of one tile."""
    x = _x_part(x_row, ok, k0, C, stride_xc, T, BKW, PER, SCHEME)
    return pa + va * x[None, :], xs + x


@triton.jit
def _row(rows, num_assignments, r: tl.constexpr, BLOCK_M: tl.constexpr):
    """(assignment, exists) of row r of the M-block (``_block_rows``' rows [BM])."""
    a = tl.sum(tl.where(tl.arange(0, BLOCK_M) == r, rows, 0))
    exists = a < num_assignments
    if r >= BLOCK_M:
        exists = a < 0  # no such row
    return a, exists


@triton.jit
def _gate_up_out(acc_g, acc_u, sg, su, n_ok, h_ptr, row, ok, offs_n, stride_hm, SCHEME: tl.constexpr,
                 ACT: tl.constexpr):
    """Row ``row`` of h [BN] from its accumulators [BN, BKW] (int8: times the per-row scales)."""
    gate, up = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    if SCHEME == 0:
        gate *= tl.load(sg, mask=n_ok, other=0.0)
        up *= tl.load(su, mask=n_ok, other=0.0)
    h = _glu(gate, up, ACT, 1.0, None, 0.0)
    tl.store(h_ptr + row * stride_hm + offs_n, h.to(h_ptr.dtype.element_ty), mask=tl.where(ok, n_ok, False))


@triton.jit
def _gate_up_step(acc_g0, acc_u0, acc_g1, acc_u1, wg, wu, sg, su, zg, zu, x0, ok0, x1, ok1, k0, K, n_ok, stride_xk,
                  stride_sg, stride_zg, BLOCK_M: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr,
                  GROUP: tl.constexpr, SCHEME: tl.constexpr):
    """One step of the gate and up tiles wg, wu [BN, BKW] for the block's rows (1 or 2): each value
    decoded once and used by every row."""
    mul_g, add_g = _word_scales(sg, zg, k0, K, n_ok, stride_sg, stride_zg, BKW, PER, GROUP, SCHEME)
    mul_u, add_u = _word_scales(su, zu, k0, K, n_ok, stride_sg, stride_zg, BKW, PER, GROUP, SCHEME)
    pg0, pu0, pg1, pu1 = tl.zeros_like(acc_g0), tl.zeros_like(acc_g0), tl.zeros_like(acc_g0), tl.zeros_like(acc_g0)
    xs0 = tl.zeros([BKW], dtype=tl.float32)
    xs1 = tl.zeros([BKW], dtype=tl.float32)
    for t in tl.static_range(PER):
        vg, vu = _value(wg, t, SCHEME), _value(wu, t, SCHEME)
        pg0, pu0, xs0 = _row_fma2(pg0, pu0, xs0, vg, vu, x0, ok0, k0, K, stride_xk, t, BKW, PER, SCHEME)
        if BLOCK_M > 1:
            pg1, pu1, xs1 = _row_fma2(pg1, pu1, xs1, vg, vu, x1, ok1, k0, K, stride_xk, t, BKW, PER, SCHEME)
    acc_g0 += pg0 * mul_g - xs0[None, :] * add_g
    acc_u0 += pu0 * mul_u - xs0[None, :] * add_u
    if BLOCK_M > 1:
        acc_g1 += pg1 * mul_g - xs1[None, :] * add_g
        acc_u1 += pu1 * mul_u - xs1[None, :] * add_u
    return acc_g0, acc_u0, acc_g1, acc_u1


@triton.jit
def gate_up_wo_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    N, K, KW, num_assignments, top_k, num_experts, num_pid_m,  # KW: words of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
):
    """h = act(x w_gate^T) * (x w_up^T) per assignment row (BLOCK_M 1 or 2 rows a block), w13 decoded
    word by word."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    a0, ok0 = _row(rows, num_assignments, 0, BLOCK_M)
    a1, ok1 = _row(rows, num_assignments, 1, BLOCK_M)
    x0 = x_ptr + tl.where(ok0, a0 // top_k, 0) * stride_xm
    x1 = x_ptr + tl.where(ok1, a1 // top_k, 0) * stride_xm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate, up = offs_n.to(tl.int64), offs_n.to(tl.int64) + N  # [BN] w13 rows; up rows follow the N gate rows
    words = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe
    qg, qu = words + gate * stride_qr, words + up * stride_qr
    sg, su = s_ptr + expert * stride_se + gate * stride_sr, s_ptr + expert * stride_se + up * stride_sr
    zg, zu = z_ptr + expert * stride_ze + gate * stride_zr, z_ptr + expert * stride_ze + up * stride_zr
    acc_g0 = tl.zeros([BLOCK_N, BKW], dtype=tl.float32)
    acc_u0, acc_g1, acc_u1 = tl.zeros_like(acc_g0), tl.zeros_like(acc_g0), tl.zeros_like(acc_g0)
    wg, wu = _load_words(qg, 0, KW, n_ok, BKW, SCHEME), _load_words(qu, 0, KW, n_ok, BKW, SCHEME)
    for w0 in range(0, KW, BKW):
        next_g = _load_words(qg, w0 + BKW, KW, n_ok, BKW, SCHEME)
        next_u = _load_words(qu, w0 + BKW, KW, n_ok, BKW, SCHEME)
        acc_g0, acc_u0, acc_g1, acc_u1 = _gate_up_step(
            acc_g0, acc_u0, acc_g1, acc_u1, wg, wu, sg, su, zg, zu, x0, ok0, x1, ok1, w0 * PER, K, n_ok, stride_xk,
            stride_sg, stride_zg, BLOCK_M, BKW, PER, GROUP, SCHEME)
        wg, wu = next_g, next_u
    let_next_kernel_launch(PDL)
    _gate_up_out(acc_g0, acc_u0, sg, su, n_ok, h_ptr, a0, ok0, offs_n, stride_hm, SCHEME, ACT)
    if BLOCK_M > 1:
        _gate_up_out(acc_g1, acc_u1, sg, su, n_ok, h_ptr, a1, ok1, offs_n, stride_hm, SCHEME, ACT)


@triton.jit
def _down_step(acc0, acc1, w, s_rows, z_rows, h0, ok0, h1, ok1, n0, N, out_ok, stride_sg, stride_zg,
               BLOCK_M: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
               SCHEME: tl.constexpr):
    """One step of the w2 tile w [BN, BKW] for the block's rows (1 or 2)."""
    mul, add = _word_scales(s_rows, z_rows, n0, N, out_ok, stride_sg, stride_zg, BKW, PER, GROUP, SCHEME)
    p0, p1 = tl.zeros_like(acc0), tl.zeros_like(acc0)
    xs0 = tl.zeros([BKW], dtype=tl.float32)
    xs1 = tl.zeros([BKW], dtype=tl.float32)
    for t in tl.static_range(PER):
        v = _value(w, t, SCHEME)
        p0, xs0 = _row_fma1(p0, xs0, v, h0, ok0, n0, N, 1, t, BKW, PER, SCHEME)
        if BLOCK_M > 1:
            p1, xs1 = _row_fma1(p1, xs1, v, h1, ok1, n0, N, 1, t, BKW, PER, SCHEME)
    acc0 += p0 * mul - xs0[None, :] * add
    if BLOCK_M > 1:
        acc1 += p1 * mul - xs1[None, :] * add
    return acc0, acc1


@triton.jit
def _down_out(acc, s_rows, out_ok, weights_ptr, y_ptr, row, ok, num_assignments, offs_out, stride_ym,
              SCHEME: tl.constexpr):
    """Row ``row``'s routed-weighted output [BN] into this split's partial row."""
    y = tl.sum(acc, axis=1)
    if SCHEME == 0:
        y *= tl.load(s_rows, mask=out_ok, other=0.0)
    y *= tl.load(weights_ptr + row, mask=ok, other=0.0).to(tl.float32)
    y_row = tl.program_id(1) * num_assignments + row
    tl.store(y_ptr + y_row * stride_ym + offs_out, y.to(y_ptr.dtype.element_ty), mask=tl.where(ok, out_ok, False))


@triton.jit
def down_wo_gemv_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    K, N, NW, num_assignments, num_experts, num_pid_m, split_words,  # NW: words of a w2 row
    stride_hm, stride_qe, stride_qr, stride_se, stride_sr, stride_sg,  # q strides in words
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BKW: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr, NAIVE: tl.constexpr, PDL: tl.constexpr,
):
    """y = routed weight * (h w2^T) per assignment row, w2 decoded word by word; BLOCK_N tiles the output
    columns (K). Split-K (SPLIT > 1, grid axis 1 = split s): words [s * split_words, (s + 1) *
    split_words) of each row (a multiple of BKW) into partial rows y[s * A + a]."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _grid_position(num_pid_m, tl.cdiv(K, BLOCK_N), GROUP_M)
    rows, expert = _block_rows(pid_m, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                               num_assignments, num_experts, BLOCK_M, NAIVE)
    if expert < 0:
        return
    a0, ok0 = _row(rows, num_assignments, 0, BLOCK_M)
    a1, ok1 = _row(rows, num_assignments, 1, BLOCK_M)
    a0, a1 = tl.where(ok0, a0, 0), tl.where(ok1, a1, 0)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    out = offs_out.to(tl.int64)
    q_rows = q_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + expert * stride_qe + out * stride_qr  # [BN]
    s_rows = s_ptr + expert * stride_se + out * stride_sr
    z_rows = z_ptr + expert * stride_ze + out * stride_zr
    acc0 = tl.zeros([BLOCK_N, BKW], dtype=tl.float32)
    acc1 = tl.zeros_like(acc0)
    w_start = tl.program_id(1) * split_words
    w = _load_words(q_rows, w_start, NW, out_ok, BKW, SCHEME)
    for w0 in range(w_start, tl.minimum(w_start + split_words, NW), BKW):
        next_w = _load_words(q_rows, w0 + BKW, NW, out_ok, BKW, SCHEME)
        acc0, acc1 = _down_step(acc0, acc1, w, s_rows, z_rows, h_ptr + a0 * stride_hm, ok0, h_ptr + a1 * stride_hm,
                                ok1, w0 * PER, N, out_ok, stride_sg, stride_zg, BLOCK_M, BKW, PER, GROUP, SCHEME)
        w = next_w
    let_next_kernel_launch(PDL)
    _down_out(acc0, s_rows, out_ok, weights_ptr, y_ptr, a0, ok0, num_assignments, offs_out, stride_ym, SCHEME)
    if BLOCK_M > 1:
        _down_out(acc1, s_rows, out_ok, weights_ptr, y_ptr, a1, ok1, num_assignments, offs_out, stride_ym, SCHEME)

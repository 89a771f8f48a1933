"""Warp-specialized weight-only grouped GEMM for Hopper (Gluon), int8_w8a16 / int4_w4a16 / mxfp4, contiguous layout.

    out[r, c] = act(A[r, :] @ (Q[e(r), c, :] * scale[e(r), c])^T)      r: a row of the permuted buffer

``gluon_gemm.grouped_gemm_kernel``'s schedule (persistent, GROUP_M-swizzled tiles, its loader partition unchanged:
TMA loads of the activation tile and the int8 weight tiles into a STAGES-deep ring) with a decoding MMA partition:
wgmma reads its right operand from shared memory only, so each step's int8 tiles [BN, BK] are read from their
stage into registers, converted to bf16 (exact: |q| <= 128) and stored into one of two decoded buffers; the
decode of step k + 1 runs while step k's asynchronous wgmma does (the brief's "consumer decodes tile k+1 while
wgmma k runs"). The per-output-channel scale multiplies the fp32 accumulator once, in the epilogue (so the loop
is only a convert). Barriers on the decoded buffers (both warpgroups read each one) come from Triton's membar
pass: a CTA barrier before the decode's store (after this step's wgmma wait: the step before's MMAs, the last
readers, retired in both warpgroups) and before the wgmma that reads it; ``fence_async_shared`` after the
store orders the generic-proxy writes before the async-proxy read.

Session 28's variants (constexprs; off: the kernel above): SPLIT, two MMA partitions of one warpgroup each (the
kernel's num_warps 4), each owning half of the tile's columns: it decodes only the weight rows it multiplies into
decoded slots of its own, so the barriers Triton puts around them are its partition's (bar.sync id, 128 threads),
never both warpgroups'; the stage's ``empty`` barrier counts both. FAST: ``gluon_wo_fast``'s decode (int4 and mxfp4
read as int32 words). SLOTS 3: a third decoded slot, so the decode of step k + 1 runs with steps k - 1 and k's MMAs
in flight (wgmma wait 2 steps deep; a stage is released two steps after its MMAs issued).

Q is a 2-D view [E * W_ROWS, R] int8 of w13.q [E, 2N, K] (W_ROWS = 2N) or w2.q [E, K, N] (W_ROWS = K); scale
[E, W_ROWS] fp32 (``stride_se`` elements an expert). GATED: gate rows c and up rows N + c, out = silu(gate) * up.
Gluon does not run in the interpreter (CUDA sm_90 only). Torch twin: ``triton_gluon_wo.experts_gluon_wo_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _loader, _tile_of, _tma_store, stage_barriers, tile_walk
from moekit.experts._kernels.gluon_wo_fast import decode_words, e8m0_pair

# SPLIT: the second MMA warpgroup's registers a thread (the first gets as many: 12 warps x 32 x 168 at launch, the
# loader's warpgroup keeps 24 a thread, 2 x 128 x 240 the rest)
SPLIT_REGISTERS = gl.constexpr(240)


@gluon.jit
def _nibble(words, SHIFT: gl.constexpr, mul, add):
    """The code at bits [16 - SHIFT, 20 - SHIFT) of each int32 word moved to bits 16-19 of float32 128.0 (one shift,
    one LOP3: 128 + code exactly), then (128 + code) * mul + add (one fma) with the rows' group (scale, -(128 +
    zero) * scale)."""
    if SHIFT > 0:
        placed = words << SHIFT
    elif SHIFT < 0:
        placed = words >> (-SHIFT)
    else:
        placed = words
    return ((placed & 0x000F0000) | 0x43000000).to(gl.float32, bitcast=True) * mul[:, None] + add[:, None]


@gluon.jit
def _decode_tile(src, dst, mul, add, magic, SCHEME: gl.constexpr, FAST: gl.constexpr, num_warps: gl.constexpr):
    """One stored tile ``src`` -> bf16 ``dst`` [BN, BK]. int8 (bytes): converted (exact). int4 (int32 words of 8
    codes, code p at bits 4p: K order): ``_nibble`` per code, the 8 codes of a word interleaved back in K order.
    mxfp4 (bytes, two codes a byte, low nibble first): the tile viewed [BN, ROW / VEC, VEC bytes] (a thread's bytes
    lie in one 32-code group), each code's bits placed as float16 e2m1 * 2^-14 (exact), times its group's
    2^(e8m0 - 113) (mul [BN, ROW / VEC]), the two nibbles interleaved back in K order. FAST (int4, mxfp4: int32
    words): ``gluon_wo_fast.decode_words``, the same values."""
    BN: gl.constexpr = src.type.shape[0]
    ROW: gl.constexpr = src.type.shape[1]
    FULL: gl.constexpr = 128 // src.dtype.primitive_bitwidth  # elements of 16 bytes: one shared load a thread
    SPREAD: gl.constexpr = BN * ROW // (32 * num_warps)  # or fewer, so that no two threads hold the same element
    VEC: gl.constexpr = FULL if FULL < SPREAD else SPREAD
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (ROW // VEC), ROW // VEC], [num_warps, 1], [1, 0])
    groups: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [32 // (ROW // VEC), ROW // VEC, 1], [num_warps, 1, 1],
                                            [2, 1, 0])
    raw = src.load(layout)  # ``_scale_rows``' rows are this layout's
    if SCHEME == 0:
        dst.store(raw.to(gl.float32).to(gl.bfloat16))
    elif FAST:
        if SCHEME == 2:
            raw = gl.convert_layout(gl.reshape(raw, [BN, ROW // VEC, VEC]), groups)
        decode_words(raw, dst, mul, add, magic, SCHEME)
    elif SCHEME == 1:
        w0, w4 = _nibble(raw, 16, mul, add), _nibble(raw, 0, mul, add)
        w1, w5 = _nibble(raw, 12, mul, add), _nibble(raw, -4, mul, add)
        w2, w6 = _nibble(raw, 8, mul, add), _nibble(raw, -8, mul, add)
        w3, w7 = _nibble(raw, 4, mul, add), _nibble(raw, -12, mul, add)
        # [BN, ROW, 2, 2, 2]: the first join's dim is code bit 2, the last's bit 0 -> [BN, 8 ROW] in K order
        w = gl.join(gl.join(gl.join(w0, w4), gl.join(w2, w6)), gl.join(gl.join(w1, w5), gl.join(w3, w7)))
        dst.store(gl.reshape(w, [BN, 8 * ROW]).to(gl.bfloat16))
    else:
        packed = gl.convert_layout(gl.reshape(raw, [BN, ROW // VEC, VEC]), groups).to(gl.int32)
        low = (((packed & 0x07) << 9) | ((packed & 0x08) << 12)).to(gl.int16).to(gl.float16, bitcast=True)
        high = (((packed & 0x70) << 5) | ((packed & 0x80) << 8)).to(gl.int16).to(gl.float16, bitcast=True)
        low = low.to(gl.float32) * mul[:, :, None]
        high = high.to(gl.float32) * mul[:, :, None]
        dst.store(gl.reshape(gl.join(low, high), [BN, 2 * ROW]).to(gl.bfloat16))


@gluon.jit
def _group_scales(s_rows, z_rows, k0, reduce_dim, stride_sg, stride_zg, GROUP: gl.constexpr, SCHEME: gl.constexpr,
                  FAST: gl.constexpr):
    """(mul, add) float32 of step k0's groups, loaded a step ahead; 0 past the reduction. int4 [BN]: GROUP a multiple
    of BLOCK_K (one group a step), add = -(128 + zero) * scale; mxfp4 [BN, ROW / VEC] (``_scale_rows``' pointers):
    mul = 2^(e8m0 - 113) (FAST: ``e8m0_pair``), add unused; int8: unused zeros (its scales multiply in the
    epilogue)."""
    ok = k0 < reduce_dim
    g = k0 // GROUP
    if SCHEME == 0:
        mul = gl.zeros_like(s_rows.to(gl.int64).to(gl.float32))
        add = mul
    elif SCHEME == 1:
        mul = gl.load(s_rows + g * stride_sg, mask=ok, other=0.0)
        zero = gl.load(z_rows + g * stride_zg, mask=ok, other=0).to(gl.float32)
        add = -(128.0 + zero) * mul
    else:
        exponent = gl.load(s_rows + g * stride_sg, mask=ok, other=0).to(gl.int32)
        if FAST:
            mul = e8m0_pair(exponent)
        else:
            mul = ((exponent + 14) << 23).to(gl.float32, bitcast=True)
        add = mul
    return mul, add


@gluon.jit
def _stored(q_bufs, index, ROWS: gl.constexpr, HALF: gl.constexpr):
    """Stored tile ``index``: whole, or (a warpgroup of SPLIT) its rows [HALF * ROWS, (HALF + 1) * ROWS)."""
    tile = q_bufs.index(index)
    if ROWS < q_bufs.type.shape[1]:
        tile = tile.slice(HALF * ROWS, ROWS, dim=0)
    return tile


@gluon.jit
def _decode_step(q_bufs, w_bufs, stage, slot, mul_g, add_g, mul_u, add_u, magic, GATED: gl.constexpr,
                 SCHEME: gl.constexpr, FAST: gl.constexpr, HALF: gl.constexpr, num_warps: gl.constexpr):
    """The stored tiles of ``stage`` (the rows ``w_bufs`` holds: all, or half HALF) -> bf16 into decoded ``slot``,
    fenced for the wgmma (gate then up when GATED)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    ROWS: gl.constexpr = w_bufs.type.shape[1]
    _decode_tile(_stored(q_bufs, stage * WTILES, ROWS, HALF), w_bufs.index(slot * WTILES), mul_g, add_g, magic,
                 SCHEME, FAST, num_warps)
    if GATED:
        _decode_tile(_stored(q_bufs, stage * WTILES + 1, ROWS, HALF), w_bufs.index(slot * WTILES + 1), mul_u, add_u,
                     magic, SCHEME, FAST, num_warps)
    fence_async_shared()


@gluon.jit
def _scaled(acc, scale_row, cols, SCHEME: gl.constexpr):
    """int8: acc [BM, BN] * scale_row[cols] (the output channels' scales) along its columns; else acc."""
    if SCHEME == 0:
        acc = acc * gl.load(scale_row + cols)[None, :]
    return acc


@gluon.jit
def _scale_rows(s_ptr, z_ptr, expert, cb, stride_se, stride_sr, stride_sg, stride_ze, stride_zr,
                BLOCK_N: gl.constexpr, ROW: gl.constexpr, VEC: gl.constexpr, PACK: gl.constexpr,
                SCHEME: gl.constexpr, num_warps: gl.constexpr):
    """Pointers to the scale and zero rows of column block cb's weight rows in ``_decode_tile``'s layouts (a stored
    tile row of ROW elements of PACK codes, VEC a thread): [BN]; mxfp4 [BN, ROW / VEC] (each part's group in a step:
    its first at column 0; ``_group_scales`` adds the step's)."""
    if SCHEME == 2:
        groups: gl.constexpr = gl.BlockedLayout([1, 1, VEC], [32 // (ROW // VEC), ROW // VEC, 1], [num_warps, 1, 1],
                                                [2, 1, 0])
        rows = cb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, groups)))
        part = gl.arange(0, ROW // VEC, layout=gl.SliceLayout(0, gl.SliceLayout(2, groups)))  # VEC * PACK codes
        s_rows = s_ptr + expert * stride_se + rows[:, None] * stride_sr + (part * VEC * PACK // 32)[None, :] * stride_sg
        z_rows = s_rows
    else:
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // (ROW // VEC), ROW // VEC], [num_warps, 1], [1, 0])
        rows = cb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        s_rows = s_ptr + expert * stride_se + rows * stride_sr
        z_rows = z_ptr + expert * stride_ze + rows * stride_zr
    return s_rows, z_rows


@gluon.jit
def _scales(sg, zg, su, zu, k0, reduce_dim, stride_sg, stride_zg, GROUP: gl.constexpr, SCHEME: gl.constexpr,
            FAST: gl.constexpr):
    """``_group_scales`` of step k0's gate rows (sg, zg) and up rows (su, zu)."""
    mul_g, add_g = _group_scales(sg, zg, k0, reduce_dim, stride_sg, stride_zg, GROUP, SCHEME, FAST)
    mul_u, add_u = _group_scales(su, zu, k0, reduce_dim, stride_sg, stride_zg, GROUP, SCHEME, FAST)
    return mul_g, add_g, mul_u, add_u


@gluon.jit
def _mma_step(a, w_bufs, slot, acc, up, GATED: gl.constexpr):
    """The step's async wgmma on decoded ``slot`` (gate and up when GATED), then all but the last SLOTS - 1 steps'
    retired (w_bufs holds SLOTS slots)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    SLOTS: gl.constexpr = w_bufs.type.shape[0] // WTILES
    acc = warpgroup_mma(a, w_bufs.index(slot * WTILES).permute((1, 0)), acc, is_async=True)
    if GATED:
        up = warpgroup_mma(a, w_bufs.index(slot * WTILES + 1).permute((1, 0)), up, is_async=True)
        acc, up = warpgroup_mma_wait(num_outstanding=2 * (SLOTS - 1), deps=(acc, up))
    else:
        acc = warpgroup_mma_wait(num_outstanding=SLOTS - 1, deps=(acc,))
    return acc, up


@gluon.jit
def _wo_mma_epilogue(c_desc, a_bufs, q_bufs, w_bufs, c_buf, ready, empty, experts_ptr, used_ptr, s_ptr, z_ptr,
                     stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
                     GATE_OFFSET: gl.constexpr, GATED: gl.constexpr, GROUP_M: gl.constexpr, SCHEME: gl.constexpr,
                     GROUP: gl.constexpr, FAST: gl.constexpr, HALF: gl.constexpr, num_warps: gl.constexpr):
    """The MMA partition: the whole [BM, BN] tile (8 warps), or with SPLIT (4 warps, c_desc blocks [BM, BN / 2])
    its columns [HALF * BN / 2, (HALF + 1) * BN / 2): this warpgroup decodes only those weight rows, into its own
    ``w_bufs``; Triton's barriers around them are then this partition's alone."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]  # the columns this partition owns
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    SLOTS: gl.constexpr = w_bufs.type.shape[0] // (2 if GATED else 1)  # decoded slots: SLOTS - 1 steps' MMAs in flight
    FULL: gl.constexpr = 128 // q_bufs.dtype.primitive_bitwidth  # ``_decode_tile``'s elements a thread
    SPREAD: gl.constexpr = BLOCK_N * q_bufs.type.shape[2] // (32 * num_warps)
    VEC: gl.constexpr = FULL if FULL < SPREAD else SPREAD
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    num_row_blocks, num_tiles, k_steps = tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K)
    magic = 0x43000000 + (reduce_dim >> 31)  # float32 128.0's bits (reduce_dim >= 0), a value ptxas keeps in a register
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        cb = cb * (q_bufs.type.shape[1] // BLOCK_N) + HALF  # in BLOCK_N-wide blocks
        expert = gl.load(experts_ptr + rb)
        sg, zg = _scale_rows(s_ptr, z_ptr, expert, cb, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, BLOCK_N,
                             q_bufs.type.shape[2], VEC, BLOCK_K // q_bufs.type.shape[2], SCHEME, num_warps)
        su, zu = sg + GATE_OFFSET * stride_sr, zg + GATE_OFFSET * stride_zr
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        mul_g, add_g, mul_u, add_u = _scales(sg, zg, su, zu, 0, reduce_dim, stride_sg, stride_zg, GROUP, SCHEME, FAST)
        mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
        _decode_step(q_bufs, w_bufs, it % STAGES, 0, mul_g, add_g, mul_u, add_u, magic, GATED, SCHEME, FAST, HALF,
                     num_warps)
        mul_g, add_g, mul_u, add_u = _scales(sg, zg, su, zu, BLOCK_K, reduce_dim, stride_sg, stride_zg, GROUP, SCHEME,
                                             FAST)
        for kk in range(k_steps):
            acc, up = _mma_step(a_bufs.index(it % STAGES), w_bufs, kk % SLOTS, acc, up, GATED)
            # step kk - (SLOTS - 1)'s MMAs retired: its stage may be refilled, its decoded slot rewritten
            mbarrier.arrive(empty.index((it + STAGES - SLOTS + 1) % STAGES), count=1, pred=kk >= SLOTS - 1)
            if kk + 1 < k_steps:  # the next step's tiles decoded while this step's MMAs (and the one's before) run
                mbarrier.wait(ready.index((it + 1) % STAGES), ((it + 1) // STAGES) & 1)
                _decode_step(q_bufs, w_bufs, (it + 1) % STAGES, (kk + 1) % SLOTS, mul_g, add_g, mul_u, add_u, magic,
                             GATED, SCHEME, FAST, HALF, num_warps)
                # the step after: its group's scales load while this step runs
                mul_g, add_g, mul_u, add_u = _scales(sg, zg, su, zu, (kk + 2) * BLOCK_K, reduce_dim, stride_sg,
                                                     stride_zg, GROUP, SCHEME, FAST)
            it += 1
        _epilogue(c_desc, c_buf, acc, up, s_ptr + expert * stride_se, rb, cb, GATE_OFFSET, GATED, SCHEME, layout)
        for j in gl.static_range(SLOTS - 1):  # the last steps' stages (all MMAs retired)
            mbarrier.arrive(empty.index((it + STAGES - 1 - j) % STAGES), count=1, pred=k_steps > j)
    tma.store_wait(0)


@gluon.jit
def _epilogue(c_desc, c_buf, acc, up, scale_row, rb, cb, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
              SCHEME: gl.constexpr, layout: gl.constexpr):
    """The last MMAs retired, int8's scales, silu(gate) * up when GATED, then the tile stored by TMA."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    cols = cb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    if GATED:
        acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
        acc = _scaled(acc, scale_row, cols, SCHEME)
        up = _scaled(up, scale_row + GATE_OFFSET, cols, SCHEME)
        acc = acc / (1.0 + gl.exp(-acc)) * up  # silu(gate) * up
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = _scaled(acc, scale_row, cols, SCHEME)
    tma.store_wait(0)  # the last tile's store has read c_buf
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)


@gluon.jit
def grouped_gemm_wo_kernel(a_desc, q_desc, c_desc, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se, stride_sr,
                           stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks, W_ROWS: gl.constexpr,
                           GATE_OFFSET: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                           SCHEME: gl.constexpr, GROUP: gl.constexpr, num_warps: gl.constexpr,
                           SPLIT: gl.constexpr = False, FAST: gl.constexpr = False, SLOTS: gl.constexpr = 2):
    """a_desc [T, R] bf16 blocks [BM, BK]; q_desc [E*W_ROWS, R / PACK] blocks [BN, BK / PACK] (int8: PACK 1; int4:
    int32 words, PACK 8; mxfp4: uint8, PACK 2); c_desc [T, C] blocks [BM, BN] (SPLIT: [BM, BN / 2]); experts_ptr
    [T / BM] int32; used_ptr -> rows in use (a multiple of BM); s_ptr / z_ptr the scales / zeros through their
    strides (int8: scale [E, W_ROWS], z unread; int4: [E, W_ROWS, R / GROUP], GROUP a multiple of BK; mxfp4: e8m0
    [E, W_ROWS, R / 32]); reduce_dim = R; num_col_blocks = C / BN; GATE_OFFSET = N when GATED.
    SPLIT (num_warps = 4): two MMA partitions of one warpgroup each, each owning half of the tile's columns.
    FAST (int4, and mxfp4 read as int32 words of 8 codes, PACK 8): ``gluon_wo_fast``'s decode, the same values.
    SLOTS: decoded slots (3: the decode of step k + 1 overlaps the MMAs of steps k - 1 and k, not k alone)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    BLOCK_N: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    PACK: gl.constexpr = BLOCK_K // q_desc.block_type.shape[1]  # weights a stored element
    HALVES: gl.constexpr = 2 if SPLIT else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES * WTILES] + q_desc.block_type.shape, q_desc.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N // HALVES, BLOCK_K], gl.bfloat16)
    w_bufs = gl.allocate_shared_memory(gl.bfloat16, [SLOTS * WTILES, BLOCK_N // HALVES, BLOCK_K], w_layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES, HALVES)  # each MMA partition releases the stage
    if SPLIT:  # the second warpgroup: its own decoded slots and output tile
        w_bufs1 = gl.allocate_shared_memory(gl.bfloat16, [SLOTS * WTILES, BLOCK_N // 2, BLOCK_K], w_layout)
        c_buf1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        gl.warp_specialize([
            (_wo_mma_epilogue, (c_desc, a_bufs, q_bufs, w_bufs, c_buf, ready, empty, experts_ptr, used_ptr, s_ptr,
                                z_ptr, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim,
                                num_col_blocks, GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, FAST, 0, num_warps)),
            (_wo_mma_epilogue, (c_desc, a_bufs, q_bufs, w_bufs1, c_buf1, ready, empty, experts_ptr, used_ptr, s_ptr,
                                z_ptr, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim,
                                num_col_blocks, GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, FAST, 1, 4)),
            (_loader, (a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                       W_ROWS, GATE_OFFSET, GATED, GROUP_M, PACK)),
        ], [4, 1], [SPLIT_REGISTERS, 24])
    else:
        gl.warp_specialize([
            (_wo_mma_epilogue, (c_desc, a_bufs, q_bufs, w_bufs, c_buf, ready, empty, experts_ptr, used_ptr, s_ptr,
                                z_ptr, stride_se, stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim,
                                num_col_blocks, GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, FAST, 0, num_warps)),
            (_loader, (a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                       W_ROWS, GATE_OFFSET, GATED, GROUP_M, PACK)),
        ], [1], [24])

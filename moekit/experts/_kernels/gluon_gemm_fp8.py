"""Block-scaled fp8 grouped GEMM for Hopper in Gluon, on the contiguous layout: the fp8 twin of ``gluon_gemm``.

    out[r, c] = act(sum_kb (A_q[r, kb] @ W_q[e(r), c, kb]^T) * a_s[r, kb] * w_s[e(r), c // 128, kb])

A_q [T, R] e4m3 (rows of the permuted buffer, each expert's segment starting on a BLOCK_M = 128 boundary),
a_s [T, R/128] float32 (one scale per row per 128 columns); W a 2-D e4m3 view [E * W_ROWS, R] (w13 [E, 2N, K]
with W_ROWS = 2N, or w2 [E, K, N] with W_ROWS = K) read in [BLOCK_N = 128, BLOCK_K = 128] tiles by TMA;
w_s [E, W_ROWS/128, R/128] float32 (``weight_scale_inv``: dequantized = q * scale). Each K-step is one scale
block and each tile's columns lie in one weight block, so a step's weight scale is one scalar.

Every K-step's wgmma goes into a fresh accumulator (``use_acc=False``: the fp8 tensor cores' own
accumulation is short of float32 and is never carried across steps), then acc += part * (a_s * w_s)[:, None]
in float32: DeepSeek-V3's promotion. The promotion must not idle the tensor cores, so the tile's two
64-row halves belong to two consumer warpgroups (partitions) that run independently: while one does its
FMAs the other's wgmma runs. Three partitions per program:
  - consumer 0 (the default partition, 4 warps) and consumer 1 (a worker, 4 warps): rows 0-63 and 64-127
    of the [128, 128] tile, each with its own float32 accumulator(s) and epilogue;
  - loader (1 warp): TMA loads of the two A halves and the weight tile(s) into a STAGES-deep SMEM ring;
    ``ready`` (bytes landed) and ``empty`` (count 2: both consumers' MMAs that read it retired).
GATED (gate-up): gate tile rows c.., up tile rows gate_offset + c.., out = silu(gate) * up, quantized per
row over the tile's 128 columns (one h group): out e4m3 [T, N] by TMA, its scale into out_s [T, N/128].
Otherwise (down): out = the product in out's dtype (bf16); the routed weight is applied by the combine.
WIDE (down only): a tile is [128, 256], two adjacent weight column blocks read like gate and up (gate_offset = 128,
two accumulators per consumer), so each A stage feeds twice the MMA work; both halves stored as they are.

Persistent: one program per SM walks the tiles of the rows in use (``rows_used``, read on the device) in
GROUP_M-swizzled order (``gluon_gemm._tile_of``). Gluon does not run in the interpreter (CUDA sm_90 only).
Torch twin: ``moekit.experts.triton_gluon_fp8.experts_gluon_fp8_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gemm import _glu
from moekit.experts._kernels.gluon_gemm import _tile_of, stage_barriers

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

FIRST_HALF = gl.constexpr(0)  # the consumers' HALF (a partition's arguments must be values or constexprs)
SECOND_HALF = gl.constexpr(1)


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
            w_rows, gate_offset, GATED: gl.constexpr, GROUP_M: gl.constexpr, WIDE: gl.constexpr,
            INTERLEAVED: gl.constexpr):
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    WTILES: gl.constexpr = 2 if GATED or WIDE else 1
    STAGES: gl.constexpr = w_bufs.type.shape[0] // WTILES
    COL_STEP: gl.constexpr = BLOCK_N * (2 if WIDE or INTERLEAVED else 1)  # weight rows per column block of the walk
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + WTILES * w_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * HALF_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        w_row = gl.load(experts_ptr + rb) * w_rows + cb * COL_STEP
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(s), nbytes)
            _tma_load(a_desc, [rb * 2 * HALF_M, kk * BLOCK_K], ready.index(s), a_bufs.index(2 * s))
            _tma_load(a_desc, [rb * 2 * HALF_M + HALF_M, kk * BLOCK_K], ready.index(s), a_bufs.index(2 * s + 1))
            _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w_bufs.index(s * WTILES))
            if GATED or WIDE:
                _tma_load(w_desc, [w_row + gate_offset, kk * BLOCK_K], ready.index(s), w_bufs.index(s * WTILES + 1))
            it += 1


@gluon.jit
def _consumer(c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr, bias_ptr,
              reduce_dim, num_col_blocks, w_rows, gate_offset, stride_as, stride_wse, stride_wsr, stride_cs,
              HALF: gl.constexpr, GATED: gl.constexpr, GROUP_M: gl.constexpr, WIDE: gl.constexpr, PIPE: gl.constexpr,
              INTERLEAVED: gl.constexpr, ACT: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr,
              UP_SHIFT: gl.constexpr, LIMIT_AFTER: gl.constexpr):
    """Rows HALF*64 .. of every tile: per K-step a wgmma into a fresh part, then the scaled FMA."""
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * HALF_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    up_block = gate_offset // BLOCK_N  # the up rows' first weight block (WIDE, INTERLEAVED: the next one, 1)
    col_blocks: gl.constexpr = 2 if WIDE or INTERLEAVED else 1  # weight scale blocks per tile column block
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        row0 = rb * 2 * HALF_M + HALF * HALF_M
        rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))  # [64]
        as_ptrs = as_ptr + rows * stride_as  # [64] this half's rows' scales of K-step 0
        expert = gl.load(experts_ptr + rb)
        ws_gate = ws_ptr + expert * stride_wse + cb * col_blocks * stride_wsr  # K-step 0's
        if INTERLEAVED:  # the second row tile's block, clamped to the expert's last (past 2N: zeroed in _variant_h)
            ws_up = ws_ptr + expert * stride_wse + gl.minimum(2 * cb + 1, gl.cdiv(w_rows, BLOCK_N) - 1) * stride_wsr
        else:
            ws_up = ws_gate + up_block * stride_wsr
        if PIPE:  # the narrow down GEMM alone (``triton_gluon_fp8_launch.check_wide``)
            acc, it = _k_loop_paired(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, k_steps, it, HALF, layout)
            up = acc  # unused: the down GEMM's
        else:
            acc, up, it = _k_loop(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, ws_up, k_steps, it, HALF,
                                  GATED or WIDE, layout)
        if WIDE:
            _wide_epilogue(acc, up, c_desc, c_bufs.index(2 * HALF), c_bufs.index(2 * HALF + 1), row0, cb)
        else:
            _epilogue(acc, up, c_desc, c_bufs.index(HALF), cs_ptr + rows * stride_cs + cb, row0, cb, GATED, bias_ptr,
                      experts_ptr + rb, cb * col_blocks * BLOCK_N, w_rows, gate_offset, INTERLEAVED, ACT, ALPHA, LIMIT,
                      UP_SHIFT, LIMIT_AFTER)
    tma.store_wait(0)


@gluon.jit
def _k_loop(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, ws_up, k_steps, it, HALF: gl.constexpr,
            GATED: gl.constexpr, layout: gl.constexpr):
    """One tile's reduction, each MMA waited at once (the other consumer's MMAs fill the tensor cores meanwhile):
    (acc [64, 128] float32, up (GATED: two weight tiles a stage, gate/up or WIDE's two column blocks; else
    unused), the ring position after it). Keeping a part in flight across the loop's back edge makes ptxas
    serialize the wgmmas (C7514: accumulator registers read inside the pipeline stage); ``_k_loop_paired``
    keeps two in flight inside one iteration instead."""
    HALF_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    WTILES: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = w_bufs.type.shape[0] // WTILES
    acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    up = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    part = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    a_scale = gl.load(as_ptrs)  # [64] K-step 0's; each step loads the next one's while its MMAs run
    for kk in range(k_steps):
        s = it % STAGES
        w_gate = gl.load(ws_gate + kk)
        if GATED:
            w_up = gl.load(ws_up + kk)
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(2 * s + HALF)
        part = warpgroup_mma(a, w_bufs.index(s * WTILES).permute((1, 0)), part, use_acc=False, is_async=True)
        next_scale = gl.load(as_ptrs + gl.minimum(kk + 1, k_steps - 1))  # the last step reloads its own
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        if GATED:
            acc += part * (a_scale * w_gate)[:, None]
            part = warpgroup_mma(a, w_bufs.index(s * WTILES + 1).permute((1, 0)), part, use_acc=False,
                                 is_async=True)
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(s), count=1)  # this half's MMAs on stage s retired
            up += part * (a_scale * w_up)[:, None]
        else:
            mbarrier.arrive(empty.index(s), count=1)
            acc += part * (a_scale * w_gate)[:, None]
        a_scale = next_scale
        it += 1
    return acc, up, it


@gluon.jit
def _k_loop_paired(a_bufs, w_bufs, ready, empty, as_ptrs, ws_ptrs, k_steps, it, HALF: gl.constexpr,
                   layout: gl.constexpr):
    """PIPE (the down GEMM, one weight tile a stage): the K-steps in pairs, both wgmmas in flight, the first one's
    part folded in while the second runs (``benchmarks/ovl_kernels.py``'s ``_pair``); an odd last step alone,
    waited. Nothing is in flight across the back edge. (acc [64, 128] float32, the ring position after it)."""
    HALF_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    scale_a = gl.load(as_ptrs) * gl.load(ws_ptrs)  # [64] step 0's; each pair loads the next pair's under its MMAs
    scale_b = gl.load(as_ptrs + gl.minimum(1, k_steps - 1)) * gl.load(ws_ptrs + gl.minimum(1, k_steps - 1))
    for j in range(k_steps // 2):
        sa = it % STAGES
        sb = (it + 1) % STAGES
        mbarrier.wait(ready.index(sa), (it // STAGES) & 1)
        pa = warpgroup_mma(a_bufs.index(2 * sa + HALF), w_bufs.index(sa).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        mbarrier.wait(ready.index(sb), ((it + 1) // STAGES) & 1)
        pb = warpgroup_mma(a_bufs.index(2 * sb + HALF), w_bufs.index(sb).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        ka = gl.minimum(2 * j + 2, k_steps - 1)  # the next pair's steps (the last pair reloads in range)
        kb = gl.minimum(2 * j + 3, k_steps - 1)
        next_a = gl.load(as_ptrs + ka) * gl.load(ws_ptrs + ka)
        next_b = gl.load(as_ptrs + kb) * gl.load(ws_ptrs + kb)
        pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
        mbarrier.arrive(empty.index(sa), count=1)
        acc += pa * scale_a[:, None]
        pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
        mbarrier.arrive(empty.index(sb), count=1)
        acc += pb * scale_b[:, None]
        scale_a = next_a
        scale_b = next_b
        it += 2
    if k_steps % 2 == 1:  # scale_a is the last step's
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(2 * s + HALF), w_bufs.index(s).permute((1, 0)), zero, use_acc=False)
        mbarrier.arrive(empty.index(s), count=1)
        acc += part * scale_a[:, None]
        it += 1
    return acc, it


@gluon.jit
def _wide_epilogue(acc, right, c_desc, c_left, c_right, row0, cb):
    """WIDE: one half tile's two [64, 128] column blocks 2cb, 2cb + 1 out by TMA in c_desc's dtype. Each goes
    through a blocked layout on its way to SMEM: stored from the wgmma layout (stmatrix), ptxas kept the loop's
    registers in a layout that spilled 364 B in the K loop (sm_90a, Triton 3.9); this way 16 B (3.6: none)."""
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    tma.store_wait(0)  # the last tile's stores have read both buffers
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 4 warps, 8 contiguous bf16 a thread
    c_left.store(gl.convert_layout(acc.to(c_desc.dtype), blocked))
    c_right.store(gl.convert_layout(right.to(c_desc.dtype), blocked))
    fence_async_shared()
    _tma_store(c_desc, [row0, 2 * cb * BLOCK_N], c_left)
    _tma_store(c_desc, [row0, (2 * cb + 1) * BLOCK_N], c_right)


@gluon.jit
def _epilogue(acc, up, c_desc, c_buf, cs_ptrs, row0, cb, GATED: gl.constexpr, bias_ptr, expert_ptr, first_row, w_rows,
              gate_offset, INTERLEAVED: gl.constexpr, ACT: gl.constexpr, ALPHA: gl.constexpr, LIMIT: gl.constexpr,
              UP_SHIFT: gl.constexpr, LIMIT_AFTER: gl.constexpr):
    """One half tile out by TMA: GATED, h = act(gate) * up quantized per row over its 128 columns (one h
    group; ``quant_fp8``'s scale and rounding), its scales to cs_ptrs [64]; else acc in c_desc's dtype.
    bias_ptr (None: none): b13 / b2 rows of the tile's weight rows first_row.. (acc's) and gate_offset + first_row..
    (up's) of the expert at expert_ptr, added in float32 first. The expert is read again here (volatile: not merged
    with the tile's first read), so no register holds it through the K loop: with it held, Triton 3.6's ptxas spilled
    two 64-bit values of consumer 0 in gpt-oss's gate-up K loop (6 local loads / stores a K-step; sm_90 SASS), without
    none (120 B of spill stores, all in the epilogue; Triton 3.9: one local load in the loop, as the plain kernel's).
    The plain silu keeps its own expression (its kernel as before: SASS-identical); any other gated spec, or
    interleaved rows, goes through ``_variant_h``."""
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    tma.store_wait(0)  # the last tile's store has read c_buf
    if bias_ptr is not None:
        acc, up = _add_biases(acc, up, bias_ptr + gl.load(expert_ptr, volatile=True) * w_rows, first_row, w_rows,
                              gate_offset, GATED)
    if GATED:
        if INTERLEAVED or ACT != 0 or ALPHA != 1.0 or LIMIT is not None or UP_SHIFT != 0.0:
            h = _variant_h(acc, up, first_row, w_rows, gate_offset, INTERLEAVED, ACT, ALPHA, LIMIT, UP_SHIFT,
                           LIMIT_AFTER)
        else:
            h = acc / (1.0 + gl.exp(-acc)) * up  # [64, 128] fp32
        amax = gl.max(gl.abs(h), axis=1)
        h_scale = gl.where(amax > 0, amax / 448.0, 1.0)
        c_buf.store(gl.minimum(gl.maximum(h / h_scale[:, None], -448.0), 448.0).to(c_desc.dtype))
        if INTERLEAVED:  # h's joined layout holds the rows as the wgmma layout does: a relabelling, no data moved
            h_scale = gl.convert_layout(h_scale, cs_ptrs.type.layout)
        gl.store(cs_ptrs, h_scale)
    else:
        c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [row0, cb * BLOCK_N], c_buf)


@gluon.jit
def _add_biases(acc, up, bias_rows, first_row, w_rows, gate_offset, GATED: gl.constexpr):
    """(acc + the bias of its weight rows first_row + c, up + those of gate_offset + first_row + c (GATED)), each
    [64, 128] float32; rows past w_rows (the expert's 2N or K) add 0. bias_rows: the expert's bias row."""
    cols = first_row + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))  # [128] weight rows
    acc += gl.load(bias_rows + cols, mask=cols < w_rows, other=0.0).to(gl.float32)[None, :]
    if GATED:
        up_rows = cols + gate_offset
        up += gl.load(bias_rows + up_rows, mask=up_rows < w_rows, other=0.0).to(gl.float32)[None, :]
    return acc, up


@gluon.jit
def _variant_h(acc, up, first_row, w_rows, gate_offset, INTERLEAVED: gl.constexpr, ACT: gl.constexpr,
               ALPHA: gl.constexpr, LIMIT: gl.constexpr, UP_SHIFT: gl.constexpr, LIMIT_AFTER: gl.constexpr):
    """h [64, 128] float32 of a gated variant (``gemm._glu``: the Triton kernels' activation, the spec's constexprs).
    INTERLEAVED: acc and up hold the products of the tile's two row tiles in place (rows first_row.. then
    first_row + 128..: gate j, up j, gate j + 1, ... of the tile's first 64 columns, then of its last 64); rows past
    w_rows (the next expert's, or the descriptor's zeros) are set to 0 first, so their h columns (past N, never
    stored) are act(0) * (0 + UP_SHIFT) = 0 for every activation and stay out of the row's amax. Each row tile's
    pairs split in registers (adjacent columns of a thread in the wgmma layout), h of the two joined in column
    order. Else acc is the gate tile, up the up tile."""
    HALF_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1]
    if INTERLEAVED:
        rows = first_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc.type.layout))  # [128] weight rows
        acc = gl.where((rows < w_rows)[None, :], acc, 0.0)
        up = gl.where((rows + gate_offset < w_rows)[None, :], up, 0.0)
        gate_a, up_a = gl.split(gl.reshape(acc, [HALF_M, BLOCK_N // 2, 2]))  # [64, 64] each: columns 0..63
        gate_b, up_b = gl.split(gl.reshape(up, [HALF_M, BLOCK_N // 2, 2]))  # columns 64..127
        h_a = _glu(gate_a, up_a, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
        h_b = _glu(gate_b, up_b, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
        h = gl.reshape(gl.permute(gl.join(h_a, h_b), [0, 2, 1]), [HALF_M, BLOCK_N])  # [64, 128]
    else:
        h = _glu(acc, up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)
    return h


@gluon.jit
def grouped_gemm_fp8_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr, bias_ptr, reduce_dim,
                            num_col_blocks, w_rows, gate_offset, stride_as, stride_wse, stride_wsr, stride_cs,
                            GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr, WIDE: gl.constexpr = False,
                            PIPE: gl.constexpr = False, INTERLEAVED: gl.constexpr = False, ACT: gl.constexpr = 0,
                            ALPHA: gl.constexpr = 1.0, LIMIT: gl.constexpr = None, UP_SHIFT: gl.constexpr = 0.0,
                            LIMIT_AFTER: gl.constexpr = False):
    """w_rows = W_ROWS and gate_offset = N (GATED) are plain arguments (one compile serves every shape).
    a_desc e4m3 [T, R] blocks [64, 128]; w_desc e4m3 [E*W_ROWS, R] blocks [128, 128]; c_desc [T, C] blocks
    [64, 128] (GATED: e4m3 h, else bf16 y); as_ptr [T, ceil(R/128)] fp32 (row stride stride_as); ws_ptr [E,
    ceil(W_ROWS/128), ceil(R/128)] fp32 (strides stride_wse, stride_wsr, 1); cs_ptr [T, ceil(C/128)] fp32 h scales
    (GATED only; row stride stride_cs); experts_ptr [T/128] int32; used_ptr -> rows in use (a multiple of 128);
    num_col_blocks = ceil(C/128). R and C need not be multiples of 128: TMA reads zeros past R (both operands) and
    clips the stores at C; a last column block's rows past W_ROWS are the next expert's (unstored columns).
    num_warps = 4 (consumer 0); consumer 1 (4 warps, CONSUMER_REGS registers) and the loader (1 warp) added.
    WIDE (down only): [128, 256] tiles, gate_offset = 128, num_col_blocks = C/256; c_desc blocks [64, 128].
    PIPE (the narrow down GEMM alone): two wgmmas in flight, one's part folded in while the other runs
    (``_k_loop_paired``).
    The experts variant (issue #15; all off: the plain kernel): bias_ptr b13 [E, 2N] (GATED) or b2 [E, K]
    contiguous, or None; INTERLEAVED (GATED): w13's rows gate j = 2j, up j = 2j + 1 (gpt-oss), a tile of 128 h columns
    read as the 256 rows in place in two row tiles (gate_offset = 128, scale blocks 2cb and 2cb + 1: ``_variant_h``);
    ACT / ALPHA / LIMIT / UP_SHIFT / LIMIT_AFTER the gated activation (``moekit.activations.ActivationSpec``,
    ``gemm._glu``)."""
    WTILES: gl.constexpr = 2 if GATED or WIDE else 1
    OUT_BUFS: gl.constexpr = 4 if WIDE else 2  # one [64, 128] output buffer per consumer per column block
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [OUT_BUFS] + c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES, 2)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr,
                     bias_ptr, reduce_dim, num_col_blocks, w_rows, gate_offset, stride_as, stride_wse, stride_wsr,
                     stride_cs, FIRST_HALF, GATED, GROUP_M, WIDE, PIPE, INTERLEAVED, ACT, ALPHA, LIMIT, UP_SHIFT,
                     LIMIT_AFTER)),
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr,
                     bias_ptr, reduce_dim, num_col_blocks, w_rows, gate_offset, stride_as, stride_wse, stride_wsr,
                     stride_cs, SECOND_HALF, GATED, GROUP_M, WIDE, PIPE, INTERLEAVED, ACT, ALPHA, LIMIT, UP_SHIFT,
                     LIMIT_AFTER)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   w_rows, gate_offset, GATED, GROUP_M, WIDE, INTERLEAVED)),
    ], [4, 1], [CONSUMER_REGS, 24])

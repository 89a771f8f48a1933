"""The bf16 Gluon down GEMM with an expert's last, mostly empty row block folded into the block before it (issue 19:
the padding tax at prefill).

    y[r, c] = h[r, :] @ W[e(r), c, :]^T        r: a row of the 128-aligned contiguous layout, e(r) its expert

``gluon_gemm.grouped_gemm_kernel`` computes every 128-row block of the layout as one [128, BLOCK_N] tile. An expert
whose rows end a little past a multiple of 128 (DeepSeek-V3 at M = 4096: ~128 rows an expert, about half of them
with a second block) pays a whole second tile for a few rows: its weights stream into SMEM twice and the MMAs run
on 128 rows. Here a block b "merges" when block b + 1 is the same expert's last block and holds at most TAIL = 64
real rows (the layout's ``sorted_ids[(b + 1) * 128 + 64]`` is padding). The tile of (b, column block) then also
computes block b + 1's first 64 rows from the same weight stage (one more [64, BLOCK_K] A tile a K step, its own
accumulator: m64 MMAs, the two warpgroups splitting the columns), and the tiles of block b + 1 do nothing (both
partitions skip them: the same predicate on the same data). Rows past 64 in a merged block are never written
(padding: the combine never reads them). The extra A tile and output leave SMEM for 4 stages (the plain down
GEMM: 6), so a tile that merges nothing runs slower than the plain kernel's: it pays only where most experts end
just past a 128-row block (measured: benchmarks/triton-notes.md, "the padding tax"). Measured and removed (H200 run
1): the gate-up GEMM with the same tail (3 stages: slower everywhere), a 128-row tail, the fp8 down GEMM's third
consumer for the tail (1.01x at DeepSeek-V3 4096).
The loader, ring and epilogue are ``gluon_gemm``'s; the tile list and its order too (GROUP_M swizzle).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tile_of, _tma_load, _tma_store, stage_barriers, tile_walk


@gluon.jit
def _merges(experts_ptr, sorted_ptr, b, num_row_blocks, num_assignments, BLOCK_M: gl.constexpr,
            TAIL: gl.constexpr):
    """Whether row block b takes block b + 1 into its tiles (1 or 0): b + 1 is the same expert's last block and holds
    at most TAIL real rows (an expert's real rows come first in its segment). Any b (-1, past the rows in use): 0,
    nothing read out of range."""
    ok = (b >= 0) & (b + 1 < num_row_blocks)
    e = gl.load(experts_ptr + b, mask=ok, other=-1)
    e1 = gl.load(experts_ptr + b + 1, mask=ok, other=-2)
    e2 = gl.load(experts_ptr + b + 2, mask=ok & (b + 2 < num_row_blocks), other=-3)  # -3: no block b + 2
    ok = ok & (e1 == e) & (e2 != e)
    if TAIL < BLOCK_M:
        ok = ok & (gl.load(sorted_ptr + (b + 1) * BLOCK_M + TAIL, mask=ok, other=0) >= num_assignments)
    return ok.to(gl.int32)


@gluon.jit
def _tile_state(t, num_tiles, num_row_blocks, num_col_blocks, experts_ptr, sorted_ptr, num_assignments,
                GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, TAIL: gl.constexpr):
    """(row block, column block, merged, skipped) of tile min(t, num_tiles - 1): the MMA partitions read the next
    tile's while this one's MMAs run (its loads off the critical path between tiles)."""
    rb, cb = _tile_of(gl.minimum(t, gl.maximum(num_tiles - 1, 0)), num_row_blocks, num_col_blocks, GROUP_M)
    merged = _merges(experts_ptr, sorted_ptr, rb, num_row_blocks, num_assignments, BLOCK_M, TAIL)
    skipped = _merges(experts_ptr, sorted_ptr, rb - 1, num_row_blocks, num_assignments, BLOCK_M, TAIL)
    return rb, cb, merged, skipped


@gluon.jit
def _tail_loader(a_desc, t_desc, w_desc, a_bufs, t_bufs, w_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr,
                 num_assignments, reduce_dim, num_col_blocks, W_ROWS: gl.constexpr, GROUP_M: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    TAIL: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    tbytes: gl.constexpr = nbytes + t_desc.block_type.nbytes
    num_row_blocks, num_tiles, k_steps = tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        merged = _merges(experts_ptr, sorted_ptr, rb, num_row_blocks, num_assignments, BLOCK_M, TAIL)
        skipped = _merges(experts_ptr, sorted_ptr, rb - 1, num_row_blocks, num_assignments, BLOCK_M, TAIL)
        if skipped == 0:
            expert = gl.load(experts_ptr + rb)
            w_row = expert * W_ROWS + cb * BLOCK_N
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                if merged != 0:
                    mbarrier.expect(ready.index(s), tbytes)
                    _tma_load(t_desc, [(rb + 1) * BLOCK_M, kk * BLOCK_K], ready.index(s), t_bufs.index(s))
                else:
                    mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [rb * BLOCK_M, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
                _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w_bufs.index(s))
                it += 1


@gluon.jit
def _tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, layout: gl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile (the plain kernel's K loop and epilogue); returns the ring position after it."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    tma.store_wait(0)  # the last tile's stores have read c_buf / ct_buf
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    return it


@gluon.jit
def _merged_tile(c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, rb, cb, k_steps, it,
                 layout: gl.constexpr, tail_layout: gl.constexpr):
    """Row block rb's tile and the first TAIL rows of block rb + 1 from the same weight stages."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    TAIL: gl.constexpr = ct_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
    tail = gl.zeros([TAIL, BLOCK_N], gl.float32, tail_layout)
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        w = w_bufs.index(s).permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(s), w, acc, is_async=True)
        tail = warpgroup_mma(t_bufs.index(s), w, tail, is_async=True)
        acc, tail = warpgroup_mma_wait(num_outstanding=2, deps=(acc, tail))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        it += 1
    acc, tail = warpgroup_mma_wait(num_outstanding=0, deps=(acc, tail))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    tma.store_wait(0)
    c_buf.store(acc.to(c_desc.dtype))
    ct_buf.store(tail.to(ct_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    _tma_store(ct_desc, [(rb + 1) * BLOCK_M, cb * BLOCK_N], ct_buf)
    return it


@gluon.jit
def _tail_mma(c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, experts_ptr, sorted_ptr,
              used_ptr, num_assignments, reduce_dim, num_col_blocks, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    TAIL: gl.constexpr = ct_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    # the TAIL = 64 rows: each warpgroup all of them and half the columns (m64 MMAs, BLOCK_N / 2 wide)
    tail_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps // 2, 2], instr_shape=[16, BLOCK_N // 2, 16])
    num_row_blocks, num_tiles, k_steps = tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K)
    it = 0
    rb, cb, merged, skipped = _tile_state(gl.program_id(0), num_tiles, num_row_blocks, num_col_blocks, experts_ptr,
                                          sorted_ptr, num_assignments, GROUP_M, BLOCK_M, TAIL)
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb_next, cb_next, merged_next, skipped_next = _tile_state(
            t + gl.num_programs(0), num_tiles, num_row_blocks, num_col_blocks, experts_ptr, sorted_ptr,
            num_assignments, GROUP_M, BLOCK_M, TAIL)
        if skipped == 0:
            if merged != 0:
                it = _merged_tile(c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, rb, cb,
                                  k_steps, it, layout, tail_layout)
            else:
                it = _tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, layout)
        rb, cb, merged, skipped = rb_next, cb_next, merged_next, skipped_next
    tma.store_wait(0)


@gluon.jit
def tail_down_kernel(a_desc, t_desc, w_desc, c_desc, ct_desc, experts_ptr, sorted_ptr, used_ptr, num_assignments,
                     reduce_dim, num_col_blocks, W_ROWS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     num_warps: gl.constexpr):
    """a_desc [T, R] blocks [BM, BK] and t_desc the same tensor in [TAIL, BK] blocks; w_desc [E*W_ROWS, R] blocks
    [BN, BK]; c_desc [T, C] blocks [BM, BN] and ct_desc the same tensor in [TAIL, BN] blocks; experts_ptr [T / BM]
    int32 expert of each row block; sorted_ptr [T] int32 assignment of each row (>= num_assignments: padding);
    used_ptr -> rows in use (a multiple of BM); reduce_dim = R; num_col_blocks = C / BN."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ct_buf = gl.allocate_shared_memory(ct_desc.dtype, ct_desc.block_type.shape, ct_desc.layout)
    ready, empty = stage_barriers(STAGES, 1)
    gl.warp_specialize([
        (_tail_mma, (c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, experts_ptr, sorted_ptr,
                     used_ptr, num_assignments, reduce_dim, num_col_blocks, GROUP_M, num_warps)),
        (_tail_loader, (a_desc, t_desc, w_desc, a_bufs, t_bufs, w_bufs, ready, empty, experts_ptr, sorted_ptr,
                        used_ptr, num_assignments, reduce_dim, num_col_blocks, W_ROWS, GROUP_M)),
    ], [1], [24])

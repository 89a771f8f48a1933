"""The bf16 Gluon grouped gate-up GEMM with 256-row tiles that skip padding in 64-row steps (issue 19 at the ridge).

    out[r, c] = silu(A[r, :] @ W[e(r), c, :]^T) * (A[r, :] @ W[e(r), N + c, :]^T)
    r: a row of the 128-aligned contiguous layout, e(r) its expert

``gluon_gemm.grouped_gemm_kernel`` computes every 128-row block as one tile, so an expert whose rows end a few past a
block boundary streams its weight tiles twice (Mixtral M = 512: gate-up 606-640 µs under uniform routing, 485-510
balanced; session 27's mid7). Here a tile covers up to 256 rows of ONE expert: the row blocks 2j and 2j + 1 counted
from the expert's first block (``_first_block``: a binary search in ``block_experts``, sorted by expert). It is four
64-row sub-tiles; the live ones are those inside the expert's segment whose first row is a real assignment
(``sorted_ids[row] < num_assignments``; an expert's real rows come first in its segment). Sub-tiles that are not live
are neither loaded, multiplied nor stored, so padding costs tensor work only in 64-row steps and every weight tile
serves up to 256 rows: an expert with <= 256 rows streams its weights once.

Per K step a stage holds A [256, BK] (the live 64-row sub-tiles, by TMA) and W [128, BK]: the tile's 64 gate rows then
its 64 up rows, one m64n128 wgmma covering both, so silu(gate) * up is a register split (the wgmma fragment repeats
every 8 columns: columns c and 64 + c sit in one thread); out [256, 64]. (A down GEMM on these tiles and a SPREAD
form, one m64 on each consumer for a tile of <= 2 live sub-tiles, lost on the H200 in session 28: removed, history
5d589df.) Three partitions a program:
  - consumer 0 (default partition, 4 warps) rows 0-127, consumer 1 (worker, 4 warps) rows 128-255: each runs an m128
    (two live sub-tiles), an m64 (one) or no MMA (none: it only releases the stages), [M, 128] float32 accumulators
    (at most 128 registers a thread), its own epilogue;
  - loader (1 warp): TMA loads of the live A sub-tiles and the weight tile into a STAGES-deep ring; ``ready`` (bytes
    landed, the count expected for the tile's live sub-tiles) and ``empty`` (count 2: both consumers are done).
The walk: one program per SM over (row block, column block) in ``gluon_gemm._tile_of``'s GROUP_M order; a row block
that is not a tile's first (odd from its expert's first block) is skipped by all three partitions alike.
Torch twin: ``moekit.experts.triton_gluon_blk256.blk256_gemm_twin``. Gluon does not run in the interpreter.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tile_of, _tma_load, _tma_store, stage_barriers

FIRST_ROWS = gl.constexpr(0)  # the consumers' SUB: rows 0-127 / 128-255 of a tile
SECOND_ROWS = gl.constexpr(1)


@gluon.jit
def _first_block(experts_ptr, rb, SEARCH_STEPS: gl.constexpr):
    """The first row block of block rb's expert: the least b <= rb with block_experts[b] == block_experts[rb] (blocks
    sorted by expert up to rows_used; SEARCH_STEPS >= log2(rb + 1) halvings)."""
    e = gl.load(experts_ptr + rb)
    lo = rb * 0
    hi = rb
    for _ in gl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = (gl.load(experts_ptr + mid) < e).to(gl.int32)
        lo = lo + below * (mid + 1 - lo)
        hi = hi + (1 - below) * (mid - hi)
    return lo


@gluon.jit
def _tile_state(t, num_row_blocks, num_col_blocks, experts_ptr, sorted_ptr, num_assignments, GROUP_M: gl.constexpr,
                SEARCH_STEPS: gl.constexpr):
    """(row block, column block, expert, live sub-tiles: 0 where rb starts no tile, else 1-4) of tile id t."""
    rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
    e = gl.load(experts_ptr + rb)
    head = ((rb - _first_block(experts_ptr, rb, SEARCH_STEPS)) % 2 == 0).to(gl.int32)
    has_next = rb + 1 < num_row_blocks
    same = (gl.load(experts_ptr + rb + 1, mask=has_next, other=-1) == e) & has_next  # rb + 1: the same expert's
    row0 = rb * 128
    live = 1 + (gl.load(sorted_ptr + row0 + 64) < num_assignments).to(gl.int32)
    last = gl.load(sorted_ptr + row0 + 192, mask=same, other=num_assignments) < num_assignments
    live = gl.where(same, 3 + last.to(gl.int32), live)  # rb + 1 the same expert's: rb full, rb + 1's row 0 real
    return rb, cb, e, live * head


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
            reduce_dim, num_col_blocks, W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GROUP_M: gl.constexpr,
            SEARCH_STEPS: gl.constexpr):
    SUB_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    W_N: gl.constexpr = w_desc.block_type.shape[0]  # 64 gate rows (then 64 up rows)
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    W_BYTES: gl.constexpr = 2 * w_desc.block_type.nbytes
    SUB_BYTES: gl.constexpr = a_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * SUB_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb, e, live = _tile_state(t, num_row_blocks, num_col_blocks, experts_ptr, sorted_ptr, num_assignments,
                                      GROUP_M, SEARCH_STEPS)
        if live > 0:
            w_row = e * W_ROWS + cb * W_N
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                for j in gl.static_range(1, 5):  # one expect, for the live sub-tiles' bytes
                    mbarrier.expect(ready.index(s), W_BYTES + j * SUB_BYTES, pred=live == j)
                a = a_bufs.index(s)
                for j in gl.static_range(4):
                    _tma_load(a_desc, [rb * 2 * SUB_M + j * SUB_M, kk * BLOCK_K], ready.index(s),
                              a.slice(j * SUB_M, SUB_M), pred=live > j)
                w = w_bufs.index(s)
                _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w.slice(0, W_N))
                _tma_load(w_desc, [w_row + GATE_OFFSET, kk * BLOCK_K], ready.index(s), w.slice(W_N, W_N))
                it += 1


@gluon.jit
def _release(ready, empty, k_steps, it):
    """A consumer with no live rows in a tile: each stage released once its loads landed (so it never arrives twice
    in one phase of ``empty``); returns the ring position after the tile."""
    STAGES: gl.constexpr = ready.type.shape[0]
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(s), count=1)
        it += 1
    return it


@gluon.jit
def _rows(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, k_steps, it, ROW: gl.constexpr, M: gl.constexpr):
    """Rows ROW .. ROW + M of the tile (M = 128: two sub-tiles, 64: one) at row0 + ROW of out, column block cb."""
    W_N: gl.constexpr = w_bufs.type.shape[1]
    SUB_M: gl.constexpr = c_desc.block_type.shape[0]
    OUT_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W_N, 16])
    acc = gl.zeros([M, W_N], gl.float32, layout)  # [gate | up]
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s).slice(ROW, M), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the previous step's MMA retired: this consumer is done with its stage
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    gate, up = acc.reshape([M, 2, OUT_N]).permute((0, 2, 1)).split()  # [M, 64] each
    out = gate / (1.0 + gl.exp(-gate)) * up  # silu(gate) * up
    tma.store_wait(0)  # the last tile's stores have read c_buf
    c_buf.slice(0, M).store(out.to(c_desc.dtype))
    fence_async_shared()
    for j in gl.static_range(M // SUB_M):
        _tma_store(c_desc, [row0 + ROW + j * SUB_M, cb * OUT_N], c_buf.slice(j * SUB_M, SUB_M))
    return it


@gluon.jit
def _share(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, live, k_steps, it, SUB: gl.constexpr):
    """This consumer's share of a tile with ``live`` sub-tiles (1-4): its rows SUB * 128 .. as an m128 (two of them
    live), an m64 (one) or no MMA; returns the ring position after the tile."""
    SUB_M: gl.constexpr = c_desc.block_type.shape[0]
    mine = gl.minimum(gl.maximum(live - 2 * SUB, 0), 2)  # this consumer's live sub-tiles
    if mine == 2:
        it = _rows(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, k_steps, it, SUB * 2 * SUB_M, 2 * SUB_M)
    elif mine == 1:
        it = _rows(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, k_steps, it, SUB * 2 * SUB_M, SUB_M)
    else:
        it = _release(ready, empty, k_steps, it)
    return it


@gluon.jit
def _consumer(c_desc, a_bufs, w_bufs, c_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
              reduce_dim, num_col_blocks, SUB: gl.constexpr, GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr):
    """Rows SUB * 128 .. of every tile (``_share``)."""
    SUB_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * SUB_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    c_buf = c_bufs.index(SUB)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb, e, live = _tile_state(t, num_row_blocks, num_col_blocks, experts_ptr, sorted_ptr, num_assignments,
                                      GROUP_M, SEARCH_STEPS)
        if live > 0:
            it = _share(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb * 2 * SUB_M, cb, live, k_steps, it, SUB)
    tma.store_wait(0)


@gluon.jit
def blk256_gemm_kernel(a_desc, w_desc, c_desc, experts_ptr, used_ptr, sorted_ptr, num_assignments, reduce_dim,
                       num_col_blocks, W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, STAGES: gl.constexpr,
                       GROUP_M: gl.constexpr, SEARCH_STEPS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       num_warps: gl.constexpr):
    """a_desc [T, K] blocks [64, BK]; w_desc [E*W_ROWS, K] blocks [64, BK] (W_ROWS = 2N: gate rows, then up rows at
    GATE_OFFSET = N); c_desc [T, N] blocks [64, 64]; experts_ptr [T / 128] int32 expert of each 128-row block (-1 past
    the rows in use); used_ptr -> rows in use (a multiple of 128); sorted_ptr [T] int32 assignment of each row (>=
    num_assignments: padding); the first five as ``gluon_gemm.grouped_gemm_kernel``'s (the lean launch binds them
    alike); reduce_dim = K; num_col_blocks = N / 64. num_warps = 4."""
    W_N: gl.constexpr = 2 * w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    SUB_M: gl.constexpr = a_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, 4 * SUB_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, W_N, BLOCK_K], w_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, 2 * SUB_M, c_desc.block_type.shape[1]], c_desc.layout)
    ready, empty = stage_barriers(STAGES, 2)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
                     reduce_dim, num_col_blocks, FIRST_ROWS, GROUP_M, SEARCH_STEPS)),
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
                     reduce_dim, num_col_blocks, SECOND_ROWS, GROUP_M, SEARCH_STEPS)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
                   reduce_dim, num_col_blocks, W_ROWS, GATE_OFFSET, GROUP_M, SEARCH_STEPS)),
    ], [4, 1], [CONSUMER_REGS, 24])

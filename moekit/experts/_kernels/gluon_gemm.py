"""Warp-specialized persistent grouped GEMM for Hopper, written in Gluon, on the contiguous layout.

    out[r, c] = act(A[r, :] @ W[e(r), c, :]^T)      r: a row of the permuted buffer, e(r) its expert

A [T, R] is the permuted activation buffer (the block-aligned layout's rows, gathered: every expert's
rows form one segment starting on a BLOCK_M boundary, so each [BLOCK_M, ...] row block belongs to one
expert, ``block_experts[row block]``). W is a 2-D view [E * W_ROWS, R] of the weights (w13 [E, 2N, K] with
W_ROWS = 2N, or w2 [E, K, N] with W_ROWS = K), read in [BLOCK_N, BLOCK_K] tiles by TMA.
GATED (the gate-up GEMM): two weight tiles per step, gate rows c and up rows N + c, two accumulators,
out = silu(gate) * up. Otherwise (down GEMM) one tile and out = the product.

One program per SM walks the tiles (row block, column block) of the rows in use (``rows_used``,
read on the device: no host sync) in a GROUP_M-swizzled order, so CTAs running at once share weight
tiles in L2. Two partitions per program:
  - loader (1 warp, few registers): TMA loads of A and W tiles into a STAGES-deep SMEM ring; each
    stage has a `ready` barrier (TMA bytes landed) and an `empty` one (the MMAs that read it retired).
  - default (num_warps = 8, two warpgroups sharing each [BLOCK_M, BLOCK_N] tile): async wgmma with
    one group in flight, releases each stage as soon as the MMA that read it retired, then the
    epilogue (registers -> SMEM -> TMA store) while the loader already fills the next tile's stages.

Triton spelled the TMA copies differently across releases: 3.6 ``async_copy_global_to_shared`` /
``async_copy_shared_to_global``, 3.9 ``async_load`` / ``async_store`` (the old names raise). The
aliases below pick whichever this Triton has. Gluon does not run in the interpreter (CUDA sm_90 only).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M: gl.constexpr):
    """Tile id -> (row block, column block): GROUP_M row blocks share each column block in turn."""
    per_group = GROUP_M * num_col_blocks
    first = (t // per_group) * GROUP_M
    rows_here = gl.minimum(num_row_blocks - first, GROUP_M)
    rb = first + (t % per_group) % rows_here
    cb = (t % per_group) // rows_here
    return rb, cb


@gluon.jit
def tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr):
    """The persistent walk's sizes: row blocks (the rows in use / BM), tiles (x the column blocks), K steps."""
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    return num_row_blocks, num_row_blocks * num_col_blocks, gl.cdiv(reduce_dim, BLOCK_K)


@gluon.jit
def stage_barriers(STAGES: gl.constexpr, EMPTY_COUNT: gl.constexpr):
    """ready [STAGES] (one arrival: the loader's expect, then the TMA bytes) and empty [STAGES] (EMPTY_COUNT
    arrivals: the consumers that release a stage), initialised; the kernels' shared stage barriers."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=EMPTY_COUNT)
    return ready, empty


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
            W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr, GROUP_M: gl.constexpr,
            PACK: gl.constexpr = 1):
    """The TMA loader. PACK: weights a stored element holds (2: the weight-only GEMM's packed int4 bytes,
    ``gluon_gemm_wo``)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    nbytes: gl.constexpr = a_desc.block_type.nbytes + WTILES * w_desc.block_type.nbytes
    num_row_blocks, num_tiles, k_steps = tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        expert = gl.load(experts_ptr + rb)
        w_row = expert * W_ROWS + cb * BLOCK_N
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(s), nbytes)
            _tma_load(a_desc, [rb * BLOCK_M, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
            _tma_load(w_desc, [w_row, kk * (BLOCK_K // PACK)], ready.index(s), w_bufs.index(s * WTILES))
            if GATED:
                _tma_load(w_desc, [w_row + GATE_OFFSET, kk * (BLOCK_K // PACK)], ready.index(s),
                          w_bufs.index(s * WTILES + 1))
            it += 1


@gluon.jit
def _mma_epilogue(c_desc, a_bufs, w_bufs, c_buf, ready, a_ready, empty, used_ptr, reduce_dim, num_col_blocks,
                  GATED: gl.constexpr, GROUP_M: gl.constexpr, GATHER: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    num_row_blocks, num_tiles, k_steps = tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if GATHER:  # the A tile came by cp.async (generic proxy): landed, then made visible to the wgmma's
                mbarrier.wait(a_ready.index(s), (it // STAGES) & 1)
                fence_async_shared()
            a = a_bufs.index(s)
            acc = warpgroup_mma(a, w_bufs.index(s * WTILES).permute((1, 0)), acc, is_async=True)
            if GATED:
                up = warpgroup_mma(a, w_bufs.index(s * WTILES + 1).permute((1, 0)), up, is_async=True)
                acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's MMAs retired: its stage may be refilled
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            it += 1
        if GATED:
            acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
            acc = acc / (1.0 + gl.exp(-acc)) * up  # silu(gate) * up
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
        tma.store_wait(0)  # the last tile's store has read c_buf
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_kernel(a_desc, w_desc, c_desc, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                        W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                        STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """a_desc [T, R] blocks [BM, BK]; w_desc [E*W_ROWS, R] blocks [BN, BK]; c_desc [T, C] blocks [BM, BN];
    experts_ptr [T / BM] int32 expert of each row block; used_ptr -> rows in use (a multiple of BM); reduce_dim = R;
    num_col_blocks = C / BN; GATE_OFFSET = N (the up rows follow the gate rows) when GATED."""
    WTILES: gl.constexpr = 2 if GATED else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES, 1)
    gl.warp_specialize([
        (_mma_epilogue, (c_desc, a_bufs, w_bufs, c_buf, ready, ready, empty, used_ptr, reduce_dim, num_col_blocks,
                         GATED, GROUP_M, False, num_warps)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   W_ROWS, GATE_OFFSET, GATED, GROUP_M)),
    ], [1], [24])

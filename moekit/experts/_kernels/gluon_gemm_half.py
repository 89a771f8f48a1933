"""The bf16 Gluon grouped GEMM whose mostly empty row blocks run as 64-row tiles (issue 19: the padding tax at the
ridge, 8 <= M <= 1024).

    out[r, c] = act(A[r, :] @ W[e(r), c, :]^T)      r: a row of the 128-aligned contiguous layout, e(r) its expert

``gluon_gemm.grouped_gemm_kernel`` multiplies every 128-row block as a whole [128, BLOCK_N] tile. At Mixtral-8x7B
M = 512 each expert holds ~128 rows, so about a third of the blocks (3.7 of 11.7, uniform routing) are an expert's
last block with 1-64 real rows, and the GEMMs multiply 1.47 rows per real row (1.24 at M = 1024); near the ridge
that tensor work is most of the gate-up GEMM's time. Here a block whose row 64 is padding (the layout's
``sorted_ids[b * 128 + 64] >= num_assignments``: an expert's real rows come first in its segment, so rows 64-127
are all padding) runs a [64, BLOCK_N] tile: the same weight stages, the A stage's first 64 rows, m64 MMAs with the
two warpgroups splitting the columns (BLOCK_N / 2 each, the tail kernel's layout), half the tensor work. Its
epilogue writes the tile's 64 rows into the output stage and stores the whole stage: rows 64-127 of such a block
get stale values (padding rows: the combine never reads them; every output row depends on its own input row only).
The loader, ring, tile order and full tiles are ``gluon_gemm``'s; both partitions see every tile (only the MMA
partition reads the predicate, once per tile).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _loader, _tile_of, _tma_store


@gluon.jit
def _rows_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, ROWS: gl.constexpr,
               GATED: gl.constexpr, layout: gl.constexpr):
    """The first ROWS rows (64 or BLOCK_M) of row block rb's tile in column block cb: the K loop over the ring (one
    MMA group in flight, each stage released once the MMAs that read it retired) and the epilogue; returns the ring
    position after it."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
    up = gl.zeros([ROWS, BLOCK_N], gl.float32, layout)
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(s)
        if ROWS < BLOCK_M:
            a = a.slice(0, ROWS)  # [ROWS, BLOCK_K]: the block's real rows
        acc = warpgroup_mma(a, w_bufs.index(s * WTILES).permute((1, 0)), acc, is_async=True)
        if GATED:
            up = warpgroup_mma(a, w_bufs.index(s * WTILES + 1).permute((1, 0)), up, is_async=True)
            acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        it += 1
    if GATED:
        acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
        acc = acc / (1.0 + gl.exp(-acc)) * up  # silu(gate) * up
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    tma.store_wait(0)  # the last tile's store has read c_buf
    if ROWS < BLOCK_M:
        c_buf.slice(0, ROWS).store(acc.to(c_desc.dtype))  # rows ROWS.. keep the last tile's values (padding rows)
    else:
        c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    return it


@gluon.jit
def _half_mma(c_desc, a_bufs, w_bufs, c_buf, ready, empty, sorted_ptr, used_ptr, num_assignments, reduce_dim,
              num_col_blocks, GATED: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    # 64 rows: each warpgroup all of them and half the columns (m64 MMAs, BLOCK_N / 2 wide)
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps // 2, 2], instr_shape=[16, BLOCK_N // 2, 16])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        if gl.load(sorted_ptr + rb * BLOCK_M + HALF) >= num_assignments:  # rows HALF.. of the block: padding
            it = _rows_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, HALF, GATED,
                            half_layout)
        else:
            it = _rows_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, BLOCK_M, GATED, layout)
    tma.store_wait(0)


@gluon.jit
def half_gemm_kernel(a_desc, w_desc, c_desc, experts_ptr, sorted_ptr, used_ptr, num_assignments, reduce_dim,
                     num_col_blocks, W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                     STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """``gluon_gemm.grouped_gemm_kernel``'s arguments, plus sorted_ptr [T] int32 (the assignment of each row of the
    layout, >= num_assignments for padding): a_desc [T, R] blocks [BM, BK]; w_desc [E*W_ROWS, R] blocks [BN, BK];
    c_desc [T, C] blocks [BM, BN]; experts_ptr [T / BM] int32; used_ptr -> rows in use (a multiple of BM)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_half_mma, (c_desc, a_bufs, w_bufs, c_buf, ready, empty, sorted_ptr, used_ptr, num_assignments, reduce_dim,
                     num_col_blocks, GATED, GROUP_M, num_warps)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   W_ROWS, GATE_OFFSET, GATED, GROUP_M)),
    ], [1], [24])

"""The bf16 Gluon down GEMM with two consumer warpgroups taking whole tiles in turn (ping-pong), so one tile's
epilogue runs under the next tile's MMAs.

    out[r, c] = A[r, :] @ W[e(r), c, :]^T      r: a row of the permuted buffer, e(r) its expert

Operands as ``gluon_gemm.grouped_gemm_kernel`` (not GATED): A [T, R] the permuted rows (128-row blocks, one expert
each, ``block_experts``), W a 2-D view [E * W_ROWS, R], out [T, C]. ``gluon_gemm`` runs each tile on 8 warps (two
warpgroups sharing the [128, BLOCK_N] tile), so the tensor cores idle while those warps store the tile; with a
short reduction (Qwen3-30B-A3B's down GEMM: K = 768, 12 steps of 64) that epilogue is a large share. Here:
  - loader (1 warp; ``gluon_gemm._loader``): TMA loads of the tiles this program walks, in order, into one
    STAGES-deep ring (``ready`` / ``empty`` barriers per stage);
  - consumer 0 (the default partition, 4 warps) takes the program's tiles 0, 2, 4, ..., consumer 1 (a worker,
    4 warps) tiles 1, 3, 5, ...; each holds a whole [128, BLOCK_N] float32 accumulator (BLOCK_N registers a thread)
    and its own output buffer. ``turns``: a consumer starts a tile's MMAs only once the other has issued all of its
    previous tile's, so the ring is read strictly in order (a consumer never waits on a stage two fills ahead, where
    the barrier's phase parity would be ambiguous) and the other's epilogue (registers -> SMEM -> TMA store) runs
    meanwhile.
Gluon does not run in the interpreter (CUDA sm_90 only). Torch twin: ``triton_gluon.experts_gluon_twin`` (the
down GEMM's product).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _loader, _tile_of

_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

FIRST = gl.constexpr(0)  # the consumers' SIDE (a partition's arguments must be values or constexprs)
SECOND = gl.constexpr(1)
NO_GATE = gl.constexpr(0)  # the loader's GATE_OFFSET and GATED: one weight tile per step
NOT_GATED = gl.constexpr(False)


@gluon.jit
def _consumer(c_desc, a_bufs, w_bufs, c_bufs, ready, empty, turns, used_ptr, reduce_dim, num_col_blocks,
              SIDE: gl.constexpr, GROUP_M: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    c_buf = c_bufs.index(SIDE)
    it = SIDE * k_steps  # ring position of this consumer's first tile (the loader walks the program's tiles in order)
    n = 0
    for t in range(gl.program_id(0) + SIDE * gl.num_programs(0), num_tiles, 2 * gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        mbarrier.wait(turns.index(SIDE), (n & 1) ^ (1 - SIDE))  # consumer 0 first: a fresh barrier passes phase 1
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the previous step's MMA retired: its stage may be refilled
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            it += 1
        mbarrier.arrive(turns.index(1 - SIDE), count=1)  # every MMA of this tile issued: the other's turn
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
        tma.store_wait(0)  # this consumer's last store has read c_buf
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
        it += k_steps  # the other consumer's tile
        n += 1
    tma.store_wait(0)


@gluon.jit
def pingpong_gemm_kernel(a_desc, w_desc, c_desc, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                         W_ROWS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc [T, R] blocks [128, BK]; w_desc [E*W_ROWS, R] blocks [BN, BK]; c_desc [T, C] blocks [128, BN];
    experts_ptr [T / 128] int32 expert of each row block; used_ptr -> rows in use (a multiple of 128); reduce_dim = R;
    num_col_blocks = C / BN. num_warps = 4 (consumer 0); consumer 1 (4 warps, CONSUMER_REGS registers) and the
    loader (1 warp, 24) added."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, turns, used_ptr, reduce_dim, num_col_blocks,
                     FIRST, GROUP_M)),
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, turns, used_ptr, reduce_dim, num_col_blocks,
                     SECOND, GROUP_M)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   W_ROWS, NO_GATE, NOT_GATED, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, 24])

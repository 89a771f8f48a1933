"""The bf16 Gluon gate-up GEMM with one wgmma per K step: the gate and up weight tiles as one [2 * BLOCK_N, BLOCK_K]
operand (issue 19 at the ridge).

    h[r, c] = silu(A[r, :] @ W[e(r), c, :]^T) * (A[r, :] @ W[e(r), N + c, :]^T)

``gluon_gemm.grouped_gemm_kernel`` (GATED) issues two [64, BLOCK_N] wgmmas a warpgroup and K step, gate and up, each
reading the same A tile from shared memory: per 16-deep step a warpgroup reads A twice (2 x 2 KB) and the two weight
tiles (2 x 4 KB) for 2 x 64 x 128 x 16 MACs. Here the loader puts the gate and up tiles of a stage next to each other
(the same ring: ``w_bufs`` [STAGES, 2 * BLOCK_N, BLOCK_K], viewed as the plain kernel's [2 * STAGES, BLOCK_N,
BLOCK_K]), and each warpgroup issues one [64, 2 * BLOCK_N] wgmma reading A once: 10 KB instead of 12 KB of shared
memory a step, the shape Hopper's tensor cores run fastest. The accumulator's columns c and BLOCK_N + c sit in the
same thread (wgmma's fragment repeats every 8 columns), so the epilogue splits it into gate and up in registers.
The loader, ring, tile order and store are ``gluon_gemm``'s.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tile_at, _tma_load, _tma_store


@gluon.jit
def _wide_loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, offsets_ptr, used_ptr, reduce_dim,
                 num_col_blocks, W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GROUP_M: gl.constexpr,
                 EXPERT_ORDER: gl.constexpr):
    """``gluon_gemm._loader`` (GATED), the gate and up tiles of a stage into one [2 * BLOCK_N, BLOCK_K] buffer."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_at(t, num_row_blocks, num_col_blocks, experts_ptr, offsets_ptr, BLOCK_M, GROUP_M, EXPERT_ORDER)
        w_row = gl.load(experts_ptr + rb) * W_ROWS + cb * BLOCK_N
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(s), nbytes)
            _tma_load(a_desc, [rb * BLOCK_M, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
            w = w_bufs.index(s)
            _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w.slice(0, BLOCK_N))
            _tma_load(w_desc, [w_row + GATE_OFFSET, kk * BLOCK_K], ready.index(s), w.slice(BLOCK_N, BLOCK_N))
            it += 1


@gluon.jit
def _wide_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, layout: gl.constexpr):
    """Row block rb's [BLOCK_M, BLOCK_N] tile of h in column block cb: the K loop over the ring (one wgmma in flight,
    each stage released once the wgmma that read it retired) and the epilogue; returns the ring position after it."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, layout)  # [gate | up]
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the previous step's MMA retired: its stage may be refilled
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    tma.store_wait(0)  # the last tile's store has read c_buf
    c_buf.store(_silu_mul(acc, BLOCK_N).to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    return it


@gluon.jit
def _silu_mul(acc, BLOCK_N: gl.constexpr):
    """silu(gate) * up of a [rows, 2 * BLOCK_N] accumulator [gate | up] (columns c and BLOCK_N + c in one thread)."""
    gate, up = acc.reshape([acc.shape[0], 2, BLOCK_N]).permute((0, 2, 1)).split()  # [rows, BLOCK_N] each
    return gate / (1.0 + gl.exp(-gate)) * up


@gluon.jit
def _wide_mma(c_desc, a_bufs, w_bufs, c_buf, ready, empty, experts_ptr, offsets_ptr, used_ptr, reduce_dim,
              num_col_blocks, GROUP_M: gl.constexpr, EXPERT_ORDER: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BLOCK_N, 16])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_at(t, num_row_blocks, num_col_blocks, experts_ptr, offsets_ptr, BLOCK_M, GROUP_M, EXPERT_ORDER)
        it = _wide_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, layout)
    tma.store_wait(0)


@gluon.jit
def wide_gate_up_kernel(a_desc, w_desc, c_desc, experts_ptr, used_ptr, offsets_ptr, reduce_dim, num_col_blocks,
                        W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                        STAGES: gl.constexpr, GROUP_M: gl.constexpr, EXPERT_ORDER: gl.constexpr,
                        num_warps: gl.constexpr):
    """``gluon_gemm.grouped_gemm_kernel``'s arguments (GATED must be True: the gate-up GEMM only): a_desc [T, R]
    blocks [BM, BK]; w_desc [E*W_ROWS, R] blocks [BN, BK]; c_desc [T, N] blocks [BM, BN]; experts_ptr [T / BM] int32;
    used_ptr -> rows in use (a multiple of BM); offsets_ptr [E + 1] int32 (read with EXPERT_ORDER only); GATE_OFFSET =
    N."""
    gl.static_assert(GATED, "the wide wgmma is the gate-up GEMM's")
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_wide_mma, (c_desc, a_bufs, w_bufs, c_buf, ready, empty, experts_ptr, offsets_ptr, used_ptr, reduce_dim,
                     num_col_blocks, GROUP_M, EXPERT_ORDER, num_warps)),
        (_wide_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, offsets_ptr, used_ptr, reduce_dim,
                        num_col_blocks, W_ROWS, GATE_OFFSET, GROUP_M, EXPERT_ORDER)),
    ], [1], [24])

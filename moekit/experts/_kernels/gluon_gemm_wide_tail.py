"""The wide bf16 Gluon gate-up GEMM (``gluon_gemm_wide``) with an expert's last, mostly empty row block folded into the
block before it (issue 19 at the ridge: Mixtral-8x7B M = 512, ~128 rows an expert).

    h[r, c] = silu(A[r, :] @ W[e(r), c, :]^T) * (A[r, :] @ W[e(r), N + c, :]^T)

At M = 512 a third of the 128-row blocks are an expert's last block with <= 64 real rows, and the gate-up GEMM's loads
alone take 571 µs (78% of copy) against 510 µs for the whole GEMM under balanced routing (no such blocks): each such
block streams its expert's weight tiles again (H200, ``benchmarks/mid7_device_check.py``). Here block b "merges"
block b + 1 when b + 1 is the same expert's last block with at most 64 real rows (``gluon_gemm_tail._merges``, the
down GEMM's rule): b's tiles also take b + 1's first 64 rows from the same weight stages (one more [64, BLOCK_K] A tile
a K step and a [64, 2 * BLOCK_N] accumulator: the warpgroups split its columns in 64-wide pieces, so gate column c
and up column BLOCK_N + c stay in one thread), and b + 1's tiles are skipped by both partitions. Rows past 64 of a
merged block are never written (padding). The extra A tile and output leave SMEM for 3 stages (the plain one: 4).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tile_at, _tma_load, _tma_store
from moekit.experts._kernels.gluon_gemm_tail import _merges, _tile_state
from moekit.experts._kernels.gluon_gemm_wide import _silu_mul, _wide_tile


@gluon.jit
def _wide_tail_loader(a_desc, t_desc, w_desc, a_bufs, t_bufs, w_bufs, ready, empty, experts_ptr, offsets_ptr,
                      sorted_ptr, used_ptr, num_assignments, reduce_dim, num_col_blocks, W_ROWS: gl.constexpr,
                      GATE_OFFSET: gl.constexpr, GROUP_M: gl.constexpr, EXPERT_ORDER: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    TAIL: gl.constexpr = t_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    tbytes: gl.constexpr = nbytes + t_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_at(t, num_row_blocks, num_col_blocks, experts_ptr, offsets_ptr, BLOCK_M, GROUP_M, EXPERT_ORDER)
        merged = _merges(experts_ptr, sorted_ptr, rb, num_row_blocks, num_assignments, BLOCK_M, TAIL)
        skipped = _merges(experts_ptr, sorted_ptr, rb - 1, num_row_blocks, num_assignments, BLOCK_M, TAIL)
        if skipped == 0:
            w_row = gl.load(experts_ptr + rb) * W_ROWS + cb * BLOCK_N
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                if merged != 0:
                    mbarrier.expect(ready.index(s), tbytes)
                    _tma_load(t_desc, [(rb + 1) * BLOCK_M, kk * BLOCK_K], ready.index(s), t_bufs.index(s))
                else:
                    mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [rb * BLOCK_M, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
                w = w_bufs.index(s)
                _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w.slice(0, BLOCK_N))
                _tma_load(w_desc, [w_row + GATE_OFFSET, kk * BLOCK_K], ready.index(s), w.slice(BLOCK_N, BLOCK_N))
                it += 1


@gluon.jit
def _wide_merged_tile(c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, rb, cb, k_steps, it,
                      layout: gl.constexpr, tail_layout: gl.constexpr):
    """Row block rb's tile and the first TAIL rows of block rb + 1 from the same weight stages."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    TAIL: gl.constexpr = ct_desc.block_type.shape[0]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, layout)  # [gate | up]
    tail = gl.zeros([TAIL, 2 * BLOCK_N], gl.float32, tail_layout)
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
    c_buf.store(_silu_mul(acc, BLOCK_N).to(c_desc.dtype))
    ct_buf.store(_silu_mul(tail, BLOCK_N).to(ct_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    _tma_store(ct_desc, [(rb + 1) * BLOCK_M, cb * BLOCK_N], ct_buf)
    return it


@gluon.jit
def _wide_tail_mma(c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, experts_ptr, offsets_ptr,
                   sorted_ptr, used_ptr, num_assignments, reduce_dim, num_col_blocks, GROUP_M: gl.constexpr,
                   EXPERT_ORDER: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    TAIL: gl.constexpr = ct_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BLOCK_N, 16])
    # the TAIL = 64 rows: each warpgroup all of them and every other 64 columns (gate c and up BLOCK_N + c together)
    tail_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps // 2, 2], instr_shape=[16, BLOCK_N // 2, 16])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    rb, cb, merged, skipped = _tile_state(gl.program_id(0), num_tiles, num_row_blocks, num_col_blocks, experts_ptr,
                                          offsets_ptr, sorted_ptr, num_assignments, GROUP_M, EXPERT_ORDER, BLOCK_M,
                                          TAIL)
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb_next, cb_next, merged_next, skipped_next = _tile_state(
            t + gl.num_programs(0), num_tiles, num_row_blocks, num_col_blocks, experts_ptr, offsets_ptr, sorted_ptr,
            num_assignments, GROUP_M, EXPERT_ORDER, BLOCK_M, TAIL)
        if skipped == 0:
            if merged != 0:
                it = _wide_merged_tile(c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, rb, cb,
                                       k_steps, it, layout, tail_layout)
            else:
                it = _wide_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, rb, cb, k_steps, it, layout)
        rb, cb, merged, skipped = rb_next, cb_next, merged_next, skipped_next
    tma.store_wait(0)


@gluon.jit
def wide_tail_gate_up_kernel(a_desc, t_desc, w_desc, c_desc, ct_desc, experts_ptr, sorted_ptr, used_ptr, offsets_ptr,
                             num_assignments, reduce_dim, num_col_blocks, W_ROWS: gl.constexpr,
                             GATE_OFFSET: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                             EXPERT_ORDER: gl.constexpr, num_warps: gl.constexpr):
    """a_desc [T, K] blocks [BM, BK] and t_desc the same tensor in [TAIL, BK] blocks; w_desc [E*2N, K] blocks [BN, BK];
    c_desc [T, N] blocks [BM, BN] and ct_desc the same tensor in [TAIL, BN] blocks; experts_ptr [T / BM] int32;
    sorted_ptr [T] int32 (>= num_assignments: padding); used_ptr -> rows in use; offsets_ptr [E + 1] int32 (read with
    EXPERT_ORDER only); reduce_dim = K; GATE_OFFSET = N."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    t_bufs = gl.allocate_shared_memory(t_desc.dtype, [STAGES] + t_desc.block_type.shape, t_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, 2 * BLOCK_N, BLOCK_K], w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ct_buf = gl.allocate_shared_memory(ct_desc.dtype, ct_desc.block_type.shape, ct_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_wide_tail_mma, (c_desc, ct_desc, a_bufs, t_bufs, w_bufs, c_buf, ct_buf, ready, empty, experts_ptr,
                          offsets_ptr, sorted_ptr, used_ptr, num_assignments, reduce_dim, num_col_blocks, GROUP_M,
                          EXPERT_ORDER, num_warps)),
        (_wide_tail_loader, (a_desc, t_desc, w_desc, a_bufs, t_bufs, w_bufs, ready, empty, experts_ptr, offsets_ptr,
                             sorted_ptr, used_ptr, num_assignments, reduce_dim, num_col_blocks, W_ROWS, GATE_OFFSET,
                             GROUP_M, EXPERT_ORDER)),
    ], [1], [24])

"""The block-scaled fp8 Gluon down GEMM with an expert's mostly empty last row block folded into the tiles of the
block before it (issues 15 / 19: the padding tax at the ridge): ``gluon_gemm_fp8`` with a third consumer.

    y[r, c] = sum_kb (h_q[r, kb] @ W_q[e(r), c, kb]^T) * h_s[r, kb] * w_s[e(r), c // 128, kb]

``gluon_gemm_fp8``'s tile is two 64-row halves, each its own 4-warp consumer partition. Here a third consumer
takes the first 64 rows of block b + 1 in the tiles of block b when b + 1 is the same expert's last block and holds
at most 64 real rows (``gluon_gemm_tail._merges``, the bf16 tail's predicate): its A half comes with the same
weight stage, so that expert's weight tiles stream once for up to 192 rows, and block b + 1's own tiles are skipped
by every partition. In the other tiles the third consumer only waits for each stage and releases it (``empty``
counts three arrivals). Down GEMM only: the gate-up's consumers need 224-232 registers, and four warpgroups leave
about 160 each. The K loop and the epilogue are ``gluon_gemm_fp8``'s (``_k_loop``, ``_epilogue``). Rows past 64 of
a folded block are never written (padding: the combine never reads them). Gluon does not run in the interpreter
(CUDA sm_90 only); its torch stand-in is ``tests/_gluon_fakes.fp8_tail_down``, the path's twin
``triton_gluon_fp8.experts_gluon_fp8_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from moekit.experts._kernels.gluon_gemm import _tile_of
from moekit.experts._kernels.gluon_gemm_fp8 import _epilogue, _k_loop, _tma_load
from moekit.experts._kernels.gluon_gemm_tail import _merges, _tile_state

FIRST, SECOND, TAIL = gl.constexpr(0), gl.constexpr(1), gl.constexpr(2)  # the consumers' halves (TAIL: block b + 1)


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
            reduce_dim, num_col_blocks, w_rows, GROUP_M: gl.constexpr):
    """Per K-step of a kept tile: its two A halves, the weight tile and, where it folds, block rb + 1's first 64
    rows (a third A tile, one more expected byte count) into the ring."""
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes
    tbytes: gl.constexpr = nbytes + a_desc.block_type.nbytes
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * HALF_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        merged = _merges(experts_ptr, sorted_ptr, rb, num_row_blocks, num_assignments, 2 * HALF_M, HALF_M)
        skipped = _merges(experts_ptr, sorted_ptr, rb - 1, num_row_blocks, num_assignments, 2 * HALF_M, HALF_M)
        if skipped == 0:
            w_row = gl.load(experts_ptr + rb) * w_rows + cb * BLOCK_N
            for kk in range(k_steps):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                if merged != 0:
                    mbarrier.expect(ready.index(s), tbytes)
                    _tma_load(a_desc, [(rb + 1) * 2 * HALF_M, kk * BLOCK_K], ready.index(s), a_bufs.index(3 * s + 2))
                else:
                    mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [rb * 2 * HALF_M, kk * BLOCK_K], ready.index(s), a_bufs.index(3 * s))
                _tma_load(a_desc, [rb * 2 * HALF_M + HALF_M, kk * BLOCK_K], ready.index(s), a_bufs.index(3 * s + 1))
                _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w_bufs.index(s))
                it += 1


@gluon.jit
def _half_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, as_ptr, ws_ptr, experts_ptr, rb, cb, k_steps, it,
               stride_as, stride_wse, stride_wsr, HALF: gl.constexpr, layout: gl.constexpr):
    """One consumer's 64 rows of tile (rb, cb): rows rb*128 + HALF*64 .. (HALF 2: block rb + 1's first 64)."""
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    row0 = rb * 2 * HALF_M + HALF * HALF_M
    rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))  # [64]
    ws = ws_ptr + gl.load(experts_ptr + rb) * stride_wse + cb * stride_wsr  # scalar pointer, K-step 0
    acc, up, it = _k_loop(a_bufs, w_bufs, ready, empty, ready, as_ptr + rows * stride_as, ws, ws, k_steps, it, HALF,
                          False, False, False, layout)
    _epilogue(acc, up, c_desc, c_buf, as_ptr, row0, cb, False)
    return it


@gluon.jit
def _release(ready, empty, k_steps, it, STAGES: gl.constexpr):
    """A tile that folds nothing, seen by the third consumer: each stage waited for and released, not read."""
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(s), count=1)
        it += 1
    return it


@gluon.jit
def _consumer(c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, experts_ptr, sorted_ptr, used_ptr,
              num_assignments, reduce_dim, num_col_blocks, stride_as, stride_wse, stride_wsr, HALF: gl.constexpr,
              GROUP_M: gl.constexpr):
    """HALF 0 / 1: rows HALF*64 .. of every kept tile; HALF 2 (TAIL): the first 64 rows of block rb + 1 in a folding
    tile, and in the others each stage waited for and released. The next tile's state is read during this one."""
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * HALF_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    c_buf = c_bufs.index(HALF)
    it = 0
    rb, cb, merged, skipped = _tile_state(gl.program_id(0), num_tiles, num_row_blocks, num_col_blocks, experts_ptr,
                                          experts_ptr, sorted_ptr, num_assignments, GROUP_M, False, 2 * HALF_M, HALF_M)
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb_next, cb_next, merged_next, skipped_next = _tile_state(
            t + gl.num_programs(0), num_tiles, num_row_blocks, num_col_blocks, experts_ptr, experts_ptr, sorted_ptr,
            num_assignments, GROUP_M, False, 2 * HALF_M, HALF_M)
        if skipped == 0:
            if HALF == 2:
                if merged != 0:
                    it = _half_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, as_ptr, ws_ptr, experts_ptr, rb, cb,
                                    k_steps, it, stride_as, stride_wse, stride_wsr, HALF, layout)
                else:
                    it = _release(ready, empty, k_steps, it, STAGES)
            else:
                it = _half_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, as_ptr, ws_ptr, experts_ptr, rb, cb,
                                k_steps, it, stride_as, stride_wse, stride_wsr, HALF, layout)
        rb, cb, merged, skipped = rb_next, cb_next, merged_next, skipped_next
    tma.store_wait(0)


@gluon.jit
def tail_down_fp8_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, experts_ptr, sorted_ptr, used_ptr, num_assignments,
                         reduce_dim, num_col_blocks, w_rows, stride_as, stride_wse, stride_wsr, STAGES: gl.constexpr,
                         GROUP_M: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc e4m3 h [T, R] blocks [64, 128]; w_desc e4m3 [E*w_rows, R] blocks [128, 128]; c_desc bf16 y [T, C]
    blocks [64, 128]; as_ptr [T, R/128] fp32 h scales (row stride stride_as); ws_ptr [E, w_rows/128, R/128] fp32
    (strides stride_wse, stride_wsr, 1); experts_ptr [T/128] int32; sorted_ptr [T] int32 assignment of each row
    (>= num_assignments: padding); used_ptr -> rows in use (a multiple of 128); num_col_blocks = C/128.
    num_warps = 4 (consumer 0); consumers 1 and 2 (4 warps, CONSUMER_REGS registers each) and the loader added."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [3 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [3] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=3)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, experts_ptr, sorted_ptr, used_ptr,
                     num_assignments, reduce_dim, num_col_blocks, stride_as, stride_wse, stride_wsr, FIRST, GROUP_M)),
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, experts_ptr, sorted_ptr, used_ptr,
                     num_assignments, reduce_dim, num_col_blocks, stride_as, stride_wse, stride_wsr, SECOND, GROUP_M)),
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, experts_ptr, sorted_ptr, used_ptr,
                     num_assignments, reduce_dim, num_col_blocks, stride_as, stride_wse, stride_wsr, TAIL, GROUP_M)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, sorted_ptr, used_ptr, num_assignments,
                   reduce_dim, num_col_blocks, w_rows, GROUP_M)),
    ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])

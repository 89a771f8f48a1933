"""The bf16 Gluon gate-up GEMM reading its activation rows straight from x (issue 19: no separate gather).

    h[r, c] = silu(x[tok(r)] @ W[e(r), c]^T) * (x[tok(r)] @ W[e(r), N + c]^T)   tok(r) = sorted_ids[r] // TOP_K

``gluon_gemm.grouped_gemm_kernel`` (GATED) reads A from a gathered copy of x (x_perm, written by a gather kernel
before it) by TMA. Hopper has no TMA gather, so here the loader partition (LOADER_WARPS warps) copies each A
tile's 128 rows from x itself with ``cp.async`` (16-byte row pieces, into the same NVMMA-swizzled stage the
wgmma reads), padding rows (sorted id >= A) zero-filled; the two weight tiles still come by TMA. Per stage:
  - ``ready`` (count 1): the weight tiles' TMA bytes, as in the plain kernel;
  - ``a_ready`` (count = the loader's threads): each loader thread arrives once its cp.async copies into the
    stage landed (``cp.async.mbarrier.arrive.noinc``); the MMA partition waits on both, then fences the generic
    proxy's writes for the wgmma (async proxy);
  - ``empty`` (count 1): the MMAs that read the stage retired (the plain kernel's).
The loader of column block 0 of each row block also writes dst[sorted_ids[r]] = r for its real rows (the
inverse the combine reads: what the gather kernel wrote before). x's rows must be 16-byte aligned (the route
checks it). The MMA partition and its epilogue are the plain kernel's (``_mma_epilogue``, GATHER). Taken for
experts at most ``triton_gluon_launch.LOADER_GATHER_MAX_INTER`` wide (measured: benchmarks/triton-notes.md, "the
bf16 gate-up GEMM gathers its own rows"); LOADER_WARPS = 4 (1 / 2 measured slower).

Triton spelled the cp.async copy differently: 3.6 ``async_copy_global_to_shared``, 3.9 ``async_load`` (the old
name raises); the alias picks whichever this Triton has. Gluon does not run in the interpreter.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moekit.experts._kernels.gluon_gemm import _mma_epilogue, _tile_of, _tma_load, tile_walk

_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@gluon.jit
def _gather_loader(x_ptr, sorted_ptr, dst_ptr, w_desc, a_bufs, w_bufs, ready, a_ready, empty, experts_ptr, used_ptr,
                   num_assignments, stride_x, reduce_dim, num_col_blocks, TOP_K: gl.constexpr, W_ROWS: gl.constexpr,
                   GATE_OFFSET: gl.constexpr, GROUP_M: gl.constexpr, LOADER_WARPS: gl.constexpr):
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    PIECES: gl.constexpr = BLOCK_K // 8  # 16-byte pieces of a row's K step: one cp.async each
    # [BLOCK_M, BLOCK_K]: 8 contiguous bf16 a thread, a row's pieces across PIECES threads
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // PIECES, PIECES], [LOADER_WARPS, 1], [1, 0])
    nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes
    num_row_blocks, num_tiles, k_steps = tile_walk(used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K)
    in_block = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, rows_layout))  # [BM]
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, rows_layout))  # [BK]
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        expert = gl.load(experts_ptr + rb)
        w_row = expert * W_ROWS + cb * BLOCK_N
        rows = rb * BLOCK_M + in_block  # [BM]
        a = gl.load(sorted_ptr + rows)  # [BM] assignment of each row; >= num_assignments: padding
        real = a < num_assignments
        gl.store(dst_ptr + a, rows, mask=real & (cb == 0))
        row_start = gl.where(real, a // TOP_K, 0).to(gl.int64) * stride_x  # [BM]
        src = x_ptr + gl.expand_dims(row_start, 1) + gl.expand_dims(cols, 0)  # [BM, BK]
        keep = gl.expand_dims(real, 1)  # [BM, 1]; padding rows zero-filled
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(s), nbytes)
            _tma_load(w_desc, [w_row, kk * BLOCK_K], ready.index(s), w_bufs.index(2 * s))
            _tma_load(w_desc, [w_row + GATE_OFFSET, kk * BLOCK_K], ready.index(s), w_bufs.index(2 * s + 1))
            _cp_async(a_bufs.index(s), src + kk * BLOCK_K, mask=keep)
            async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)
            it += 1


@gluon.jit
def gather_gate_up_kernel(x_ptr, sorted_ptr, dst_ptr, w_desc, c_desc, experts_ptr, used_ptr, num_assignments,
                          stride_x, reduce_dim, num_col_blocks, TOP_K: gl.constexpr, W_ROWS: gl.constexpr,
                          GATE_OFFSET: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                          LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """x [M, R] (rows 16-byte aligned, stride_x elements apart); sorted_ptr [T] int32 assignment of each row of
    the layout (>= num_assignments: padding); dst_ptr [A] int32 (written: the row of each real assignment);
    w_desc [E*W_ROWS, R] blocks [BN, BK]; c_desc [T, N] blocks [BM, BN]; experts_ptr [T / BM] int32;
    used_ptr -> rows in use (a multiple of BM); reduce_dim = R; num_col_blocks = N / BN; GATE_OFFSET = N."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], w_desc.dtype)
    a_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * 2] + w_desc.block_type.shape, w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(a_ready.index(i), count=LOADER_WARPS * 32)  # one noinc arrival per loader thread
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_epilogue, (c_desc, a_bufs, w_bufs, c_buf, ready, a_ready, empty, used_ptr, reduce_dim, num_col_blocks,
                         True, GROUP_M, True, num_warps)),
        (_gather_loader, (x_ptr, sorted_ptr, dst_ptr, w_desc, a_bufs, w_bufs, ready, a_ready, empty, experts_ptr,
                          used_ptr, num_assignments, stride_x, reduce_dim, num_col_blocks, TOP_K, W_ROWS,
                          GATE_OFFSET, GROUP_M, LOADER_WARPS)),
    ], [LOADER_WARPS], [LOADER_REGS])

"""The bf16 grouped GEMM of ``gluon_gemm`` with each 128-row tile's two 64-row halves in two consumer partitions.

    out[r, c] = act(A[r, :] @ W[e(r), c, :]^T)      (``gluon_gemm``'s contract, its layout and tile walk)

``gluon_gemm`` runs one 8-warp partition over the whole [128, BLOCK_N] tile (both warpgroups issue every
wgmma together). Here each warpgroup is a partition of its own (consumer 0: the default partition, 4 warps,
rows 0-63; consumer 1: a worker, 4 warps, rows 64-127), as in ``gluon_gemm_fp8``, whose loader this reuses
(the two A halves and the weight tile(s) of a K-step in one stage; ``empty`` counts both consumers). So:
  - SKIP_PADDING: a half whose first row is padding (sorted_ids[row] >= A: an expert's real rows come first in
    its segment, so the rest is padding too) runs no MMA and stores nothing, it only releases its stages; the
    tensor work on padding goes in 64-row steps while each weight tile still serves 128 rows;
  - the halves' epilogues need not coincide (one's store under the other's MMAs).
w_rows and gate_offset are plain arguments (one compile serves every shape). Gluon does not run in the
interpreter (CUDA sm_90 only); ``benchmarks/ridge_compile_cpu.py`` compiles it, ``ridge_device_check.py`` runs it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tile_of
from moekit.experts._kernels.gluon_gemm_fp8 import FIRST_HALF, SECOND_HALF, _loader, _release_stages

_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _half(c_desc, a_bufs, w_bufs, c_bufs, ready, empty, sorted_ptr, used_ptr, reduce_dim, num_col_blocks,
          num_assignments, HALF: gl.constexpr, GATED: gl.constexpr, GROUP_M: gl.constexpr,
          SKIP_PADDING: gl.constexpr):
    """Rows HALF*64 .. of every tile (``_half_tile``); SKIP_PADDING: an all-padding half only releases its stages."""
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    WTILES: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = w_bufs.type.shape[0] // WTILES
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * HALF_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    c_buf = c_bufs.index(HALF)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        row0 = rb * 2 * HALF_M + HALF * HALF_M
        if SKIP_PADDING:  # static: without it the plain tile (Triton 3.6 fails on a branch on a constant)
            if gl.load(sorted_ptr + row0) < num_assignments:
                it = _half_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, k_steps, it, HALF, GATED,
                                layout)
            else:
                it = _release_stages(ready, empty, k_steps, it, STAGES)
        else:
            it = _half_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, k_steps, it, HALF, GATED, layout)
    tma.store_wait(0)


@gluon.jit
def _half_tile(c_desc, a_bufs, w_bufs, c_buf, ready, empty, row0, cb, k_steps, it, HALF: gl.constexpr,
               GATED: gl.constexpr, layout: gl.constexpr):
    """One half tile: the K loop (async wgmma, one group in flight, each stage released as soon as the MMAs that
    read it retired; the other consumer's arrival completes it), then the epilogue. Returns the ring position."""
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    WTILES: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = w_bufs.type.shape[0] // WTILES
    acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    up = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    for kk in range(k_steps):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(2 * s + HALF)
        acc = warpgroup_mma(a, w_bufs.index(s * WTILES).permute((1, 0)), acc, is_async=True)
        if GATED:
            up = warpgroup_mma(a, w_bufs.index(s * WTILES + 1).permute((1, 0)), up, is_async=True)
            acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the previous step's MMAs retired: this half is done with its stage
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=kk > 0)
        it += 1
    if GATED:
        acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
        acc = acc / (1.0 + gl.exp(-acc)) * up  # silu(gate) * up
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=k_steps > 0)
    tma.store_wait(0)  # this half's last store has read c_buf
    c_buf.store(acc.to(c_desc.dtype))
    fence_async_shared()
    _tma_store(c_desc, [row0, cb * BLOCK_N], c_buf)
    return it


@gluon.jit
def grouped_gemm_halves_kernel(a_desc, w_desc, c_desc, experts_ptr, used_ptr, sorted_ptr, reduce_dim,
                               num_col_blocks, num_assignments, w_rows, gate_offset, GATED: gl.constexpr,
                               STAGES: gl.constexpr, GROUP_M: gl.constexpr, SKIP_PADDING: gl.constexpr,
                               CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """a_desc [T, R] blocks [64, BK]; w_desc [E*w_rows, R] blocks [BN, BK]; c_desc [T, C] blocks [64, BN];
    experts_ptr [T / 128] int32; used_ptr -> rows in use (a multiple of 128); sorted_ptr [T] the layout's
    assignment of each row (>= num_assignments: padding; read with SKIP_PADDING only); num_col_blocks = C / BN;
    gate_offset = N when GATED. num_warps = 4 (consumer 0); consumer 1 (4 warps, CONSUMER_REGS registers) and
    the loader (1 warp) added."""
    WTILES: gl.constexpr = 2 if GATED else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize([
        (_half, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, sorted_ptr, used_ptr, reduce_dim, num_col_blocks,
                 num_assignments, FIRST_HALF, GATED, GROUP_M, SKIP_PADDING)),
        (_half, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, sorted_ptr, used_ptr, reduce_dim, num_col_blocks,
                 num_assignments, SECOND_HALF, GATED, GROUP_M, SKIP_PADDING)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   w_rows, gate_offset, GATED, GROUP_M)),
    ], [4, 1], [CONSUMER_REGS, 24])

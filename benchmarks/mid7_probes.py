"""Probe kernels of ``mid7_device_check.py`` (issue 19 at the ridge): the bf16 Gluon GEMM (``_kernels/gluon_gemm.py``)
split into its two halves, so one run says what each costs alone at the cell's tiles and tile order.

- ``stream_kernel``: the GEMM's own loader partition (TMA loads of the A and weight tiles into the ring, in the GEMM's
  tile order) with a default partition that releases each stage as soon as it landed: the weight stream with no MMA
  behind it.
- ``mma_kernel``: no loads: the ring is filled once (the first tile's first STAGES K steps, real data, so the tensor
  cores see the bits they would), then every tile's K loop runs its wgmmas on those stages (one group in flight, as
  the GEMM) and stores its output tile: the tensor work of the padded tile set with no stream in front of it.

If the GEMM took max(stream, mma) the two would overlap fully; the issue's reading near the ridge is their sum.
Gluon needs sm_90 and does not run in the interpreter (``mid7_compile_cpu.py`` compiles both offline).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _loader, _tile_of, _tma_load, _tma_store


@gluon.jit
def _drain(ready, empty, used_ptr, reduce_dim, num_col_blocks, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
           STAGES: gl.constexpr):
    """Wait for every stage the loader fills, release it at once (the GEMM's K steps without their MMAs)."""
    num_tiles = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M) * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            mbarrier.arrive(empty.index(s), count=1)
            it += 1


@gluon.jit
def stream_kernel(a_desc, w_desc, experts_ptr, used_ptr, reduce_dim, num_col_blocks, W_ROWS: gl.constexpr,
                  GATE_OFFSET: gl.constexpr, GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                  num_warps: gl.constexpr):
    """``grouped_gemm_kernel``'s loads only (its arguments less the output)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_drain, (ready, empty, used_ptr, reduce_dim, num_col_blocks, BLOCK_M, BLOCK_K, STAGES)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   W_ROWS, GATE_OFFSET, GATED, GROUP_M)),
    ], [1], [24])


@gluon.jit
def _fill_ring(a_desc, w_desc, a_bufs, w_bufs, bar, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr):
    """The ring's stages s = the first tile's K step s (A rows 0.., weight rows 0.. and GATE_OFFSET..), waited for."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    mbarrier.expect(bar, STAGES * (a_desc.block_type.nbytes + WTILES * w_desc.block_type.nbytes))
    for s in gl.static_range(STAGES):
        _tma_load(a_desc, [0, s * BLOCK_K], bar, a_bufs.index(s))
        _tma_load(w_desc, [0, s * BLOCK_K], bar, w_bufs.index(s * WTILES))
        if GATED:
            _tma_load(w_desc, [GATE_OFFSET, s * BLOCK_K], bar, w_bufs.index(s * WTILES + 1))
    mbarrier.wait(bar, 0)


@gluon.jit
def mma_kernel(a_desc, w_desc, c_desc, used_ptr, reduce_dim, num_col_blocks, GATE_OFFSET: gl.constexpr,
               GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """``grouped_gemm_kernel``'s MMAs and stores only, on a ring filled once (8 warps, no loader partition)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    _fill_ring(a_desc, w_desc, a_bufs, w_bufs, bar, GATE_OFFSET, GATED)
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout)
        for kk in range(k_steps):
            s = it % STAGES
            acc = warpgroup_mma(a_bufs.index(s), w_bufs.index(s * WTILES).permute((1, 0)), acc, is_async=True)
            if GATED:
                up = warpgroup_mma(a_bufs.index(s), w_bufs.index(s * WTILES + 1).permute((1, 0)), up, is_async=True)
                acc, up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            it += 1
        if GATED:
            acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
            acc = acc / (1.0 + gl.exp(-acc)) * up
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        tma.store_wait(0)
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)
    tma.store_wait(0)


def launch_probe(kind: str, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                 rows_used: torch.Tensor, tile, gated: bool, w_rows: int, gate_offset: int = 0) -> None:
    """``launch_gemm``'s arguments (a plain ``GluonTile``); kind "stream" (loads only) or "mma" (MMAs and stores only;
    out gets products of the ring's data, not of a)."""
    from moekit.experts.triton_gluon_launch import BLOCK_M, MAX_REGISTERS, NUM_WARPS, gluon_descriptor, num_sms

    a_desc = gluon_descriptor(a, [BLOCK_M, tile.block_k])
    w_desc = gluon_descriptor(w, [tile.block_n, tile.block_k])
    num_col_blocks = out.shape[1] // tile.block_n
    grid = (max(1, min(num_sms(a.device), -(-a.shape[0] // BLOCK_M) * num_col_blocks)),)
    if kind == "stream":
        stream_kernel[grid](a_desc, w_desc, block_experts, rows_used, a.shape[1], num_col_blocks, W_ROWS=w_rows,
                            GATE_OFFSET=gate_offset, GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m,
                            num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS)
        return
    c_desc = gluon_descriptor(out, [BLOCK_M, tile.block_n])
    mma_kernel[grid](a_desc, w_desc, c_desc, rows_used, a.shape[1], num_col_blocks, GATE_OFFSET=gate_offset,
                     GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS)

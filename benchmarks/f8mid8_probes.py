"""Probe kernels of ``f8mid8_device_check.py`` (issue 15 at the ridge): the block-scaled fp8 Gluon GEMM
(``_kernels/gluon_gemm_fp8.py``) split into what it overlaps, the mid7 probes' method (``mid7_probes.py``, bf16) on
the fp8 kernel, so one run says what each part costs alone at the cell's tiles and tile order.

- ``stream_fp8_kernel``: the GEMM's own loader partition (TMA loads of the two A halves and the weight tile(s) into
  the ring, in the GEMM's tile order) with a partition that releases each stage as soon as it landed: the stream
  with no MMA behind it ("loads alone").
- ``consumers_fp8_kernel``: the GEMM's own two consumer partitions (per K-step a wgmma into a fresh part, waited for,
  then the scale fold; the epilogue and its stores) on a ring filled once (the first tile's first STAGES K-steps,
  real data), a loader that only hands the stages round: the tensor work, the promotion and the stores with no
  stream in front of them ("consumers alone").
- ``mma_fp8_kernel``: the same tiles' wgmmas alone: 8 warps, [128, 128] accumulators carried across K-steps (no
  fresh part, no fold, one group in flight), on the ring filled once; the tile stored as bf16 to a scratch buffer:
  the fp8 tensor rate of this tile set ("MMAs alone"). consumers / mma says what the promotion costs.
- ``unpromoted_fp8_kernel``: the whole GEMM (its loader, ring, walk and epilogue) with consumers that accumulate each
  K-step's wgmmas in place, no scale loads and no fold ("unpromoted"): the GEMM as the bf16 one is, on fp8 operands.
  Against the GEMM it says what the promotion costs when the loads run beside it.

If the GEMM took max(loads, consumers) the two would overlap fully. Gluon needs sm_90 and does not run in the
interpreter (``f8mid8_compile_cpu.py`` compiles these offline).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _tile_of
from moekit.experts._kernels.gluon_gemm_fp8 import (
    FIRST_HALF, SECOND_HALF, _consumer, _epilogue, _loader, _tma_load, _tma_store,
)

ON, OFF = gl.constexpr(True), gl.constexpr(False)  # flags passed to partitions (values or constexprs only)


@gluon.jit
def _hand_round(ready, empty, used_ptr, reduce_dim, num_col_blocks, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                STAGES: gl.constexpr, RELEASE: gl.constexpr):
    """The GEMM's K-steps as ring turns: RELEASE, wait for each landed stage and free it (loads alone); else wait
    for each free stage and mark it landed without loading (consumers alone, on the data already there)."""
    num_tiles = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M) * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        for kk in range(k_steps):
            s = it % STAGES
            if RELEASE:
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                mbarrier.arrive(empty.index(s), count=1)
            else:
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                mbarrier.arrive(ready.index(s), count=1)
            it += 1


@gluon.jit
def stream_fp8_kernel(a_desc, w_desc, experts_ptr, used_ptr, reduce_dim, num_col_blocks, w_rows, gate_offset,
                      GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """``grouped_gemm_fp8_kernel``'s loads only (its descriptors and walk; no scales, no output)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_hand_round, (ready, empty, used_ptr, reduce_dim, num_col_blocks, 2 * HALF_M, BLOCK_K, STAGES, ON)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   w_rows, gate_offset, GATED, GROUP_M, OFF)),
    ], [1], [24])


@gluon.jit
def _fill_ring(a_desc, w_desc, a_bufs, w_bufs, bar, gate_offset, GATED: gl.constexpr, A_TILES: gl.constexpr):
    """Stage s = the first tile's K-step s (A rows 0.., A_TILES tiles of them; weight rows 0.. and gate_offset..)."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    ROWS: gl.constexpr = a_desc.block_type.shape[0]
    WTILES: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = w_bufs.type.shape[0] // WTILES
    mbarrier.expect(bar, STAGES * (A_TILES * a_desc.block_type.nbytes + WTILES * w_desc.block_type.nbytes))
    for s in gl.static_range(STAGES):
        for h in gl.static_range(A_TILES):
            _tma_load(a_desc, [h * ROWS, s * BLOCK_K], bar, a_bufs.index(A_TILES * s + h))
        _tma_load(w_desc, [0, s * BLOCK_K], bar, w_bufs.index(s * WTILES))
        if GATED:
            _tma_load(w_desc, [gate_offset, s * BLOCK_K], bar, w_bufs.index(s * WTILES + 1))
    mbarrier.wait(bar, 0)


@gluon.jit
def consumers_fp8_kernel(a_desc, w_desc, c_desc, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr, reduce_dim,
                         num_col_blocks, gate_offset, stride_as, stride_wse, stride_wsr, stride_cs,
                         GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``grouped_gemm_fp8_kernel``'s consumers (arguments as there, less w_rows) on a ring filled once."""
    WTILES: gl.constexpr = 2 if GATED else 1
    HALF_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(bar.index(0), count=1)
    _fill_ring(a_desc, w_desc, a_bufs, w_bufs, bar.index(0), gate_offset, GATED, 2)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr,
                     reduce_dim, num_col_blocks, gate_offset, stride_as, stride_wse, stride_wsr, stride_cs,
                     FIRST_HALF, GATED, GROUP_M, OFF, OFF)),
        (_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, as_ptr, ws_ptr, cs_ptr, experts_ptr, used_ptr,
                     reduce_dim, num_col_blocks, gate_offset, stride_as, stride_wse, stride_wsr, stride_cs,
                     SECOND_HALF, GATED, GROUP_M, OFF, OFF)),
        (_hand_round, (ready, empty, used_ptr, reduce_dim, num_col_blocks, 2 * HALF_M, BLOCK_K, STAGES, OFF)),
    ], [4, 1], [CONSUMER_REGS, 24])


@gluon.jit
def mma_fp8_kernel(a_desc, w_desc, c_desc, used_ptr, reduce_dim, num_col_blocks, gate_offset, GATED: gl.constexpr,
                   STAGES: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    """The tiles' wgmmas only, accumulated in place (no promotion), 8 warps, a ring filled once; a_desc blocks
    [128, 128]; c_desc a bf16 scratch [T, C] with blocks [128, 128] (GATED: silu(gate) * up)."""
    WTILES: gl.constexpr = 2 if GATED else 1
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WTILES] + w_desc.block_type.shape, w_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    _fill_ring(a_desc, w_desc, a_bufs, w_bufs, bar.index(0), gate_offset, GATED, 1)
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


@gluon.jit
def _plain_consumer(c_desc, a_bufs, w_bufs, c_bufs, ready, empty, cs_ptr, experts_ptr, used_ptr, reduce_dim,
                    num_col_blocks, stride_cs, HALF: gl.constexpr, GATED: gl.constexpr, GROUP_M: gl.constexpr):
    """``gluon_gemm_fp8._consumer`` without the promotion: each K-step's wgmma(s) accumulate in place (no fresh
    part, no scale loads, no fold), waited for before the stage is released as there; the same epilogue."""
    HALF_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    WTILES: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = w_bufs.type.shape[0] // WTILES
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), 2 * HALF_M)
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    it = 0
    for t in range(gl.program_id(0), num_row_blocks * num_col_blocks, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        row0 = rb * 2 * HALF_M + HALF * HALF_M
        rows = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))  # [64]
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
        up = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
        for kk in range(k_steps):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            a = a_bufs.index(2 * s + HALF)
            acc = warpgroup_mma(a, w_bufs.index(s * WTILES).permute((1, 0)), acc, is_async=True)
            if GATED:
                up = warpgroup_mma(a, w_bufs.index(s * WTILES + 1).permute((1, 0)), up, is_async=True)
                acc, up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(s), count=1)
            it += 1
        _epilogue(acc, up, c_desc, c_bufs.index(HALF), cs_ptr + rows * stride_cs + cb, row0, cb, GATED)
    tma.store_wait(0)


@gluon.jit
def unpromoted_fp8_kernel(a_desc, w_desc, c_desc, cs_ptr, experts_ptr, used_ptr, reduce_dim, num_col_blocks, w_rows,
                          gate_offset, stride_cs, GATED: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``grouped_gemm_fp8_kernel`` (its loader, ring and epilogue) with consumers that do not promote."""
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
        (_plain_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, cs_ptr, experts_ptr, used_ptr, reduce_dim,
                           num_col_blocks, stride_cs, FIRST_HALF, GATED, GROUP_M)),
        (_plain_consumer, (c_desc, a_bufs, w_bufs, c_bufs, ready, empty, cs_ptr, experts_ptr, used_ptr, reduce_dim,
                           num_col_blocks, stride_cs, SECOND_HALF, GATED, GROUP_M)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                   w_rows, gate_offset, GATED, GROUP_M, OFF)),
    ], [4, 1], [CONSUMER_REGS, 24])


def launch_probe(kind: str, a, a_s, w, w_s, out, out_s, block_experts, rows_used, tile, gated: bool,
                 gate_offset: int = 0, scratch: torch.Tensor | None = None) -> None:
    """``launch_gemm_fp8``'s arguments (a plain ``Fp8GluonTile``); kind "stream" (loads only), "consumers" (the
    consumers on a ring filled once; out / out_s get products of the ring's data), "unpromoted" (the whole GEMM, its
    consumers without the promotion: out gets unscaled products) or "mma" (wgmmas only into ``scratch``, bf16
    [T, C])."""
    from moekit.experts.triton_gluon_fp8_launch import CONSUMER_WARPS, GROUP, HALF_M
    from moekit.experts.triton_gluon_launch import gluon_descriptor, num_sms

    num_experts, w_rows, reduce_dim = w.shape
    w_desc = gluon_descriptor(w.view(num_experts * w_rows, reduce_dim), [GROUP, GROUP])
    num_col_blocks = out.shape[1] // GROUP
    grid = (max(1, min(num_sms(a.device), -(-a.shape[0] // (2 * HALF_M)) * num_col_blocks)),)
    if kind == "stream":
        stream_fp8_kernel[grid](gluon_descriptor(a, [HALF_M, GROUP]), w_desc, block_experts, rows_used, reduce_dim,
                                num_col_blocks, w_rows, gate_offset, GATED=gated, STAGES=tile.stages,
                                GROUP_M=tile.group_m, num_warps=4)
    elif kind == "consumers":
        out_s = a_s if out_s is None else out_s
        consumers_fp8_kernel[grid](gluon_descriptor(a, [HALF_M, GROUP]), w_desc, gluon_descriptor(out, [HALF_M, GROUP]),
                                   a_s, w_s, out_s, block_experts, rows_used, reduce_dim, num_col_blocks, gate_offset,
                                   a_s.stride(0), w_s.stride(0), w_s.stride(1), out_s.stride(0), GATED=gated,
                                   STAGES=tile.stages, GROUP_M=tile.group_m, CONSUMER_REGS=tile.consumer_regs,
                                   num_warps=CONSUMER_WARPS, maxnreg=tile.max_registers)
    elif kind == "unpromoted":
        out_s = a_s if out_s is None else out_s
        c_desc = gluon_descriptor(out, [HALF_M, GROUP])
        unpromoted_fp8_kernel[grid](gluon_descriptor(a, [HALF_M, GROUP]), w_desc, c_desc, out_s, block_experts,
                                    rows_used, reduce_dim, num_col_blocks, w_rows, gate_offset, out_s.stride(0),
                                    GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m,
                                    CONSUMER_REGS=tile.consumer_regs, num_warps=CONSUMER_WARPS,
                                    maxnreg=tile.max_registers)
    else:
        mma_fp8_kernel[grid](gluon_descriptor(a, [2 * HALF_M, GROUP]), w_desc,
                             gluon_descriptor(scratch, [2 * HALF_M, GROUP]), rows_used, reduce_dim, num_col_blocks,
                             gate_offset, GATED=gated, STAGES=tile.stages, GROUP_M=tile.group_m, num_warps=8)

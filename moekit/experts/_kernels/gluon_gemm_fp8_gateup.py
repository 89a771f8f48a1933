"""The fp8 Gluon gate-up GEMM's pipelined K loops and their epilogues (``gluon_gemm_fp8``'s consumers call them).

Each K-step's promotion (a fresh part, waited, then folded into float32 with its scales) keeps the tensor cores idle
unless another MMA is in flight meanwhile; gate and up accumulators [64, 128] float32 (128 registers a thread) leave
no room for two [64, 128] parts in flight. Two ways around it:
  - PIPE (``_k_loop_gated_paired``): each weight tile's wgmma in two 64-column halves, four [64, 64] accumulators and
    two [64, 64] parts in flight (ptxas spills 224-264 B in the K loop);
  - PAIRS (``_pairs_tile``): the tile's 128 h columns in two passes over K, 64 at a time: a stage holds the 64 gate
    rows then the 64 up rows of those columns ([128, 128], by two [64, 128] TMA boxes), one m64n128 wgmma a step
    covers both, so a pass holds one [64, 128] accumulator and two parts in flight (the down GEMM's pipelined
    schedule, ``_k_loop_paired``); a part is split into its gate and up columns in registers (the wgmma fragment
    repeats every 64 columns) and each folded with its own scale. The first pass's h (float32, [64, 64]) waits in
    SMEM for the second's: the row scale of an h group takes its 128 columns. A streams twice a tile.
Either's h equals the waited loop's (``_k_loop``): the same parts, folded in the same order with the same scales.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _k_loop_gated_paired(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, ws_up, k_steps, it, HALF: gl.constexpr):
    """PIPE on the gate-up GEMM: each weight tile's wgmma split in two 64-column halves (two [64, 128] accumulators
    and two [64, 128] parts are 256 registers a thread; in halves, four [64, 64] accumulators and two parts in
    flight, 192), chained two in flight (each part folded in while the next one runs), all retired inside the step.
    (gate's and up's column halves [64, 64] float32, the ring position after it)."""
    HALF_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    SUB: gl.constexpr = BLOCK_N // 2
    STAGES: gl.constexpr = w_bufs.type.shape[0] // 2
    sub: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, SUB, 32])
    gate_lo = gl.zeros([HALF_M, SUB], gl.float32, sub)
    gate_hi = gl.zeros([HALF_M, SUB], gl.float32, sub)
    up_lo = gl.zeros([HALF_M, SUB], gl.float32, sub)
    up_hi = gl.zeros([HALF_M, SUB], gl.float32, sub)
    zero = gl.zeros([HALF_M, SUB], gl.float32, sub)
    as_ptrs = gl.convert_layout(as_ptrs, gl.SliceLayout(1, sub))
    a_scale = gl.load(as_ptrs)  # [64] K-step 0's; each step loads the next one's while its MMAs run
    for kk in range(k_steps):
        s = it % STAGES
        s_gate = a_scale * gl.load(ws_gate + kk)
        s_up = a_scale * gl.load(ws_up + kk)
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        a = a_bufs.index(2 * s + HALF)
        w_gate = w_bufs.index(2 * s)
        w_up = w_bufs.index(2 * s + 1)
        p0 = warpgroup_mma(a, w_gate.slice(0, SUB).permute((1, 0)), zero, use_acc=False, is_async=True)
        p1 = warpgroup_mma(a, w_gate.slice(SUB, SUB).permute((1, 0)), zero, use_acc=False, is_async=True)
        next_scale = gl.load(as_ptrs + gl.minimum(kk + 1, k_steps - 1))  # the last step reloads its own
        p0 = warpgroup_mma_wait(num_outstanding=1, deps=(p0,))
        gate_lo += p0 * s_gate[:, None]
        p2 = warpgroup_mma(a, w_up.slice(0, SUB).permute((1, 0)), zero, use_acc=False, is_async=True)
        p1 = warpgroup_mma_wait(num_outstanding=1, deps=(p1,))
        gate_hi += p1 * s_gate[:, None]
        p3 = warpgroup_mma(a, w_up.slice(SUB, SUB).permute((1, 0)), zero, use_acc=False, is_async=True)
        p2 = warpgroup_mma_wait(num_outstanding=1, deps=(p2,))
        up_lo += p2 * s_up[:, None]
        p3 = warpgroup_mma_wait(num_outstanding=0, deps=(p3,))
        mbarrier.arrive(empty.index(s), count=1)  # this half's MMAs on stage s retired
        up_hi += p3 * s_up[:, None]
        a_scale = next_scale
        it += 1
    return gate_lo, gate_hi, up_lo, up_hi, it


@gluon.jit
def _halves_epilogue(gate_lo, gate_hi, up_lo, up_hi, c_desc, c_buf, cs_ptrs, row0, cb, layout: gl.constexpr):
    """``_epilogue``'s GATED store from the tile's column halves [64, 64]: h = silu(gate) * up per half."""
    h_lo = gate_lo / (1.0 + gl.exp(-gate_lo)) * up_lo  # [64, 64] fp32
    h_hi = gate_hi / (1.0 + gl.exp(-gate_hi)) * up_hi
    amax = gl.maximum(gl.max(gl.abs(h_lo), axis=1), gl.max(gl.abs(h_hi), axis=1))
    _store_h(h_lo, h_hi, amax, c_desc, c_buf, cs_ptrs, row0, cb, layout)


@gluon.jit
def _store_h(h_lo, h_hi, amax, c_desc, c_buf, cs_ptrs, row0, cb, layout: gl.constexpr):
    """h's column halves [64, 64] float32 (``amax``: each row's over both) quantized with one scale a row (the h
    group), the e4m3 halves joined side by side in ``layout`` (the 128-wide wgmma layout: a register permutation)
    on their way to SMEM, out by TMA; the scales to cs_ptrs [64]."""
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    tma.store_wait(0)  # the last tile's store has read c_buf
    h_scale = gl.where(amax > 0, amax / 448.0, 1.0)
    q_lo = gl.minimum(gl.maximum(h_lo / h_scale[:, None], -448.0), 448.0).to(c_desc.dtype)
    q_hi = gl.minimum(gl.maximum(h_hi / gl.convert_layout(h_scale, gl.SliceLayout(1, h_hi.type.layout))[:, None],
                                 -448.0), 448.0).to(c_desc.dtype)
    both = gl.permute(gl.join(q_lo, gl.convert_layout(q_hi, q_lo.type.layout)), (0, 2, 1))  # [64, 2, 64]
    c_buf.store(gl.convert_layout(gl.reshape(both, [q_lo.shape[0], BLOCK_N]), layout))
    gl.store(cs_ptrs, gl.convert_layout(h_scale, gl.SliceLayout(1, layout)))
    fence_async_shared()
    _tma_store(c_desc, [row0, cb * BLOCK_N], c_buf)


@gluon.jit
def _gate_and_up(part):
    """A [64, 128] gate-up pair's columns 0-63 (gate) and 64-127 (up), [64, 64] each: a register split."""
    return part.reshape([part.shape[0], 2, part.shape[1] // 2]).permute((0, 2, 1)).split()


@gluon.jit
def _fold(gate, up, part, a_scale, w_gate, w_up):
    """gate, up += the part's gate and up columns x their scales (a_scale [64] x the step's weight scale)."""
    g, u = _gate_and_up(part)
    return gate + g * (a_scale * w_gate)[:, None], up + u * (a_scale * w_up)[:, None]


@gluon.jit
def _k_loop_pairs(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, ws_up, k_steps, it, HALF: gl.constexpr,
                  layout: gl.constexpr):
    """PAIRS: one pass over K for 64 of the tile's columns, a stage's weight tile [128, 128] their 64 gate rows then
    64 up rows; the K-steps in pairs, both wgmmas in flight, the first part folded in while the second runs, an odd
    last step alone, waited; nothing in flight across the back edge. (h = silu(gate) * up [64, 64] float32, each
    row's amax, the ring position after it)."""
    HALF_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = w_bufs.type.shape[1]
    STAGES: gl.constexpr = w_bufs.type.shape[0]
    zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    gate, up = _gate_and_up(zero)
    as_ptrs = gl.convert_layout(as_ptrs, gl.SliceLayout(1, gate.type.layout))
    scale_a = gl.load(as_ptrs)  # [64] step 0's; each pair loads the next pair's under its MMAs
    scale_b = gl.load(as_ptrs + gl.minimum(1, k_steps - 1))
    for j in range(k_steps // 2):
        sa = it % STAGES
        sb = (it + 1) % STAGES
        mbarrier.wait(ready.index(sa), (it // STAGES) & 1)
        pa = warpgroup_mma(a_bufs.index(2 * sa + HALF), w_bufs.index(sa).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        mbarrier.wait(ready.index(sb), ((it + 1) // STAGES) & 1)
        pb = warpgroup_mma(a_bufs.index(2 * sb + HALF), w_bufs.index(sb).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        next_a = gl.load(as_ptrs + gl.minimum(2 * j + 2, k_steps - 1))  # the last pair reloads in range
        next_b = gl.load(as_ptrs + gl.minimum(2 * j + 3, k_steps - 1))
        pa = warpgroup_mma_wait(num_outstanding=1, deps=(pa,))
        mbarrier.arrive(empty.index(sa), count=1)
        gate, up = _fold(gate, up, pa, scale_a, gl.load(ws_gate + 2 * j), gl.load(ws_up + 2 * j))
        pb = warpgroup_mma_wait(num_outstanding=0, deps=(pb,))
        mbarrier.arrive(empty.index(sb), count=1)
        gate, up = _fold(gate, up, pb, scale_b, gl.load(ws_gate + 2 * j + 1), gl.load(ws_up + 2 * j + 1))
        scale_a = next_a
        scale_b = next_b
        it += 2
    if k_steps % 2 == 1:  # scale_a is the last step's
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(2 * s + HALF), w_bufs.index(s).permute((1, 0)), zero, use_acc=False)
        mbarrier.arrive(empty.index(s), count=1)
        gate, up = _fold(gate, up, part, scale_a, gl.load(ws_gate + k_steps - 1), gl.load(ws_up + k_steps - 1))
        it += 1
    h = gate / (1.0 + gl.exp(-gate)) * up  # [64, 64] fp32
    return h, gl.max(gl.abs(h), axis=1), it


@gluon.jit
def _pairs_tile(a_bufs, w_bufs, ready, empty, h_buf, c_desc, c_buf, as_ptrs, ws_gate, ws_up, cs_ptrs, row0, cb, k_steps,
                it, HALF: gl.constexpr, layout: gl.constexpr):
    """PAIRS: this consumer's 64 rows of a gate-up tile in two passes (h columns 0-63, then 64-127), the first
    pass's h parked in ``h_buf`` (SMEM [64, 64] float32, this consumer's: each thread reads back what it wrote);
    the ring position after it."""
    h_lo, amax_lo, it = _k_loop_pairs(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, ws_up, k_steps, it, HALF, layout)
    h_buf.store(h_lo)
    h_hi, amax_hi, it = _k_loop_pairs(a_bufs, w_bufs, ready, empty, as_ptrs, ws_gate, ws_up, k_steps, it, HALF, layout)
    amax = gl.maximum(amax_hi, gl.convert_layout(amax_lo, amax_hi.type.layout))
    _store_h(h_buf.load(h_hi.type.layout), h_hi, amax, c_desc, c_buf, cs_ptrs, row0, cb, layout)
    return it

"""The one-launch Gluon decode kernel on fp8_block weights (DeepSeek-V3's recipe; issue 15): ``gluon_decode``'s
schedule, loader, gate-up epilogue and down epilogue, with e4m3 wgmma and 128 x 128 block scales.

    xq, xs  = x's rows quantized per 128 columns (s = amax / 448, 1 for an all-zero block; e4m3 round to nearest)
    g, u    = sum over K steps kk of (w13_q tile @ xq[:, kk]^T) * w13_s[e, row block, kk] * xs[:, kk]   float32
    h[s]    = silu(g) * u                                                                            float32
    hq, hs  = h's rows quantized per 128 columns, as x's
    y[s]    = weight[s] * sum over N steps c of (w2_q tile @ hq[:, c]^T) * w2_s[e, row block, c] * hs[:, c]
    out[t]  = sum of its k slots' y in slot order, in x's dtype

Every K step is one scale block (BK = 128), and a tile's BM = 64 rows lie in one 128-row weight block, so a step's
weight scale is one scalar. Each step's wgmma goes into a fresh accumulator (``use_acc=False``: the fp8 tensor
cores' own accumulation is short of float32) and is then added, scaled, in float32. The MMA partition quantizes
x itself when it stages x (every program the same values: no quantize launch), and h when it stages every slot's
h before its first down tile (h is written in float32, unquantized: a gate-up tile holds 64 of a 128-column
group). Scales: x's and h's in registers, [steps, rows]; the weights' read from global, a tile's at its start.
Gluon does not run in the interpreter: the torch twin is ``triton_gluon_decode_fp8.decode_fp8_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_decode import (
    _barrier, _decode_loader, _down_epilogue, _slot_tile, _up_epilogue, _wait_all,
)

FP8_MAX = gl.constexpr(448.0)


@gluon.constexpr_function
def _pow2(n):
    return 1 << (int(n) - 1).bit_length()


@gluon.jit
def _stage_quantized(q_smem, src_ptr, num_rows, row_stride, CP: gl.constexpr, num_warps: gl.constexpr):
    """q_smem [C, R, 128] e4m3 = src's first num_rows rows (float32 or bf16, row_stride elements apart) quantized
    per 128 columns; rows past num_rows zero (scale 1). Returns the scales [CP, R] float32 (CP >= C, a power of
    two; rows past C are 1) in ``_scale_layout``."""
    C: gl.constexpr = q_smem.type.shape[0]
    R: gl.constexpr = q_smem.type.shape[1]
    BK: gl.constexpr = q_smem.type.shape[2]
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, num_warps], [1, 0])
    sl: gl.constexpr = _scale_layout(num_warps)
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, layout)), 1)  # [R, 1]
    c = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, layout)), 0)  # [1, BK]
    ci = gl.expand_dims(gl.arange(0, CP, layout=gl.SliceLayout(1, sl)), 1)  # [CP, 1]
    scales = gl.full([CP, R], 1.0, gl.float32, sl)
    for i in gl.static_range(C):
        v = gl.load(src_ptr + r * row_stride + i * BK + c, mask=r < num_rows, other=0.0,
                    cache_modifier=".cg").to(gl.float32)
        amax = gl.max(gl.abs(v), axis=1)  # [R]
        scale = gl.where(amax > 0, amax / FP8_MAX, 1.0)
        q = gl.minimum(gl.maximum(v / gl.expand_dims(scale, 1), -FP8_MAX), FP8_MAX)
        q_smem.index(i).store(q.to(q_smem.dtype))
        row = gl.expand_dims(gl.convert_layout(scale, gl.SliceLayout(0, sl)), 0)  # [1, R]
        scales = gl.where(ci == i, row, scales)
    fence_async_shared()
    _barrier()
    return scales


@gluon.constexpr_function
def _scale_layout(num_warps):
    return gl.BlockedLayout([1, 1], [4, 8], [num_warps, 1], [1, 0])


@gluon.jit
def _col_scales(scales, i, col_layout: gl.constexpr):
    """Row i of the [CP, R] scales, as a [1, R] tensor of the accumulator's column layout."""
    ci = gl.expand_dims(gl.arange(0, scales.type.shape[0], layout=gl.SliceLayout(1, scales.type.layout)), 1)
    row = gl.sum(gl.where(ci == i, scales, 0.0), axis=0)  # [R]
    return gl.expand_dims(gl.convert_layout(row, col_layout), 0)


@gluon.jit
def _step_scale(vec, idx, i):
    """vec[i] of a register vector (a scalar)."""
    return gl.sum(gl.where(idx == i, vec, 0.0), axis=0)


@gluon.jit
def _up_tile_fp8(xq_smem, xs, ring, ready, empty, w13s_ptr, e, blk, piece, it, N: gl.constexpr,
                 K: gl.constexpr, KS: gl.constexpr, acc_layout: gl.constexpr, num_warps: gl.constexpr):
    """Gate-up MMAs of one tile's K piece, block-scaled: (it, gate, up), [BM, XR] float32 each."""
    BM: gl.constexpr = ring.type.shape[1]
    BK: gl.constexpr = ring.type.shape[2]
    XR: gl.constexpr = xq_smem.type.shape[1]
    STAGES: gl.constexpr = ring.type.shape[0] // 2
    KP: gl.constexpr = K // BK // KS
    KPP: gl.constexpr = 16 if KP <= 16 else (32 if KP <= 32 else 64)
    KSB: gl.constexpr = K // 128  # weight scale blocks along K
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    kidx = gl.arange(0, KPP, layout=vec_layout)
    base = w13s_ptr + e * (2 * N // 128) * KSB + piece * KP + kidx
    s_gate = gl.load(base + (blk * BM // 128) * KSB, mask=kidx < KP, other=0.0)  # [KPP] this piece's steps
    s_up = gl.load(base + ((N + blk * BM) // 128) * KSB, mask=kidx < KP, other=0.0)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    zero = gl.zeros([BM, XR], gl.float32, acc_layout)
    g = gl.zeros([BM, XR], gl.float32, acc_layout)
    u = gl.zeros([BM, XR], gl.float32, acc_layout)
    for kk in range(piece * KP, piece * KP + KP):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        xb = xq_smem.index(kk).permute((1, 0))  # [BK, XR] e4m3
        pg = warpgroup_mma(ring.index(2 * st), xb, zero, use_acc=False, is_async=True)
        pu = warpgroup_mma(ring.index(2 * st + 1), xb, zero, use_acc=False, is_async=True)
        xsk = _col_scales(xs, kk, col_layout)  # [1, XR]
        sg = _step_scale(s_gate, kidx, kk - piece * KP)
        su = _step_scale(s_up, kidx, kk - piece * KP)
        pg, pu = warpgroup_mma_wait(num_outstanding=0, deps=(pg, pu))
        mbarrier.arrive(empty.index(st), count=1)  # this step's MMAs retired
        g += pg * (xsk * sg)
        u += pu * (xsk * su)
        it += 1
    return it, g, u


@gluon.jit
def _down_tile_fp8(ring, hq_smem, hs, ready, empty, w2s_ptr, ids_ptr, wts_ptr, y_ptr, out_ptr, arrive_ptr,
                   num_experts, e, s, blk, tok, it, TOP_K: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                   num_warps: gl.constexpr):
    """Down tile (slot s, rows blk*BM.. of K), block-scaled, then ``_down_epilogue``."""
    BM: gl.constexpr = ring.type.shape[1]
    BK: gl.constexpr = ring.type.shape[2]
    HR: gl.constexpr = hq_smem.type.shape[1]
    STAGES: gl.constexpr = ring.type.shape[0] // 2
    NSB: gl.constexpr = N // 128
    NPP: gl.constexpr = 16 if NSB <= 16 else (32 if NSB <= 32 else 128)
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HR, 32])
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    nidx = gl.arange(0, NPP, layout=vec_layout)
    s_w2 = gl.load(w2s_ptr + e * (K // 128) * NSB + (blk * BM // 128) * NSB + nidx, mask=nidx < NSB, other=0.0)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    zero = gl.zeros([BM, HR], gl.float32, acc_layout)
    acc = gl.zeros([BM, HR], gl.float32, acc_layout)
    for j in range(N // (2 * BK)):
        st = it % STAGES
        mbarrier.wait(ready.index(st), (it // STAGES) & 1)
        p0 = warpgroup_mma(ring.index(2 * st), hq_smem.index(2 * j).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        p1 = warpgroup_mma(ring.index(2 * st + 1), hq_smem.index(2 * j + 1).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        hs0 = _col_scales(hs, 2 * j, col_layout)  # [1, HR]
        hs1 = _col_scales(hs, 2 * j + 1, col_layout)
        w0 = _step_scale(s_w2, nidx, 2 * j)
        w1 = _step_scale(s_w2, nidx, 2 * j + 1)
        p0, p1 = warpgroup_mma_wait(num_outstanding=0, deps=(p0, p1))
        mbarrier.arrive(empty.index(st), count=1)
        acc += p0 * (hs0 * w0) + p1 * (hs1 * w1)
        it += 1
    _down_epilogue(acc, ids_ptr, wts_ptr, y_ptr, out_ptr, arrive_ptr, num_experts, s, blk, tok, TOP_K, K)
    return it


@gluon.jit
def _decode_mma_fp8(xq_smem, ring, hq_smem, ready, empty, x_ptr, w13s_ptr, w2s_ptr, ids_ptr,
                    wts_ptr, h_ptr, y_ptr, out_ptr, part_ptr, up_done_ptr, piece_ptr, arrive_ptr, exit_ptr,
                    num_experts, S: gl.constexpr, TOP_K: gl.constexpr, N: gl.constexpr, K: gl.constexpr,
                    KS: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = ring.type.shape[1]
    XR: gl.constexpr = xq_smem.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, XR, 32])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))  # [BM]
    cols = gl.expand_dims(gl.arange(0, XR, layout=gl.SliceLayout(0, acc_layout)), 0)  # [1, XR]
    KSP: gl.constexpr = _pow2(K // 128)
    NSP: gl.constexpr = _pow2(N // 128)
    HR: gl.constexpr = hq_smem.type.shape[1]
    xs = _stage_quantized(xq_smem, x_ptr, S // TOP_K, K, KSP, num_warps)  # x's M rows, zero-padded to XR
    hs = gl.full([NSP, HR], 1.0, gl.float32, _scale_layout(num_warps))
    it = 0
    staged = 0
    for t in range(gl.program_id(0), S * (N // BM * KS + K // BM), gl.num_programs(0)):
        up, s, blk, piece = _slot_tile(t, S, N // BM, K // BM, KS)
        e = gl.minimum(gl.load(ids_ptr + s), num_experts - 1)
        if up:
            it, g, u = _up_tile_fp8(xq_smem, xs, ring, ready, empty, w13s_ptr, e, blk, piece, it, N, K, KS,
                                    acc_layout, num_warps)
            _up_epilogue(g, u, h_ptr, part_ptr, piece_ptr, up_done_ptr, s, blk, piece, s // TOP_K, rows, cols, N, KS)
        else:
            if staged == 0:  # the program's first down tile: every slot's h, quantized, once
                _wait_all(up_done_ptr, S, N // BM)
                hs = _stage_quantized(hq_smem, h_ptr, S, N, NSP, num_warps)
                staged = 1
            it = _down_tile_fp8(ring, hq_smem, hs, ready, empty, w2s_ptr, ids_ptr, wts_ptr, y_ptr, out_ptr,
                                arrive_ptr, num_experts, e, s, blk, s // TOP_K, it, TOP_K, N, K, num_warps)
    _barrier()
    done = gl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if done == gl.num_programs(0) - 1:  # every program has passed all its waits: reset for the next call
        slots = gl.arange(0, 16, layout=gl.SliceLayout(1, acc_layout))
        gl.store(up_done_ptr + slots, gl.zeros([16], gl.int32, gl.SliceLayout(1, acc_layout)), mask=slots < S)
        gl.store(exit_ptr, 0)


@gluon.jit
def decode_fp8_kernel(w13_desc, w2_desc, x_ptr, w13s_ptr, w2s_ptr, ids_ptr, wts_ptr, h_ptr, y_ptr, out_ptr, part_ptr,
                      up_done_ptr, piece_ptr, arrive_ptr, exit_ptr, num_experts, S: gl.constexpr, TOP_K: gl.constexpr,
                      N: gl.constexpr, K: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    """``gluon_decode.decode_kernel``'s arguments, with w13_desc / w2_desc over the e4m3 weights (blocks [64, 128])
    and w13s_ptr [E, 2N/128, K/128], w2s_ptr [E, K/128, N/128] their float32 block scales (contiguous); h_ptr
    [S, N] float32. N a multiple of 256, K of 128 * KS."""
    BK: gl.constexpr = w13_desc.block_type.shape[1]
    XR: gl.constexpr = 8
    HR: gl.constexpr = 8 if S <= 8 else 16
    fp8: gl.constexpr = w13_desc.dtype
    xq_smem = gl.allocate_shared_memory(fp8, [K // BK, XR, BK], gl.NVMMASharedLayout.get_default_for([XR, BK], fp8))
    hq_smem = gl.allocate_shared_memory(fp8, [N // BK, HR, BK], gl.NVMMASharedLayout.get_default_for([HR, BK], fp8))
    ring = gl.allocate_shared_memory(fp8, [2 * STAGES] + w13_desc.block_type.shape, w13_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_decode_mma_fp8, (xq_smem, ring, hq_smem, ready, empty, x_ptr, w13s_ptr, w2s_ptr, ids_ptr,
                           wts_ptr, h_ptr, y_ptr, out_ptr, part_ptr, up_done_ptr, piece_ptr, arrive_ptr, exit_ptr,
                           num_experts, S, TOP_K, N, K, KS, num_warps)),
        (_decode_loader, (w13_desc, w2_desc, ring, ready, empty, ids_ptr, num_experts, S, N, K, KS)),
    ], [1], [40])

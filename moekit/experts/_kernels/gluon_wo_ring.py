"""A warp-specialized Gluon GEMV for the int4 weight-only decode (Hopper; issue 16): the packed weights stream
through a shared-memory ring that one loader warp keeps full with TMA, decoupled from the decode.

    gate-up (GATED): h[s, r] = bf16(silu(g) * u),  g = x[s // TOP_K] . w13[e(s), r],  u = ... w13[e(s), N + r]
    down:            y[s, r] = weight[s] * (h[s] . w2[e(s), r])                           float32
    w[e, r, c] = (code - zero[e, c // 128, r]) * scale[e, c // 128, r]       (one group of 128 a step)

One program per SM walks the tile list t = program_id + i * grid, tile t = (slot s = t // NB, rows blk = t % NB
of BM rows), each tile the whole reduction dim in G steps of one group (64 packed bytes = 128 values).

Partitions:
  - loader (1 warp): per step one stage: the [BM, 64] packed bytes of the tile's rows (gate and up rows both
    when GATED), their scales [1, BM] float32 and zeros [1, BM] uint8 from the transposed group tensors (``scale_t``
    / ``zero_t`` [E * G, R]: a TMA box needs >= 16 contiguous bytes, so the per-group values of BM rows must be
    contiguous). It never waits on anything but a free stage.
  - loader, also: the step's 128 values of the x row (gate-up: the token's; down: the slot's h) as [1, 64] int32.
  - decode (num_warps warps): x's two bf16 values of a packed byte read as one int32 (low value in its low half:
    ``xlo = bits << 16``, ``xhi = bits & 0xffff0000``, exact); each packed byte b gives the two codes as exact
    float32 by bit placement: ``(b & 0x0f) | 0x4b000000`` is the float 2^23 + code, ``(b & 0xf0) | 0x4b000000``
    the float 2^23 + 16 code, so one subtraction of 2^23 + zero (2^23 + 16 zero) gives code - zero
    (16 (code - zero): x's high value carries the 1/16); then the FMAs and the group's scale on the row sum.
    The stage is released once every warp has its registers (a partition barrier, then one arrival).
  - LOADER_ONLY: the decode partition waits for each stage and releases it at once (the ring's own rate).

Gluon does not run in the interpreter: the torch twin is ``triton_wo_ring.ring_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moekit.experts._kernels.gluon_gemm import _tma_load

_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
MAGIC = gl.constexpr(0x4B000000)  # the float32 bits of 2^23
HIGH_HALF = gl.constexpr(-65536)  # 0xffff0000 as int32


@gluon.jit
def _ring_loader(q_desc, s_desc, z_desc, x_desc, xs_desc, wq, ws, wz, wx, wxs, ready, empty, ids_ptr, item_e_ptr,
                 item_s_ptr, count_ptr, num_experts, S: gl.constexpr, TOP_K: gl.constexpr, R: gl.constexpr,
                 ROWS: gl.constexpr, G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr,
                 XPREP: gl.constexpr):
    """XPREP: x_desc / xs_desc are the words decode's prepared x [rows * G * 8, 16] / sums [rows * G, 16] float32,
    blocks [8, 16] / [1, 16] (a step's); q_desc's blocks [BM, 16] int32 words (else [BM, 64] bytes): either way 64
    bytes of BM rows a step. Else xs_desc and wxs are unused."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    W: gl.constexpr = 2 if GATED else 1  # tiles a stage (gate and up)
    STAGES: gl.constexpr = empty.type.shape[0]
    NB: gl.constexpr = ROWS // BM
    XB: gl.constexpr = x_desc.block_type.nbytes + (xs_desc.block_type.nbytes if XPREP else 0)
    nbytes: gl.constexpr = (W * (q_desc.block_type.nbytes + s_desc.block_type.nbytes + z_desc.block_type.nbytes)
                            + TM * XB)
    if GROUPED:
        items = gl.load(count_ptr)
    else:
        items = S
    it = 0
    for t in range(gl.program_id(0), items * NB, gl.num_programs(0)):
        item = t // NB
        r0 = (t % NB) * BM
        if GROUPED:
            e = gl.load(item_e_ptr + item)
        else:
            e = gl.load(ids_ptr + item)
        e = gl.minimum(e, num_experts - 1)  # an id >= E (EP skip): weight 0, any rows
        for g in range(G):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(st), nbytes)
            for i in gl.static_range(TM):  # x's rows: the slots' tokens (down: h's rows, the slots; TOP_K 1)
                if GROUPED:
                    slot = gl.maximum(gl.load(item_s_ptr + item * TM + i), 0)
                else:
                    slot = item
                if XPREP:
                    _tma_load(x_desc, [((slot // TOP_K) * G + g) * 8, 0], ready.index(st), wx.index(TM * st + i))
                    _tma_load(xs_desc, [(slot // TOP_K) * G + g, 0], ready.index(st), wxs.index(TM * st + i))
                else:
                    _tma_load(x_desc, [slot // TOP_K, g * 64], ready.index(st), wx.index(TM * st + i))
            for w in gl.static_range(W):
                _tma_load(q_desc, [e * R + w * ROWS + r0, g * q_desc.block_type.shape[1]], ready.index(st),
                          wq.index(W * st + w))
                _tma_load(s_desc, [e * G + g, w * ROWS + r0], ready.index(st), ws.index(W * st + w))
                _tma_load(z_desc, [e * G + g, w * ROWS + r0], ready.index(st), wz.index(W * st + w))
            it += 1


@gluon.jit
def _row_values(buf, L: gl.constexpr, num_warps: gl.constexpr):
    """A [1, BM] stage buffer as a [BM] float32 tensor distributed like L's rows (BM // (4 num_warps) a thread)."""
    BM: gl.constexpr = buf.type.shape[1]
    RPT: gl.constexpr = BM // (4 * num_warps)
    LS: gl.constexpr = gl.BlockedLayout([1, RPT], [8, 4], [1, num_warps], [0, 1])  # rows: L's thread bits
    v = gl.sum(buf.load(LS).to(gl.float32), axis=0)  # [BM], one value a row
    return gl.convert_layout(v, gl.SliceLayout(1, L))


@gluon.jit
def _decode(buf, zbuf, L: gl.constexpr, num_warps: gl.constexpr):
    """One stage's [BM, 64] packed bytes as exact float32 (code - zero[r]) [BM, 64] (low nibbles) and
    16 (code - zero[r]) (high nibbles)."""
    b = buf.load(L).to(gl.int32)  # [BM, 64]
    z = gl.expand_dims(_row_values(zbuf, L, num_warps), 1)  # [BM, 1]
    lo = ((b & 0x0F) | MAGIC).to(gl.float32, bitcast=True) - (8388608.0 + z)
    hi = ((b & 0xF0) | MAGIC).to(gl.float32, bitcast=True) - (8388608.0 + 16.0 * z)
    return lo, hi


@gluon.jit
def _dot(lo, hi, xbuf, L: gl.constexpr, LX: gl.constexpr):
    """sum_j lo[r, j] x[2j] + hi[r, j] x[2j+1] / 16: [BM] float32; xbuf [1, 64] int32 (x's bf16 pairs)."""
    bits = gl.convert_layout(gl.sum(xbuf.load(LX), axis=0), gl.SliceLayout(0, L))  # [64] int32
    xlo = (bits << 16).to(gl.float32, bitcast=True)  # x[2j] (the low half)
    xhi = (bits & HIGH_HALF).to(gl.float32, bitcast=True) * 0.0625  # x[2j+1] / 16
    return gl.sum(lo * gl.expand_dims(xlo, 0) + hi * gl.expand_dims(xhi, 0), axis=1)


@gluon.jit
def _ring_decode(wq, ws, wz, wx, ready, empty, ids_ptr, wts_ptr, item_s_ptr, count_ptr, out_ptr, num_experts,
                 S: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr,
                 GROUPED: gl.constexpr, LOADER_ONLY: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = wq.type.shape[1]
    W: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = empty.type.shape[0]
    NB: gl.constexpr = ROWS // BM
    RPT: gl.constexpr = BM // (4 * num_warps)
    L: gl.constexpr = gl.BlockedLayout([RPT, 8], [4, 8], [num_warps, 1], [1, 0])  # [BM, 64]
    LX: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])  # [1, 64]: columns as L's
    LA: gl.constexpr = gl.BlockedLayout([RPT, TM], [4, 8], [num_warps, 1], [1, 0])  # [BM, TM]: rows as L's
    rows = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(1, LA)), 1)  # [BM, 1]
    cols = gl.expand_dims(gl.arange(0, TM, layout=gl.SliceLayout(0, LA)), 0)  # [1, TM]: the item's slots
    if GROUPED:
        items = gl.load(count_ptr)
    else:
        items = S
    it = 0
    for t in range(gl.program_id(0), items * NB, gl.num_programs(0)):
        item = t // NB
        r0 = (t % NB) * BM
        acc_g = gl.zeros([BM, TM], gl.float32, LA)
        acc_u = gl.zeros([BM, TM], gl.float32, LA)
        for g in range(G):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            if not LOADER_ONLY:
                lo_g, hi_g = _decode(wq.index(W * st), wz.index(W * st), L, num_warps)
                sc_g = _row_values(ws.index(W * st), L, num_warps)
                if GATED:
                    lo_u, hi_u = _decode(wq.index(W * st + 1), wz.index(W * st + 1), L, num_warps)
                    sc_u = _row_values(ws.index(W * st + 1), L, num_warps)
                for i in gl.static_range(TM):
                    p = gl.convert_layout(_dot(lo_g, hi_g, wx.index(TM * st + i), L, LX) * sc_g, gl.SliceLayout(1, LA))
                    acc_g += gl.where(cols == i, gl.expand_dims(p, 1), 0.0)
                    if GATED:
                        p = gl.convert_layout(_dot(lo_u, hi_u, wx.index(TM * st + i), L, LX) * sc_u,
                                              gl.SliceLayout(1, LA))
                        acc_u += gl.where(cols == i, gl.expand_dims(p, 1), 0.0)
                _barrier()  # every warp has its registers before the stage is handed back
            mbarrier.arrive(empty.index(st), count=1)
            it += 1
        if GROUPED:
            slots = gl.load(item_s_ptr + item * TM + cols)  # [1, TM], -1: none
        else:
            slots = item + cols
        ok = slots >= 0
        if GATED:
            h = acc_g / (1.0 + gl.exp(-acc_g)) * acc_u
            gl.store(out_ptr + slots * ROWS + r0 + rows, h.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            at = gl.maximum(slots, 0)
            wt = gl.where(ok & (gl.load(ids_ptr + at) < num_experts), gl.load(wts_ptr + at), 0.0)
            gl.store(out_ptr + slots * ROWS + r0 + rows, acc_g * wt, mask=ok)


@gluon.jit
def ring_kernel(q_desc, s_desc, z_desc, x_desc, ids_ptr, wts_ptr, item_e_ptr, item_s_ptr, count_ptr, out_ptr,
                num_experts, S: gl.constexpr, TOP_K: gl.constexpr, R: gl.constexpr, ROWS: gl.constexpr,
                G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr, STAGES: gl.constexpr,
                LOADER_ONLY: gl.constexpr, num_warps: gl.constexpr):
    """q_desc [E*R, G*64] uint8 blocks [BM, 64]; s_desc [E*G, R] float32 and z_desc [E*G, R] uint8 blocks [1, BM];
    x_desc [S / TOP_K (GATED) or S, G*64] int32 (bf16 pairs) blocks [1, 64]; ids_ptr / wts_ptr [S] int32 /
    float32 (slots token-major); out_ptr [S, ROWS]: bf16 h (GATED, ROWS = N, R = 2N) or float32 y (ROWS = R = K).
    GROUPED: items of up to TM slots of one expert (its rows read once for all): item_e_ptr [S] int32 the item's
    expert, item_s_ptr [S, TM] int32 its slots (-1: none), count_ptr [1] int32 the items; else (TM 1) a slot an
    item and the three unused."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    W: gl.constexpr = 2 if GATED else 1
    wq = gl.allocate_shared_memory(gl.uint8, [W * STAGES, BM, 64], q_desc.layout)
    ws = gl.allocate_shared_memory(gl.float32, [W * STAGES, 1, BM], s_desc.layout)
    wz = gl.allocate_shared_memory(gl.uint8, [W * STAGES, 1, BM], z_desc.layout)
    wx = gl.allocate_shared_memory(gl.int32, [TM * STAGES, 1, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_ring_decode, (wq, ws, wz, wx, ready, empty, ids_ptr, wts_ptr, item_s_ptr, count_ptr, out_ptr, num_experts,
                        S, ROWS, G, GATED, TM, GROUPED, LOADER_ONLY, num_warps)),
        (_ring_loader, (q_desc, s_desc, z_desc, x_desc, x_desc, wq, ws, wz, wx, wx, ready, empty, ids_ptr, item_e_ptr,
                        item_s_ptr, count_ptr, num_experts, S, TOP_K, R, ROWS, G, GATED, TM, GROUPED, False)),
    ], [1], [40])

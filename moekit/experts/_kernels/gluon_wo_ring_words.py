"""The ring GEMV's word decode (int4, Hopper; issue 16): the same loader and ring as ``gluon_wo_ring`` (its
``_ring_loader`` with XPREP), the packed bytes read from shared memory as 32-bit words, 8 codes each.

    word c of a step = K values 8c..8c+7 of the group, code j in bits 4j..4j+3 (little endian, low nibble first)
    (w & (15 << 4j)) | 0x4b000000        = the float 2^23 + code * 16^j            (j = 0..3; exact)
    ((w >> 16) & (15 << 4(j-4))) | ...   = the float 2^23 + code * 16^(j-4)         (j = 4..7)

One subtraction of 2^23 gives code * 16^(j % 4); x comes prepared (``triton_wo_ring.prep_x``: float32, value j
of word c at [j, c] times 16^-(j % 4); beside it the word's sum of the 8 values), so a word's dot is one FFMA a
code: t[r, c] = sum_j code_j * x_j[c]; the zero enters once a word: (t - zero[r] * xsum[c]) * scale[r], added
to a [BM, 16] float32 accumulator summed over the row only at the tile's end (no per-step reduction).

Items of up to TM = 1 or 2 slots of one expert (GROUPED as in ``gluon_wo_ring``). Torch twin:
``triton_wo_ring.ring_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moekit.experts._kernels.gluon_wo_ring import MAGIC, _barrier, _ring_loader, _row_values


@gluon.jit
def _x_row(xb, j: gl.constexpr, LW: gl.constexpr, num_warps: gl.constexpr):
    """Row j of a step's prepared x [8, 16] (or sums [1, 16]) as [1, 16] float32 distributed like LW's columns."""
    LXJ: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [num_warps, 1], [1, 0])
    v = gl.sum(xb.slice(j, 1, dim=0).load(LXJ), axis=0)  # [16]
    return gl.expand_dims(gl.convert_layout(v, gl.SliceLayout(0, LW)), 0)


@gluon.jit
def _code(w, w_hi, j: gl.constexpr):
    """Code j of each word times 16^(j % 4), exact float32."""
    src = w if j < 4 else w_hi
    return ((src & (15 << (4 * (j % 4)))) | MAGIC).to(gl.float32, bitcast=True) - 8388608.0


@gluon.jit
def _word_dots(wg, wu, xb, LW: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
    """(t_gate, t_up) [BM, 16]: sum_j code_j(w[r, c]) * x_j[c] over the 8 codes of each word."""
    wg_hi = wg >> 16
    wu_hi = wu >> 16
    tg = gl.zeros(wg.shape, gl.float32, LW)
    tu = gl.zeros(wg.shape, gl.float32, LW)
    for j in gl.static_range(8):
        xj = _x_row(xb, j, LW, num_warps)
        tg += _code(wg, wg_hi, j) * xj
        if GATED:
            tu += _code(wu, wu_hi, j) * xj
    return tg, tu


@gluon.jit
def _stage(wq, ws, wz, idx, LW: gl.constexpr, num_warps: gl.constexpr):
    """Ring buffer idx: (words [BM, 16] int32, zeros [BM, 1] and scales [BM, 1] float32), rows as LW's."""
    RPT: gl.constexpr = wq.type.shape[1] // (4 * num_warps)
    L: gl.constexpr = gl.BlockedLayout([RPT, 8], [4, 8], [num_warps, 1], [1, 0])  # rows as LW's
    z = gl.expand_dims(gl.convert_layout(_row_values(wz.index(idx), L, num_warps), gl.SliceLayout(1, LW)), 1)
    s = gl.expand_dims(gl.convert_layout(_row_values(ws.index(idx), L, num_warps), gl.SliceLayout(1, LW)), 1)
    return wq.index(idx).load(LW), z, s


@gluon.jit
def _words_decode(wq, ws, wz, wx, wxs, ready, empty, ids_ptr, wts_ptr, item_s_ptr, count_ptr, out_ptr, num_experts,
                  S: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr,
                  GROUPED: gl.constexpr, LOADER_ONLY: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = wq.type.shape[1]
    W: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = empty.type.shape[0]
    NB: gl.constexpr = ROWS // BM
    RPT: gl.constexpr = BM // (4 * num_warps)
    LW: gl.constexpr = gl.BlockedLayout([RPT, 2], [4, 8], [num_warps, 1], [1, 0])  # [BM, 16] words
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, LW))  # [BM]
    if GROUPED:
        items = gl.load(count_ptr)
    else:
        items = S
    it = 0
    for t in range(gl.program_id(0), items * NB, gl.num_programs(0)):
        item = t // NB
        r0 = (t % NB) * BM
        acc_g0 = gl.zeros([BM, 16], gl.float32, LW)
        acc_u0 = gl.zeros([BM, 16], gl.float32, LW)
        acc_g1 = gl.zeros([BM, 16], gl.float32, LW)
        acc_u1 = gl.zeros([BM, 16], gl.float32, LW)
        for g in range(G):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            if not LOADER_ONLY:
                wg, zg, sg = _stage(wq, ws, wz, W * st, LW, num_warps)
                if GATED:
                    wu, zu, su = _stage(wq, ws, wz, W * st + 1, LW, num_warps)
                else:
                    wu = wg
                    zu = zg
                    su = sg
                xb = wx.index(TM * st)
                xs = _x_row(wxs.index(TM * st), 0, LW, num_warps)  # [1, 16] the words' x sums
                tg, tu = _word_dots(wg, wu, xb, LW, GATED, num_warps)
                acc_g0 += (tg - zg * xs) * sg
                if GATED:
                    acc_u0 += (tu - zu * xs) * su
                if TM > 1:
                    xb = wx.index(TM * st + 1)
                    xs = _x_row(wxs.index(TM * st + 1), 0, LW, num_warps)
                    tg, tu = _word_dots(wg, wu, xb, LW, GATED, num_warps)
                    acc_g1 += (tg - zg * xs) * sg
                    if GATED:
                        acc_u1 += (tu - zu * xs) * su
                _barrier()  # every warp has its registers before the stage is handed back
            mbarrier.arrive(empty.index(st), count=1)
            it += 1
        _words_store(acc_g0, acc_u0, 0, item, r0, rows, ids_ptr, wts_ptr, item_s_ptr, out_ptr, num_experts, ROWS, GATED,
                     TM, GROUPED)
        if TM > 1:
            _words_store(acc_g1, acc_u1, 1, item, r0, rows, ids_ptr, wts_ptr, item_s_ptr, out_ptr, num_experts, ROWS,
                         GATED, TM, GROUPED)


@gluon.jit
def _words_store(acc_g, acc_u, i: gl.constexpr, item, r0, rows, ids_ptr, wts_ptr, item_s_ptr, out_ptr, num_experts,
                 ROWS: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr):
    """The item's i-th slot's rows: gated h = silu(gate) * up (bf16), else y = weight * the sum (float32)."""
    if GROUPED:
        slot = gl.load(item_s_ptr + item * TM + i)  # -1: none
    else:
        slot = item
    ok = (rows < ROWS) & (slot >= 0)
    g = gl.sum(acc_g, axis=1)  # [BM]
    if GATED:
        u = gl.sum(acc_u, axis=1)
        h = g / (1.0 + gl.exp(-g)) * u
        gl.store(out_ptr + slot * ROWS + r0 + rows, h.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        at = gl.maximum(slot, 0)
        wt = gl.where(gl.load(ids_ptr + at) < num_experts, gl.load(wts_ptr + at), 0.0)
        gl.store(out_ptr + slot * ROWS + r0 + rows, g * wt, mask=ok)


@gluon.jit
def ring_words_kernel(q_desc, s_desc, z_desc, x_desc, xs_desc, ids_ptr, wts_ptr, item_e_ptr, item_s_ptr, count_ptr,
                      out_ptr, num_experts, S: gl.constexpr, TOP_K: gl.constexpr, R: gl.constexpr, ROWS: gl.constexpr,
                      G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr,
                      STAGES: gl.constexpr, LOADER_ONLY: gl.constexpr, num_warps: gl.constexpr):
    """As ``gluon_wo_ring.ring_kernel`` but q_desc [E*R, G*16] int32 blocks [BM, 16] and x_desc / xs_desc the
    prepared x [rows * G * 8, 16] / sums [rows * G, 16] float32 blocks [8, 16] / [1, 16] (``triton_wo_ring.prep_x``);
    TM 1 or 2."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    W: gl.constexpr = 2 if GATED else 1
    wq = gl.allocate_shared_memory(gl.int32, [W * STAGES, BM, 16], q_desc.layout)
    ws = gl.allocate_shared_memory(gl.float32, [W * STAGES, 1, BM], s_desc.layout)
    wz = gl.allocate_shared_memory(gl.uint8, [W * STAGES, 1, BM], z_desc.layout)
    wx = gl.allocate_shared_memory(gl.float32, [TM * STAGES, 8, 16], x_desc.layout)
    wxs = gl.allocate_shared_memory(gl.float32, [TM * STAGES, 1, 16], xs_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_words_decode, (wq, ws, wz, wx, wxs, ready, empty, ids_ptr, wts_ptr, item_s_ptr, count_ptr, out_ptr,
                         num_experts, S, ROWS, G, GATED, TM, GROUPED, LOADER_ONLY, num_warps)),
        (_ring_loader, (q_desc, s_desc, z_desc, x_desc, xs_desc, wq, ws, wz, wx, wxs, ready, empty, ids_ptr,
                        item_e_ptr, item_s_ptr, count_ptr, num_experts, S, TOP_K, R, ROWS, G, GATED, TM, GROUPED,
                        True)),
    ], [1], [40])

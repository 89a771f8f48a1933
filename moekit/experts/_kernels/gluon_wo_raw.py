"""The ring GEMV's raw word decode (int4, Hopper; issue 16): a loader warp keeps a TMA ring of packed words and
raw x; the decode warps read the group scales and zeros of the moekit layout ([E, R, G], no copy) from global
memory four groups ahead, and decode each 32-bit word's 8 codes in place.

    word c of a step = K values 8c..8c+7 of the group, code j in bits 4j..4j+3 (little endian, low nibble first);
    p = j % 4, src = w (j < 4) or w >> 16 (j >= 4):
    (src & (15 << 4p)) | bits(2^(23 - 4p))   is the float 2^(23-4p) + code (exact: the code's unit is that
                                             float's last mantissa bit), so minus 2^(23-4p) = code

Then one FFMA a code against x (bf16 pairs read as int32 from the ring: x[2q] = bits << 16, x[2q+1] = bits &
0xffff0000); a word's sum minus zero times the word's x sum, times the row's group scale, goes to a [BM, 16]
float32 accumulator, summed over the row once a tile. One tile = (item, BM rows), the whole reduction dim in G
steps of 128 values (64 bytes a row).

    gate-up (GATED): h[s, r] = bf16(silu(g) * u)            down: y[s, r] = weight[s] * (h[s] . w2[e(s), r])

Items: a slot, or (GROUPED) up to TM = 1 or 2 slots of one expert (``triton_wo_ring.ring_items``). Gluon does not
run in the interpreter: torch twin ``triton_wo_ring.ring_twin``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from moekit.experts._kernels.gluon_gemm import _tma_load
from moekit.experts._kernels.gluon_wo_ring import HIGH_HALF, _barrier

RAW_CONSTANTS = {False: (15, 0x4B000000), True: (0x01C00000, -(1 << 31))}  # raw_kernel's fifteen, magic by MX


@gluon.jit
def _raw_loader(q_desc, x_desc, wq, wx, ready, empty, ids_ptr, item_e_ptr, item_s_ptr, count_ptr, num_experts,
                S: gl.constexpr, TOP_K: gl.constexpr, R: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr,
                GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    W: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = empty.type.shape[0]
    NB: gl.constexpr = ROWS // BM
    nbytes: gl.constexpr = W * q_desc.block_type.nbytes + TM * x_desc.block_type.nbytes
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
                _tma_load(x_desc, [(slot // TOP_K) * (G * 16) + g * 16, 0], ready.index(st), wx.index(TM * st + i))
            for w in gl.static_range(W):
                _tma_load(q_desc, [e * R + w * ROWS + r0, g * 16], ready.index(st), wq.index(W * st + w))
            it += 1


@gluon.jit
def _x_pair(xb, jj: gl.constexpr, LW: gl.constexpr, num_warps: gl.constexpr):
    """(x[8c + 2jj], x[8c + 2jj + 1]) [1, 16] float32 from a step's raw x [16, 4] int32, columns as LW's."""
    LXC: gl.constexpr = gl.BlockedLayout([2, 1], [8, 4], [1, num_warps], [0, 1])  # [16, 1]: c as LW's columns
    bits = gl.sum(xb.slice(jj, 1, dim=1).load(LXC), axis=1)  # [16]
    bits = gl.expand_dims(gl.convert_layout(bits, gl.SliceLayout(0, LW)), 0)
    return (bits << 16).to(gl.float32, bitcast=True), (bits & HIGH_HALF).to(gl.float32, bitcast=True)


@gluon.jit
def _code(w, w_hi, j: gl.constexpr, fifteen, magic):
    """code j of each word, exact float32 (fifteen = 15 and magic = 0x4b000000 arrive as launch arguments: in
    registers, so each code is one LOP3 with no constant moves)."""
    p: gl.constexpr = j % 4
    if j < 4:
        src = w
    else:
        src = w_hi
    if p == 0:
        base = 8388608.0  # 2^23
    elif p == 1:
        base = 524288.0  # 2^19
    elif p == 2:
        base = 32768.0  # 2^15
    else:
        base = 2048.0  # 2^11
    return ((src & (fifteen << (4 * p))) | (magic - (p << 25))).to(gl.float32, bitcast=True) - base


@gluon.jit
def _mx_code(w, j: gl.constexpr, mag_mask, sign_mask):
    """e2m1 code j of each word times 2^-126, exact float32 (denormal for the 0 / 0.5 codes): its magnitude bits
    moved to float bits 22..24, its sign to bit 31 (mag_mask = 0x01c00000, sign_mask = 0x80000000)."""
    if j <= 5:
        mag = w << (22 - 4 * j)
    else:
        mag = (w.to(gl.uint32, bitcast=True) >> (4 * j - 22)).to(gl.int32, bitcast=True)
    return ((mag & mag_mask) | ((w << (28 - 4 * j)) & sign_mask)).to(gl.float32, bitcast=True)


@gluon.jit
def _mx_dots(wg, wu, xb, mag_mask, sign_mask, LW: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
    """(t_gate, t_up) [BM, 16]: 2^-62 * sum_j e2m1_j * x[8c + j] over each word's 8 codes (x taken times 2^64: the
    products stay normal)."""
    tg = gl.zeros(wg.shape, gl.float32, LW)
    tu = gl.zeros(wg.shape, gl.float32, LW)
    for jj in gl.static_range(4):
        xlo, xhi = _x_pair(xb, jj, LW, num_warps)
        xlo = xlo * 18446744073709551616.0  # 2^64
        xhi = xhi * 18446744073709551616.0
        tg += _mx_code(wg, 2 * jj, mag_mask, sign_mask) * xlo
        tg += _mx_code(wg, 2 * jj + 1, mag_mask, sign_mask) * xhi
        if GATED:
            tu += _mx_code(wu, 2 * jj, mag_mask, sign_mask) * xlo
            tu += _mx_code(wu, 2 * jj + 1, mag_mask, sign_mask) * xhi
    return tg, tu


@gluon.jit
def _dots(wg, wu, zg, zu, xb, fifteen, magic, LW: gl.constexpr, GATED: gl.constexpr, num_warps: gl.constexpr):
    """(t_gate, t_up) [BM, 16]: sum_j (code_j - zero) * x[8c + j] over each word's 8 codes (the zero through the
    word's x sum, shared by the rows)."""
    wg_hi = (wg.to(gl.uint32, bitcast=True) >> 16).to(gl.int32, bitcast=True)
    wu_hi = (wu.to(gl.uint32, bitcast=True) >> 16).to(gl.int32, bitcast=True)
    tg = gl.zeros(wg.shape, gl.float32, LW)
    tu = gl.zeros(wg.shape, gl.float32, LW)
    xs = gl.zeros([1, wg.shape[1]], gl.float32, LW)
    for jj in gl.static_range(4):
        xlo, xhi = _x_pair(xb, jj, LW, num_warps)
        xs += xlo + xhi
        tg += _code(wg, wg_hi, 2 * jj, fifteen, magic) * xlo
        tg += _code(wg, wg_hi, 2 * jj + 1, fifteen, magic) * xhi
        if GATED:
            tu += _code(wu, wu_hi, 2 * jj, fifteen, magic) * xlo
            tu += _code(wu, wu_hi, 2 * jj + 1, fifteen, magic) * xhi
    return tg - zg * xs, tu - zu * xs


@gluon.jit
def _either_dots(wg, wu, zg, zu, xb, fifteen, magic, LW: gl.constexpr, GATED: gl.constexpr, MX: gl.constexpr,
                 num_warps: gl.constexpr):
    """The step's word dots: mxfp4's (fifteen / magic carry its two masks) or int4's."""
    if MX:
        tg, tu = _mx_dots(wg, wu, xb, fifteen, magic, LW, GATED, num_warps)
    else:
        tg, tu = _dots(wg, wu, zg, zu, xb, fifteen, magic, LW, GATED, num_warps)
    return tg, tu


@gluon.jit
def _group(s_row, z_row, g, G: gl.constexpr, MX: gl.constexpr, LW: gl.constexpr):
    """Step g's (scale, zero) of the rows (0 past G). int4: [BM, 1] float32 each (one group of 128). mxfp4: the
    scale [BM, 16] a word (its group of 32: word c // 4) as 2^(e8m0 - 65) (the 2^-62 of the codes and x's 2^64
    undone; exact for e8m0 <= 192), the zero unused."""
    ok = g < G
    if MX:
        c = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, LW)), 0)  # [1, 16]
        e8 = gl.load(gl.expand_dims(s_row, 1) + 4 * g + c // 4, mask=ok, other=0).to(gl.int32)  # [BM, 16]
        scale = ((e8 + 62) << 23).to(gl.float32, bitcast=True)
        zero = 0.0
    else:
        scale = gl.expand_dims(gl.load(s_row + g, mask=ok, other=0.0), 1)
        zero = gl.expand_dims(gl.load(z_row + g, mask=ok, other=0).to(gl.float32), 1)
    return scale, zero


@gluon.jit
def _groups(sp, zp, up, g, G: gl.constexpr, MX: gl.constexpr, LW: gl.constexpr):
    """Step g's (scale, zero) of the gate rows and of the up rows ``up`` elements on (up 0: the same rows)."""
    sg, zg = _group(sp, zp, g, G, MX, LW)
    su, zu = _group(sp + up, zp + up, g, G, MX, LW)
    return sg, zg, su, zu


@gluon.jit
def _step(wq, wx, ready, empty, it, sg, zg, su, zu, acc_g0, acc_u0, acc_g1, acc_u1, fifteen, magic, has2,
          LW: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, LOADER_ONLY: gl.constexpr, MX: gl.constexpr,
          num_warps: gl.constexpr):
    """One ring stage: its words against the item's x rows (the second only where the item has one: ``has2``, the
    same for the whole program, so no divergence), into the accumulators; the stage handed back."""
    W: gl.constexpr = 2 if GATED else 1
    STAGES: gl.constexpr = empty.type.shape[0]
    st = it % STAGES
    mbarrier.wait(ready.index(st), (it // STAGES) & 1)
    if not LOADER_ONLY:
        wg = wq.index(W * st).load(LW)  # [BM, 16] int32
        if GATED:
            wu = wq.index(W * st + 1).load(LW)
        else:
            wu = wg
        tg, tu = _either_dots(wg, wu, zg, zu, wx.index(TM * st), fifteen, magic, LW, GATED, MX, num_warps)
        acc_g0 += tg * sg
        acc_u0 += tu * su
        if TM > 1:
            if has2:
                tg, tu = _either_dots(wg, wu, zg, zu, wx.index(TM * st + 1), fifteen, magic, LW, GATED, MX, num_warps)
                acc_g1 += tg * sg
                acc_u1 += tu * su
        _barrier()  # every warp has its registers before the stage is handed back
    mbarrier.arrive(empty.index(st), count=1)
    return acc_g0, acc_u0, acc_g1, acc_u1


@gluon.jit
def _store(acc_g, acc_u, i: gl.constexpr, item, r0, rows, ids_ptr, wts_ptr, item_s_ptr, out_ptr, num_experts,
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
        gl.store(out_ptr + slot * ROWS + r0 + rows, (g / (1.0 + gl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        at = gl.maximum(slot, 0)
        wt = gl.where(gl.load(ids_ptr + at) < num_experts, gl.load(wts_ptr + at), 0.0)
        gl.store(out_ptr + slot * ROWS + r0 + rows, g * wt, mask=ok)


@gluon.jit
def _tile(t, rows, ids_ptr, item_e_ptr, item_s_ptr, num_experts, R: gl.constexpr, ROWS: gl.constexpr, G: gl.constexpr,
          TM: gl.constexpr, GROUPED: gl.constexpr, MX: gl.constexpr):
    """Tile t -> (item, first row, [BM] offsets of the rows' group 0 in the scales / zeros, item has a 2nd slot)."""
    BM: gl.constexpr = rows.shape[0]
    item = t // (ROWS // BM)
    r0 = (t % (ROWS // BM)) * BM
    if GROUPED:
        e = gl.load(item_e_ptr + item)
    else:
        e = gl.load(ids_ptr + item)
    GS: gl.constexpr = 4 * G if MX else G  # scales a row (mxfp4: one per 32 values)
    first = (gl.minimum(e, num_experts - 1) * R + r0 + rows) * GS  # an id >= E (EP skip): weight 0, any rows
    if GROUPED and TM > 1:
        has2 = gl.load(item_s_ptr + item * TM + 1) >= 0
    else:
        has2 = False
    return item, r0, first, has2


@gluon.jit
def _raw_decode(wq, wx, ready, empty, scale_ptr, zero_ptr, ids_ptr, wts_ptr, item_e_ptr, item_s_ptr, count_ptr,
                out_ptr, num_experts, fifteen, magic, S: gl.constexpr, R: gl.constexpr, ROWS: gl.constexpr,
                G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr,
                LOADER_ONLY: gl.constexpr, MX: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = wq.type.shape[1]
    NB: gl.constexpr = ROWS // BM
    LW: gl.constexpr = gl.BlockedLayout([BM // (4 * num_warps), 2], [4, 8], [num_warps, 1], [1, 0])  # [BM, 16]
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, LW))  # [BM]
    if GROUPED:
        items = gl.load(count_ptr)
    else:
        items = S
    it = 0
    for t in range(gl.program_id(0), items * NB, gl.num_programs(0)):
        item, r0, first, has2 = _tile(t, rows, ids_ptr, item_e_ptr, item_s_ptr, num_experts, R, ROWS, G, TM,
                                      GROUPED, MX)
        if GATED:
            up = ROWS * G * (4 if MX else 1)
        else:
            up = 0
        acc_g0 = gl.zeros([BM, 16], gl.float32, LW)
        acc_u0 = gl.zeros([BM, 16], gl.float32, LW)
        acc_g1 = gl.zeros([BM, 16], gl.float32, LW)
        acc_u1 = gl.zeros([BM, 16], gl.float32, LW)
        # groups g .. g + 3 in flight: (scale, zero) of gate (g*) and up (u*) rows, loaded 4 steps before use
        sp, zp = scale_ptr + first, zero_ptr + first
        sg0, zg0, su0, zu0 = _groups(sp, zp, up, 0, G, MX, LW)
        sg1, zg1, su1, zu1 = _groups(sp, zp, up, 1, G, MX, LW)
        sg2, zg2, su2, zu2 = _groups(sp, zp, up, 2, G, MX, LW)
        sg3, zg3, su3, zu3 = _groups(sp, zp, up, 3, G, MX, LW)
        for g4 in range(0, G, 4):
            for k in gl.static_range(4):
                if k == 0:
                    sg, zg, su, zu = sg0, zg0, su0, zu0
                    sg0, zg0, su0, zu0 = _groups(sp, zp, up, g4 + 4, G, MX, LW)
                elif k == 1:
                    sg, zg, su, zu = sg1, zg1, su1, zu1
                    sg1, zg1, su1, zu1 = _groups(sp, zp, up, g4 + 5, G, MX, LW)
                elif k == 2:
                    sg, zg, su, zu = sg2, zg2, su2, zu2
                    sg2, zg2, su2, zu2 = _groups(sp, zp, up, g4 + 6, G, MX, LW)
                else:
                    sg, zg, su, zu = sg3, zg3, su3, zu3
                    sg3, zg3, su3, zu3 = _groups(sp, zp, up, g4 + 7, G, MX, LW)
                if g4 + k < G:
                    acc_g0, acc_u0, acc_g1, acc_u1 = _step(wq, wx, ready, empty, it, sg, zg, su, zu, acc_g0, acc_u0,
                                                           acc_g1, acc_u1, fifteen, magic, has2, LW, GATED, TM,
                                                           LOADER_ONLY, MX, num_warps)
                    it += 1
        _store(acc_g0, acc_u0, 0, item, r0, rows, ids_ptr, wts_ptr, item_s_ptr, out_ptr, num_experts, ROWS, GATED,
               TM, GROUPED)
        if TM > 1:
            _store(acc_g1, acc_u1, 1, item, r0, rows, ids_ptr, wts_ptr, item_s_ptr, out_ptr, num_experts, ROWS, GATED,
                   TM, GROUPED)


@gluon.jit
def raw_kernel(q_desc, x_desc, scale_ptr, zero_ptr, ids_ptr, wts_ptr, item_e_ptr, item_s_ptr, count_ptr, out_ptr,
               num_experts, fifteen, magic, S: gl.constexpr, TOP_K: gl.constexpr, R: gl.constexpr, ROWS: gl.constexpr,
               G: gl.constexpr, GATED: gl.constexpr, TM: gl.constexpr, GROUPED: gl.constexpr, STAGES: gl.constexpr,
               LOADER_ONLY: gl.constexpr, MX: gl.constexpr, num_warps: gl.constexpr):
    """q_desc [E*R, G*16] int32 words blocks [BM, 16]; x_desc x (GATED) or h [rows * G * 16, 4] int32 (bf16 pairs,
    row r's step g at rows (r G + g) 16 ..) blocks [16, 4]; scale_ptr [E, R, G] float32, zero_ptr [E, R, G] uint8
    (moekit's int4 layout, group 128; MX: mxfp4, scale_ptr [E, R, 4G] uint8 e8m0, zero_ptr unused); ids_ptr /
    wts_ptr [S] int32 / float32 (slots token-major); out_ptr [S, ROWS]: bf16 h (GATED, ROWS = N, R = 2N) or
    float32 y (ROWS = R = K). GROUPED: item_e_ptr [S] int32 the items' experts, item_s_ptr [S, TM] int32 their
    slots (-1: none), count_ptr [1] int32 the items; else unused.
    fifteen, magic: ``RAW_CONSTANTS[MX]`` (int4: 15 and the float bits of 2^23; mxfp4: the masks of the code's
    magnitude and sign bits once placed)."""
    BM: gl.constexpr = q_desc.block_type.shape[0]
    W: gl.constexpr = 2 if GATED else 1
    wq = gl.allocate_shared_memory(gl.int32, [W * STAGES, BM, 16], q_desc.layout)
    wx = gl.allocate_shared_memory(gl.int32, [TM * STAGES, 16, 4], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_raw_decode, (wq, wx, ready, empty, scale_ptr, zero_ptr, ids_ptr, wts_ptr, item_e_ptr, item_s_ptr, count_ptr,
                       out_ptr, num_experts, fifteen, magic, S, R, ROWS, G, GATED, TM, GROUPED, LOADER_ONLY, MX,
                       num_warps)),
        (_raw_loader, (q_desc, x_desc, wq, wx, ready, empty, ids_ptr, item_e_ptr, item_s_ptr, count_ptr, num_experts,
                       S, TOP_K, R, ROWS, G, GATED, TM, GROUPED)),
    ], [1], [40])

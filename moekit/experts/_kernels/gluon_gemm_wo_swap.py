"""Warp-specialized weight-only grouped GEMM for Hopper (Gluon) with the operands swapped: the decoded weights are
wgmma's register operand, the activations its shared-memory one (issue #16 target 3, session 29; int8_w8a16 and
int4_w4a16).

    out[r, c] = act(A[r, :] @ (Q[e(r), c, :] * scale[e(r), c])^T)      r: a row of the permuted buffer
    acc[c, r] = sum_k Q[e, c, k] * A[r, k]: the [BN weight rows, BM rows] tile of out^T, scaled, stored transposed

``gluon_gemm_wo`` decodes each step's stored tiles into bf16 shared-memory slots that the wgmma reads as its B
operand: a gate-up step (BK 64, [128, 128] x 2) moves 176 KB of shared memory (TMA 32, the codes' LDS 16, the decoded
STS 32, the wgmmas' operand reads 96), 1.22x the bf16 GEMM's 144. Here the weight rows are the MMA's M: each
warpgroup loads the codes of its 64 weight rows from the stage straight into wgmma's A-operand layout
(``DotOperandLayout`` of the accumulator's, operand 0), converts them there (int8 -> bf16, exact) and issues the wgmma
with A in registers and the stage's activation tile as B (its [BM, BK] tile read K-major through ``permute``): no
decoded slots, no CTA barrier, no STS; a step moves TMA 32 + LDS 16 + the wgmmas' reads of B 64 = 112 KB.

The loader partition is ``gluon_gemm._loader`` (TMA of the activation tile and the code tiles into a STAGES-deep
ring). The MMA partition (8 warps: two warpgroups, each owning 64 of the tile's weight rows) decodes step k + 1 into
registers while step k's wgmmas run, then waits for them (the A registers they read stay live through the wait's
deps) and releases their stage. The per-output-channel scale multiplies the accumulator's rows in the epilogue; the
[BN, BM] result is transposed in registers and stored through SMEM by TMA into out's [BM, BN] block.

Q is a 2-D view [E * W_ROWS, R / PACK] of w13.q [E, 2N, K / PACK] (W_ROWS = 2N) or w2.q [E, K, N / PACK] (W_ROWS
= K): int8 (PACK 1), scale [E, W_ROWS] fp32; int4 bytes (PACK 2, the low nibble first), scale / zero [E, W_ROWS,
R / GROUP], GROUP a multiple of BK (each byte decoded into its K pair in the operand's layout, the group's scale and
zero loaded a step ahead: ``_int4_tile``). GATED: gate rows c and up rows N + c, out = silu(gate) * up. Gluon does not
run in the interpreter (CUDA sm_90 only). Torch twin: ``triton_gluon_wo.experts_gluon_wo_twin`` (the same arithmetic:
int8 codes times the products' scales; int4 weights dequantized to bf16).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from moekit.experts._kernels.gluon_gemm import _loader, _tile_of, _tma_store
from moekit.experts._kernels.gluon_gemm_wo import SPLIT_REGISTERS, _scales, _stored


# FAST: two int8 codes (one 16-bit load of the A fragment's K pair) -> their bf16x2, exact: each byte b = v - 128 s
# (v its low 7 bits, s bit 7) placed in a 16-bit half, then (0x4300 | v) = 128 + v plus (0xC300 | s << 7) = -128 -
# 128 s in one bf16x2 add (the sum, an integer of at most 8 bits, is exact). $0 the pair's bf16x2, $1 the two codes,
# $2 / $3 0x43004300 / 0xC300C300 (runtime values: ptxas keeps them in registers)
_INT8_ASM = gl.constexpr("""{
.reg .b32 w, h, x, c;
cvt.u32.u16 w, $1;
prmt.b32 h, w, 0, 0x4140;
lop3.b32 x, h, 0x007F007F, $2, 0xEA;
lop3.b32 c, h, 0x00800080, $4, 0xEA;
add.rn.bf16x2 $0, x, c;
}""")


@gluon.jit
def _convert(codes, magic, FAST: gl.constexpr):
    """int8 codes -> bf16 in their (register) layout: Triton's conversion, or FAST ``_INT8_ASM`` a K pair."""
    if FAST:
        return gl.inline_asm_elementwise(_INT8_ASM, "=r,h,r,r,r,r", [codes, magic, magic ^ -0x7FFF8000],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    return codes.to(gl.float32).to(gl.bfloat16)


# An int4 byte (two codes, the low nibble first) -> its two weights as bf16x2 (the first the low half): each code
# moved to bits 16-19 of float32 128.0 (a shift, a lop3 with $4 = 0x43000000 held in a register), then
# fma(128 + code, scale $2, -(128 + zero) * scale $3) and one cvt.rn.bf16x2.f32 (``gluon_wo_fast``'s int4
# arithmetic, bit for bit). $0 the bf16x2 (as int32), $1 the byte (int32)
_INT4_BYTE_ASM = gl.constexpr("""{
.reg .b32 a, b;
.reg .f32 fa, fb, m, c;
mov.b32 m, $2;
mov.b32 c, $3;
shl.b32 a, $1, 16;
shl.b32 b, $1, 12;
lop3.b32 a, a, 0x000F0000, $4, 0xEA;
lop3.b32 b, b, 0x000F0000, $4, 0xEA;
mov.b32 fa, a;
mov.b32 fb, b;
fma.rn.f32 fa, fa, m, c;
fma.rn.f32 fb, fb, m, c;
cvt.rn.bf16x2.f32 $0, fb, fa;
}""")


@gluon.jit
def _int4_tile(tile, mul, add, magic, layout: gl.constexpr):
    """A stored int4 tile [ROWS, BK / 2] uint8 (two codes a byte, the low nibble first: K order) -> bf16 [ROWS, BK]
    in wgmma's A-operand layout: each byte loaded where the operand wants its K pair (the operand layout of k_width
    1 on the bytes), decoded by ``_INT4_BYTE_ASM`` with its row's (scale, -(128 + zero) * scale), the pair's halves
    joined in K order, which is the k_width-2 operand layout itself (the conversion moves nothing)."""
    packed: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=1)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
    b = tile.load(packed).to(gl.int32)  # [ROWS, BK / 2]
    pair = gl.inline_asm_elementwise(
        _INT4_BYTE_ASM, "=r,r,r,r,r",
        [b, mul.to(gl.int32, bitcast=True)[:, None], add.to(gl.int32, bitcast=True)[:, None], magic],
        dtype=gl.int32, is_pure=True, pack=1)
    lo = (pair & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    w = gl.reshape(gl.join(lo, hi), [tile.type.shape[0], 2 * tile.type.shape[1]])  # [ROWS, BK]
    return gl.convert_layout(w, operand)


@gluon.jit
def _tile_codes(tile, mul, add, magic, SCHEME: gl.constexpr, FAST: gl.constexpr, layout: gl.constexpr):
    """One stored tile -> bf16 in wgmma's A-operand layout (int8: ``_convert``; int4: ``_int4_tile``)."""
    if SCHEME == 0:
        w = _convert(tile.load(gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)), magic, FAST)
    else:
        w = _int4_tile(tile, mul, add, magic ^ 0x43000000 ^ 0x43004300, layout)
    return w


@gluon.jit
def _codes(q_bufs, stage, magic, mul_g, add_g, mul_u, add_u, ROWS: gl.constexpr, HALF: gl.constexpr,
           GATED: gl.constexpr, SCHEME: gl.constexpr, FAST: gl.constexpr, layout: gl.constexpr):
    """The stage's code tiles (their rows [HALF * ROWS, (HALF + 1) * ROWS)) -> bf16 [ROWS, BK] in wgmma's A-operand
    layout (each warpgroup's 64 rows): gate and up when GATED (else the one tile twice, the second unused); int4
    with the step's group scales (mul, add) of the gate and the up rows."""
    WTILES: gl.constexpr = 2 if GATED else 1
    gate = _tile_codes(_stored(q_bufs, stage * WTILES, ROWS, HALF), mul_g, add_g, magic, SCHEME, FAST, layout)
    if GATED:
        up = _tile_codes(_stored(q_bufs, stage * WTILES + 1, ROWS, HALF), mul_u, add_u, magic, SCHEME, FAST, layout)
    else:
        up = gate
    return gate, up


@gluon.jit
def _swap_epilogue(c_desc, c_buf, acc, up, scale_row, rb, cb, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                   SCHEME: gl.constexpr, layout: gl.constexpr):
    """acc (and up) [BN, BM]: int8's weight-row scales, silu(gate) * up when GATED, transposed to out's [BM, BN]
    block and stored by TMA."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    rows = cb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))  # [BN] weight rows
    if SCHEME == 0:
        acc = acc * gl.load(scale_row + rows)[:, None]
        if GATED:
            up = up * gl.load(scale_row + GATE_OFFSET + rows)[:, None]
    if GATED:
        acc = acc / (1.0 + gl.exp(-acc)) * up  # silu(gate) * up
    tma.store_wait(0)  # the last tile's store has read c_buf
    c_buf.store(gl.permute(acc.to(c_desc.dtype), [1, 0]))  # [BM, BN]
    fence_async_shared()
    _tma_store(c_desc, [rb * BLOCK_M, cb * BLOCK_N], c_buf)


@gluon.jit
def _step(a_bufs, q_bufs, ready, empty, acc, up, w_gate, w_up, it, more, magic, mul_g, add_g, mul_u, add_u,
          ROWS: gl.constexpr, HALF: gl.constexpr, GATED: gl.constexpr, SCHEME: gl.constexpr, FAST: gl.constexpr,
          layout: gl.constexpr):
    """Reduction step ``it``: its wgmmas on the codes (w_gate, w_up) and the stage's activations; the next step's
    codes (``more``: there is one; int4: its scales mul / add) decoded into registers while they run; then they
    retire (the codes they read kept live until then through the wait's deps) and the stage is released. Returns
    (acc, up, the next step's codes)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    x_t = a_bufs.index(it % STAGES).permute((1, 0))  # [BK, BM]
    acc = warpgroup_mma(w_gate, x_t, acc, is_async=True)
    if GATED:
        up = warpgroup_mma(w_up, x_t, up, is_async=True)
    if more:
        mbarrier.wait(ready.index((it + 1) % STAGES), ((it + 1) // STAGES) & 1)
        next_gate, next_up = _codes(q_bufs, (it + 1) % STAGES, magic, mul_g, add_g, mul_u, add_u, ROWS, HALF, GATED,
                                    SCHEME, FAST, layout)
    else:
        next_gate, next_up = w_gate, w_up
    if GATED:
        acc, up, w_gate, w_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, up, w_gate, w_up))
    else:
        acc, w_gate = warpgroup_mma_wait(num_outstanding=0, deps=(acc, w_gate))
    mbarrier.arrive(empty.index(it % STAGES), count=1)  # this step's wgmmas retired: refill its stage
    return acc, up, next_gate, next_up


@gluon.jit
def _swap_mma(c_desc, a_bufs, q_bufs, c_buf, ready, empty, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se, stride_sr,
              stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks, GATE_OFFSET: gl.constexpr,
              GATED: gl.constexpr, GROUP_M: gl.constexpr, SCHEME: gl.constexpr, GROUP: gl.constexpr,
              FAST: gl.constexpr, HALF: gl.constexpr, num_warps: gl.constexpr):
    """The MMA partition: per tile, acc [BN, BM] (and up) over the reduction, step k + 1's codes decoded into
    registers under step k's wgmmas (int4: its group scales loaded a step before). With SPLIT (4 warps, c_desc blocks
    [BM, BN / 2]) the tile's weight rows [HALF * BN / 2, (HALF + 1) * BN / 2) alone: its barriers are its
    warpgroup's, never both's."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]  # the weight rows this partition owns
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, gl.DotOperandLayout(operand_index=0, parent=layout, k_width=1))
    num_row_blocks = gl.cdiv(gl.load(used_ptr).to(gl.int32), BLOCK_M)
    num_tiles = num_row_blocks * num_col_blocks
    k_steps = gl.cdiv(reduce_dim, BLOCK_K)
    magic = 0x43004300 + (reduce_dim >> 31)  # (reduce_dim >= 0) FAST's bf16x2 128.0, a value ptxas keeps in a register
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        rb, cb = _tile_of(t, num_row_blocks, num_col_blocks, GROUP_M)
        cb = cb * (q_bufs.type.shape[1] // BLOCK_N) + HALF  # in BLOCK_N-wide blocks
        expert = gl.load(experts_ptr + rb)
        rows = cb * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_layout)  # int4: the scale and zero rows
        sg, zg = s_ptr + expert * stride_se + rows * stride_sr, z_ptr + expert * stride_ze + rows * stride_zr
        su, zu = sg + GATE_OFFSET * stride_sr, zg + GATE_OFFSET * stride_zr
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout)
        up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout)
        mul_g, add_g, mul_u, add_u = _scales(sg, zg, su, zu, 0, reduce_dim, stride_sg, stride_zg, GROUP, SCHEME, False)
        mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
        w_gate, w_up = _codes(q_bufs, it % STAGES, magic, mul_g, add_g, mul_u, add_u, BLOCK_N, HALF, GATED, SCHEME,
                              FAST, layout)
        for kk in range(k_steps):
            mul_g, add_g, mul_u, add_u = _scales(sg, zg, su, zu, (kk + 1) * BLOCK_K, reduce_dim, stride_sg,
                                                 stride_zg, GROUP, SCHEME, False)  # the next step's (0 past the end)
            acc, up, w_gate, w_up = _step(a_bufs, q_bufs, ready, empty, acc, up, w_gate, w_up, it, kk + 1 < k_steps,
                                          magic, mul_g, add_g, mul_u, add_u, BLOCK_N, HALF, GATED, SCHEME, FAST,
                                          layout)
            it += 1
        _swap_epilogue(c_desc, c_buf, acc, up, s_ptr + expert * stride_se, rb, cb, GATE_OFFSET, GATED, SCHEME, layout)
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_wo_swap_kernel(a_desc, q_desc, c_desc, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se, stride_sr,
                                stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
                                W_ROWS: gl.constexpr, GATE_OFFSET: gl.constexpr, GATED: gl.constexpr,
                                STAGES: gl.constexpr, GROUP_M: gl.constexpr, SCHEME: gl.constexpr,
                                GROUP: gl.constexpr, num_warps: gl.constexpr, FAST: gl.constexpr = False,
                                SPLIT: gl.constexpr = False):
    """``gluon_gemm_wo.grouped_gemm_wo_kernel``'s arguments (one launch for both; int8, SCHEME 0, reads only
    s_ptr's rows: scale [E, W_ROWS] with stride_sr 1; z_ptr, the group and zero strides and GROUP are int4's, SCHEME
    1): a_desc [T, R] bf16 blocks [BM, BK]; q_desc [E*W_ROWS, R / PACK] blocks [BN, BK / PACK] (int8; int4 bytes,
    PACK 2); c_desc [T, C] blocks [BM, BN]; experts_ptr [T / BM] int32; used_ptr -> rows in use (a multiple of
    BM); reduce_dim = R; num_col_blocks = C / BN; GATE_OFFSET = N when GATED. FAST: ``_INT8_ASM``'s conversion. SPLIT
    (num_warps 4, c_desc blocks [BM, BN / 2]): two MMA partitions of one warpgroup each, each owning half of the
    tile's weight rows (the wgmma's M), so neither waits at the other's barriers."""
    gl.static_assert(SCHEME < 2, "the swapped weight-only GEMM decodes int8_w8a16 and int4_w4a16 only")
    WTILES: gl.constexpr = 2 if GATED else 1
    HALVES: gl.constexpr = 2 if SPLIT else 1
    PACK: gl.constexpr = a_desc.block_type.shape[1] // q_desc.block_type.shape[1]  # weights a stored byte
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES * WTILES] + q_desc.block_type.shape, q_desc.layout)
    c_buf = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=HALVES)  # each MMA partition releases the stage
    if SPLIT:  # the second warpgroup: the other half of the weight rows, its own output tile
        c_buf1 = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        gl.warp_specialize([
            (_swap_mma, (c_desc, a_bufs, q_bufs, c_buf, ready, empty, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se,
                         stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
                         GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, FAST, 0, num_warps)),
            (_swap_mma, (c_desc, a_bufs, q_bufs, c_buf1, ready, empty, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se,
                         stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
                         GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, FAST, 1, 4)),
            (_loader, (a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                       W_ROWS, GATE_OFFSET, GATED, GROUP_M, PACK)),
        ], [4, 1], [SPLIT_REGISTERS, 24])
    else:
        gl.warp_specialize([
            (_swap_mma, (c_desc, a_bufs, q_bufs, c_buf, ready, empty, experts_ptr, used_ptr, s_ptr, z_ptr, stride_se,
                         stride_sr, stride_sg, stride_ze, stride_zr, stride_zg, reduce_dim, num_col_blocks,
                         GATE_OFFSET, GATED, GROUP_M, SCHEME, GROUP, FAST, 0, num_warps)),
            (_loader, (a_desc, q_desc, a_bufs, q_bufs, ready, empty, experts_ptr, used_ptr, reduce_dim, num_col_blocks,
                       W_ROWS, GATE_OFFSET, GATED, GROUP_M, PACK)),
        ], [1], [24])

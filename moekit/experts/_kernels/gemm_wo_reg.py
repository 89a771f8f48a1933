"""Grouped GEMMs with weight-only quantized experts, the register decode: the weights stay packed in
HBM and are decoded in the MMA operand's registers, right after the stored bytes are read from shared
memory; activations stay bf16 (or fp16), accumulation fp32. The other decode, one whole dequantized
tile per step before a single ``tl.dot``, is ``gemm_wo``; the plan (``triton_wo_plan.choose_decode``)
picks one per call kind from H200 measurements: this one is faster at decode sizes (4-bit weights:
fewer instructions a weight), the tile decode at prefill sizes (this one's narrower tiles and chunked
dots lose 4-10x there).

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch`` (dequantize, then the float32 loop).

Schemes (the SCHEME constexpr; layouts as in ``triton_wo``'s module docstring), weight [E, R, C] quantized
along C, the reduction dim (gate-up: R = 2N, C = K; down: R = K, C = N):
    0 int8_w8a16  q int8 [E, R, C], scale fp32 [E, R]: the tile is converted (exact in bf16: |q| <= 128)
                  and the per-row scale multiplies the accumulator once, in the epilogue.
    1 int4_w4a16  q uint8 [E, R, ceil(C/2)] (element 2i low nibble, 2i+1 high), scale fp32 and zero uint8
                  [E, R, ceil(C/g)]: w = (nibble - zero) * scale.
    2 mxfp4       q as int4 (e2m1 codes), scale uint8 e8m0 [E, R, ceil(C/32)]: w = e2m1(nibble) * 2^(s-127).

Packed schemes: each reduction step of BLOCK_K runs in chunks of SPAN = min(BLOCK_K, g) columns, one
scale group each (``_dot_chunk``). A chunk's bytes [BN, SPAN/2] decode to exact values per nibble and
two dots take the even K (low nibbles) and the odd K (high nibbles) against the matching activation
columns (``tl.split`` of the activation tile): every operation from the loaded bytes to the dot is
elementwise, so Triton moves the layout change onto the bytes (ldmatrix from shared memory into the
MMA operand layout) and decodes in those registers: no decoded tile through shared memory, no
interleaving. The scale then applies to the chunk's fp32 partial product p [BM, BN], once per output
element rather than once per weight:
    int4   decoded = base + code (``_base``: 128 in bf16 and float32, 1024 in fp16; the code in the low
           mantissa bits, exact); acc += p * s + rowsum(a) * (-(base + z) * s). The cancellation costs
           ~2^-24 * base * sum|a| * s: far below the bf16 rounding of the output.
    mxfp4  decoded = the e2m1 value itself (exact in bf16 and fp16); acc += p * 2^(s - 127), the factor
           built as the float32 bits s << 23 (exact; e8m0 0, 2^-127, gives 0).
Decoding (``_decode``): with ASM (set by the plan on NVIDIA sm_80+ GPUs only, never under the
interpreter) and bf16 activations, inline PTX on 32-bit words, two weights per instruction: prmt spreads 4 bytes
into 16-bit halves, then for int4 one lop3 ((t & 0x000F000F) | 0x43004300: 128 + code in bf16) per pair and a
shift for the high nibbles; for mxfp4 the magnitude bits to bf16 bits 6-8 and the sign to bit 15 (the value *
2^-126; the code 0.5 a bf16 subnormal, which bf16x2 arithmetic keeps) and one fma.rn.bf16x2 by 2^126 plus -0 (sm_80's
form of a bf16x2 multiply).
Elsewhere (the interpreter, fp16, other GPUs) the same bit placement in Triton (``_nibble_values``; mxfp4 via fp16
bits 9-11, value * 2^-14, then * 2^14).
sm_90 SASS of the decode loops (Triton 3.9, compiled on the CPU): int4 gate-up 64 x 128 steps 454
instructions (960 with the previous whole-tile fp32 decode), down 128 x 128 440; mxfp4 (g = 32)
gate-up 918, down 718.

Operand order: acc [BM, BN] = a [BM, K] @ W^T for all schemes (the decoded weights the right operand).
SWAP_AB (``KernelConfig.swap_ab``; session 24: the int4 heuristic at 16-row blocks takes it, ``triton_wo_configs``):
acc^T [BN, BM] = W @ a^T, the decoded weights the MMA's M side (the left operand, wgmma), transposed back for the
epilogue. H200 graph µs unswapped / swapped: Mixtral int4 M = 8 482 / 420, DeepSeek-V3 int4 M = 8 943 / 857,
mxfp4 DeepSeek-V3 M = 1 209 / 257, M = 8 1186 / 1493. (Session 20's
swap-AB of the int8 decode measured 1.3-1.6x slower on the H200, Triton 3.6.) sm_90 SASS (Triton 3.9,
``benchmarks/wo_reg_sass_cpu.py``): int4 gate-up 64 x 128 9.2 instructions a weight unswapped (PRMT 2.6 of them:
the bytes' layout change), 7.4 swapped; mxfp4 11.7 / 9.8; the decode itself is about 1 a weight.

Past C (an odd C, a group tail, a last partial step or chunk) the activations load as 0 and the
bytes as 0, which decode to finite values; a chunk past the last group has scales 0. Nothing leaks in.

Split-K (down only, SPLIT > 1, decode sizes where the touched experts' output tiles are too few to
fill the GPU): grid axis 1 splits the reduction, each split writes fp32 partial rows, and
``combine.sum_slots_kernel`` (SPLIT > 1) sums them with the k slots (atomic-free, so the result does not depend on
timing).

Alignment, NAIVE, PDL and UPCAST as in ``gemm.py`` (whose grid order, block rows and activations these
kernels share).

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN/BK the tile, SPAN the
reduction width of a chunk (one scale group; int8: BK).
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import routed_slot_count, zero_unrouted_tokens
from moekit.experts._kernels.e2m1_ptx import e2m1_place
from moekit.experts._kernels.gemm import _glu, program_tile
from moekit.experts._kernels.gemm_fp8 import acc_zeros, unswap
from moekit.experts._kernels.gemm_wo import _down_epilogue, _load_weights, add_b13

@triton.jit
def _base(DTYPE: tl.constexpr):
    """The offset that int4 codes decode with in DTYPE (``_exact_codes``): 1024 in fp16, else 128."""
    if DTYPE == tl.float16:
        base = 1024.0
    else:
        base = 128.0
    return base


@triton.jit
def _chunk_scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, GROUP: tl.constexpr, SCHEME: tl.constexpr,
                  DTYPE: tl.constexpr):
    """(mul, add) [BN] float32 of the group holding the chunk at k0 (a chunk never straddles two groups):
    the chunk's partial product p = a @ decoded^T adds p * mul + rowsum(a) * add to the accumulator
    (int4: decoded = base + code, so add = -(base + zero) * scale; mxfp4: decoded = the e2m1 value,
    mul = 2^(s - 127), add = 0). Past the last group both are 0; int8 (scaled in the epilogue): zeros.
    The kernels load these one chunk ahead (a load of bytes that Triton cannot pipeline would
    otherwise stall every chunk for a memory latency)."""
    g = k0 // GROUP
    ok = n_ok & (tl.zeros(n_ok.shape, dtype=tl.int32) + k0 < C)  # [BN]
    if SCHEME == 0:
        mul = tl.zeros(n_ok.shape, dtype=tl.float32)
        add = mul
    elif SCHEME == 1:
        mul = tl.load(s_rows + g * stride_sg, mask=ok, other=0.0)
        zero = tl.load(z_rows + g * stride_zg, mask=ok, other=0).to(tl.float32)
        add = -(_base(DTYPE) + zero) * mul
    else:
        exponent = tl.load(s_rows + g * stride_sg, mask=ok, other=0).to(tl.int32)
        mul = tl.where(ok, (exponent << 23).to(tl.float32, bitcast=True), 0.0)  # exact; e8m0 0 and 255 excluded
        add = tl.zeros_like(mul)
    return mul, add


# Inline PTX (sm_80+; bf16 only): 4 packed bytes (one 32-bit register, byte i = element i) -> the
# values of their low nibbles ($0: elements 0, 1; $1: 2, 3) and high nibbles ($2, $3) as bf16 pairs.
# prmt spreads bytes 0, 1 (2, 3) into the two 16-bit halves of t0 (t1); the nibbles then land in place
# by a shift and one lop3 each, two weights per instruction.
_SPREAD = """
.reg .b32 t0, t1, s0, s1, z;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
"""
# int4: lop3 (a & b) | c puts the nibble in the low mantissa bits of 128.0 (0x4300): 128 + code.
_INT4_ASM = tl.constexpr("{" + _SPREAD + """
lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
shr.b32 s0, t0, 4;
shr.b32 s1, t1, 4;
lop3.b32 $2, s0, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $3, s1, 0x000F000F, 0x43004300, 0xEA;
}""")
# mxfp4: the magnitude bits to bf16 bits 6-8 (value * 2^-126; the code 0.5 a subnormal, which bf16x2
# arithmetic keeps), the sign to bit 15, then * 2^126 (0x7E80) + -0 in bf16x2 (fma: sm_80 has no bf16x2
# mul; adding -0 changes no product, -0 included): the e2m1 value, exactly.
_MXFP4_ASM = tl.constexpr("{" + _SPREAD + """
.reg .b32 m, g, k, nz;
mov.b32 k, 0x7E807E80;
mov.b32 nz, 0x80008000;
""" + "".join(e2m1_place("m", t, shift, shift + 6, "0x01C001C0", "0x80008000") + f"fma.rn.bf16x2 ${i}, m, k, nz;\n"
              for i, (t, shift) in enumerate((("t0", 6), ("t1", 6), ("t0", 2), ("t1", 2)))) + "}")


@triton.jit
def _nibble_values(codes, DTYPE: tl.constexpr, SCHEME: tl.constexpr):
    """codes [BN, SPAN/2] (0..15, one per weight) -> exact values in DTYPE by placing bits: int4 base +
    code (``_base``: the code in the low mantissa bits of 128.0 bf16, 1024.0 fp16, 128.0 float32);
    mxfp4 the e2m1 value, its magnitude bits to fp16 bits 9-11 (value * 2^-14, the code 0.5 an fp16
    subnormal), the sign to bit 15, then * 2^14 (exact in fp16, bf16 and float32)."""
    if SCHEME == 1:
        if DTYPE == tl.bfloat16:
            value = (codes.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        elif DTYPE == tl.float16:
            value = (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        else:
            value = ((codes.to(tl.int32) << 16) | 0x43000000).to(tl.float32, bitcast=True)
    else:
        codes = codes.to(tl.int16)
        bits = ((codes & 7) << 9) | ((codes & 8) << 12)
        value = (bits.to(tl.float16, bitcast=True) * 16384.0).to(DTYPE)
    return value


@triton.jit
def _decode(raw, DTYPE: tl.constexpr, SCHEME: tl.constexpr, ASM: tl.constexpr):
    """Packed bytes [BN, SPAN/2] -> (low nibbles' values, high nibbles' values) [BN, SPAN/2] in DTYPE,
    exact (int4: base + code; mxfp4: the e2m1 value). Elementwise, so the compiler decodes in the MMA
    operand's registers right after reading the bytes from shared memory. ASM (NVIDIA sm_80+, bf16): the
    inline PTX above, two weights per instruction; else ``_nibble_values`` (the interpreter, fp16, other GPUs)."""
    if ASM and DTYPE == tl.bfloat16:
        if SCHEME == 1:
            low, high = tl.inline_asm_elementwise(_INT4_ASM, "=r,=r,=r,=r,r", [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                                  is_pure=True, pack=4)
        else:
            low, high = tl.inline_asm_elementwise(_MXFP4_ASM, "=r,=r,=r,=r,r", [raw], dtype=(tl.bfloat16, tl.bfloat16),
                                                  is_pure=True, pack=4)
    else:
        low = _nibble_values(raw & 0x0F, DTYPE, SCHEME)
        high = _nibble_values(raw >> 4, DTYPE, SCHEME)
    return low, high


@triton.jit
def _dot_chunk(raw, a, mul, add, acc, BLOCK_M: tl.constexpr, SPAN: tl.constexpr, SCHEME: tl.constexpr,
               ASM: tl.constexpr, SWAP_AB: tl.constexpr = False):
    """acc [BM, BN] + a [BM, SPAN] @ W^T for one chunk's stored bytes ``raw`` (``_load_weights``) and
    scales (``_chunk_scales``); SWAP_AB: acc^T [BN, BM] + W @ a^T (the weights the MMA's M side). int8: the
    bytes converted (exact in bf16: |q| <= 128; scaled in the epilogue). Packed: the codes decoded exactly
    and the group's scale applied to the fp32 partial product, not per weight; two dots over the even and
    odd K (a byte's low and high nibble), so each weight decodes from its own byte, elementwise, with no
    shuffle of decoded values."""
    if SCHEME == 0:
        w = raw.to(tl.float32).to(a.dtype)  # via float32: the interpreter's int8 -> bf16 gives NaN
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    else:
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, SPAN // 2, 2]))  # [BM, SPAN/2] each: K = 2i, 2i + 1
        low, high = _decode(raw, a.dtype, SCHEME, ASM)
        if SWAP_AB:
            part = tl.dot(high, tl.trans(a_odd), tl.dot(low, tl.trans(a_even)))  # [BN, BM]
            acc += part * mul[:, None]
            if SCHEME == 1:  # the base and the zero point, once per row of the chunk
                acc += add[:, None] * tl.sum(a.to(tl.float32), axis=1)[None, :]
        else:
            part = tl.dot(a_odd, tl.trans(high), tl.dot(a_even, tl.trans(low)))
            acc += part * mul[None, :]
            if SCHEME == 1:  # the base and the zero point, once per row of the chunk
                acc += tl.sum(a.to(tl.float32), axis=1)[:, None] * add[None, :]
    return acc


@triton.jit
def gate_up_wo_reg_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, b13_ptr,  # b13 [E, 2N] or None
    N, K, K_STORED, num_assignments, top_k, num_experts, num_pid_m,  # K_STORED: bytes of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,
    stride_ze, stride_zr, stride_zg, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr, SWAP_AB: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False,
):
    """h = glu(x w_gate^T + b13_gate, x w_up^T + b13_up) per row, w13 dequantized in registers (b13: ``gemm_wo``)."""
    wait_for_previous_kernel(PDL)
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(N, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments  # [BM]
    token = tl.where(row_ok, rows // top_k, 0)  # [BM] int64: the x row of each assignment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    gate = offs_n.to(tl.int64) * (2 if INTERLEAVED else 1)  # [BN] w13 rows: gate j at j (INTERLEAVED: 2j)
    up = gate + (1 if INTERLEAVED else N)  # the up rows follow the N gate rows (INTERLEAVED: gpt-oss's 2j + 1)
    qg, qu = q_ptr + expert * stride_qe + gate * stride_qr, q_ptr + expert * stride_qe + up * stride_qr
    sg, su = s_ptr + expert * stride_se + gate * stride_sr, s_ptr + expert * stride_se + up * stride_sr
    zg, zu = z_ptr + expert * stride_ze + gate * stride_zr, z_ptr + expert * stride_ze + up * stride_zr
    x_rows = x_ptr + token[:, None] * stride_xm  # [BM, 1]
    offs_k = tl.arange(0, SPAN)
    acc_gate = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)  # [BM, BN], SWAP_AB [BN, BM]
    acc_up = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    dtype = x_ptr.dtype.element_ty
    if UPCAST:  # the weights then decode to float32 too (the interpreter truncates float32 -> bf16)
        dtype = tl.float32
    mul_g, add_g = _chunk_scales(sg, zg, 0, K, n_ok, stride_sg, stride_zg, GROUP, SCHEME, dtype)
    mul_u, add_u = _chunk_scales(su, zu, 0, K, n_ok, stride_sg, stride_zg, GROUP, SCHEME, dtype)
    for k0 in range(0, K, BLOCK_K):
        for c in tl.static_range(0, BLOCK_K, SPAN):  # chunks of one scale group each
            next_mul_g, next_add_g = _chunk_scales(sg, zg, k0 + c + SPAN, K, n_ok, stride_sg, stride_zg, GROUP,
                                                   SCHEME, dtype)
            next_mul_u, next_add_u = _chunk_scales(su, zu, k0 + c + SPAN, K, n_ok, stride_sg, stride_zg, GROUP,
                                                   SCHEME, dtype)
            k = k0 + c + offs_k
            a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & (k < K)[None, :], other=0.0).to(dtype)
            acc_gate = _dot_chunk(_load_weights(qg, k0 + c, K_STORED, n_ok, stride_qc, SPAN, SCHEME), a, mul_g, add_g,
                                  acc_gate, BLOCK_M, SPAN, SCHEME, ASM, SWAP_AB)
            acc_up = _dot_chunk(_load_weights(qu, k0 + c, K_STORED, n_ok, stride_qc, SPAN, SCHEME), a, mul_u, add_u,
                                acc_up, BLOCK_M, SPAN, SCHEME, ASM, SWAP_AB)
            mul_g, add_g, mul_u, add_u = next_mul_g, next_add_g, next_mul_u, next_add_u
    let_next_kernel_launch(PDL)
    acc_gate, acc_up = unswap(acc_gate, SWAP_AB), unswap(acc_up, SWAP_AB)
    if SCHEME == 0:  # int8: the per-row scale, once
        acc_gate *= tl.load(sg, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(su, mask=n_ok, other=0.0)[None, :]
    if b13_ptr is not None:
        acc_gate, acc_up = add_b13(acc_gate, acc_up, b13_ptr, expert, gate, up, n_ok, N)
    h = _glu(acc_gate, acc_up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)  # [BM, BN] fp32: act(gate) * up (plain)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def down_wo_reg_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    b2_ptr,  # b2 [E, K] or None
    K, N, N_STORED, num_assignments, num_experts, num_pid_m, split_len,  # N_STORED: bytes of a w2 row
    stride_hm, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr,
    KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (``gemm.down_kernel``'s, SPLIT 1)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
    SWAP_AB: tl.constexpr = False,
):
    """y = routed weight * (h w2^T + b2) per assignment row, w2 dequantized in registers (split-K, KSUM: module doc;
    b2: ``gemm_wo``'s)."""
    wait_for_previous_kernel(PDL)
    if KSUM:
        if tl.program_id(0) >= num_pid_m * tl.cdiv(K, BLOCK_N):  # the programs after the GEMM's
            zero_unrouted_tokens(out_ptr, ids_ptr, map_ptr, num_pid_m * tl.cdiv(K, BLOCK_N), K, num_assignments,
                                 top_k, num_experts, num_global, BLOCK_N, TOPK_PAD, HAS_MAP, ZERO_T)
            return
    pid_n, rows, expert = program_tile(num_pid_m, tl.cdiv(K, BLOCK_N), ids_ptr, sorted_ids_ptr, expert_ids_ptr,
                                       num_padded_ptr, num_assignments, num_experts, BLOCK_M, GROUP_M, NAIVE)
    if expert < 0:
        return
    row_ok = rows < num_assignments
    safe_rows = tl.where(row_ok, rows, 0)
    arrivals = 0  # KSUM: [BM] routed slots of each row's token, loaded before the main loop (the epilogue's)
    if KSUM:
        arrivals = routed_slot_count(safe_rows // top_k, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD,
                                     HAS_MAP)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    out = offs_out.to(tl.int64)
    q_rows = q_ptr + expert * stride_qe + out * stride_qr  # [BN]
    s_rows = s_ptr + expert * stride_se + out * stride_sr
    z_rows = z_ptr + expert * stride_ze + out * stride_zr
    h_rows = h_ptr + safe_rows[:, None] * stride_hm  # [BM, 1]
    offs_red = tl.arange(0, SPAN)
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)  # [BM, BN], SWAP_AB [BN, BM]
    dtype = h_ptr.dtype.element_ty
    if UPCAST:  # the weights then decode to float32 too (the interpreter truncates float32 -> bf16)
        dtype = tl.float32
    n_start = tl.program_id(1) * split_len
    mul, add = _chunk_scales(s_rows, z_rows, n_start, N, out_ok, stride_sg, stride_zg, GROUP, SCHEME, dtype)
    for n0 in range(n_start, tl.minimum(n_start + split_len, N), BLOCK_K):
        for c in tl.static_range(0, BLOCK_K, SPAN):  # chunks of one scale group each
            next_mul, next_add = _chunk_scales(s_rows, z_rows, n0 + c + SPAN, N, out_ok, stride_sg, stride_zg, GROUP,
                                               SCHEME, dtype)
            red = n0 + c + offs_red
            a = tl.load(h_rows + red[None, :], mask=row_ok[:, None] & (red < N)[None, :], other=0.0).to(dtype)
            acc = _dot_chunk(_load_weights(q_rows, n0 + c, N_STORED, out_ok, stride_qc, SPAN, SCHEME), a, mul, add,
                             acc, BLOCK_M, SPAN, SCHEME, ASM, SWAP_AB)
            mul, add = next_mul, next_add
    let_next_kernel_launch(PDL)
    _down_epilogue(unswap(acc, SWAP_AB), s_rows, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows,
                   row_ok, arrivals, pid_n, offs_out, out_ok, K, num_assignments, top_k, num_experts, num_global,
                   stride_ym, b2_ptr, expert, BLOCK_N, SCHEME, KSUM, TOPK_PAD, HAS_MAP, SUM_ROWS)

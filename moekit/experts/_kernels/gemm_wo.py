"""Grouped GEMMs with weight-only quantized experts: the weights stay packed in HBM and are dequantized
in registers, one whole [BLOCK_N, BLOCK_K] tile per reduction step, right before a single ``tl.dot``;
activations stay bf16 (or fp16), accumulation fp32. The plan's "tile" decode: faster at prefill sizes
(tall tiles reuse each decoded tile); the "register" decode is ``gemm_wo_reg`` (``triton_wo_plan``
chooses per call kind).

Torch twin: ``moekit.experts.triton_wo.fused_experts_wo_torch`` (dequantize, then the float32 loop).

Schemes (the SCHEME constexpr; layouts as in ``triton_wo``'s module docstring), weight [E, R, C] quantized
along C, the reduction dim (gate-up: R = 2N, C = K; down: R = K, C = N):
    0 int8_w8a16  q int8 [E, R, C], scale fp32 [E, R]: the tile is converted (exact in bf16: |q| <= 128)
                  and the per-row scale multiplies the accumulator once, in the epilogue.
    1 int4_w4a16  q uint8 [E, R, ceil(C/2)] (element 2i low nibble, 2i+1 high), scale fp32 and zero uint8
                  [E, R, ceil(C/g)]: w = (nibble - zero) * scale.
    2 mxfp4       q as int4 (e2m1 codes), scale uint8 e8m0 [E, R, ceil(C/32)]: w = e2m1(nibble) * 2^(s-127).

Decoding a packed tile (``_decode``): the packed bytes [BN, BK/2] (contiguous along C) are split into
low and high nibbles, which ``tl.join`` + ``tl.reshape`` interleave back into the natural K order
[BN, BK] (element 2i, 2i+1 side by side in one thread: no data moves). Each nibble is decoded by placing
its bits, never by per-element branches or tables:
    int4   (code << 16) | 0x43000000 read as float32 is 128 + code exactly; w = (128 + code) * s - (128 + z) * s,
           one fma per weight with the group's (s, -(128 + z) * s) in float32 (error ~2^-24 of 143 s: far
           below the bf16 rounding that follows).
    mxfp4  (code & 7) << 9 | (code & 8) << 12 read as float16 is e2m1(code) * 2^-14 exactly (e = 0, the
           code 0.5, lands on an fp16 subnormal, which fp16 -> fp32 converts exactly; no flush-to-zero
           applies to 16-bit sources); w = that * 2^(s - 113), the factor built as the float32 bits
           (s + 14) << 23 (exact; e8m0 scales above 2^113 are out of range and overflow).
The group scales multiply the weights in float32 (the tile viewed as [BN, BK/SPAN, SPAN], SPAN =
min(BK, g), one scale per span), then the tile is rounded once to the activations' dtype: the same
one rounding of the exact dequantized weight as ``dequantize_wo(...).to(bf16)``.

Operand order: acc [BM, BN] = a [BM, BK] @ W^T, the decoded tile [BN, BK] transposed as the right
operand. (Swap-AB, acc^T = W @ a^T with the weights as wgmma's register operand, measured slower on
the H200, Triton 3.6: int8 decode 1.3-1.6x the time of this order, the decode ALU work being equal.)

Past C (an odd C, a group tail, a last partial step) the activations load as 0; the weights there
decode to finite values (0 where no scale group remains), so nothing leaks in.

Split-K (down only, SPLIT > 1, decode sizes where the touched experts' output tiles are too few to
fill the GPU): grid axis 1 splits the reduction, each split writes fp32 partial rows, and
``combine.sum_slots_kernel`` (SPLIT > 1) sums them with the k slots (atomic-free, so the result does not depend on
timing).
Program (.., s) reduces N in [s * split_len, (s + 1) * split_len) (split_len a multiple of BLOCK_K: no step
straddles two splits) into its own partial rows y[s * A + a].

KSUM (down, one split, M <= ``LaunchOptions.sum_fold_max``, lean eager calls with the pool's kept counters):
the k-sum folded into the down GEMM's epilogue, ``gemm.down_kernel``'s KSUM (its docstring) with the same
``combine`` helpers: bit for bit the ordered separate k-sum, one launch fewer. The same in ``gemm_wo_reg``
and ``gemm_wo_gemv``.

AHEAD (software pipelining of the dequant): each step's weight tiles are loaded and decoded one step
early and carried in registers, the step's ``tl.dot`` issued on them first and the next step's decode
after it, so the decode's ALU work runs while the (asynchronous, Hopper wgmma) dot does; the group
scales then load two steps ahead. Costs the registers of one decoded tile per weight operand; the last
step decodes a tile past the reduction (masked loads: zeros, never read).

Biases and the activation variant (gpt-oss's experts; the tile and register decodes, ``gemm_wo_reg`` too):
b13_ptr [E, 2N] and b2_ptr [E, K], contiguous, or None (constexpr-specialised: without them the kernels are the
ones before). b13 is added to the gate and up accumulators before the activation (after int8's row scale), b2 to
the down output before the routed weight (split-K: by split 0 alone), the order of ``gemm.py``'s bf16 kernels.
INTERLEAVED: gate column j is w13 (and b13) row 2j, up j row 2j + 1 (gpt-oss's stored order, read in place);
ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER: ``gemm._glu``'s clamped SwiGLU. Their defaults are the plain gated activation.

Alignment, NAIVE, PDL and UPCAST as in ``gemm.py`` (whose grid order, block rows and activations these
kernels share).

Shapes: A = M*k assignments, E local experts, K hidden, N intermediate, BM/BN/BK the tile, SPAN the
reduction width one scale covers inside a step.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.combine import routed_slot_count, zero_unrouted_tokens
from moekit.experts._kernels.down_store import store_routed
from moekit.experts._kernels.gemm import _glu, program_tile

@triton.jit
def _interleave(low, high, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """low, high [BN, BK/2] (what the low and high nibbles of each byte decode to) -> [BN, BK] in K
    order: element 2i from the low nibble, 2i+1 from the high (a register-local join)."""
    return tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])


@triton.jit
def _group_scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, SPAN: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_K: tl.constexpr, SCHEME: tl.constexpr):
    """(mul, add) [BN, BK/SPAN] float32 for the spans of step k0: w = decoded * mul + add. Past the
    last group both are 0. The kernels load these one step ahead (a load of bytes that Triton cannot
    pipeline would otherwise stall every step for a memory latency)."""
    g = k0 // GROUP + tl.arange(0, BLOCK_K // SPAN)  # [BK/SPAN] group of each span (SPAN = GROUP when > 1)
    ok = n_ok[:, None] & (g * GROUP < C)[None, :]
    if SCHEME == 1:
        scale = tl.load(s_rows[:, None] + g[None, :] * stride_sg, mask=ok, other=0.0)
        zero = tl.load(z_rows[:, None] + g[None, :] * stride_zg, mask=ok, other=0).to(tl.float32)
        add = -(128.0 + zero) * scale
    else:
        exponent = tl.load(s_rows[:, None] + g[None, :] * stride_sg, mask=ok, other=0).to(tl.int32)
        scale = tl.where(ok, ((exponent + 14) << 23).to(tl.float32, bitcast=True), 0.0)
        add = tl.zeros_like(scale)
    return scale, add


@triton.jit
def _scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, SPAN: tl.constexpr, GROUP: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCHEME: tl.constexpr):
    """``_group_scales`` of step k0 for the packed schemes; int8 (scaled in the epilogue): zeros [BN, 1]."""
    if SCHEME == 0:
        mul = tl.zeros([BLOCK_N, 1], dtype=tl.float32)
        add = mul
    else:
        mul, add = _group_scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, SPAN, GROUP, BLOCK_K, SCHEME)
    return mul, add


@triton.jit
def _load_weights(q_rows, k0, stored_cols, n_ok, stride_qc, BLOCK_K: tl.constexpr, SCHEME: tl.constexpr):
    """The stored bytes of W[rows, k0 : k0 + BK]: int8 [BN, BK], packed [BN, BK/2]. ``stored_cols``: a
    row's bytes (C, or ceil(C/2) packed), passed in rather than computed from C so that the compiler
    sees its divisibility: the masked load then stays a 16-byte vector load (and a pipelined one)."""
    if SCHEME == 0:
        k = k0 + tl.arange(0, BLOCK_K)
    else:
        k = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # packed columns of this step
    return tl.load(q_rows[:, None] + k[None, :] * stride_qc, mask=n_ok[:, None] & (k < stored_cols)[None, :], other=0)


@triton.jit
def _decode(raw, mul, add, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
            SCHEME: tl.constexpr):
    """``_load_weights``' bytes of a step -> W[rows, k0 : k0 + BK] [BN, BK] in DTYPE, dequantized with that
    step's ``_group_scales`` (int8: not yet scaled, mul and add unused)."""
    if SCHEME == 0:
        w = raw.to(tl.float32).to(DTYPE)  # exact; via float32 (the interpreter's int8 -> bf16 gives NaN)
    else:
        packed = raw.to(tl.int32)  # [BN, BK/2] bytes
        if SCHEME == 1:  # the nibble to bits 16-19 of float32 128.0
            bits = _interleave((packed & 0x0F) << 16, (packed & 0xF0) << 12, BLOCK_N, BLOCK_K) | 0x43000000
            decoded = bits.to(tl.float32, bitcast=True)  # 128 + code
        else:  # exponent and mantissa bits to fp16 bits 9-11, the sign to bit 15
            low = ((packed & 0x07) << 9) | ((packed & 0x08) << 12)
            high = ((packed & 0x70) << 5) | ((packed & 0x80) << 8)
            bits = _interleave(low, high, BLOCK_N, BLOCK_K).to(tl.int16)
            decoded = bits.to(tl.float16, bitcast=True).to(tl.float32)  # e2m1 value * 2^-14
        spans = tl.reshape(decoded, [BLOCK_N, BLOCK_K // SPAN, SPAN])
        w = tl.reshape(spans * mul[:, :, None] + add[:, :, None], [BLOCK_N, BLOCK_K]).to(DTYPE)
    return w


@triton.jit
def _decode_step(q_rows, k0, stored_cols, n_ok, stride_qc, mul, add, x_ptr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPAN: tl.constexpr, SCHEME: tl.constexpr, UPCAST: tl.constexpr):
    """W[rows, k0 : k0 + BK] [BN, BK] loaded and decoded with step k0's (mul, add), in the dtype the dot
    takes: x's, float32 with UPCAST."""
    raw = _load_weights(q_rows, k0, stored_cols, n_ok, stride_qc, BLOCK_K, SCHEME)
    if UPCAST:
        w = _decode(raw, mul, add, tl.float32, BLOCK_N, BLOCK_K, SPAN, SCHEME)
    else:
        w = _decode(raw, mul, add, x_ptr.dtype.element_ty, BLOCK_N, BLOCK_K, SPAN, SCHEME)
    return w


@triton.jit
def _first(q_rows, s_rows, z_rows, k0, C, stored_cols, n_ok, stride_qc, stride_sg, stride_zg, x_ptr,
           SPAN: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           SCHEME: tl.constexpr, UPCAST: tl.constexpr, AHEAD: tl.constexpr):
    """(w, mul, add) before the loop's first step k0: with AHEAD w is step k0's decoded tile and (mul,
    add) step k0 + BK's scales; else w a placeholder (never read) and (mul, add) step k0's."""
    mul, add = _scales(s_rows, z_rows, k0, C, n_ok, stride_sg, stride_zg, SPAN, GROUP, BLOCK_N, BLOCK_K, SCHEME)
    if AHEAD:
        w = _decode_step(q_rows, k0, stored_cols, n_ok, stride_qc, mul, add, x_ptr, BLOCK_N, BLOCK_K, SPAN, SCHEME,
                         UPCAST)
        mul, add = _scales(s_rows, z_rows, k0 + BLOCK_K, C, n_ok, stride_sg, stride_zg, SPAN, GROUP, BLOCK_N, BLOCK_K,
                           SCHEME)
    else:
        w = tl.zeros([1, 1], dtype=tl.float32)
    return w, mul, add


@triton.jit
def _step(w, a, acc, q_rows, k0, stored_cols, n_ok, stride_qc, mul, add, x_ptr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr, SPAN: tl.constexpr, SCHEME: tl.constexpr, UPCAST: tl.constexpr,
          AHEAD: tl.constexpr):
    """One reduction step, (acc + a @ W[rows, k0 : k0 + BK]^T, w). AHEAD: w is that tile (decoded a step
    earlier), the dot goes first and the tile of step k0 + BK (decoded with (mul, add), its scales)
    comes back; else the tile is decoded here with (mul, add) and w passes through."""
    if AHEAD:
        acc = _dot_t(w, a, acc)
        w = _decode_step(q_rows, k0 + BLOCK_K, stored_cols, n_ok, stride_qc, mul, add, x_ptr, BLOCK_N, BLOCK_K, SPAN,
                         SCHEME, UPCAST)
    else:
        acc = _dot_t(_decode_step(q_rows, k0, stored_cols, n_ok, stride_qc, mul, add, x_ptr, BLOCK_N, BLOCK_K, SPAN,
                                  SCHEME, UPCAST), a, acc)
    return acc, w


@triton.jit
def _dot_t(w, a, acc):
    """acc [BM, BN] + a [BM, BK] @ w^T (w [BN, BK])."""
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def add_b13(acc_gate, acc_up, b13_ptr, expert, gate, up, n_ok, N):
    """acc_gate, acc_up [BM, BN] (or one row's [BN], the gemv's) float32 + expert's b13 (contiguous [E, 2N]) at its
    gate and up rows [BN] (w13's), broadcast over the rows."""
    row = b13_ptr + expert * 2 * N
    acc_gate += tl.load(row + gate, mask=n_ok, other=0.0).to(tl.float32)
    acc_up += tl.load(row + up, mask=n_ok, other=0.0).to(tl.float32)
    return acc_gate, acc_up


@triton.jit
def add_b2(acc, b2_ptr, expert, offs_out, out_ok, K):
    """acc [BM, BN] (or one row's [BN], the gemv's) float32 + expert's b2 (contiguous [E, K]) at columns offs_out,
    broadcast over the rows, by split 0 only (split-K's partials sum onto it)."""
    b2 = tl.load(b2_ptr + expert * K + offs_out, mask=out_ok, other=0.0).to(tl.float32)  # [BN]
    return acc + tl.where(tl.program_id(1) == 0, b2, 0.0)


@triton.jit
def gate_up_wo_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, h_ptr,  # x [M, K]; w13 as q/scale/zero ([E, 2N, ..]); h [A, N] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, b13_ptr,  # b13 [E, 2N] or None
    N, K, K_STORED, num_assignments, top_k, num_experts, num_pid_m,  # K_STORED: bytes of a w13 row
    stride_xm, stride_xk, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,
    stride_ze, stride_zr, stride_zg, stride_hm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, ACT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr = False,
    INTERLEAVED: tl.constexpr = False, ALPHA: tl.constexpr = 1.0, LIMIT: tl.constexpr = None,
    UP_SHIFT: tl.constexpr = 0.0, LIMIT_AFTER: tl.constexpr = False):
    """h = glu(x w_gate^T + b13_gate, x w_up^T + b13_up) per row, w13 dequantized in registers (b13, variant: doc)."""
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
    offs_k = tl.arange(0, BLOCK_K)
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_g, mul_g, add_g = _first(qg, sg, zg, 0, K, K_STORED, n_ok, stride_qc, stride_sg, stride_zg, x_ptr, SPAN,
                               GROUP, BLOCK_N, BLOCK_K, SCHEME, UPCAST, AHEAD)
    w_u, mul_u, add_u = _first(qu, su, zu, 0, K, K_STORED, n_ok, stride_qc, stride_sg, stride_zg, x_ptr, SPAN,
                               GROUP, BLOCK_N, BLOCK_K, SCHEME, UPCAST, AHEAD)
    for k0 in range(0, K, BLOCK_K):
        k_scales = k0 + BLOCK_K  # the step whose scales load now: the next, with AHEAD the one after
        if AHEAD:
            k_scales += BLOCK_K
        next_mul_g, next_add_g = _scales(sg, zg, k_scales, K, n_ok, stride_sg, stride_zg, SPAN, GROUP,
                                         BLOCK_N, BLOCK_K, SCHEME)
        next_mul_u, next_add_u = _scales(su, zu, k_scales, K, n_ok, stride_sg, stride_zg, SPAN, GROUP,
                                         BLOCK_N, BLOCK_K, SCHEME)
        k = k0 + offs_k
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & (k < K)[None, :], other=0.0)  # [BM, BK]
        if UPCAST:  # the weights then decode to float32 too (the interpreter truncates float32 -> bf16)
            a = a.to(tl.float32)
        acc_gate, w_g = _step(w_g, a, acc_gate, qg, k0, K_STORED, n_ok, stride_qc, mul_g, add_g, x_ptr, BLOCK_N,
                              BLOCK_K, SPAN, SCHEME, UPCAST, AHEAD)
        acc_up, w_u = _step(w_u, a, acc_up, qu, k0, K_STORED, n_ok, stride_qc, mul_u, add_u, x_ptr, BLOCK_N,
                            BLOCK_K, SPAN, SCHEME, UPCAST, AHEAD)
        mul_g, add_g, mul_u, add_u = next_mul_g, next_add_g, next_mul_u, next_add_u
    let_next_kernel_launch(PDL)
    if SCHEME == 0:  # int8: the per-row scale, once
        acc_gate *= tl.load(sg, mask=n_ok, other=0.0)[None, :]
        acc_up *= tl.load(su, mask=n_ok, other=0.0)[None, :]
    if b13_ptr is not None:
        acc_gate, acc_up = add_b13(acc_gate, acc_up, b13_ptr, expert, gate, up, n_ok, N)
    h = _glu(acc_gate, acc_up, ACT, ALPHA, LIMIT, UP_SHIFT, LIMIT_AFTER)  # [BM, BN] fp32: act(gate) * up (plain)
    h_ptrs = h_ptr + rows[:, None] * stride_hm + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_epilogue(acc, s_rows, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok,
                   arrivals, pid_n, offs_out, out_ok, K, num_assignments, top_k, num_experts, num_global, stride_ym,
                   b2_ptr, expert, BLOCK_N: tl.constexpr, SCHEME: tl.constexpr, KSUM: tl.constexpr,
                   TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr, SUM_ROWS: tl.constexpr):
    """The weight-only down kernels' end: the y tile acc [BM, BN] (float32) x the int8 row scales, + b2 (``add_b2``;
    b2_ptr None: none), then ``down_store.store_routed`` (x the routed weight, into this split's partial rows; KSUM:
    this program's arrivals, ``arrivals`` [BM] each row's token's routed slots)."""
    if SCHEME == 0:
        acc *= tl.load(s_rows, mask=out_ok, other=0.0)[None, :]
    if b2_ptr is not None:
        acc = add_b2(acc, b2_ptr, expert, offs_out, out_ok, K)
    store_routed(acc, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, num_assignments, row_ok,
                 arrivals, pid_n, offs_out, out_ok, K, top_k, num_experts, num_global, stride_ym, BLOCK_N, KSUM,
                 TOPK_PAD, HAS_MAP, SUM_ROWS)  # y [SPLIT * A, K]: this split's partial rows


@triton.jit
def down_wo_kernel(
    h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, weights_ptr,  # h [A, N]; w2 as q/scale/zero ([E, K, ..]); y [SPLIT*A, K] out
    ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    out_ptr, counters_ptr, map_ptr,  # KSUM only (else None): out [M, K], counters [M, K tiles] int32, the expert map
    b2_ptr,  # b2 [E, K] or None
    K, N, N_STORED, num_assignments, num_experts, num_pid_m, split_len,  # N_STORED: bytes of a w2 row
    stride_hm, stride_qe, stride_qr, stride_qc, stride_se, stride_sr, stride_sg,
    stride_ze, stride_zr, stride_zg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPAN: tl.constexpr,
    GROUP: tl.constexpr, GROUP_M: tl.constexpr, SCHEME: tl.constexpr, SPLIT: tl.constexpr,
    NAIVE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr = False,
    KSUM: tl.constexpr = False, top_k=1, num_global=0,  # KSUM: the k-sum folded in (``gemm.down_kernel``'s, SPLIT 1)
    TOPK_PAD: tl.constexpr = 1, HAS_MAP: tl.constexpr = False, SUM_ROWS: tl.constexpr = 1, ZERO_T: tl.constexpr = 1,
):
    """y = routed weight * (h w2^T + b2) per row, w2 dequantized in registers (split-K, KSUM, b2: module doc)."""
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
    offs_red = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_start = tl.program_id(1) * split_len
    w, mul, add = _first(q_rows, s_rows, z_rows, n_start, N, N_STORED, out_ok, stride_qc, stride_sg, stride_zg, h_ptr,
                         SPAN, GROUP, BLOCK_N, BLOCK_K, SCHEME, UPCAST, AHEAD)
    for n0 in range(n_start, tl.minimum(n_start + split_len, N), BLOCK_K):
        n_scales = n0 + BLOCK_K
        if AHEAD:
            n_scales += BLOCK_K
        next_mul, next_add = _scales(s_rows, z_rows, n_scales, N, out_ok, stride_sg, stride_zg, SPAN, GROUP,
                                     BLOCK_N, BLOCK_K, SCHEME)
        red = n0 + offs_red
        a = tl.load(h_rows + red[None, :], mask=row_ok[:, None] & (red < N)[None, :], other=0.0)  # [BM, BK]
        if UPCAST:
            a = a.to(tl.float32)
        acc, w = _step(w, a, acc, q_rows, n0, N_STORED, out_ok, stride_qc, mul, add, h_ptr, BLOCK_N, BLOCK_K, SPAN,
                       SCHEME, UPCAST, AHEAD)
        mul, add = next_mul, next_add
    let_next_kernel_launch(PDL)
    _down_epilogue(acc, s_rows, weights_ptr, y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, safe_rows, row_ok,
                   arrivals, pid_n, offs_out, out_ok, K, num_assignments, top_k, num_experts, num_global, stride_ym,
                   b2_ptr, expert, BLOCK_N, SCHEME, KSUM, TOPK_PAD, HAS_MAP, SUM_ROWS)

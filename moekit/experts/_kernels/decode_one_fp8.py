"""One launch for a whole tiny-batch fp8_block experts call: ``decode_one``'s schedule (tickets, gate-up tiles,
then down tiles waiting on their slot's counter, the last-arrival k-sum, counters reset by the last program out)
on e4m3 weights with 128 x 128 block scales (DeepSeek-V3's recipe, ``moekit.quant.fp8_block``).

Torch twin: ``moekit.experts.triton_fp8.fused_experts_fp8_torch`` (the same quantization of x and h).

Shapes as ``decode_one``; G = 128 (the scale blocks' width, the activation groups); N and K multiples of 128
(the host refuses the rest). Scales: w13 [E, 2N/G, K/G], w2 [E, K/G, N/G] float32 (dequantized = q * scale).
Activations are quantized as the fp8 path does (``quant_fp8``: s = amax / 448 per token per G columns, q = e4m3
rounded to nearest even): each gate-up program quantizes its token's x step by step as it loads it (every
program the same groups, the same rounding), and each down tile its h row (float32, written by gate-up) per G
columns. Per G-group the products of the e4m3 values are summed in float32, then scaled by x_s * w_s once.

GEMV only (CUDA cores; every slot its own programs). A gate-up tile's BN rows (<= G) lie in one scale row block,
as do a down tile's BKO rows (<= G); BK (gate-up step) and BNR (down step) are multiples of G.
EMULATE: the interpreter's e4m3 rounding (``quant_fp8``); the weights are converted exactly either way.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import wait_for_previous_kernel
from moekit.experts._kernels.decode_one import (
    FP8_GROUP, down_tiles, last_out_resets, quantized_groups, scaled_rows, take_ticket,
)

G: tl.constexpr = FP8_GROUP


@triton.jit
def _gate_up_fp8(x_ptr, wq_ptr, ws_ptr, h_ptr, e, token, s, nt, N, K,
                 BN: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr):
    """h[s, nt*BN + i] = silu(gate) * up, both block-scaled fp8 GEMVs over x[token] quantized per G columns."""
    GROUPS: tl.constexpr = BK // G
    kb = K // G  # scale columns
    offs_n = nt * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    groups = tl.arange(0, GROUPS)
    g_ptrs = wq_ptr + e * (2 * N) * K + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BN, BK]
    u_ptrs = g_ptrs + N * K
    sg_ptrs = ws_ptr + e * (2 * N // G) * kb + ((nt * BN) // G) * kb + groups  # [GROUPS] step 0's
    su_ptrs = sg_ptrs + (N // G) * kb
    acc_g = tl.zeros([BN], dtype=tl.float32)
    acc_u = tl.zeros([BN], dtype=tl.float32)
    for i in range(0, tl.cdiv(K, BK)):
        k_ok = offs_k < K - i * BK  # whole groups: K is a multiple of G
        g_ok = groups < kb - i * GROUPS
        wg = tl.load(g_ptrs + i * BK, mask=k_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs + i * BK, mask=k_ok[None, :], other=0.0)
        xv = tl.load(x_ptr + token * K + i * BK + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        xq, xs = quantized_groups(xv, GROUPS, EMULATE)
        acc_g += scaled_rows(wg, xq, xs, tl.load(sg_ptrs + i * GROUPS, mask=g_ok, other=0.0), BN, GROUPS)
        acc_u += scaled_rows(wu, xq, xs, tl.load(su_ptrs + i * GROUPS, mask=g_ok, other=0.0), BN, GROUPS)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + s * N + offs_n, h)


@triton.jit
def decode_one_fp8_kernel(
    x_ptr, w13q_ptr, w13s_ptr, w2q_ptr, w2s_ptr, ids_ptr, weights_ptr, h_ptr, y_ptr, out_ptr, counters_ptr,
    N, K, num_experts, num_slots, top_k,
    S_PAD: tl.constexpr, BN_UP: tl.constexpr, BK_UP: tl.constexpr, BK_OUT: tl.constexpr, BN_RED: tl.constexpr,
    EMULATE: tl.constexpr, PDL: tl.constexpr, SPIN_LIMIT: tl.constexpr, TICKET: tl.constexpr = True,
    DOWN_TILES: tl.constexpr = 1,
):
    """The whole fp8_block experts call; phases by ticket (``decode_one``'s docstring). h: float32 [S, N]."""
    wait_for_previous_kernel(PDL)
    ticket = take_ticket(counters_ptr, TICKET)
    nt_up = tl.cdiv(N, BN_UP)
    kt_out = tl.cdiv(K, BK_OUT)
    down_programs = tl.cdiv(kt_out, DOWN_TILES)  # per slot
    up_tiles = num_slots * nt_up
    in_up = ticket < up_tiles
    s = tl.where(in_up, ticket // nt_up, (ticket - up_tiles) // down_programs)
    e = tl.load(ids_ptr + s).to(tl.int64)
    valid = (e >= 0) & (e < num_experts)
    if in_up:
        if valid:
            _gate_up_fp8(x_ptr, w13q_ptr, w13s_ptr, h_ptr, e, s // top_k, s, ticket % nt_up, N, K, BN_UP, BK_UP,
                         EMULATE)
        tl.debug_barrier()
        tl.atomic_add(counters_ptr + 2 + s, 1, sem="release")
    else:
        down_tiles(h_ptr, w2q_ptr, w2s_ptr, y_ptr, out_ptr, weights_ptr, counters_ptr, e, valid, s, s,
                   ((ticket - up_tiles) % down_programs) * DOWN_TILES, N, K, top_k, nt_up, kt_out, 2 + S_PAD, BK_OUT,
                   BN_RED, DOWN_TILES, SPIN_LIMIT, FP8=True, EMULATE=EMULATE)
    last_out_resets(counters_ptr, up_tiles + num_slots * down_programs, S_PAD)

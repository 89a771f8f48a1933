"""Tiny batches: the down GEMM and the k-sum as one kernel whose programs walk a token's slots.

Torch twin: ``moekit.experts.reference`` (the down projection, the routed weight, the sum over slots); on the
fused path it replaces ``gemm.down_kernel`` + ``combine.sum_slots_kernel`` (ORDERED) and gives their bits.

Shapes: M tokens, k slots, A = M*k assignments (a = t*k + j), E experts, K hidden, N intermediate. h [A, N] (gate-up's
output, assignment order), w2 [E, K, N] (a TMA descriptor over [E*K, N], block [BLOCK_N, BLOCK_K]), out [M, K].

Program (pid_n, t) owns out[t, pid_n*BN : +BN]. One flat loop over (slot j, reduction step) runs k * cdiv(N, BK)
steps, so the weight pipeline (TMA, num_stages deep) never drains between a token's experts: the next slot's first
w2 tiles are in flight while this slot's last ones are multiplied. A slot's expert and routed weight come from
[TOPK_PAD] vectors loaded once (no load in the loop feeds an address). At a slot's last step its [BN] row is scaled by
the routed weight, rounded to out's dtype (what the separate path stores as y) and added in float32 to the running
sum, in slot order from 0: bit for bit ``down_kernel``'s y summed by the ordered k-sum. A slot not routed here
(id < 0 or >= E) reads expert 0's tile and adds nothing. The 16-row tile is the MMA's minimum: row 0 is the token's.

Why: at Qwen3-30B-A3B M = 1 the separate path's down GEMM (256 programs of 6 steps each) pays its pipeline's ramp per
program and the k-sum a launch of its own; here 2048 / BN programs of 8 * 6 steps each.

FP8 (fp8_block weights, ``triton_fp8``'s tiny-batch path; BLOCK_K = the scale group, BLOCK_N within one group of
rows): w2 e4m3 with scales ws [E, K/GROUP, N/GROUP]; each step is one scale block, acc += dot(h_q, w_q) * h_s * w_s,
as ``gemm_fp8.down_fp8_kernel`` without SWAP_AB. H_FP32: h is float32, quantized per step here (``quant_fp8``'s
rounding), else h_q (e4m3) with h_s [A, N/GROUP]. Its torch twin: ``triton_fp8.fused_experts_fp8_torch``.

PDL: waits before its first read of h, lets the next kernel launch after its main loop (``gemm.py``'s rule).
UPCAST, PRECISION: as in ``gemm.py`` (the interpreter's bf16 ``tl.dot``); Y_FP32 (the interpreter, whose workspace
is float32): a slot's row is not rounded to out's dtype before it is summed. EMULATE: ``quant_fp8``'s.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, wait_for_previous_kernel
from moekit.experts._kernels.quant_fp8 import group_scale, to_e4m3


@triton.jit
def down_slots_kernel(
    h_ptr, w2_desc, weights_ptr, ids_ptr, out_ptr,  # h [A, N], w2 descriptor, weights / ids [A], out [M, K]
    hs_ptr, ws_ptr,  # FP8 only (else None): h_s [A, N/GROUP] (unread with H_FP32), w2's scales [E, K/GROUP, N/GROUP]
    K, N, top_k, num_experts, stride_hm, stride_om, stride_hsm, stride_wse, stride_wsk, stride_wsn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, Y_FP32: tl.constexpr,
    FP8: tl.constexpr = False, H_FP32: tl.constexpr = False, EMULATE: tl.constexpr = False, GROUP: tl.constexpr = 128,
):
    """out[t, tile] = sum over t's routed slots j (in order) of round(weight_j * (h[t*k + j] w2[e_j]^T))."""
    pid_n = tl.program_id(0)
    token = tl.program_id(1).to(tl.int64)
    slots = tl.arange(0, TOPK_PAD)
    slot_ok = slots < top_k
    ids = tl.load(ids_ptr + token * top_k + slots, mask=slot_ok, other=-1).to(tl.int32)  # [TOPK_PAD]
    routed = slot_ok & (ids >= 0) & (ids < num_experts)
    experts = tl.where(routed, ids, 0)
    routed_w = tl.load(weights_ptr + token * top_k + slots, mask=routed, other=0.0).to(tl.float32)
    wait_for_previous_kernel(PDL)  # h is the previous kernel's (ids and weights are older: gate-up waited on them)
    lanes = tl.arange(0, 16)
    offs_red = tl.arange(0, BLOCK_K)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    steps = tl.cdiv(N, BLOCK_K)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    total = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for s in range(0, top_k * steps):
        j = s // steps
        n0 = (s - j * steps) * BLOCK_K
        pick = slots == j
        expert = tl.sum(tl.where(pick, experts, 0))
        live = tl.sum(tl.where(pick, routed.to(tl.int32), 0))  # 1: slot j is routed here, else 0
        h_ptrs = h_ptr + (token * top_k + j) * stride_hm + n0 + offs_red[None, :] + lanes[:, None] * 0  # [16, BK]
        ha = tl.load(h_ptrs, mask=(lanes[:, None] < live) & (offs_red[None, :] < N - n0), other=0.0)
        wb = w2_desc.load([expert * K + pid_n * BLOCK_N, n0]).T  # [BK, BN]; columns past N read 0
        if FP8:
            if H_FP32:  # this step's group of h quantized as the separate down GEMM does (``gemm_fp8._x_step``)
                hs = group_scale(tl.max(tl.abs(ha), axis=1))  # [16]
                ha = to_e4m3(ha / hs[:, None], EMULATE)
            else:
                hs = tl.load(hs_ptr + (token * top_k + j) * stride_hsm + n0 // BLOCK_K + lanes * 0)  # [16]
            ws = tl.load(ws_ptr + expert.to(tl.int64) * stride_wse + ((pid_n * BLOCK_N) // GROUP) * stride_wsk
                         + (n0 // BLOCK_K) * stride_wsn)
            if UPCAST:
                part = tl.dot(ha.to(tl.float32), wb.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(ha, wb, out_dtype=tl.float32)
            acc = acc + part * (hs * ws)[:, None]
        elif UPCAST:
            acc = tl.dot(ha.to(tl.float32), wb.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(ha, wb, acc, input_precision=PRECISION)
        last = n0 + BLOCK_K >= N  # this slot's last step: its y row joins the sum, the accumulator restarts
        weight = tl.sum(tl.where(pick, routed_w, 0.0))
        y = acc * weight
        if not Y_FP32:
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # the separate path's y
        total += tl.where(last & (live > 0), y, 0.0)
        acc = tl.where(last, 0.0, acc)
    let_next_kernel_launch(PDL)
    out_ptrs = out_ptr + token * stride_om + offs_out[None, :] + lanes[:, None] * 0  # [16, BN], row 0 stored
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=(lanes[:, None] == 0) & (offs_out[None, :] < K))

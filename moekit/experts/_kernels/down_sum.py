"""The down GEMM and the k-sum in one launch, for the naive (tiny-batch) path: no [A, K] y round trip.

    out[t, c] = sum_j weight[t, j] * (h[t*k + j] . w2[e_j, c, :] + b2[e_j, c]),  e_j = the slot's local expert

Program (t, pid_n) owns token t and output columns pid_n*BN ..; it walks the token's k slots and, per
slot, the reduction N in BK steps (one flattened loop, so the load pipeline never drains between slots).
Each step's partial product is multiplied by the slot's routed weight and added to one fp32 accumulator:
the routed weight applies per slot, the order is fixed (deterministic, no atomics), and each weight byte
is read once, as by the down GEMM it replaces. A slot not routed here (id < 0, id >= E, map entry -1)
is never read: its h row was never written (``gate_up_kernel`` skips it) and its loads are masked.

DOT: the step is a ``tl.dot`` of [BM, BK] x [BK, BN] whose rows past the first are zeros (BM = 16, the
smallest dot: the tensor cores idle, but Triton pipelines loads that feed a dot); else a CUDA-core
product of the [BK] h chunk with the [BK, BN] weight tile, reduced over BK.

W_DESC: w2 comes as a TMA descriptor over [E*K, N], block [BN, BK] (the plan's down descriptor); an
unrouted slot then reads expert 0's tile and discards it (the product is zeroed, never added).

Torch twin: ``moekit.experts.reference`` (the down projection and the weighted sum of each token's slots).
Shapes: M tokens, k slots, A = M*k, E local experts, K hidden (output columns), N intermediate.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import let_next_kernel_launch, local_expert_ids, wait_for_previous_kernel


@triton.jit
def _slots(t, ids_ptr, map_ptr, weights_ptr, top_k, num_experts, num_global, TOPK_PAD: tl.constexpr,
           HAS_MAP: tl.constexpr):
    """Token t's slots, loaded once before the loop: (local expert [TOPK_PAD] int64, num_experts when
    unrouted or past k; routed weight [TOPK_PAD] fp32, 0 there)."""
    slots = tl.arange(0, TOPK_PAD)
    slot_ok = slots < top_k
    a = t.to(tl.int64) * top_k + slots
    ids = tl.load(ids_ptr + a, mask=slot_ok, other=-1).to(tl.int64)
    e = local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP)
    weight = tl.load(weights_ptr + a, mask=slot_ok & (e < num_experts), other=0.0).to(tl.float32)
    return e, weight


@triton.jit
def _pick(e_all, weight_all, j, num_experts, TOPK_PAD: tl.constexpr):
    """Slot j's (local expert, 0 when unrouted; routed; routed weight), from registers: no load in the
    loop, so the weight tiles' addresses are known ahead and the loads pipeline across slots."""
    sel = tl.arange(0, TOPK_PAD) == j
    e = tl.sum(tl.where(sel, e_all, 0))
    routed = e < num_experts
    return tl.where(routed, e, 0), routed, tl.sum(tl.where(sel, weight_all, 0.0))


@triton.jit
def down_sum_kernel(
    h_ptr, w2_ptr, b2_ptr, weights_ptr, ids_ptr, map_ptr, out_ptr,  # h [A, N], w2 [E, K, N], b2 [E, K], out [M, K]
    K, N, top_k, num_experts, num_global,
    stride_hm, stride_we, stride_wk, stride_wn, stride_b2e, stride_b2k, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr, DOT: tl.constexpr, HAS_MAP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, W_DESC: tl.constexpr, PDL: tl.constexpr,
):
    """out = sum over token t's slots of routed weight * (h w2^T + b2); b2_ptr is None without a bias.
    BLOCK_N tiles the output columns (K), BLOCK_K the reduction (N), as in ``gemm.down_kernel``."""
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ok = offs_out < K
    offs_red = tl.arange(0, BLOCK_K)
    lanes = tl.arange(0, 16)  # DOT: row 0 is the token, rows 1.. zeros
    n_steps = tl.cdiv(N, BLOCK_K)
    e_all, weight_all = _slots(t, ids_ptr, map_ptr, weights_ptr, top_k, num_experts, num_global, TOPK_PAD, HAS_MAP)
    if DOT:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, top_k * n_steps):
        j = i // n_steps
        n0 = (i - j * n_steps) * BLOCK_K
        a = t.to(tl.int64) * top_k + j
        e, routed, weight = _pick(e_all, weight_all, j, num_experts, TOPK_PAD)
        red_ok = offs_red < tl.where(routed, N - n0, 0)  # nothing of an unrouted slot is read
        if W_DESC:
            wb = w2_ptr.load([(e * K + pid_n * BLOCK_N).to(tl.int32), n0]).T  # [BK, BN]; columns past N read 0
        else:
            w_ptrs = (w2_ptr + e * stride_we + offs_out[None, :].to(tl.int64) * stride_wk
                      + (n0 + offs_red)[:, None] * stride_wn)
            wb = tl.load(w_ptrs, mask=red_ok[:, None] & out_ok[None, :], other=0.0)  # [BK, BN]
        h_ptrs = h_ptr + a * stride_hm + n0 + offs_red
        if DOT:
            ha = tl.load(h_ptrs[None, :] + lanes[:, None] * 0, mask=(lanes[:, None] == 0) & red_ok[None, :], other=0.0)
            if UPCAST:
                ha, wb = ha.to(tl.float32), wb.to(tl.float32)
            part = tl.dot(ha, wb, input_precision=PRECISION)  # [16, BN]
        else:
            ha = tl.load(h_ptrs, mask=red_ok, other=0.0).to(tl.float32)  # [BK]
            part = tl.sum(wb.to(tl.float32) * ha[:, None], axis=0)  # [BN]
        acc += tl.where(routed, part * weight, 0.0)
    let_next_kernel_launch(PDL)
    if b2_ptr is not None:  # each slot's bias, times its routed weight (added before it in the twin)
        for j in range(0, top_k):
            e, routed, weight = _pick(e_all, weight_all, j, num_experts, TOPK_PAD)
            b2 = tl.load(b2_ptr + e * stride_b2e + offs_out.to(tl.int64) * stride_b2k, mask=offs_out < tl.where(routed, K, 0),
                         other=0.0)
            if DOT:
                acc += tl.where(lanes[:, None] == 0, b2.to(tl.float32)[None, :] * weight, 0.0)
            else:
                acc += b2.to(tl.float32) * weight
    out_ptrs = out_ptr + t.to(tl.int64) * stride_om + offs_out
    if DOT:
        tl.store(out_ptrs[None, :] + lanes[:, None] * 0, acc.to(out_ptr.dtype.element_ty),
                 mask=(lanes[:, None] == 0) & out_ok[None, :])
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_ok)

"""The sum over the k slots (and the split-K partials): out[t] = sum_s sum_j y[s*A + t*k + j] over the
slots routed here. SPLIT = 1 for every down GEMM but the weight-only one's split-K schedule
(``gemm_wo.down_wo_kernel``, SPLIT > 1), whose partials of split s are rows s*A...

Torch twin: ``y.view(SPLIT, M, k, K).sum((0, 2))`` with unrouted slots zeroed. A slot that is not routed
here (id < 0, id >= E, map entry -1) was never written by the down GEMM, so it is masked, never read.

ORDERED (the plain bf16/fp16/fp32 path): the slots are added one at a time in slot order, in float32 from
0 (``sum_token_slots``), the order the down GEMM's folded k-sum (``gemm.py``, KSUM) uses too, so the two
are equal bit for bit and a call's result does not depend on which of them ran. Unordered, ``tl.sum``
adds the slots in whatever order the compiler's layout gives.

Shapes: y [SPLIT*A, K] (A = M*k), out [M, K]; BT tokens x BK columns per program.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids, let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def slot_routed(tokens, j, ids_ptr, map_ptr, top_k, num_experts, num_global, HAS_MAP: tl.constexpr):
    """[R] bool: slot j of each token (int64 [R], in range) is routed here (the down GEMM wrote its row)."""
    slot = tl.zeros_like(tokens) + j  # [R]: a tensor mask (j and top_k may both be constants)
    ids = tl.load(ids_ptr + tokens * top_k + slot, mask=slot < top_k, other=-1).to(tl.int64)
    return local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP) < num_experts


@triton.jit
def sum_token_slots(y_ptr, tokens, t_ok, cols, c_ok, ids_ptr, map_ptr, top_k, num_experts, num_global, stride_ym,
                    TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr):
    """[R, C] float32: sum over j = 0, 1, .. of y[token * k + j, cols], one slot at a time from 0 (the order
    both k-sums share), unrouted slots never read. tokens: int64 [R] (in range where not t_ok)."""
    acc = tl.zeros([tokens.shape[0], cols.shape[0]], dtype=tl.float32)
    for j in tl.static_range(TOPK_PAD):  # unrolled: the k loads are independent and go out together
        ok = t_ok & slot_routed(tokens, j, ids_ptr, map_ptr, top_k, num_experts, num_global, HAS_MAP)
        y = tl.load(y_ptr + (tokens * top_k + j)[:, None] * stride_ym + cols[None, :], mask=ok[:, None] & c_ok[None, :],
                    other=0.0)
        acc += y.to(tl.float32)
    return acc


@triton.jit
def sum_slots_kernel(
    y_ptr, ids_ptr, map_ptr, out_ptr,
    num_tokens, K, top_k, num_experts, num_global,
    stride_ym, stride_om, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
    PDL: tl.constexpr, SPLIT: tl.constexpr, ORDERED: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    t_ok = tokens < num_tokens
    c_ok = cols < K
    if ORDERED:  # SPLIT == 1 (the host's check)
        acc = sum_token_slots(y_ptr, tl.where(t_ok, tokens, 0).to(tl.int64), t_ok, cols, c_ok, ids_ptr, map_ptr, top_k,
                              num_experts, num_global, stride_ym, TOPK_PAD, HAS_MAP)
    else:
        acc = _sum_slots_at_once(y_ptr, ids_ptr, map_ptr, tokens, t_ok, cols, c_ok, num_tokens, top_k, num_experts,
                                 num_global, stride_ym, BLOCK_T, BLOCK_K, TOPK_PAD, HAS_MAP, SPLIT)
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _sum_slots_at_once(y_ptr, ids_ptr, map_ptr, tokens, t_ok, cols, c_ok, num_tokens, top_k, num_experts, num_global,
                       stride_ym, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr,
                       HAS_MAP: tl.constexpr, SPLIT: tl.constexpr):
    """[BT, BK] float32: every split's slots summed by ``tl.sum``. One [BT, k, BK] load: every slot's row is
    requested at once (a runtime loop over j waited on k dependent load round trips: 4.6 µs for M=8 on the H200)."""
    slots = tl.arange(0, TOPK_PAD)
    a = tokens[:, None].to(tl.int64) * top_k + slots[None, :]  # [BT, k] assignment of each slot
    a_ok = t_ok[:, None] & (slots[None, :] < top_k)
    ids = tl.load(ids_ptr + a, mask=a_ok, other=-1).to(tl.int64)
    routed = a_ok & (local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP) < num_experts)
    mask = routed[:, :, None] & c_ok[None, None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # [BT, k, BK] per split
        y = tl.load(y_ptr + (s * num_tokens * top_k + a)[:, :, None] * stride_ym + cols[None, None, :], mask=mask,
                    other=0.0)
        acc += tl.sum(y.to(tl.float32), axis=1)  # [BT, BK]
    return acc

"""The sum over the k slots (and the split-K partials): out[t] = sum_s sum_j y[s*A + t*k + j] over the
slots routed here. SPLIT = 1 for every down GEMM but the weight-only one's split-K schedule
(``gemm_wo.down_wo_kernel``, SPLIT > 1), whose partials of split s are rows s*A...

Torch twin: ``y.view(SPLIT, M, k, K).sum((0, 2))`` with unrouted slots zeroed. A slot that is not routed
here (id < 0, id >= E, map entry -1) was never written by the down GEMM, so it is masked, never read.

Shapes: y [SPLIT*A, K] (A = M*k), out [M, K]; BT tokens x BK columns per program.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids, let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def sum_slots_kernel(
    y_ptr, ids_ptr, map_ptr, out_ptr,
    num_tokens, K, top_k, num_experts, num_global,
    stride_ym, stride_om, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
    PDL: tl.constexpr, SPLIT: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
    # One [BT, k, BK] load: every slot's row is requested at once (a loop over j would wait on k
    # dependent load round trips; measured 4.6 µs for M=8 on the H200 that way).
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    slots = tl.arange(0, TOPK_PAD)
    t_ok = tokens < num_tokens
    c_ok = cols < K
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
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

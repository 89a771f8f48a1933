"""The sum over split-K partials and k slots: out[t] = sum_s sum_j y[s*A + t*k + j] over the slots routed
here, for the weight-only down GEMM's split-K schedule (``gemm_wo.down_wo_kernel`` with SPLIT > 1).

Torch twin: ``y.view(SPLIT, M, k, K).sum((0, 2))`` with unrouted slots zeroed; with SPLIT = 1 it is
``combine.sum_slots_kernel``. An unrouted slot was never written, so it is masked, never read.

Shapes: y [SPLIT*A, K] (A = M*k), out [M, K]; BT tokens x BK columns per program.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids, let_next_kernel_launch, wait_for_previous_kernel


@triton.jit
def sum_split_slots_kernel(
    y_ptr, ids_ptr, map_ptr, out_ptr,
    num_tokens, K, top_k, num_experts, num_global,
    stride_ym, stride_om, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr, SPLIT: tl.constexpr,
    HAS_MAP: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    let_next_kernel_launch(PDL)
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
    for s in tl.static_range(SPLIT):  # every slot's row of a split requested at once: [BT, k, BK]
        rows = s * num_tokens * top_k + a  # [BT, k] int64
        y = tl.load(y_ptr + rows[:, :, None] * stride_ym + cols[None, None, :], mask=mask, other=0.0)
        acc += tl.sum(y.to(tl.float32), axis=1)
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

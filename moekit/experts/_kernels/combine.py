"""The sum over the k slots: out[t] = sum_j y[t*k + j] over the slots routed here.

Torch twin: ``y.view(M, k, K).sum(1)`` with unrouted slots zeroed. A slot that is not routed here
(id < 0, id >= E, map entry -1) was never written by the down GEMM, so it is masked, never read.

Shapes: y [A, K] (A = M*k), out [M, K]; BT tokens x BK columns per program.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids


@triton.jit
def sum_slots_kernel(
    y_ptr, ids_ptr, map_ptr, out_ptr,
    num_tokens, K, top_k, num_experts, num_global,
    stride_ym, stride_om, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MAP: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    t_ok = tokens < num_tokens
    c_ok = cols < K
    acc = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for j in range(0, top_k):
        a = tokens.to(tl.int64) * top_k + j  # [BT] assignment of slot j
        ids = tl.load(ids_ptr + a, mask=t_ok, other=-1).to(tl.int64)
        routed = local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP) < num_experts
        acc += tl.load(y_ptr + a[:, None] * stride_ym + cols[None, :],
                       mask=(t_ok & routed)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])

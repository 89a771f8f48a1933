"""The sum over the k slots: out[t] = sum_j y[t*k + j] over the slots routed here.

Torch twin: ``y.view(M, k, K).sum(1)`` with unrouted slots zeroed. A slot that is not routed here
(id < 0, id >= E, map entry -1) was never written by the down GEMM, so it is masked, never read.

Two ways: ``sum_slots_kernel``, a pass of its own, and ``arrive_and_sum_slots``, which the tiny-batch
down GEMM runs at its end (no launch, no second grid; the last of a token's k programs sums).

Shapes: y [A, K] (A = M*k), out [M, K]; BT tokens x BK columns per program.
"""

import triton
import triton.language as tl

from moekit.experts._kernels._common import local_expert_ids, wait_for_previous_kernel


@triton.jit
def sum_slots_kernel(
    y_ptr, ids_ptr, map_ptr, out_ptr,
    num_tokens, K, top_k, num_experts, num_global,
    stride_ym, stride_om, stride_ok,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
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
    y = tl.load(y_ptr + a[:, :, None] * stride_ym + cols[None, None, :],
                mask=routed[:, :, None] & c_ok[None, None, :], other=0.0)  # [BT, k, BK]
    acc = tl.sum(y.to(tl.float32), axis=1)  # [BT, BK]
    out_ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def zero_counters(counters_ptr, num_counters):
    """Zero the arrival counters of ``arrive_and_sum_slots`` (run by one program of the kernel before)."""
    for c0 in range(0, num_counters, 1024):
        offs = c0 + tl.arange(0, 1024)
        tl.store(counters_ptr + offs, tl.zeros([1024], dtype=tl.int32), mask=offs < num_counters)


@triton.jit
def arrive_and_sum_slots(
    y_ptr, ids_ptr, out_ptr, counters_ptr,  # y [A, K], ids [A], out [M, K], counters [M, num_tiles] int32 zeroed
    assignment, tile, num_tiles, top_k, num_experts, K, stride_ym, stride_om,
    BLOCK_COLS: tl.constexpr, TOPK_PAD: tl.constexpr,
):
    """The k-sum at the end of the tiny-batch down GEMM, whose program (assignment a, column tile c) has
    written y[a, tile c] or, for a slot not routed here, nothing. It counts itself in counters[t, c]
    (t = a // k); the last of the token's k programs to arrive sums the routed slots into out[t, tile c].
    The slots are added in slot order whatever the arrival order, so the result does not depend on it."""
    token = assignment // top_k
    tl.debug_barrier()  # every thread's y stores come before the release below
    arrived = tl.atomic_add(counters_ptr + token * num_tiles + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == top_k - 1:
        tl.debug_barrier()
        slots = tl.arange(0, TOPK_PAD)
        a = token.to(tl.int64) * top_k + slots  # [k]
        ids = tl.load(ids_ptr + a, mask=slots < top_k, other=-1)
        routed = (slots < top_k) & (ids >= 0) & (ids < num_experts)
        cols = tile * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        c_ok = cols < K
        y = tl.load(y_ptr + a[:, None] * stride_ym + cols[None, :], mask=routed[:, None] & c_ok[None, :],
                    other=0.0, cache_modifier=".cg")  # [k, BC], read past L1: other SMs wrote it
        total = tl.sum(y.to(tl.float32), axis=0)  # [BC]
        tl.store(out_ptr + token.to(tl.int64) * stride_om + cols, total.to(out_ptr.dtype.element_ty), mask=c_ok)

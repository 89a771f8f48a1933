"""The gate GEMM and the router in one launch, for decode-sized batches (M <= 8 rows,
``moekit.routing.gate.MAX_TOKENS``): x [M, K] -> router logits [M, E] -> topk_ids [M, k(+S)] int32, topk_weights [M,
k(+S)] fp32.

    [Gate -> Route: score -> (grouped) top-k -> weights (+ shared slots), one launch] -> Capacity -> Group -> Experts
      -> Combine

Torch twin: ``F.linear`` then ``moekit.routing.route`` (and ``append_shared_slots``); the two halves are
``gate_tile`` (``gate_kernel.py``) and ``route_rows`` (``route_kernel.py``), the same code the separate
launches run.

Shapes: M tokens (all of them in one row block, BLOCK_M = next_pow2(M)), K hidden, E experts. Program p
computes the logits of experts [p * BLOCK_E, (p + 1) * BLOCK_E) for every row, as the gate kernel does,
and stores them; then it counts itself done on ``count_ptr`` ([1] int32, 0 between launches). The last
program to finish sees every program's logits and routes all M rows, then sets the count back to 0 for
the next launch on the stream.
"""

import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents

from moekit.routing._kernels.gate_kernel import gate_tile
from moekit.routing._kernels.route_kernel import route_rows


@triton.jit
def gate_route_kernel(
    x_ptr, w_ptr, b_ptr, logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr, count_ptr,
    # [M, K], [E, K], [E], [M, E] contiguous, [E], [M, 1], [M, k+S] x2 contiguous, [1], [1]
    num_tokens, hidden, stride_xm, stride_we, stride_b, stride_gm, scaling,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_LINEAR_BIAS: tl.constexpr,
    PER_GROUP: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, NUM_SHARED: tl.constexpr, SLOTS_PAD: tl.constexpr,
    GROUPED: tl.constexpr, TOP2: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, CHECK_FINITE: tl.constexpr,
    PRECISE: tl.constexpr, ASSERT_FINITE: tl.constexpr, PDL: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0, SOFTCAP_INV: tl.constexpr = 0.0, BIAS_ON_LOGITS: tl.constexpr = False,
    FILL_ZERO: tl.constexpr = False, SHARED_SCALE: tl.constexpr = 1.0,  # the router options (route_kernel's)
    SQRT_SOFTPLUS: tl.constexpr = False, RENORM_LOG_EPS: tl.constexpr = None, RENORM_LOG_CLAMP: tl.constexpr = None,
):
    if PDL:  # the experts' first kernel may launch now; it waits (gdc_wait) for this grid to finish before reading
        gdc_launch_dependents()
    gate_tile(x_ptr, w_ptr, b_ptr, logits_ptr, 0, tl.program_id(0) * BLOCK_E, num_tokens, hidden, stride_xm, stride_we,
              NUM_EXPERTS, NUM_EXPERTS, BLOCK_M, BLOCK_E, BLOCK_K, HAS_LINEAR_BIAS)
    tl.debug_barrier()  # every thread's logits stored before the count releases them
    done = tl.atomic_add(count_ptr, 1, sem="acq_rel")  # programs finished before this one
    if done == tl.num_programs(0) - 1:
        tl.debug_barrier()
        route_rows(logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr, 0, num_tokens, NUM_EXPERTS, 1,
                   stride_b, stride_gm, scaling, NUM_EXPERTS, PER_GROUP, G_PAD, P_PAD, TOP_K, TOPK_GROUP, NUM_SHARED,
                   SLOTS_PAD, GROUPED, TOP2, SIGMOID, RENORMALIZE, HAS_BIAS, HAS_GATE, CHECK_FINITE, BLOCK_M,
                   PRECISE, ASSERT_FINITE, True, SOFTCAP, SOFTCAP_INV, BIAS_ON_LOGITS, FILL_ZERO, SHARED_SCALE,
                   SQRT_SOFTPLUS, RENORM_LOG_EPS, RENORM_LOG_CLAMP)
        tl.store(count_ptr, 0)

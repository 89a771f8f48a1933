"""The gate GEMM on tensor cores for 9..256 rows, and the router in the same launch: x [M, K] -> router logits
[M, E] (fp32 accumulation, stored in the logits' dtype) -> topk_ids [M, k(+S)] int32, topk_weights [M, k(+S)] fp32.

    [Gate -> Route: score -> (grouped) top-k -> weights (+ shared slots), one launch] -> Capacity -> Group -> Experts
    -> Combine

Torch twin: ``F.linear`` then ``moekit.routing.route`` (and ``append_shared_slots``); the route half is
``route_rows`` (``route_kernel.py``), the code the router's own launch runs.

Shapes: M tokens, K hidden, E experts; grid (row blocks, expert blocks, K splits). Program (i, j, s) multiplies
x[i*BM : (i+1)*BM, K slice s] by W[j*BE : (j+1)*BE, K slice s]^T with ``tl.dot`` into an fp32 tile [BM, BE]. With
SPLIT_K = 1 it stores the logits tile; else it stores its partial tile in ``part_ptr`` [SPLIT_K, M, E] fp32 and
counts itself done on the tile's counter, and the last of the tile's SPLIT_K programs sums the partials in split
order (the same bits whichever program is last) and stores the logits. With ROUTE, the program that stored a
tile counts it on the row block's counter, and the one that stores the row block's last tile routes its BM rows,
ROUTE_M rows at a time. Counters (``count_ptr``: [row blocks, expert blocks] tile counters, then [row blocks]
row-block counters, int32, 0 between launches) are set back to 0 by the program that read them last.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from moekit.routing._kernels.route_kernel import route_rows


@triton.jit
def gate_mma_kernel(
    x_ptr, w_ptr, b_ptr, logits_ptr, part_ptr, count_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr,
    # [M, K], [E, K], [E], [M, E] contiguous, [SPLIT_K, M, E] fp32, [RB * (EB + 1)], [E], [M, 1], [M, k+S] x2, [1]
    num_tokens, hidden, stride_xm, stride_we, stride_b, stride_gm, scaling, k_per_split,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, HAS_LINEAR_BIAS: tl.constexpr,
    ROUTE: tl.constexpr,
    # the router's (``fused._Plan.constexprs``); a gate-only launch (ROUTE False) leaves them at these values
    ROUTE_M: tl.constexpr = 1, PER_GROUP: tl.constexpr = 1, G_PAD: tl.constexpr = 1, P_PAD: tl.constexpr = 1,
    TOP_K: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1, NUM_SHARED: tl.constexpr = 0, SLOTS_PAD: tl.constexpr = 1,
    GROUPED: tl.constexpr = False, TOP2: tl.constexpr = False, SIGMOID: tl.constexpr = False,
    RENORMALIZE: tl.constexpr = False, HAS_BIAS: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
    CHECK_FINITE: tl.constexpr = False, PRECISE: tl.constexpr = False, ASSERT_FINITE: tl.constexpr = False,
    PDL: tl.constexpr = False, SOFTCAP: tl.constexpr = 0.0, SOFTCAP_INV: tl.constexpr = 0.0,
    BIAS_ON_LOGITS: tl.constexpr = False, FILL_ZERO: tl.constexpr = False, SHARED_SCALE: tl.constexpr = 1.0,
    SQRT_SOFTPLUS: tl.constexpr = False, RENORM_LOG_EPS: tl.constexpr = None, RENORM_LOG_CLAMP: tl.constexpr = None,
):
    if PDL:  # the experts' first kernel may launch now; it waits (gdc_wait) for this grid to finish before reading
        gdc_launch_dependents()
    pid_m, pid_e, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e_blocks = tl.num_programs(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE] experts
    row_ok, col_ok = rows < num_tokens, cols < NUM_EXPERTS
    acc = _dot_tile(x_ptr, w_ptr, rows, cols, pid_k * k_per_split, k_per_split, num_tokens, hidden, stride_xm,
                    stride_we, NUM_EXPERTS, BLOCK_M, BLOCK_E, BLOCK_K, IEEE, UPCAST)  # [BM, BE] fp32
    tile = rows.to(tl.int64)[:, None] * NUM_EXPERTS + cols[None, :]  # [BM, BE] offsets into [M, E]
    tile_ok = row_ok[:, None] & col_ok[None, :]
    stored = True  # whether this program stores the logits tile
    if SPLIT_K > 1:
        plane = num_tokens.to(tl.int64) * NUM_EXPERTS
        tl.store(part_ptr + pid_k * plane + tile, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial stored before the count releases it
        counter = count_ptr + pid_m * e_blocks + pid_e
        done = tl.atomic_add(counter, 1, sem="acq_rel")  # programs of this tile finished before this one
        stored = done == SPLIT_K - 1
        if stored:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
            for s in range(SPLIT_K):  # split order, whoever is last: the same sum every launch
                acc += tl.load(part_ptr + s * plane + tile, mask=tile_ok, other=0.0, volatile=True)
            tl.store(counter, 0)
    if stored:
        if HAS_LINEAR_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(logits_ptr + tile, acc.to(logits_ptr.dtype.element_ty), mask=tile_ok)
        if ROUTE:
            tl.debug_barrier()  # every thread's logits stored before the count releases them
            row_counter = count_ptr + tl.num_programs(0) * e_blocks + pid_m
            tiles_done = tl.atomic_add(row_counter, 1, sem="acq_rel")
            if tiles_done == e_blocks - 1:
                tl.debug_barrier()
                for r in range(pid_m * BLOCK_M, tl.minimum(pid_m * BLOCK_M + BLOCK_M, num_tokens), ROUTE_M):
                    route_rows(logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr, r, num_tokens,
                               NUM_EXPERTS, 1, stride_b, stride_gm, scaling, NUM_EXPERTS, PER_GROUP, G_PAD, P_PAD,
                               TOP_K, TOPK_GROUP, NUM_SHARED, SLOTS_PAD, GROUPED, TOP2, SIGMOID, RENORMALIZE, HAS_BIAS,
                               HAS_GATE, CHECK_FINITE, ROUTE_M, PRECISE, ASSERT_FINITE, True, SOFTCAP, SOFTCAP_INV,
                               BIAS_ON_LOGITS, FILL_ZERO, SHARED_SCALE, SQRT_SOFTPLUS, RENORM_LOG_EPS,
                               RENORM_LOG_CLAMP)
                tl.store(row_counter, 0)


@triton.jit
def _dot_tile(x_ptr, w_ptr, rows, cols, k0, k_per_split, num_tokens, hidden, stride_xm, stride_we,
              NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
              IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """x[rows, k0 : k0 + k_per_split] @ W[cols, same]^T -> [BM, BE] fp32 (rows and experts past the ends: clamped
    loads, never stored)."""
    x_row = x_ptr + tl.minimum(rows, num_tokens - 1).to(tl.int64)[:, None] * stride_xm  # [BM, 1]; rows past M unstored
    w_row = w_ptr + tl.minimum(cols, NUM_EXPERTS - 1).to(tl.int64)[:, None] * stride_we  # [BE, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_E], tl.float32)
    for start in range(k0, tl.minimum(k0 + k_per_split, hidden), BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        k_ok = ks < hidden
        xt = tl.load(x_row + ks, mask=k_ok, other=0.0)  # [BM, BK]
        wt = tl.load(w_row + ks, mask=k_ok, other=0.0)  # [BE, BK]
        if UPCAST:  # bf16 / fp16 x or W into float32 logits (``gate.reads_as``): the float32 inputs' ieee dot on
            # their exact upcasts; and the interpreter, whose bf16 tl.dot returns garbage (as experts/_kernels/gemm.py)
            acc = tl.dot(xt.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
        elif IEEE:  # fp32 inputs: full-precision products, as torch's fp32 matmul (no TF32)
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    return acc

"""The sum over the k slots (and the split-K partials): out[t] = sum_s sum_j y[s*A + t*k + j] over the
slots routed here. SPLIT = 1 for every down GEMM but the weight-only one's split-K schedule
(``gemm_wo.down_wo_kernel``, SPLIT > 1), whose partials of split s are rows s*A...

Torch twin: ``y.view(SPLIT, M, k, K).sum((0, 2))`` with unrouted slots zeroed. A slot that is not routed
here (id < 0, id >= E, map entry -1) was never written by the down GEMM, so it is masked, never read.

ORDERED (the plain bf16/fp16/fp32 path): the slots are added one at a time in slot order, in float32 from
0 (``sum_token_slots``), the order the down GEMM's folded k-sum (``ksum_epilogue`` below, which
``gemm.down_kernel`` calls under KSUM) uses too, so the two
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
def routed_slot_count(tokens, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD: tl.constexpr,
                      HAS_MAP: tl.constexpr):
    """[R] int32: how many of each token's slots are routed here. tokens: int64 [R], in range."""
    count = tl.zeros([tokens.shape[0]], dtype=tl.int32)
    for j in tl.static_range(TOPK_PAD):
        count += slot_routed(tokens, j, ids_ptr, map_ptr, top_k, num_experts, num_global, HAS_MAP).to(tl.int32)
    return count


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


# ---------------------------------------------------------------------------------------------------
# The k-sum folded into the down GEMM (``gemm.down_kernel``'s KSUM; ``LaunchOptions.sum_fold_max``). The
# GEMM's schedule is unchanged: each program stores its y tile as without KSUM, then counts its rows' arrivals.
# ---------------------------------------------------------------------------------------------------


@triton.jit
def ksum_epilogue(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, rows, row_ok, arrivals, pid_n, offs_out, out_ok, K,
                  top_k, num_experts, num_global, stride_ym, BLOCK_N: tl.constexpr, TOPK_PAD: tl.constexpr,
                  HAS_MAP: tl.constexpr, SUM_ROWS: tl.constexpr):
    """After a down program stored its [BM, BN] y tile: for each of its rows, one arrival on the counter of
    (the row's token, this K tile), counters [M, K tiles] int32. The program whose arrival is the token's
    last (its routed slots, all written: the count before it is routed - 1) sums that token's slot rows of
    this tile in slot order (``combine.sum_token_slots``, the separate k-sum's order: bit for bit the same
    out), writes out[token, tile] and sets the counter back to 0, so the kept counters are all 0 again
    when the kernel ends (the next call, a graph replay). ``arrivals`` [BM]: ``routed_slot_count`` of each
    row's token (the down kernel loads them before its main loop). Tokens with no routed slot get no arrival:
    ``zero_unrouted_tokens`` writes them. Orders: every thread's y stores, a CTA barrier, then the
    atomics (acq_rel, GPU scope: the release publishes this tile, the acquire of the last sees every
    other program's); a barrier again before the last's loads."""
    num_tiles = tl.cdiv(K, BLOCK_N)
    token = rows // top_k  # [BM] int64 (rows in range)
    tl.debug_barrier()
    before = tl.atomic_add(counters_ptr + token * num_tiles + pid_n, 1, mask=row_ok, sem="acq_rel", scope="gpu")
    last = row_ok & (before == arrivals - 1)  # [BM]
    tl.debug_barrier()
    num_last = tl.sum(last.to(tl.int32), axis=0)
    rank = tl.cumsum(last.to(tl.int32), axis=0) - 1  # [BM] each last row's place among them
    picks = tl.arange(0, SUM_ROWS)
    for first in range(0, num_last, SUM_ROWS):  # SUM_ROWS last rows at a time, gathered by a [S, BM] compare
        pick = last[None, :] & (rank[None, :] == (first + picks)[:, None])
        tokens = tl.sum(tl.where(pick, token[None, :], 0), axis=1)  # [S] int64
        t_ok = first + picks < num_last
        acc = sum_token_slots(y_ptr, tokens, t_ok, offs_out, out_ok, ids_ptr, map_ptr, top_k, num_experts, num_global,
                              stride_ym, TOPK_PAD, HAS_MAP)  # [S, BN] fp32
        tl.store(out_ptr + tokens[:, None] * K + offs_out[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & out_ok[None, :])
        tl.store(counters_ptr + tokens * num_tiles + pid_n, 0, mask=t_ok)


@triton.jit
def zero_unrouted_tokens(out_ptr, ids_ptr, map_ptr, first_pid, K, num_assignments, top_k, num_experts, num_global,
                         BLOCK_N: tl.constexpr, TOPK_PAD: tl.constexpr, HAS_MAP: tl.constexpr, ZERO_T: tl.constexpr):
    """out[t] = 0 for the ZERO_T tokens of this program (after the GEMM's programs) that no slot routes here:
    no down program arrives for them (``ksum_epilogue``); the separate k-sum writes them 0 too."""
    tokens = (tl.program_id(0) - first_pid) * ZERO_T + tl.arange(0, ZERO_T)
    t_ok = tokens < num_assignments // top_k
    safe = tl.where(t_ok, tokens, 0).to(tl.int64)
    none = t_ok & (routed_slot_count(safe, ids_ptr, map_ptr, top_k, num_experts, num_global, TOPK_PAD, HAS_MAP) == 0)
    if tl.sum(none.to(tl.int32), axis=0) > 0:
        cols = tl.arange(0, BLOCK_N)
        zeros = tl.zeros([ZERO_T, BLOCK_N], dtype=out_ptr.dtype.element_ty)
        for c0 in range(0, K, BLOCK_N):
            tl.store(out_ptr + safe[:, None] * K + (c0 + cols)[None, :], zeros,
                     mask=none[:, None] & (c0 + cols < K)[None, :])


# ---------------------------------------------------------------------------------------------------
# The k-sum after the down GEMM, in its grid (``gemm.down_kernel``'s SUM_AFTER; ``LaunchOptions.sum_tail_max``).
# The GEMM's programs and schedule are unchanged; each signals once when its y tile is stored, and programs
# appended after the GEMM's wait for every signal, then each sums a [SUM_T, SUM_K] tile of out exactly as
# ``sum_slots_kernel`` with ORDERED (bit for bit the separate launch's out).
# ---------------------------------------------------------------------------------------------------


@triton.jit
def gemm_done(counters_ptr, SUM_AFTER: tl.constexpr):
    """A GEMM program of a SUM_AFTER down kernel is done with y (nothing without SUM_AFTER): every thread's stores,
    a CTA barrier, then one arrival on counters[0] (release, GPU scope: publishes this program's tile to the sum
    programs)."""
    if SUM_AFTER:
        tl.debug_barrier()
        tl.atomic_add(counters_ptr, 1, sem="release", scope="gpu")


@triton.jit
def programs_after_gemm(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, num_gemm, K, num_assignments, top_k,
                        num_experts, num_global, stride_ym, BLOCK_N: tl.constexpr, TOPK_PAD: tl.constexpr,
                        HAS_MAP: tl.constexpr, ZERO_T: tl.constexpr, SUM_AFTER: tl.constexpr, SUM_T: tl.constexpr,
                        SUM_K: tl.constexpr, PDL: tl.constexpr):
    """A program after the ``num_gemm`` GEMM programs of a down kernel with the k-sum in it: SUM_AFTER's sum
    (``sum_after_gemm``), else KSUM's zero-fill (``zero_unrouted_tokens``)."""
    if SUM_AFTER:
        let_next_kernel_launch(PDL)
        sum_after_gemm(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, num_gemm, K, num_assignments, top_k,
                       num_experts, num_global, stride_ym, SUM_T, SUM_K, TOPK_PAD, HAS_MAP)
    else:
        zero_unrouted_tokens(out_ptr, ids_ptr, map_ptr, num_gemm, K, num_assignments, top_k, num_experts, num_global,
                             BLOCK_N, TOPK_PAD, HAS_MAP, ZERO_T)


@triton.jit
def sum_after_gemm(y_ptr, out_ptr, counters_ptr, ids_ptr, map_ptr, num_gemm, K, num_assignments, top_k, num_experts,
                   num_global, stride_ym, SUM_T: tl.constexpr, SUM_K: tl.constexpr, TOPK_PAD: tl.constexpr,
                   HAS_MAP: tl.constexpr):
    """A sum program (program id >= ``num_gemm``, 1-D grid): waits until all ``num_gemm`` GEMM programs have
    arrived on counters[0], then out[tokens, cols] of its tile = the slot-order sum (``sum_token_slots``; tokens no
    slot routes here get 0). The last sum program to leave sets counters[0] and [1] back to 0 (every sum program
    has passed its wait by then), so the kept counters are 0 when the kernel ends.
    Forward progress: a GPU starts a grid's programs in program-id order, so when a sum program runs, every GEMM
    program has started (it runs or has finished) and the wait ends; the same order the single-pass scans'
    decoupled look-back relies on. Under the interpreter the programs run one after another in that order."""
    pid = tl.program_id(0) - num_gemm
    col_tiles = tl.cdiv(K, SUM_K)
    tokens = (pid // col_tiles) * SUM_T + tl.arange(0, SUM_T)
    cols = (pid % col_tiles) * SUM_K + tl.arange(0, SUM_K)
    t_ok = tokens < num_assignments // top_k
    c_ok = cols < K
    while tl.load(counters_ptr, volatile=True) < num_gemm:  # L2 reads, no atomics contending with the arrivals
        pass
    tl.atomic_add(counters_ptr, 0, sem="acquire", scope="gpu")  # what the arrivals released is visible
    tl.debug_barrier()
    acc = sum_token_slots(y_ptr, tl.where(t_ok, tokens, 0).to(tl.int64), t_ok, cols, c_ok, ids_ptr, map_ptr, top_k,
                          num_experts, num_global, stride_ym, TOPK_PAD, HAS_MAP)
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * K + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])
    left = tl.atomic_add(counters_ptr + 1, 1, sem="relaxed", scope="gpu")
    if left == tl.num_programs(0) - num_gemm - 1:
        tl.store(counters_ptr, 0)
        tl.store(counters_ptr + 1, 0)

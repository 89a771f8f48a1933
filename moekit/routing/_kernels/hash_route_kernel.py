"""Hash routing (DeepSeek-V4's first MoE layers) in one kernel: router logits [M, E], token ids [M], the table [V, k]
-> ids [M, k(+S)] int32, weights [M, k(+S)] fp32.

    [Route: tid2eid[token_ids] -> scores at those experts -> / (their sum + 1e-20) x scaling (+ shared slots)]
      -> Group -> Experts -> Combine

Torch twin: ``moekit.routing.hash_route`` (and ``append_shared_slots``). Scores as ``route_kernel`` computes them (its
``_score``: softmax over the row, sigmoid or sqrt(softplus), libdevice on the GPU; renormalised, sqrt(softplus) is
e^(x/2) where softplus is subnormal or 0, as the twin's). The two checks ``hash_route`` makes
in torch (every logit finite, every token id in [0, V)) are, with ASSERT_IN_KERNEL (a compiled kernel, ``debug=True``),
this kernel's own ``tl.device_assert``s (as ``route_kernel``'s ASSERT_FINITE: no launch after it, no host sync), else
two flags it clears, ``ok_ptr[0]`` / ``ok_ptr[1]``, which the launcher asserts (the interpreter's way: a ``ValueError``
on the CPU). A token id outside the table reads row 0 (never out of bounds) and is flagged or asserted.

Shapes: M tokens, E experts (E_PAD = next_pow2(E)), k = TOP_K, S = NUM_SHARED, BM = BLOCK_M rows per program.
"""

import triton
import triton.language as tl

from moekit.routing._kernels.route_kernel import _exp, _score, _soft_capped


@triton.jit
def hash_route_kernel(
    logits_ptr, tid_ptr, table_ptr, ids_ptr, weights_ptr, ok_ptr,  # [M, E], [M], [V, k], [M, k+S] x2, [2] int32 flags
    num_tokens, table_rows, stride_lm, stride_le, stride_tv, scaling,
    NUM_EXPERTS: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr,
    SLOTS_PAD: tl.constexpr, SIGMOID: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr, RENORMALIZE: tl.constexpr,
    SHARED_SCALE: tl.constexpr, SOFTCAP: tl.constexpr, SOFTCAP_INV: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISE: tl.constexpr, ASSERT_IN_KERNEL: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < num_tokens
    e = tl.arange(0, E_PAD)[None, :]
    valid = row_ok[:, None] & (e < NUM_EXPERTS)  # [BM, E_PAD]
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_lm  # [BM]
    x = tl.load(row_ptr[:, None] + e * stride_le, mask=valid, other=0.0).to(tl.float32)  # [BM, E_PAD]
    finite = tl.abs(x) < float("inf")
    if ASSERT_IN_KERNEL:
        tl.device_assert(finite | ~valid, "router_logits contains NaN or infinite values")
    else:
        bad = tl.max(tl.max((valid & ~finite).to(tl.int32), axis=1), axis=0)
        tl.store(ok_ptr, bad * 0, mask=bad > 0)  # a NaN or infinite logit: every writer writes 0 (a benign race)
    x = tl.where(valid, _soft_capped(x, SOFTCAP, SOFTCAP_INV, PRECISE), float("-inf"))
    row_max = tl.max(x, axis=1)  # [BM] (softmax only: the others never read it)
    row_sum = tl.sum(tl.where(valid, _exp(x - row_max[:, None], PRECISE), 0.0), axis=1)  # [BM]
    tid = tl.load(tid_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [BM]
    inside = (tid >= 0) & (tid < table_rows)
    if ASSERT_IN_KERNEL:
        tl.device_assert(inside | ~row_ok, "token_ids outside [0, hash_table_size)")
    else:
        bad_id = tl.max((row_ok & ~inside).to(tl.int32), axis=0)
        tl.store(ok_ptr + 1, bad_id * 0, mask=bad_id > 0)
    slot = tl.arange(0, SLOTS_PAD)[None, :]
    routed = row_ok[:, None] & (slot < TOP_K)  # [BM, SLOTS_PAD]
    ids = tl.load(table_ptr + tl.where(inside, tid, 0)[:, None] * stride_tv + slot, mask=routed, other=0)
    chosen = tl.load(row_ptr[:, None] + ids * stride_le, mask=routed, other=0.0).to(tl.float32)  # [BM, SLOTS_PAD]
    chosen = _soft_capped(chosen, SOFTCAP, SOFTCAP_INV, PRECISE)
    w = tl.where(routed, _score(chosen, row_max[:, None], row_sum[:, None], SIGMOID, PRECISE, SQRT_SOFTPLUS,
                                RENORMALIZE), 0.0)  # renormalised: the formula's sqrt(softplus) at subnormal scores
    if RENORMALIZE:  # hash_route's w / (sum + 1e-20), the division correctly rounded as torch's
        numerator, denominator = tl.broadcast(w, tl.sum(w, axis=1)[:, None] + 1e-20)
        w = tl.math.div_rn(numerator, denominator)
    w = w * scaling
    if NUM_SHARED > 0:  # shared slots last: ids E..E+S-1, weight SHARED_SCALE (append_shared_slots, ungated)
        ids = tl.where(slot < TOP_K, ids, NUM_EXPERTS + slot - TOP_K)
        w = tl.where(slot < TOP_K, w, SHARED_SCALE)
    out = rows.to(tl.int64)[:, None] * (TOP_K + NUM_SHARED) + slot
    out_ok = row_ok[:, None] & (slot < TOP_K + NUM_SHARED)
    tl.store(ids_ptr + out, ids.to(tl.int32), mask=out_ok)
    tl.store(weights_ptr + out, w, mask=out_ok)

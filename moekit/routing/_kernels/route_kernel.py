"""The router after the gate matmul, in one kernel: router logits [M, E] -> topk_ids [M, k(+S)] int32,
topk_weights [M, k(+S)] fp32.

    [Route: score -> (grouped) top-k -> weights (+ shared slots)] -> Capacity (opt-in) -> Group -> Experts -> Combine

Torch twin: ``moekit.routing.route`` (and ``append_shared_slots`` for the S shared slots).

Shapes: M tokens, E experts = G groups x P experts per group, k = TOP_K, S = NUM_SHARED shared slots,
BM = BLOCK_M rows per program, C = G_PAD * P_PAD tile columns. Column c of a row's tile holds expert
(c // P_PAD) * P + c % P_PAD, so a group is P_PAD adjacent columns and the [BM, C] tile reshapes into
[BM, G_PAD, P_PAD] for the group scores without any gather (ungrouped: G_PAD = 1, P_PAD = next_pow2(E)).

Selection is k rounds of ``tl.argmax(..., tie_break_left=True)`` on an int32 key whose order is the
float order of the biased score (``_order_key``): the lowest column wins among equal keys, and columns
ascend with expert ids (and groups with group ids), which is route's rule "equal scores: lower id wins".
Two reserved keys sit below every float: a non-finite expert (``_MASKED``: chosen only after every
finite expert of the allowed groups) and a column that can never be chosen (``_EXCLUDED``: padding, an
expert of a group that was not kept, an expert already taken).

Scores are computed as torch computes them on the GPU (``exp`` is libdevice's expf, divisions are
correctly rounded ``div_rn``; Triton's default ``exp`` and ``/`` are approximations), so that the ids
match route bit for bit where no two candidates tie. Triton's interpreter has no libdevice, so there
(``PRECISE=False``) ``exp`` and ``log1p`` are numpy's, as close to torch's CPU kernels as the tests need.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_EXCLUDED: tl.constexpr = -2147483648  # key of a column that is never chosen
_MASKED: tl.constexpr = -2147483647  # key of a non-finite expert: above _EXCLUDED, below every float


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _log1p(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log1p(x)
    return tl.log(1.0 + x)


@triton.jit
def _order_key(x):
    """fp32 -> int32 of the same order: key(a) < key(b) iff a < b, and -inf maps above _MASKED. -0.0 is
    folded onto +0.0 first: they compare equal as floats, so they must tie as keys."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _score(x, row_max, row_sum, SIGMOID: tl.constexpr, PRECISE: tl.constexpr):
    """torch.sigmoid(x), or torch.softmax's exp(x - max) / sum with the row's max and sum [BM, 1]."""
    if SIGMOID:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, PRECISE))
    numerator, denominator = tl.broadcast(_exp(x - row_max, PRECISE), row_sum)  # div_rn does not broadcast
    return tl.math.div_rn(numerator, denominator)


@triton.jit
def _allowed_groups(choice, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
                    NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2: tl.constexpr):
    """choice [BM, C] (-inf where masked or padding) -> [BM, C] int32, 1 on the columns of the
    TOPK_GROUP best groups. A group scores its best finite expert, or with TOP2 its best two summed
    (its best alone when it has one); a group without a finite expert scores -inf."""
    per_group = tl.reshape(choice, (BLOCK_M, G_PAD, P_PAD))  # [BM, G, P]
    best = tl.max(per_group, axis=2)  # [BM, G]
    if TOP2:
        p = tl.arange(0, P_PAD)
        first = tl.argmax(per_group, axis=2, tie_break_left=True)  # [BM, G] one column holding best
        second = tl.max(tl.where(p[None, None, :] == first[:, :, None], float("-inf"), per_group), axis=2)
        best = tl.where(second == float("-inf"), best, best + second)
    g = tl.arange(0, G_PAD)
    key = tl.where(g[None, :] < NUM_GROUPS, _order_key(best), _EXCLUDED)  # [BM, G]
    group_of_col = tl.arange(0, G_PAD * P_PAD) // P_PAD  # [C]
    allowed = tl.zeros([BLOCK_M, G_PAD * P_PAD], tl.int32)
    for _ in tl.static_range(TOPK_GROUP):
        win = tl.argmax(key, axis=1, tie_break_left=True)  # [BM] best remaining group, lower id on ties
        allowed = allowed | (group_of_col[None, :] == win[:, None]).to(tl.int32)
        key = tl.where(g[None, :] == win[:, None], _EXCLUDED, key)
    return allowed


@triton.jit
def _select(key, BLOCK_M: tl.constexpr, COLS: tl.constexpr, SLOTS_PAD: tl.constexpr, TOP_K: tl.constexpr,
            P_PAD: tl.constexpr, PER_GROUP: tl.constexpr):
    """key [BM, C] -> ids [BM, SLOTS_PAD] int32: the experts of the TOP_K largest keys, best first."""
    cols = tl.arange(0, COLS)
    slot = tl.arange(0, SLOTS_PAD)
    ids = tl.zeros([BLOCK_M, SLOTS_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        win = tl.argmax(key, axis=1, tie_break_left=True)  # [BM] best remaining column, lower on ties
        expert = win // P_PAD * PER_GROUP + win % P_PAD  # [BM]
        ids = tl.where(slot[None, :] == j, expert[:, None], ids)
        key = tl.where(cols[None, :] == win[:, None], _EXCLUDED, key)
    return ids


@triton.jit
def _weights(chosen, taken, row_max, row_sum, scaling, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
             PRECISE: tl.constexpr):
    """chosen [BM, SLOTS_PAD] logits of the chosen experts; taken: the slot holds a finite chosen expert.
    Renormalisation is a softmax over the taken slots' log-scores (route's formula, no 0/0)."""
    if RENORMALIZE:
        log_score = chosen
        if SIGMOID:  # torch's logsigmoid: min(x, 0) - log1p(exp(-|x|))
            log_score = tl.minimum(chosen, 0.0) - _log1p(_exp(-tl.abs(chosen), PRECISE), PRECISE)
        log_score = tl.where(taken, log_score, float("-inf"))
        top = tl.max(log_score, axis=1)  # [BM]; -inf on a row with nothing taken (then all weights 0)
        e = _exp(log_score - top[:, None], PRECISE)
        numerator, denominator = tl.broadcast(e, tl.sum(e, axis=1)[:, None])
        w = tl.math.div_rn(numerator, denominator)
    else:
        w = _score(chosen, row_max, row_sum, SIGMOID, PRECISE)
    return tl.where(taken, w * scaling, 0.0)


@triton.jit
def route_kernel(
    logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr,  # [M, E], [E], [M, 1], [M, k+S] x2, [1]
    num_tokens, stride_lm, stride_le, stride_b, stride_gm, scaling,
    NUM_EXPERTS: tl.constexpr, PER_GROUP: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, NUM_SHARED: tl.constexpr, SLOTS_PAD: tl.constexpr,
    GROUPED: tl.constexpr, TOP2: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, CHECK_FINITE: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISE: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the logits come from the kernel before (the gate matmul): wait for it to finish
        gdc_wait()
        gdc_launch_dependents()
    COLS: tl.constexpr = G_PAD * P_PAD
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < num_tokens
    cols = tl.arange(0, COLS)
    expert = cols // P_PAD * PER_GROUP + cols % P_PAD  # [C] expert id of each column
    col_ok = (cols // P_PAD < NUM_EXPERTS // PER_GROUP) & (cols % P_PAD < PER_GROUP)  # [C] not padding
    valid = row_ok[:, None] & col_ok[None, :]  # [BM, C]
    row_ptr = logits_ptr + rows.to(tl.int64)[:, None] * stride_lm  # [BM, 1]
    x = tl.load(row_ptr + expert[None, :] * stride_le, mask=valid, other=0.0).to(tl.float32)  # [BM, C]
    finite = valid & (tl.abs(x) < float("inf"))
    if CHECK_FINITE:  # nonfinite="raise": clear the flag; every writer writes 0, so the race is benign
        bad = tl.max(tl.max((valid & ~finite).to(tl.int32), axis=1), axis=0)
        tl.store(ok_ptr, bad * 0, mask=bad > 0)

    # Scores over the finite experts only: a masked expert takes no probability mass from the others.
    x_fin = tl.where(finite, x, float("-inf"))
    row_max = tl.max(x_fin, axis=1)[:, None]  # [BM, 1]
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(tl.where(finite, _exp(x_fin - row_max, PRECISE), 0.0), axis=1)[:, None]  # [BM, 1]
    choice = _score(x_fin, row_max, row_sum, SIGMOID, PRECISE)  # [BM, C]
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(finite, choice, float("-inf"))
    allowed = valid
    if GROUPED:
        allowed = valid & (_allowed_groups(choice, BLOCK_M, G_PAD, P_PAD, NUM_EXPERTS // PER_GROUP,
                                           TOPK_GROUP, TOP2) != 0)
    key = tl.where(finite & allowed, _order_key(choice), tl.where(allowed, _MASKED, _EXCLUDED))
    ids = _select(key, BLOCK_M, COLS, SLOTS_PAD, TOP_K, P_PAD, PER_GROUP)  # [BM, SLOTS_PAD]

    slot = tl.arange(0, SLOTS_PAD)
    is_routed = slot[None, :] < TOP_K
    chosen = tl.load(row_ptr + ids * stride_le, mask=row_ok[:, None] & is_routed, other=0.0).to(tl.float32)
    taken = is_routed & (tl.abs(chosen) < float("inf"))
    w = _weights(chosen, taken, row_max, row_sum, scaling, SIGMOID, RENORMALIZE, PRECISE)  # [BM, SLOTS_PAD]
    if NUM_SHARED > 0:  # shared slots last: ids E..E+S-1, weight 1 or sigmoid(gate logit)
        ids = tl.where(is_routed, ids, NUM_EXPERTS + slot[None, :] - TOP_K)
        shared_w = tl.full([BLOCK_M, SLOTS_PAD], 1.0, tl.float32)
        if HAS_GATE:  # Qwen2-MoE's gated shared expert: sigmoid(x @ g), as append_shared_slots
            gate = tl.load(gate_ptr + rows.to(tl.int64) * stride_gm, mask=row_ok, other=0.0).to(tl.float32)
            shared_w = shared_w * _score(gate, row_max, row_sum, True, PRECISE)[:, None]
        w = tl.where(is_routed, w, shared_w)
    out = rows.to(tl.int64)[:, None] * (TOP_K + NUM_SHARED) + slot[None, :]
    out_ok = row_ok[:, None] & (slot[None, :] < TOP_K + NUM_SHARED)
    tl.store(ids_ptr + out, ids, mask=out_ok)
    tl.store(weights_ptr + out, w, mask=out_ok)

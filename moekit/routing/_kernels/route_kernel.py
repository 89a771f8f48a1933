"""The router after the gate matmul, in one kernel: router logits [M, E] -> topk_ids [M, k(+S)] int32,
topk_weights [M, k(+S)] fp32.

    [Route: score -> (grouped) top-k -> weights (+ shared slots)] -> Capacity (opt-in) -> Group -> Experts -> Combine

Torch twin: ``moekit.routing.route`` (and ``append_shared_slots`` for the S shared slots).

Shapes: M tokens, E experts = G groups x P experts per group, k = TOP_K, S = NUM_SHARED shared slots,
BM = BLOCK_M rows per program. Each program holds its rows as one [BM, G_PAD, P_PAD] tile (ungrouped:
G_PAD = 1, P_PAD = next_pow2(E)); tile column c = g * P_PAD + p holds expert g * P + p. The tile stays
3-D throughout: the group scores are reductions over axis 2 whose results broadcast straight back. (A
[BM, C] tile reshaped for the groups made Triton 3.9 keep all 256 DeepSeek-V3 columns in every thread:
12k instructions per row and a 30 s compile, against 1.2k and 2 s this way, sm_90 PTX.)

Selection is k rounds of a max over (key, then the lower column), packed in one int64 (``_packed``).
The key is an int32 in the float order of the biased score (``_order_key``); columns ascend with
expert ids and groups with group ids, so this is route's rule: equal scores, lower id wins. Two reserved keys sit below
every float: a non-finite expert (``_MASKED``: chosen only when the allowed groups hold fewer than k finite experts) and
a column that is never chosen (``_EXCLUDED``: padding, an expert of a group not kept, an expert already taken).

Scores are computed as torch computes them on the GPU (``exp``, ``log1p`` and ``log`` are libdevice's, divisions are
correctly rounded ``div_rn`` and DeepSeek-V4's sqrt(softplus) takes ``sqrt_rn``; Triton's default ``exp``, ``log``,
``sqrt`` and ``/`` are approximations), so the ids match route bit for bit where no two candidates tie. Triton's
interpreter has no libdevice, so there (``PRECISE=False``) ``exp`` and ``log`` are numpy's and ``log1p`` is built from
them (``_log1p``), as close to torch's CPU kernels as the tests need.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_EXCLUDED = tl.constexpr(-2147483648)  # key of a column that is never chosen
_MASKED = tl.constexpr(-2147483647)  # key of a non-finite expert: above _EXCLUDED, below every float
_NEVER = tl.constexpr(-9223372036854775808)  # packed value of a taken column, below every packed key
_TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal (torch.finfo(torch.float32).tiny)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log1p(x, PRECISE: tl.constexpr):
    """log1p; interpreted, Goldberg's log(u) * x / (u - 1) at u = 1 + x, within a few ulps where log(1 + x) loses x
    (log(1 + 1e-10) is 0 in fp32: every sqrt(softplus) score below a logit of -17 would tie at 0)."""
    if PRECISE:
        y = libdevice.log1p(x)
    else:
        u = 1.0 + x
        y = tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))
    return y


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    """torch.log on the GPU: libdevice's logf (Triton's default ``log`` is an lg2 approximation); else numpy's."""
    return libdevice.log(x) if PRECISE else tl.log(x)


@triton.jit
def _softplus(x, PRECISE: tl.constexpr):
    """torch's F.softplus (beta 1, threshold 20): x itself above 20, else log1p(exp(x)) (0 where exp underflows,
    below -103.9: as torch). exp reads min(x, 20): no overflow on the branch tl.where discards."""
    return tl.where(x > 20.0, x, _log1p(_exp(tl.minimum(x, 20.0), PRECISE), PRECISE))


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    """torch.sigmoid on the GPU: 1 / (1 + exp(-x)), the division correctly rounded."""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, PRECISE))


@triton.jit
def _score(x, row_max, row_sum, SIGMOID: tl.constexpr, PRECISE: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr = False,
           EXACT_TINY: tl.constexpr = False):
    """torch.sigmoid(x), DeepSeek-V4's sqrt(softplus(x)) (torch's sqrt is correctly rounded: sqrt_rn), or
    torch.softmax's exp(x - max) / sum with the row's max and sum. EXACT_TINY (scores renormalised next: the hash
    router): sqrt(softplus) is e^(x/2) where softplus is subnormal or 0, as ``route._sqrt_softplus``'s exact_tiny."""
    if SQRT_SOFTPLUS:
        softplus = _softplus(x, PRECISE)
        score = tl.sqrt_rn(softplus)
        if EXACT_TINY:
            score = tl.where(softplus < _TINY, _exp(0.5 * x, PRECISE), score)
    elif SIGMOID:
        score = _sigmoid(x, PRECISE)
    else:
        numerator, denominator = tl.broadcast(_exp(x - row_max, PRECISE), row_sum)  # div_rn does not broadcast
        score = tl.math.div_rn(numerator, denominator)
    return score


@triton.jit
def _order_key(x):
    """fp32 -> int32 of the same order: key(a) < key(b) iff a < b, and -inf maps above _MASKED. -0.0 is
    folded onto +0.0 first: they compare equal as floats, so they must tie as keys."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _packed(key, index, SIZE: tl.constexpr):
    """int32 key and index in [0, SIZE) -> one int64, the key above (SIZE - 1 - index): its plain max is
    the largest key and, of equal keys, the lowest index; distinct indices give distinct values, so
    == finds the winner. Half the instructions of a (key, index) pair reduction (sm_90 PTX, one Qwen3
    row: 711 -> 411)."""
    return key.to(tl.int64) * 4294967296 + (SIZE - 1 - index)


@triton.jit
def _allowed_groups(choice, G_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                    TOP2: tl.constexpr):
    """choice [BM, G, P] (-inf where masked or padding) -> [BM, G, 1], True for the TOPK_GROUP best
    groups. A group scores its best finite expert, or with TOP2 its best two summed (its best alone
    when it has one); a group without a finite expert scores -inf and is kept only to fill up."""
    best = tl.max(choice, axis=2)  # [BM, G]
    if TOP2:
        is_best = choice == best[:, :, None]
        second = tl.max(tl.where(is_best, float("-inf"), choice), axis=2)  # [BM, G]
        second = tl.where(tl.sum(is_best.to(tl.int32), axis=2) > 1, best, second)  # best twice: top-2 = 2 best
        best = tl.where(second == float("-inf"), best, best + second)
    g = tl.arange(0, G_PAD)[None, :]
    packed = _packed(tl.where(g < NUM_GROUPS, _order_key(best), _EXCLUDED), g, G_PAD)  # [BM, G]
    kept = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        hit = packed == tl.max(packed, axis=1)[:, None]  # [BM, G] best remaining group, lower id on ties
        kept = kept | hit
        packed = tl.where(hit, _NEVER, packed)
    return kept[:, :, None]


@triton.jit
def _select(key, col, BLOCK_M: tl.constexpr, SLOTS_PAD: tl.constexpr, TOP_K: tl.constexpr,
            COLS: tl.constexpr, P_PAD: tl.constexpr, PER_GROUP: tl.constexpr):
    """key, col [BM, G, P] -> ids [BM, SLOTS_PAD] int32: the experts of the TOP_K largest keys, best first."""
    packed = _packed(key, col, COLS)  # [BM, G, P]
    slot = tl.arange(0, SLOTS_PAD)[None, :]
    ids = tl.zeros([BLOCK_M, SLOTS_PAD], tl.int32)
    for j in tl.static_range(TOP_K):
        # A thread holds all G groups of its P columns: reduce axis 1 first, without shuffles.
        best = tl.max(tl.max(packed, axis=1), axis=1)  # [BM]
        win = COLS - 1 - best.to(tl.int32)  # [BM] column of the best remaining expert (the low 32 bits)
        ids = tl.where(slot == j, (win // P_PAD * PER_GROUP + win % P_PAD)[:, None], ids)
        packed = tl.where(packed == best[:, None, None], _NEVER, packed)
    return ids


@triton.jit
def _weights(chosen, taken, row_max, row_sum, scaling, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
             PRECISE: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr = False, RENORM_LOG_EPS: tl.constexpr = None,
             RENORM_LOG_CLAMP: tl.constexpr = None):
    """chosen [BM, SLOTS_PAD] logits of the chosen experts; taken: the slot holds a finite chosen expert; row_max,
    row_sum [BM] the softmax's. Renormalisation is a softmax over the taken slots' log-scores (route's formula, no
    0/0); with RENORM_LOG_EPS = log eps, e_i / (sum e + eps e^-top): w_i / (S + eps) scaled by e^-top, the largest
    score's reciprocal (route's ``_eps_factor``; the sum unchanged by the term wherever S > 2^24 eps); with
    RENORM_LOG_CLAMP = log c, times min(1, S / c) from the row's log S, in route's order (``_clamp_factor``): exactly
    1.0 wherever S >= c, so those rows keep the exact ratio's bits."""
    if RENORMALIZE:
        log_score = chosen
        if SQRT_SOFTPLUS:  # route's 0.5 * log(softplus(x)), x itself where softplus is subnormal or 0
            softplus = _softplus(chosen, PRECISE)
            log_score = 0.5 * tl.where(softplus < _TINY, chosen, _log(tl.maximum(softplus, _TINY), PRECISE))
        elif SIGMOID:  # torch's logsigmoid: min(x, 0) - log1p(exp(-|x|))
            log_score = tl.minimum(chosen, 0.0) - _log1p(_exp(-tl.abs(chosen), PRECISE), PRECISE)
        log_score = tl.where(taken, log_score, float("-inf"))
        top = tl.max(log_score, axis=1)  # [BM]; -inf on a row with nothing taken (then all weights 0)
        e = _exp(log_score - top[:, None], PRECISE)
        total = tl.sum(e, axis=1)  # [BM]
        if RENORM_LOG_EPS is not None:  # + eps / e^top; softmax: its scores are e^(x - row_max) / row_sum
            if SIGMOID or SQRT_SOFTPLUS:
                total += _exp(RENORM_LOG_EPS - top, PRECISE)
            else:
                total += row_sum * _exp(RENORM_LOG_EPS + row_max - top, PRECISE)
        numerator, denominator = tl.broadcast(e, total[:, None])
        w = tl.math.div_rn(numerator, denominator)
        if RENORM_LOG_CLAMP is not None:  # ERNIE-4.5's w / max(S, c): log S = top + log T (softmax: - the logsumexp)
            log_total = top + _log(total, PRECISE)  # [BM]
            if not (SIGMOID or SQRT_SOFTPLUS):
                log_total -= row_max + _log(row_sum, PRECISE)
            w *= _exp(tl.minimum(log_total - RENORM_LOG_CLAMP, 0.0), PRECISE)[:, None]
    else:
        w = _score(chosen, row_max[:, None], row_sum[:, None], SIGMOID, PRECISE, SQRT_SOFTPLUS)
    return tl.where(taken, w * scaling, 0.0)


@triton.jit
def _check_finite(valid, finite, ok_ptr, CHECK_FINITE: tl.constexpr, ASSERT_FINITE: tl.constexpr):
    """nonfinite="raise": CHECK_FINITE clears the flag at ok_ptr (every writer writes 0, so the race is
    benign); ASSERT_FINITE is this kernel's own device-side assert (compiled only with debug=True)."""
    if CHECK_FINITE:
        bad = tl.max(tl.max(tl.max((valid & ~finite).to(tl.int32), axis=2), axis=1), axis=0)
        tl.store(ok_ptr, bad * 0, mask=bad > 0)
    if ASSERT_FINITE:
        tl.device_assert(finite | ~valid, "router_logits contains NaN or infinite values")


@triton.jit
def _soft_capped(x, CAP: tl.constexpr, INV: tl.constexpr, PRECISE: tl.constexpr):
    """route's ``soft_capped``: CAP * tanh(x / CAP) (CAP 0: x itself, no code). On the GPU as torch computes it
    there: x times INV, the fp32 reciprocal of CAP (its CUDA division by a Python scalar), and libdevice's tanhf;
    interpreted (no libdevice), x / CAP as torch's CPU kernel and ``_tanh_interpreted``."""
    if CAP != 0.0:
        if PRECISE:
            x = libdevice.tanh(x * INV) * CAP
        else:
            x = _tanh_interpreted(x / CAP) * CAP
    return x


@triton.jit
def _tanh_interpreted(y):
    """tanh from exp for the interpreter, within a few fp32 ulps: its odd series to y^7 below |y| = 1/8 (where
    1 - exp(-2|y|) would cancel), else (1 - e) / (1 + e) with e = exp(-2|y|)."""
    a = tl.abs(y)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    y2 = y * y
    small = a * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0 - y2 * (17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(y < 0.0, -t, t)


@triton.jit
def route_kernel(
    logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr,  # [M, E], [E], [M, 1], [M, k+S] x2, [1]
    num_tokens, stride_lm, stride_le, stride_b, stride_gm, scaling,
    NUM_EXPERTS: tl.constexpr, PER_GROUP: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, NUM_SHARED: tl.constexpr, SLOTS_PAD: tl.constexpr,
    GROUPED: tl.constexpr, TOP2: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_GATE: tl.constexpr, CHECK_FINITE: tl.constexpr, BLOCK_M: tl.constexpr,
    PRECISE: tl.constexpr, PDL: tl.constexpr, ASSERT_FINITE: tl.constexpr,
    # the router options (``MoEConfig.changed_router_options``; these defaults: none)
    SOFTCAP: tl.constexpr = 0.0, SOFTCAP_INV: tl.constexpr = 0.0, BIAS_ON_LOGITS: tl.constexpr = False,
    FILL_ZERO: tl.constexpr = False, SHARED_SCALE: tl.constexpr = 1.0, SQRT_SOFTPLUS: tl.constexpr = False,
    RENORM_LOG_EPS: tl.constexpr = None,  # MoEConfig.renorm_eps's float32 log; None: renorm_eps 0 (no code)
    RENORM_LOG_CLAMP: tl.constexpr = None,  # MoEConfig.renorm_clamp's float32 log; None: renorm_clamp 0 (no code)
):
    if PDL:  # the logits come from the kernel before (the gate matmul): wait for it to finish
        gdc_wait()
        gdc_launch_dependents()
    route_rows(logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr, tl.program_id(0) * BLOCK_M, num_tokens,
               stride_lm, stride_le, stride_b, stride_gm, scaling, NUM_EXPERTS, PER_GROUP, G_PAD, P_PAD, TOP_K,
               TOPK_GROUP, NUM_SHARED, SLOTS_PAD, GROUPED, TOP2, SIGMOID, RENORMALIZE, HAS_BIAS, HAS_GATE, CHECK_FINITE,
               BLOCK_M, PRECISE, ASSERT_FINITE, False, SOFTCAP, SOFTCAP_INV, BIAS_ON_LOGITS, FILL_ZERO, SHARED_SCALE,
               SQRT_SOFTPLUS, RENORM_LOG_EPS, RENORM_LOG_CLAMP)


@triton.jit
def route_rows(
    logits_ptr, bias_ptr, gate_ptr, ids_ptr, weights_ptr, ok_ptr, row0, num_tokens, stride_lm, stride_le, stride_b,
    stride_gm, scaling, NUM_EXPERTS: tl.constexpr, PER_GROUP: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, NUM_SHARED: tl.constexpr, SLOTS_PAD: tl.constexpr,
    GROUPED: tl.constexpr, TOP2: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_GATE: tl.constexpr, CHECK_FINITE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISE: tl.constexpr,
    ASSERT_FINITE: tl.constexpr, VOLATILE: tl.constexpr, SOFTCAP: tl.constexpr, SOFTCAP_INV: tl.constexpr,
    BIAS_ON_LOGITS: tl.constexpr, FILL_ZERO: tl.constexpr, SHARED_SCALE: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr,
    RENORM_LOG_EPS: tl.constexpr = None, RENORM_LOG_CLAMP: tl.constexpr = None):
    """Rows row0 .. row0 + BM - 1 (those below num_tokens) routed; also the route part of ``gate_route_kernel``,
    where the logits were written by other programs of the same launch (``VOLATILE``: loaded past the L1)."""
    rows = row0 + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < num_tokens
    g, p = tl.arange(0, G_PAD)[None, :, None], tl.arange(0, P_PAD)[None, None, :]  # [1, G, 1], [1, 1, P]
    expert = g * PER_GROUP + p  # [1, G, P]
    col_ok = (g < NUM_EXPERTS // PER_GROUP) & (p < PER_GROUP)  # [1, G, P] not padding
    valid = row_ok[:, None, None] & col_ok  # [BM, G, P]
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_lm  # [BM]
    x = tl.load(row_ptr[:, None, None] + expert * stride_le, mask=valid, other=0.0,
                volatile=VOLATILE).to(tl.float32)  # [BM, G, P]
    finite = valid & (tl.abs(x) < float("inf"))  # of the logits themselves, before any soft-cap
    _check_finite(valid, finite, ok_ptr, CHECK_FINITE, ASSERT_FINITE)
    # Scores over the finite experts only: a masked expert takes no probability mass from the others.
    x_fin = tl.where(finite, _soft_capped(x, SOFTCAP, SOFTCAP_INV, PRECISE), float("-inf"))
    row_max = tl.max(tl.max(x_fin, axis=2), axis=1)  # [BM]
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.where(finite, _exp(x_fin - row_max[:, None, None], PRECISE), 0.0)
    row_sum = tl.sum(tl.sum(e, axis=2), axis=1)  # [BM]
    choice = x_fin if BIAS_ON_LOGITS else _score(x_fin, row_max[:, None, None], row_sum[:, None, None], SIGMOID,
                                                 PRECISE, SQRT_SOFTPLUS)  # [BM, G, P]; Kolibri's: logits (+ bias)
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert * stride_b, mask=col_ok, other=0.0).to(tl.float32)
    choice = tl.where(finite, choice, float("-inf"))
    allowed = valid
    if GROUPED:
        allowed = valid & _allowed_groups(choice, G_PAD, NUM_EXPERTS // PER_GROUP, TOPK_GROUP, TOP2)
    if FILL_ZERO:  # a dropped group's experts score 0 for the choice, all allowed again (masked: still below)
        choice, allowed = tl.where(allowed, choice, 0.0), valid
    key = tl.where(finite & allowed, _order_key(choice), tl.where(allowed, _MASKED, _EXCLUDED))
    col = tl.broadcast_to(g * P_PAD + p, key.shape)  # [BM, G, P] tile column
    ids = _select(key, col, BLOCK_M, SLOTS_PAD, TOP_K, G_PAD * P_PAD, P_PAD, PER_GROUP)  # [BM, SLOTS_PAD]
    slot = tl.arange(0, SLOTS_PAD)[None, :]
    is_routed = slot < TOP_K
    chosen = tl.load(row_ptr[:, None] + ids * stride_le, mask=row_ok[:, None] & is_routed, other=0.0,
                     volatile=VOLATILE).to(tl.float32)
    taken = is_routed & (tl.abs(chosen) < float("inf"))
    chosen = _soft_capped(chosen, SOFTCAP, SOFTCAP_INV, PRECISE)  # the weights read the capped logits too
    w = _weights(chosen, taken, row_max, row_sum, scaling, SIGMOID, RENORMALIZE, PRECISE, SQRT_SOFTPLUS, RENORM_LOG_EPS,
                 RENORM_LOG_CLAMP)
    if NUM_SHARED > 0:  # shared slots last: ids E..E+S-1, weight 1 or sigmoid(gate logit), times SHARED_SCALE
        ids = tl.where(is_routed, ids, NUM_EXPERTS + slot - TOP_K)
        shared_w = tl.full([BLOCK_M, SLOTS_PAD], SHARED_SCALE, tl.float32)  # 0.5: Cohere2's average
        if HAS_GATE:  # Qwen2-MoE's gated shared expert: sigmoid(x @ g), as append_shared_slots
            gate = tl.load(gate_ptr + rows.to(tl.int64) * stride_gm, mask=row_ok, other=0.0).to(tl.float32)
            shared_w = shared_w * _sigmoid(gate, PRECISE)[:, None]
        w = tl.where(is_routed, w, shared_w)
    out = rows.to(tl.int64)[:, None] * (TOP_K + NUM_SHARED) + slot
    out_ok = row_ok[:, None] & (slot < TOP_K + NUM_SHARED)
    tl.store(ids_ptr + out, ids, mask=out_ok)
    tl.store(weights_ptr + out, w, mask=out_ok)

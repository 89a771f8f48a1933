"""A float64 MoE layer written from the spec (``/work/shared/seeds``) and ``MoEConfig``'s documented semantics, one
token and one chosen expert at a time: the independent reference of ``test_fuzz_layer`` and
``benchmarks/fuzz_layer.py``. It calls none of moekit's routing, experts, activation or shared-expert code; it reads
the layer's weights (``LayerWeights.of``) and computes everything else itself.

    [Gate: x @ Wg^T + bg] -> [Route: cap, score, bias, groups, top-k, weights] -> [Capacity, opt-in]
      -> [Experts: w2 @ glu(w13 @ x + b13) + b2, times the weight (or on weight x x)] -> [+ shared] -> [+ identity]

Near ties: the layer routes in float32; where two of the values a choice compares (or a sparsemixer threshold) lie
within ``TIE`` of each other the float64 choice may differ from it without either being wrong, so the token is
marked ``ambiguous`` and the callers leave it out (and a whole capacity-dropping case with one: the drops of every
token depend on it). Exact ties are not ambiguous: the lower id wins on both sides.

Shapes: M tokens, K hidden, N expert intermediate, E routed experts, k = top_k, Z identity experts, S shared slots,
W = the router's width (E, E + Z or E + S).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from _fuzz_experts import activation_spec, combine

TIE = 2e-5  # |a - b| <= TIE * (1 + |a| + |b|): a float32 router may order a and b either way


@dataclass
class SharedSlot:
    """One piece of the shared MLP: rows of its gate-up weight in the activation's row order, the matching columns
    of its down weight. A fused layer's slots are its w13/w2 rows E..E+S-1; a separate MLP is cut into S slots of
    width N (or kept whole when its width is not a multiple of N)."""

    w13: torch.Tensor  # [2n, K] float64
    w2: torch.Tensor  # [K, n] float64


@dataclass
class LayerWeights:
    """Everything the layer computes with, as float64 copies (quantized experts dequantized)."""

    gate: torch.Tensor  # [W, K]
    gate_bias: torch.Tensor | None  # [W]
    correction_bias: torch.Tensor | None  # [E(+Z)]
    w13: torch.Tensor  # [E, 2N, K] routed experts only
    w2: torch.Tensor  # [E, K, N]
    b13: torch.Tensor | None  # [E, 2N]
    b2: torch.Tensor | None  # [E, K]
    shared: list[SharedSlot]  # [] without a shared expert
    shared_gate: torch.Tensor | None  # [K] (Qwen2-MoE's sigmoid gate)
    shared_separate: bool = False  # the shared MLP is the layer's own (not fused slots): torch ops in the layer's dtype

    @staticmethod
    def of(layer, leaves: dict[str, torch.Tensor] | None = None) -> "LayerWeights":
        """Read ``layer`` (a ``moekit.MoE``): its parameters and buffers, nothing it computes. With ``leaves`` (a
        dict, filled here) each parameter's float64 copy is a leaf that requires grad, kept under the parameter's
        name: the float64 loop built from these weights differentiates into them (``_fuzz_grad``)."""
        cfg = layer.config
        e, n = cfg.num_experts, cfg.moe_intermediate_size
        names = {id(p): name for name, p in layer.named_parameters()}

        def f64(t):
            if t is None:
                return None
            copy = t.detach().double()
            if leaves is None or id(t) not in names:  # a buffer (the correction bias) carries no gradient
                return copy
            leaves[names[id(t)]] = copy.requires_grad_(True)
            return copy

        def dense(w):  # a QuantizedWeight (not a tensor): its dequantized values, the quantized layer's weights
            return f64(w) if isinstance(w, torch.Tensor) else w.dequantize(torch.float64)

        w13, w2 = dense(layer.w13), dense(layer.w2)
        if layer.fuse_shared:  # rows E..E+S-1 are the shared slots
            shared = [SharedSlot(w13[e + s], w2[e + s]) for s in range(cfg.num_shared_slots)]
        elif layer.shared_w13 is not None:
            interleaved = activation_spec(cfg.shared_mlp_activation).interleaved
            shared = _cut_shared(f64(layer.shared_w13), f64(layer.shared_w2), n, interleaved)
        else:
            shared = []
        b13 = None if layer.b13 is None else f64(layer.b13)[:e]
        b2 = None if layer.b2 is None else f64(layer.b2)[:e]
        sg = None if layer.shared_gate is None else f64(layer.shared_gate.weight)[0]
        return LayerWeights(gate=f64(layer.gate.weight), gate_bias=f64(layer.gate.bias),
                            correction_bias=f64(layer.e_score_correction_bias), w13=w13[:e], w2=w2[:e], b13=b13,
                            b2=b2, shared=shared, shared_gate=sg,
                            shared_separate=not layer.fuse_shared and layer.shared_w13 is not None)


def _cut_shared(w13: torch.Tensor, w2: torch.Tensor, n: int, interleaved: bool) -> list[SharedSlot]:
    """The separate shared MLP w13 [2SN, K], w2 [K, SN] as S slots of width n (one slot when SN % n)."""
    width = w2.shape[1]
    if width % n:
        return [SharedSlot(w13, w2)]
    slots = []
    for s in range(width // n):
        cols = slice(s * n, (s + 1) * n)
        if interleaved:  # row 2j gate j, row 2j+1 up j: slot s is 2n consecutive rows
            rows = w13[2 * s * n:2 * (s + 1) * n]
        else:  # gate rows first, then up rows
            rows = torch.cat([w13[cols], w13[width + s * n:width + (s + 1) * n]])
        slots.append(SharedSlot(rows, w2[:, cols]))
    return slots


# ---------------------------------------------------------------------------------------------------------------
# Routing, one token at a time
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class TokenRoute:
    ids: list[int]  # [k] the router's choice in order (descending choice value; sparsemixer: round order)
    weights: list[float]  # [k] each slot's weight
    shared_weights: list[float] | None = None  # [S] shared_expert_combine="router" only
    members: list[list[int]] | None = None  # [k] sparsemixer: the experts each round's softmax ran over
    masked: bool = False  # no finite logit at all
    ambiguous: bool = False  # a near tie decided something (module docstring)


def _near(a: float, b: float) -> bool:
    if a == b or not (math.isfinite(a) and math.isfinite(b)):
        return False  # an exact (or structural) tie: the lower id wins on both sides
    return abs(a - b) <= TIE * (1 + abs(a) + abs(b))


def _ordered(values: dict[int, float]) -> list[int]:
    """Keys by descending value, the lower key first on equal values."""
    return sorted(values, key=lambda i: (-values[i], i))


def _boundary_near(values: dict[int, float], order: list[int], upto: int) -> bool:
    """Whether any two neighbours among the first upto + 1 of ``order`` are near (the choice or its order), the head
    run on past an exact tie at its end: the value behind two tied ones may be near both (fuzz seed 47's chained
    offload input: capped logits 1.5, 1.5 exactly and 1.5 - 4e-9, which float32 rounds to a three-way tie)."""
    end = min(upto + 1, len(order))
    while 2 <= end < len(order) and values[order[end - 1]] == values[order[end - 2]]:
        end += 1
    head = order[:end]
    return any(_near(values[a], values[b]) for a, b in zip(head, head[1:]))


def _rounded_tie(values: dict[int, float], scored: dict[int, float], row: list[float], order: list[int],
                 upto: int) -> bool:
    """Whether two neighbours among the first upto + 1 of ``order`` tie exactly on choice values (not a zero fill)
    made from logits that differ: the tie is float64's rounding (the exp of logits an ulp apart; seed 854's float64
    gate gave two copied rows' logits an ulp apart, which the layer's softmax kept), so the lower id need not win."""
    head = [e for e in order[:upto + 1] if values[e] == scored[e]]
    return any(values[a] == values[b] and row[a] != row[b] for a, b in zip(head, head[1:]))


def _sigmoid(v: float) -> float:
    return 1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v))


def _sqrt_softplus(v: float) -> float:
    """sqrt(log(1 + e^v)) (DeepSeek-V4's score), without overflow above nor rounding to 0 before float64 must."""
    return math.sqrt(v + math.log1p(math.exp(-v)) if v > 0 else math.log1p(math.exp(v)))


def score(v: float, cfg) -> float:
    """The score of a (capped) logit under a per-expert scoring rule (sigmoid, sqrt(softplus))."""
    return _sqrt_softplus(v) if cfg.scoring == "sqrtsoftplus" else _sigmoid(v)


def renorm_total(total: float, cfg) -> float:
    """What the renormalisation divides the chosen scores by, from their sum: sum + eps (DeepSeek-V3's 1e-20), max(sum,
    c) (ERNIE-4.5's clamp) or the sum itself."""
    return total + cfg.renorm_eps if cfg.renorm_eps else max(total, cfg.renorm_clamp)


def route_token(raw: list[float], cfg, bias: list[float] | None) -> TokenRoute:
    """One token's routing from its raw logits [W] (float64 values of the layer's logits)."""
    cap = cfg.router_logit_softcap
    width = cfg.choice_width  # E (+ Z); the router-weighted shared columns come after it
    finite = [math.isfinite(v) for v in raw]
    row = [cap * math.tanh(v / cap) if cap and f else v for v, f in zip(raw, finite)]
    if cfg.sparsemixer_jitter_eps is not None:
        return _sparsemixer(row[:width], finite[:width], cfg)
    live = [e for e in range(width) if finite[e]]
    if cfg.shared_expert_combine == "router" or cfg.scoring != "softmax":
        scores = {e: score(row[e], cfg) for e in live}
    else:  # softmax over the finite experts only
        top = max((row[e] for e in live), default=0.0)
        total = sum(math.exp(row[e] - top) for e in live)
        scores = {e: math.exp(row[e] - top) / total for e in live}
    shifted = scores if cfg.correction_bias_on == "scores" else {e: row[e] for e in live}
    choice = {e: shifted[e] + (bias[e] if bias is not None else 0.0) for e in live}
    allowed, ambiguous = _kept_experts(choice, cfg, bias is not None)
    scored = choice  # before the zero fill
    if cfg.dropped_group_fill == "zero":
        choice = {e: (v if e in allowed else 0.0) for e, v in choice.items()}
        allowed = set(range(width))
    candidates = {e: v for e, v in choice.items() if e in allowed}
    order = _ordered(candidates)
    ambiguous |= _boundary_near(candidates, order, cfg.top_k) or _rounded_tie(candidates, scored, row, order, cfg.top_k)
    masked_fill = [e for e in range(width) if e in allowed and not finite[e]]  # lower id first, weight 0
    ids = (order + masked_fill)[:cfg.top_k]
    taken = [e for e in ids if finite[e]]
    if cfg.shared_expert_combine == "router":
        return _router_shared(raw, row, ids, cfg, ambiguous)
    if cfg.renormalize:
        total = renorm_total(sum(scores[e] for e in taken), cfg)  # the family's eps or clamp (0: the exact ratio)
        weights = [scores[e] / total if finite[e] else 0.0 for e in ids]
    else:
        weights = [scores[e] if finite[e] else 0.0 for e in ids]
    scale = cfg.routed_scaling_factor * (0.5 if cfg.shared_expert_combine == "average" else 1.0)
    return TokenRoute(ids=ids, weights=[w * scale for w in weights], masked=not live, ambiguous=ambiguous)


HASH_EPS = 1e-20  # DeepSeek-V4's hash router: weights / (sum + 1e-20), whatever renorm_eps (0 or 1e-20) says


def hash_route_token(raw: list[float], cfg, experts: list[int]) -> TokenRoute:
    """One token of a hash layer (DeepSeek-V4): its experts are its table row ``experts`` [k] (in the table's order,
    repeats kept), each weighted by its score of the (capped) logits [E]: softmax over the row, sigmoid or
    sqrt(softplus), divided by their sum + 1e-20 when renormalised, times routed_scaling_factor. No choice: no tie."""
    cap = cfg.router_logit_softcap
    row = [cap * math.tanh(v / cap) if cap else v for v in raw]
    if cfg.scoring == "softmax":
        top = max(row)
        total = sum(math.exp(v - top) for v in row)
        scores = [math.exp(v - top) / total for v in row]
    else:
        scores = [score(v, cfg) for v in row]
    weights = [scores[e] for e in experts]
    if cfg.renormalize:
        total = sum(weights) + HASH_EPS
        weights = [w / total for w in weights]
    return TokenRoute(ids=list(experts), weights=[w * cfg.routed_scaling_factor for w in weights])


def _kept_experts(choice: dict[int, float], cfg, biased: bool) -> tuple[set[int], bool]:
    """The experts of the best ``topk_group`` groups (all without groups), and whether a near tie chose them."""
    e = cfg.num_experts
    if cfg.n_group == 1:
        return set(range(cfg.choice_width)), False
    size = e // cfg.n_group
    top2 = size >= 2 and (cfg.group_score == "top2_sum" or (cfg.group_score == "auto" and biased))
    scores, empty = {}, set()
    for g in range(cfg.n_group):
        members = sorted((choice[i] for i in range(g * size, (g + 1) * size) if i in choice), reverse=True)
        if not members:
            empty.add(g)
            scores[g] = -math.inf
        else:
            scores[g] = sum(members[:2]) if top2 else members[0]
    order = sorted(range(cfg.n_group), key=lambda g: (g in empty, -scores[g], g))
    kept, last = order[:cfg.topk_group], cfg.topk_group - 1
    ambiguous = last + 1 < cfg.n_group and _near(scores[order[last]], scores[order[last + 1]])
    return {i for g in kept for i in range(g * size, (g + 1) * size)}, ambiguous


def _router_shared(raw, row, ids, cfg, ambiguous) -> TokenRoute:
    """Inkling: each of the k chosen and the S shared sigmoids over their sum, times routed_scaling_factor; the
    logits as the router scores them (soft-capped first, like every other use of them)."""
    e, s = cfg.num_experts, cfg.num_shared_slots
    sig = [_sigmoid(row[i]) for i in ids] + [_sigmoid(row[e + j]) for j in range(s)]
    total = sum(sig)
    w = [v / total * cfg.routed_scaling_factor for v in sig]
    return TokenRoute(ids=ids, weights=w[:len(ids)], shared_weights=w[len(ids):], ambiguous=ambiguous)


def _sparsemixer(row: list[float], finite: list[bool], cfg) -> TokenRoute:
    """Phi-MoE at inference: k rounds; each takes the best expert left and weights it by a softmax over the experts
    left within 2 eps of it, relatively: (m - l) / max(|l|, m) <= 2 eps. Masked experts come last, weight 0."""
    near, left = 2 * cfg.sparsemixer_jitter_eps, [e for e in range(len(row)) if finite[e]]
    ids, weights, rounds, ambiguous = [], [], [], False
    masked = [e for e in range(len(row)) if not finite[e]]
    for _ in range(cfg.top_k):
        if not left:
            ids.append(masked.pop(0))
            weights.append(0.0)
            rounds.append([])
            continue
        order = _ordered({e: row[e] for e in left})
        ambiguous |= _boundary_near({e: row[e] for e in left}, order, 1)
        best = order[0]
        m = row[best]
        members = []
        for e in left:
            denom = max(abs(row[e]), m)
            rel = (m - row[e]) / denom if denom else 0.0
            ambiguous |= _near(rel, near)
            if rel <= near:
                members.append(e)
        total = sum(math.exp(row[e] - m) for e in members)
        ids.append(best)
        weights.append(1 / total)
        rounds.append(members)
        left.remove(best)
    scale = cfg.routed_scaling_factor * (0.5 if cfg.shared_expert_combine == "average" else 1.0)
    return TokenRoute(ids=ids, weights=[w * scale for w in weights], members=rounds, masked=not any(finite),
                      ambiguous=ambiguous)


# ---------------------------------------------------------------------------------------------------------------
# Capacity, the experts, the layer
# ---------------------------------------------------------------------------------------------------------------


def capacity_keep(routes: list[TokenRoute], cfg, factor: float, policy: str) -> tuple[list[list[bool]], bool]:
    """[M][k] kept flags: each routed expert keeps C = ceil(factor * M * k / E) of its assignments, first slot 0
    of every token, then slot 1, ... ("position"), or the heaviest first, ties in that order ("weight");
    identity slots are never dropped. Also whether a near tie of weights decided a drop."""
    m, k, e = len(routes), cfg.top_k, cfg.num_experts
    cap = math.ceil(factor * m * k / e)
    order = [(j, t) for j in range(k) for t in range(m) if routes[t].ids[j] < e]
    if policy == "weight":
        order = sorted(order, key=lambda jt: -routes[jt[1]].weights[jt[0]])  # stable: position among equals
    keep = [[True] * k for _ in range(m)]
    taken: dict[int, list[float]] = {}
    ambiguous = False
    for j, t in order:
        expert, w = routes[t].ids[j], routes[t].weights[j]
        held = taken.setdefault(expert, [])
        if len(held) >= cap:
            keep[t][j] = False
            # any kept weight near it, not only the last: float64 weights a float32 router ties exactly may differ
            # by an ulp, which then orders them (seed 314: 1/6 + 1 ulp put token 7 first, dropping token 5)
            ambiguous |= policy == "weight" and any(_near(h, w) for h in held)
        else:
            held.append(w)
    return keep, ambiguous


@dataclass
class Reference:
    out: torch.Tensor  # [M, K] float64
    routes: list[TokenRoute]  # [M] the router's choice, before capacity
    kept: list[list[bool]]  # [M][k] after capacity
    dropped: int  # routed assignments capacity dropped
    counts: list[int]  # [E] assignments each routed expert ran
    identity_counts: list[int]  # [Z] slots each identity expert took
    masked_tokens: int
    capacity_ambiguous: bool = False  # a near tie decided a drop: the whole case is ambiguous
    ambiguous_tokens: list[int] = field(default_factory=list)


def reference_moe(w: LayerWeights, cfg, x: torch.Tensor, logits: torch.Tensor | None = None, *,
                  capacity_factor: float | None = None, drop_policy: str = "position",
                  fp8_block: int | None = None, hash_rows: list[list[int]] | None = None) -> Reference:
    """The layer on x [M, K]. ``logits`` [M, W]: route from these (the layer's own, upcast: a bf16 gate rounds them)
    instead of the float64 gate GEMM. ``hash_rows`` [M][k]: a hash layer's table rows of the tokens' ids.
    ``fp8_block``: the experts run fp8_block's activation recipe. x's dtype is the layer's: input-weighted experts read
    weight x token rounded to it."""
    dtype, x = x.dtype, x.double()
    if logits is None:
        logits = x @ w.gate.t() + (w.gate_bias if w.gate_bias is not None else 0.0)  # [M, W]
    bias = None if w.correction_bias is None else w.correction_bias.tolist()
    rows = logits.double().tolist()
    routes = [route_token(r, cfg, bias) for r in rows] if hash_rows is None else \
        [hash_route_token(r, cfg, experts) for r, experts in zip(rows, hash_rows)]
    m, e = x.shape[0], cfg.num_experts
    keep, cap_amb = ([[True] * cfg.top_k for _ in range(m)], False) if capacity_factor is None else \
        capacity_keep(routes, cfg, capacity_factor, drop_policy)
    counts, identity = [0] * e, [0] * cfg.num_identity_experts
    dropped = 0
    for r, kept in zip(routes, keep):
        for expert, k in zip(r.ids, kept):
            if expert >= e:
                identity[expert - e] += 1
            elif k:
                counts[expert] += 1
            else:
                dropped += 1
    out = combine(x, w, cfg, routes, keep, [r.weights for r in routes], [r.shared_weights for r in routes],
                  fp8_block, dtype)
    return Reference(out=out, routes=routes, kept=keep, dropped=dropped, counts=counts, identity_counts=identity,
                     masked_tokens=sum(r.masked for r in routes), capacity_ambiguous=cap_amb,
                     ambiguous_tokens=[t for t, r in enumerate(routes) if r.ambiguous])


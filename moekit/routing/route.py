"""Routing: router logits -> which k experts each token uses, and with what weight.

    [Route: score -> top-k -> weights] -> Capacity (opt-in) -> Shared slots -> Group -> Experts -> Combine

Shapes: M tokens, E routed experts, k = top_k, G = n_group, S = shared slots.

Tie rule: when two experts (or two groups) score exactly the same, the lower id wins. Selection is a
stable descending sort, so the rule holds on every device and in every torch version.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit.config import MoEConfig
from moekit.routing.router_math import renorm_log_eps


@dataclass
class Routing:
    """Which experts each token is sent to, and the weight its output is scaled by."""

    # [M, k(+S)] int32; expert of each slot, in descending score order (hash_route: the table's); shared slots last;
    # -1 = skipped
    topk_ids: torch.Tensor
    # [M, k(+S)] float32 (float64 from float64 logits); weight of each slot; 0 where the id is -1
    topk_weights: torch.Tensor
    # [] int64; tokens route() found with no finite logit (nonfinite="mask"): all their weights are 0.
    # route() always sets it (0 with nonfinite="raise"); None where none can be masked (the fused router
    # with nonfinite="raise", hash_route) and on a Routing built by hand.
    masked_tokens: torch.Tensor | None = None
    # [M, S] topk_weights' dtype; each shared slot's weight where the router gives it (shared_expert_combine=
    # "router": Inkling); None: config.shared_weight. The shared slots take it when appended or run apart.
    shared_weights: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]


def route(router_logits: torch.Tensor, config: MoEConfig, correction_bias: torch.Tensor | None = None) -> Routing:
    """Score, select and weight experts as the model's reference implementation does.

    - softmax scoring (Mixtral, Qwen): probabilities over all E experts; with ``renormalize`` the chosen weights are
      re-scaled to sum to 1, else the chosen experts' probabilities. Phi-MoE's sparsemixer: ``_sparsemixer``.
    - ``router_logit_softcap`` c > 0 (Laguna): the logits become c * tanh(logits / c) before anything else.
    - sigmoid scoring (DeepSeek-V3): independent gates. ``correction_bias`` [E] shifts the scores used for *selection*
      only (or the logits, ``correction_bias_on="logits"``: Kolibri); weights come from the unbiased scores.
    - grouped top-k (``n_group`` > 1): a group scores the sum of its top-2 choice scores (``group_score="top2_sum"``,
      or "auto" when a bias is given and a group has >= 2 experts), else its max; only the best ``topk_group``
      groups can be chosen from (``dropped_group_fill="zero"``, A.X-K2 and Mistral-4: the other groups' experts
      score 0 for the choice, so they still win over a kept expert's negative score).
    - renormalisation: a softmax over the chosen experts' log-scores (= w / sum(w); finite when all underflow), times
      S / (S + eps) with ``renorm_eps`` eps > 0 (S = sum(w), computed from the log-scores: ``_eps_factor``), the
      family's w / (S + eps); that factor is exactly 1.0 in float32 wherever S > 2^24 eps (1.7e-13 at 1e-20). With
      ``renorm_clamp`` c > 0 instead, times S / max(S, c) (ERNIE-4.5's w / clamp(S, min=c): ``_clamp_factor``),
      exactly 1.0 wherever S >= c.
    - ``routed_scaling_factor`` multiplies the routed weights (``MoEConfig.routed_weight_scale``: halved too
      where the shared expert is averaged in, ``shared_expert_combine="average"``).

    The result holds the k routed slots only; ``append_shared_slots`` adds a fused shared expert's. With
    ``num_identity_experts`` Z > 0 (LongCat-Flash) the logits are [M, E + Z] and ids E..E+Z-1 are identity experts
    (``moekit.routing.weighting`` takes them out before the experts run); with ``shared_expert_combine="router"``
    (Inkling) [M, E + S], the last S weighting the shared slots (``Routing.shared_weights``).

    NaN or infinite logits raise unless ``config.nonfinite`` is ``"mask"``; a NaN or infinite ``correction_bias``
    always raises. On the CPU the error is a ``ValueError`` naming the bad rows (or the bias); on a GPU it is a
    device-side assert, so the path never syncs with the host.

    With ``nonfinite="mask"`` an expert whose logit is not finite is *masked*:
    - it takes no probability mass from the others (softmax over the finite experts only);
    - group score: computed over the group's finite experts only (with a bias and >= 2 experts per group, the sum
      of the top-2 biased scores among them, or the one finite expert's biased score when it has exactly one;
      otherwise their max biased score). A group with no finite expert scores -inf and is chosen only when fewer
      than ``topk_group`` groups have a finite expert (lower id first);
    - selection: a masked expert is never chosen over a finite one of the allowed groups; it fills a slot only
      when fewer than k finite experts are allowed (lower id first), and gets weight 0;
    - renormalisation runs over the chosen finite experts only;
    - a token with no finite expert at all gets all-zero weights and is counted in ``Routing.masked_tokens``
      (surfaced as ``MoEStats.masked_tokens``), never silently.
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    logits = _check_logits(router_logits, config)
    bias = check_bias(correction_bias, config, logits.device)
    if config.shared_expert_combine == "router":  # Inkling: the last S columns weight the shared slots
        return _with_shared_weights(logits, config, bias)
    return _choose(logits, soft_capped(logits, config), config, bias)


def _choose(raw: torch.Tensor, logits: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None) -> Routing:
    """``route`` after the checks: ``raw`` [M, E] the checked logits, ``logits`` [M, E] them soft-capped
    (``soft_capped``; the same tensor without a cap)."""
    finite = torch.isfinite(raw) if config.nonfinite == "mask" else None  # [M, E] bool, of the raw logits
    if finite is not None:
        # The most negative float scores ~0 under softmax and sigmoid, so a masked expert takes no probability
        # mass from the others; selection and renormalisation exclude it explicitly.
        logits = logits.masked_fill(~finite, torch.finfo(torch.float32).min)
    if config.sparsemixer_jitter_eps is not None:
        return _sparsemixer(logits, finite, config)  # Phi-MoE
    scores = router_scores(logits, config.scoring)  # [M, E]
    shifted = scores if config.correction_bias_on == "scores" else logits  # what the bias shifts (Kolibri: logits)
    choice = shifted if bias is None else shifted + bias  # [M, E]
    if finite is None:
        return _select(logits, scores, choice, config, biased=bias is not None)
    return _select_masked(logits, scores, choice, finite, config, biased=bias is not None)


def router_scores(logits: torch.Tensor, scoring: str, renormalized: bool = False) -> torch.Tensor:
    """[M, E] logits -> [M, E] scores: softmax, sigmoid or sqrt(softplus) (``renormalized``: ``_sqrt_softplus``'s)."""
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    return _sqrt_softplus(logits, renormalized)


def _sqrt_softplus(logits: torch.Tensor, exact_tiny: bool = False) -> torch.Tensor:
    """sqrt(softplus(logits)) [M, E], a finite gradient (sqrt's backward: 0 / 0 where softplus is 0, below -103.9 in
    float32). Below float32's tiny (-87.3) it is e^(x/2) (1 - e^x / 4 ...): the gradient e^(x/2) / 2's, the values
    sqrt's bits (transformers': a subnormal's sqrt or 0) + g - g; ``exact_tiny`` (a renormalised row): e^(x/2)."""
    softplus = torch.nn.functional.softplus(logits)
    if not (exact_tiny or (logits.requires_grad and torch.is_grad_enabled())):
        return softplus.sqrt()
    tiny = torch.finfo(softplus.dtype).tiny
    path = torch.where(softplus < tiny, torch.exp(0.5 * logits), softplus.clamp(min=tiny).sqrt())
    return path if exact_tiny else softplus.sqrt().detach() + (path - path.detach())


def router_log_scores(chosen_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """[M, k] chosen logits -> log of their scores up to a row's constant (softmax: the logits themselves), the
    renormalisation's input: softmax of it is w_i / sum_j w_j without underflow to 0/0 (the router's, and the
    sequence-wise balance loss's s / sum(s) over a row)."""
    if scoring == "softmax":
        return chosen_logits
    if scoring == "sigmoid":
        return torch.nn.functional.logsigmoid(chosen_logits)
    # 0.5 log(softplus(x)); where softplus is subnormal or 0 (x below -87.3 in float32), log(log1p(e^x)) = x - e^x / 2 =
    # x to the dtype's precision (the log of a subnormal would carry its rounding, of 0 be -inf: NaN weights)
    softplus = torch.nn.functional.softplus(chosen_logits)
    tiny = torch.finfo(softplus.dtype).tiny
    return 0.5 * torch.where(softplus < tiny, chosen_logits, torch.log(softplus.clamp(min=tiny)))


def _eps_factor(log_scores: torch.Tensor, logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """[M, 1] S / (S + eps) for eps = ``renorm_eps``, S the chosen scores' sum: with t the largest of ``log_scores``
    [M, k] (softmax: they are the logits; minus the row's logsumexp over ``logits`` [M, E], the masked experts at the
    dtype's min), T = sum_j e^(l_j - t) and c = eps e^-t, T / (T + c) (the fused kernels divide by T + c: one
    division). Exactly 1.0 where c is below T's rounding (S > 2^24 eps: 1.7e-13 at 1e-20); 0, with a zero gradient,
    where eps e^-t overflows (weights below 1e-38); NaN on a row with no finite slot (its weights are zeroed)."""
    top = log_scores.max(dim=-1, keepdim=True).values  # [M, 1]
    total = torch.exp(log_scores - top).sum(dim=-1, keepdim=True)  # [M, 1]
    if config.scoring == "softmax":
        top = top - torch.logsumexp(logits, dim=-1, keepdim=True)
    log_c = renorm_log_eps(config.renorm_eps, top.dtype) - top  # [M, 1]
    over = torch.isinf(torch.exp(log_c.detach()))  # exp's and the division's backward would read 0 x inf there
    return torch.where(over, 0.0, total / (total + torch.exp(torch.where(over, 0.0, log_c))))


def _clamp_factor(log_scores: torch.Tensor, logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """[M, 1] S / max(S, c) = min(1, S / c) for c = ``renorm_clamp`` (ERNIE-4.5's w / clamp(sum(w), min=c)), S the
    chosen scores' sum from ``log_scores`` [M, k] (softmax: minus the row's logsumexp over ``logits`` [M, E]) as
    log S = t + log sum_j e^(l_j - t); exactly 1.0 wherever S >= c, so those rows keep the exact ratio's bits."""
    top = log_scores.max(dim=-1, keepdim=True).values  # [M, 1]
    log_total = top + torch.log(torch.exp(log_scores - top).sum(dim=-1, keepdim=True))  # [M, 1] log S
    if config.scoring == "softmax":
        log_total = log_total - torch.logsumexp(logits, dim=-1, keepdim=True)
    return torch.exp((log_total - renorm_log_eps(config.renorm_clamp, top.dtype)).clamp(max=0.0))


def _select(logits: torch.Tensor, scores: torch.Tensor, choice: torch.Tensor, config: MoEConfig,
            biased: bool) -> Routing:
    """Top-k of ``choice`` [M, E] within the allowed groups, weighted from the unbiased scores."""
    if config.n_group > 1:
        fill = 0.0 if config.dropped_group_fill == "zero" else float("-inf")
        choice = choice.masked_fill(~_allowed_experts(choice, None, config, biased), fill)
    topk_ids = _topk_lower_id_wins(choice, config.top_k)  # [M, k] int64
    weights = _weights(logits, scores, topk_ids, None, config)  # [M, k] float32
    masked_tokens = torch.zeros((), dtype=torch.int64, device=logits.device)
    return Routing(topk_ids=topk_ids.to(torch.int32), topk_weights=weights, masked_tokens=masked_tokens)


def _select_masked(logits: torch.Tensor, scores: torch.Tensor, choice: torch.Tensor, finite: torch.Tensor,
                   config: MoEConfig, biased: bool) -> Routing:
    """``_select`` with ``nonfinite="mask"``: finite [M, E] decides the tiers of the docstring of ``route``."""
    choice = choice.masked_fill(~finite, float("-inf"))
    allowed = _allowed_experts(choice, finite, config, biased)  # [M, E] bool
    if config.dropped_group_fill == "zero":  # a dropped group's finite experts stay choosable, at score 0
        choice = torch.where(allowed | ~finite, choice, 0.0)
        allowed = torch.ones_like(allowed)
    # [M, E] tier: 0 finite and allowed, 1 masked and allowed, 2 or 3 in a group not chosen
    tier = (~finite).to(torch.int8) + 2 * (~allowed).to(torch.int8)
    topk_ids = _topk_tiered(choice, tier, config.top_k)  # [M, k] int64
    weights = _weights(logits, scores, topk_ids, finite.gather(1, topk_ids), config)  # [M, k] float32
    masked_tokens = (~finite.any(dim=1)).sum()
    return Routing(topk_ids=topk_ids.to(torch.int32), topk_weights=weights, masked_tokens=masked_tokens)


def _sparsemixer(logits: torch.Tensor, finite: torch.Tensor | None, config: MoEConfig) -> Routing:
    """Phi-MoE's sparsemixer as its router runs at inference (transformers' ``sparsemixer``, training=False): k
    rounds (Phi-MoE's block: 2); each chooses the best expert not chosen yet (argmax, lower id on a tie) and weights
    it by its softmax over the experts left whose logit l is near that max m: (m - l) / max(|l|, m) <= 2 eps. No
    renormalisation across rounds. Masked experts (``finite`` False) weigh 0 where a round has to take one."""
    near = 2 * config.sparsemixer_jitter_eps  # a Python float, compared in the logits' dtype as Phi-MoE does
    magnitude = logits.abs()  # [M, E]
    left = logits  # [M, E]; the experts chosen so far at -inf
    ids, weights = [], []
    for _ in range(config.top_k):
        top, chosen = left.max(dim=-1, keepdim=True)  # [M, 1] each; max returns the first maximal index
        far = (top - logits) / magnitude.clamp(min=top) > near  # [M, E]; 0 / 0 is NaN, not far (as Phi-MoE)
        gates = torch.softmax(left.masked_fill(far, float("-inf")), dim=-1)  # [M, E]
        ids.append(chosen)
        weights.append(gates.gather(1, chosen))
        left = left.scatter(1, chosen, float("-inf"))
    topk_ids, topk_weights = torch.cat(ids, dim=1), torch.cat(weights, dim=1)  # [M, k] int64, [M, k]
    masked_tokens = torch.zeros((), dtype=torch.int64, device=logits.device)
    if finite is not None:
        topk_weights = torch.where(finite.gather(1, topk_ids), topk_weights, 0.0)
        masked_tokens = (~finite.any(dim=1)).sum()
    if config.routed_weight_scale != 1.0:
        topk_weights = topk_weights * config.routed_weight_scale
    return Routing(topk_ids=topk_ids.to(torch.int32), topk_weights=topk_weights.to(logits.dtype),
                   masked_tokens=masked_tokens)


@functools.lru_cache(maxsize=64)  # a config is frozen: made once, not on every call
def _routed_part(config: MoEConfig) -> MoEConfig:
    """The config that chooses Inkling's k experts: sigmoid, the bias, not renormalised, not scaled (the weights
    are made again over the k + S in ``_with_shared_weights``)."""
    return config.replace(shared_expert_combine="sum", renormalize=False, routed_scaling_factor=1.0)


def _with_shared_weights(logits: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None) -> Routing:
    """Inkling's routing of the checked logits [M, E + S]: the k experts chosen from the first E (``_routed_part``),
    weighted by a softmax over the log-sigmoids of the k chosen logits and the S shared ones (= each sigmoid over
    their sum), times ``routed_scaling_factor``. Each logit is soft-capped once (``router_logit_softcap``: before
    anything else), the choice and the weights reading the same capped values. (MoEConfig refuses
    ``nonfinite="mask"`` here: no finite mask.)"""
    e, k = config.num_experts, config.top_k
    routed = soft_capped(logits[:, :e], config)  # [M, E]
    routing = _choose(logits[:, :e], routed, _routed_part(config), bias)
    chosen = routed.gather(1, routing.topk_ids.long())  # [M, k]
    shared = soft_capped(logits[:, e:], config)  # [M, S]
    both = torch.nn.functional.logsigmoid(torch.cat([chosen, shared], dim=1))  # [M, k + S]
    weights = torch.softmax(both, dim=-1)
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    weights = weights.to(logits.dtype)
    return Routing(topk_ids=routing.topk_ids, topk_weights=weights[:, :k], masked_tokens=routing.masked_tokens,
                   shared_weights=weights[:, k:])


def _check_logits(router_logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2 or router_logits.shape[1] != config.router_width:
        raise ValueError(f"router_logits must have shape [M, {_width(config)}], got {tuple(router_logits.shape)}")
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating-point tensor, got {router_logits.dtype}")
    # [M, E] float32, or float64 when given: the weights follow, so float64 gradients check (gradcheck)
    logits = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32))
    if config.nonfinite != "raise" or logits.numel() == 0:
        return logits
    assert_logits_finite(torch.isfinite(logits).all(), logits)
    return logits


def assert_logits_finite(all_finite: torch.Tensor, logits: torch.Tensor) -> None:
    """The ``nonfinite="raise"`` contract, given the flag [] bool: a device-side assert on the GPU and
    while compiling (no host sync, so the path stays CUDA-graph capturable and traces whole), a
    ``ValueError`` naming the first bad token rows on the CPU."""
    if logits.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(all_finite, "router_logits contains NaN or infinite values")
    elif not bool(all_finite):
        bad = (~torch.isfinite(logits)).any(dim=1).nonzero()[:5, 0].tolist()
        raise ValueError(
            f"router_logits contains NaN or infinite values (first bad token rows: {bad}); "
            "pass MoEConfig(nonfinite='mask') to mask those experts instead"
        )


def check_bias(bias: torch.Tensor | None, config: MoEConfig, device: torch.device) -> torch.Tensor | None:
    """The correction bias as float32 [E], or an error naming it: wrong type, shape, device or dtype, or a
    NaN/inf value (a ValueError on the CPU, a device-side assert elsewhere: no host sync)."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"correction_bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.shape != (config.choice_width,):
        raise ValueError(f"correction_bias must have shape [{_width(config, config.choice_width)}], got "
                         f"{tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"correction_bias must be on {device} like router_logits, got {bias.device}")
    if not bias.is_floating_point():
        raise TypeError(f"correction_bias must be a floating-point tensor, got {bias.dtype}")
    bias = bias.float()  # [E]
    all_finite = torch.isfinite(bias).all()
    if bias.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(all_finite, "correction_bias contains NaN or infinite values")  # no host sync
    elif not bool(all_finite):
        bad = (~torch.isfinite(bias)).nonzero()[:5, 0].tolist()
        raise ValueError(f"correction_bias contains NaN or infinite values (first bad experts: {bad})")
    return bias


def _width(config: MoEConfig, width: int | None = None) -> str:
    """A width in words (the router's by default): ``num_experts=E``, with identity experts ``num_experts +
    num_identity_experts=E+Z``, with router-weighted shared slots ``num_experts + num_shared_slots=E+S``."""
    width = config.router_width if width is None else width
    names = ["num_experts"] + ["num_identity_experts"] * bool(config.num_identity_experts)
    names += ["num_shared_slots"] * (width > config.choice_width)
    return f"{' + '.join(names)}={width}"


def soft_capped(logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """logits [M, E] as the router scores them: c * tanh(logits / c) with ``router_logit_softcap`` c > 0
    (Laguna's order of operations), else the logits themselves."""
    cap = config.router_logit_softcap
    return logits if not cap else torch.tanh(logits / cap) * cap


def _topk_lower_id_wins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties broken towards the lower index."""
    # A stable descending sort keeps equal scores in index order; topk makes no such promise.
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # [M, k]


def _topk_tiered(scores: torch.Tensor, tier: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best per row: the lowest tier first, then the largest score, then the lower index."""
    by_score = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [M, E]
    by_tier = torch.sort(tier.gather(1, by_score), dim=-1, stable=True).indices  # [M, E]; stable keeps score order
    return by_score.gather(1, by_tier)[:, :k]  # [M, k]


def _allowed_experts(
    choice: torch.Tensor, finite: torch.Tensor | None, config: MoEConfig, biased: bool
) -> torch.Tensor:
    """[M, E] bool: the experts of each token's best ``topk_group`` groups (all True without groups).

    ``choice`` [M, E] holds the biased scores, -inf where ``finite`` is False (masked experts)."""
    num_tokens, num_groups = choice.shape[0], config.n_group
    if num_groups == 1:
        return torch.ones_like(choice, dtype=torch.bool)
    per_group = config.num_experts // num_groups
    grouped = choice.view(num_tokens, num_groups, per_group)  # [M, G, E/G]
    top2_sum = config.group_score == "top2_sum" or (config.group_score == "auto" and biased)
    if top2_sum and per_group >= 2:
        top2 = grouped.topk(2, dim=-1).values  # [M, G, 2]; masked experts are -inf, so they come last
        group_scores = top2.sum(dim=-1)  # [M, G]
        if finite is not None:  # one finite expert: its score alone; none: -inf (top2[..., 0] is -inf)
            num_finite = finite.view(num_tokens, num_groups, per_group).sum(dim=-1)  # [M, G]
            group_scores = torch.where(num_finite >= 2, group_scores, top2[..., 0])
    else:
        group_scores = grouped.max(dim=-1).values  # [M, G]
    if finite is None:
        keep = _topk_lower_id_wins(group_scores, config.topk_group)  # [M, topk_group]
    else:  # a group with no finite expert comes after every group with one, whatever the scores
        empty = ~finite.view(num_tokens, num_groups, per_group).any(dim=-1)  # [M, G]
        keep = _topk_tiered(group_scores, empty.to(torch.int8), config.topk_group)  # [M, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [M, G]
    return group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, config.num_experts)  # [M, E]


def _weights(
    logits: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor, chosen_finite: torch.Tensor | None,
    config: MoEConfig) -> torch.Tensor:
    """Weights of the chosen experts [M, k]; ``chosen_finite`` [M, k] (mask mode) zeroes masked slots
    and keeps them out of the renormalisation."""
    if config.renormalize:
        # softmax over the chosen log-scores == w_i / sum_j w_j, without underflow to 0/0.
        chosen_logits = logits.gather(1, topk_ids)  # [M, k]
        log_scores = router_log_scores(chosen_logits, config.scoring)
        if chosen_finite is not None:
            log_scores = log_scores.masked_fill(~chosen_finite, float("-inf"))
        weights = torch.softmax(log_scores, dim=-1)  # NaN on a row with no finite slot: zeroed below
        if config.renorm_eps:
            weights = weights * _eps_factor(log_scores, logits, config)
        elif config.renorm_clamp:
            weights = weights * _clamp_factor(log_scores, logits, config)
    else:
        weights = scores.gather(1, topk_ids)  # [M, k]
    if chosen_finite is not None:
        weights = torch.where(chosen_finite, weights, 0.0)
    scale = config.routed_weight_scale
    if scale != 1.0:
        weights = weights * scale
    return weights.to(logits.dtype)

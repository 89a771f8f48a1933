"""Routing with masked (non-finite) logits and checked correction biases, against a float64 per-token
loop written here from route()'s documented definition, independently of moekit.routing."""

import math

import pytest
import torch

from moekit import MoEConfig, route
from moekit.layer import MoE

INF = float("inf")


def masked_reference(logits, cfg, bias=None):
    """float64, one token at a time: (ids [M, k], weights [M, k], tokens with no finite expert)."""
    ids, weights, lost = [], [], 0
    for row in logits.double().tolist():
        finite = [math.isfinite(v) for v in row]
        lost += not any(finite)
        scores = _scores(row, finite, cfg.scoring)
        choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        allowed = _allowed(choice, finite, cfg, bias is not None)
        # finite experts first (best biased score, then lower id), then masked ones by id
        chosen = sorted(allowed, key=lambda e: (not finite[e], -choice[e] if finite[e] else 0.0, e))[: cfg.top_k]
        w = [scores[e] if finite[e] else 0.0 for e in chosen]
        if cfg.renormalize and sum(w) > 0:
            w = [v / sum(w) for v in w]
        ids.append(chosen)
        weights.append([v * cfg.routed_scaling_factor for v in w])
    k = cfg.top_k
    return (torch.tensor(ids, dtype=torch.int32).view(-1, k), torch.tensor(weights, dtype=torch.float64).view(-1, k),
            lost)


def _scores(row, finite, scoring):
    if scoring == "sigmoid":
        return [1.0 / (1.0 + math.exp(-v)) if f else 0.0 for v, f in zip(row, finite)]
    if not any(finite):
        return [0.0] * len(row)
    top = max(v for v, f in zip(row, finite) if f)
    exps = [math.exp(v - top) if f else 0.0 for v, f in zip(row, finite)]
    return [e / sum(exps) for e in exps]


def _allowed(choice, finite, cfg, biased):
    if cfg.n_group == 1:
        return list(range(cfg.num_experts))
    size = cfg.num_experts // cfg.n_group
    group_score = []
    for g in range(cfg.n_group):
        members = sorted((choice[e] for e in range(g * size, (g + 1) * size) if finite[e]), reverse=True)
        if not members:
            group_score.append(-INF)
        elif biased and size >= 2:
            group_score.append(sum(members[:2]))
        else:
            group_score.append(members[0])
    has_finite = [any(finite[g * size:(g + 1) * size]) for g in range(cfg.n_group)]
    groups = sorted(range(cfg.n_group), key=lambda g: (not has_finite[g], -group_score[g], g))[: cfg.topk_group]
    return [e for e in range(cfg.num_experts) if e // size in groups]


def random_masked_logits(m, e, seed):
    """Random logits with NaN/+inf/-inf masks of varying density, one fully masked row and one row with
    a single finite expert."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, e, generator=g) * 3
    density = torch.rand(m, 1, generator=g)  # per row: from nearly clean to nearly all masked
    masked = torch.rand(m, e, generator=g) < density
    kind = torch.randint(0, 3, (m, e), generator=g)
    bad = torch.tensor([float("nan"), INF, -INF])[kind]  # [M, E]
    logits = torch.where(masked, bad, logits)
    logits[0] = float("nan")
    logits[1, :] = -INF
    logits[1, e - 1] = 0.5
    return logits


GROUPINGS = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 3), (8, 2), (8, 5)]  # (n_group, topk_group) with E = 16


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("n_group, topk_group", GROUPINGS)
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("renormalize", [True, False])
def test_masked_routing_matches_reference(scoring, n_group, topk_group, use_bias, renormalize):
    top_k = min(4, topk_group * 16 // n_group)
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=16, top_k=top_k, scoring=scoring,
                    n_group=n_group, topk_group=topk_group, renormalize=renormalize, routed_scaling_factor=1.5,
                    use_correction_bias=use_bias, nonfinite="mask")
    seed = 100 * n_group + 10 * topk_group + 2 * use_bias + renormalize
    logits = random_masked_logits(96, 16, seed)
    bias = torch.randn(16, generator=torch.Generator().manual_seed(seed)) * 0.5 if use_bias else None
    got = route(logits, cfg, bias)
    ids, weights, lost = masked_reference(logits, cfg, bias)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-7)
    assert int(got.masked_tokens) == lost >= 1


def issue_config(**changes):
    base = dict(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=1, scoring="sigmoid", n_group=2,
                topk_group=1, use_correction_bias=True, nonfinite="mask")
    return MoEConfig(**{**base, **changes})


def test_issue_example_masked_expert_does_not_sink_its_group():
    got = route(torch.tensor([[float("nan"), 5.0, -3.0, -3.0]]), issue_config(), torch.zeros(4))
    assert got.topk_ids.tolist() == [[1]]
    assert got.topk_weights.tolist() == [[1.0]]


def test_single_finite_expert_keeps_its_weight():
    nan = float("nan")
    got = route(torch.tensor([[nan, nan, 2.0, nan]]), issue_config(), torch.zeros(4))
    assert got.topk_ids.tolist() == [[2]] and got.topk_weights.tolist() == [[1.0]]
    assert int(got.masked_tokens) == 0


def test_token_with_no_finite_expert_is_counted_in_stats():
    cfg = issue_config(top_k=2, topk_group=2)
    moe = MoE(cfg)
    x = torch.randn(5, 16)
    x[3] = float("nan")  # every logit of token 3 is NaN
    stats = moe(x, return_stats=True).stats
    assert stats.masked_tokens == 1
    assert route(torch.randn(4, 4), issue_config()).masked_tokens.item() == 0
    assert route(torch.randn(4, 4), issue_config(nonfinite="raise")).masked_tokens.item() == 0


@pytest.mark.parametrize("bad", [float("nan"), INF, -INF])
def test_nonfinite_correction_bias_raises(bad):
    bias = torch.zeros(4)
    bias[2] = bad
    for nonfinite in ("raise", "mask"):
        with pytest.raises(ValueError, match=r"correction_bias contains NaN or infinite values .*\[2\]"):
            route(torch.randn(3, 4), issue_config(nonfinite=nonfinite), bias)
    moe = MoE(issue_config())
    with torch.no_grad():
        moe.e_score_correction_bias.fill_(bad)
    with pytest.raises(ValueError, match="correction_bias"):
        moe(torch.randn(3, 16))


def test_bad_correction_bias_type_is_named():
    with pytest.raises(TypeError, match="correction_bias must be a floating-point tensor"):
        route(torch.randn(3, 4), issue_config(), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="correction_bias must be a torch.Tensor"):
        route(torch.randn(3, 4), issue_config(), [0.0] * 4)

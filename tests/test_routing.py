"""Routing against a float64 per-token reference written here, independently of moekit.routing."""

import math

import pytest
import torch

from moekit import MoEConfig, route
from moekit.routing import Routing, append_shared_slots


def reference_route(logits, cfg, bias=None):
    """Per-token float64 loop: scores, grouped selection, lower id wins ties, renormalise, scale."""
    ids, weights = [], []
    for row in logits.double().tolist():
        if cfg.scoring == "softmax":
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[i])) for i, s in enumerate(scores)]
        allowed = range(cfg.num_experts)
        if cfg.n_group > 1:
            size = cfg.num_experts // cfg.n_group
            group_score = []
            for g in range(cfg.n_group):
                members = sorted(choice[g * size:(g + 1) * size], reverse=True)
                group_score.append(sum(members[:2]) if bias is not None else members[0])
            groups = sorted(range(cfg.n_group), key=lambda g: (-group_score[g], g))[: cfg.topk_group]
            allowed = [e for e in range(cfg.num_experts) if e // size in groups]
        chosen = sorted(allowed, key=lambda e: (-choice[e], e))[: cfg.top_k]
        w = [scores[e] for e in chosen]
        if cfg.renormalize:
            if cfg.scoring == "sigmoid":  # exact ratios even where sigmoid underflows: w_i / sum w = softmax(log w)
                logs = [-math.log1p(math.exp(-row[e])) if row[e] > -30 else row[e] for e in chosen]
                top = max(logs)
                w = [math.exp(v - top) for v in logs]
            w = [v / sum(w) for v in w]
        ids.append(chosen)
        weights.append([v * cfg.routed_scaling_factor for v in w])
    return (torch.tensor(ids, dtype=torch.int32).view(-1, cfg.top_k),
            torch.tensor(weights, dtype=torch.float64).view(-1, cfg.top_k))


def assert_matches(logits, cfg, bias=None):
    got = route(logits, cfg, bias)
    ids, weights = reference_route(logits, cfg, bias)
    assert got.topk_ids.dtype == torch.int32 and got.topk_weights.dtype == torch.float32
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-7)
    return got


SOFTMAX = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=12, top_k=3)
SIGMOID = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sigmoid",
                    n_group=4, topk_group=2, routed_scaling_factor=2.5, use_correction_bias=True)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_reference(renormalize):
    cfg = SOFTMAX.replace(renormalize=renormalize)
    got = assert_matches(torch.randn(64, 12, generator=torch.Generator().manual_seed(1)) * 3, cfg)
    if not renormalize:  # the chosen experts' softmax probabilities, never raw logits
        assert (got.topk_weights > 0).all() and (got.topk_weights.sum(1) < 1).all()


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("renormalize", [True, False])
def test_sigmoid_grouped_with_bias_matches_reference(use_bias, renormalize):
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(16, generator=g) * 0.5 if use_bias else None
    assert_matches(torch.randn(64, 16, generator=g) * 2, SIGMOID.replace(renormalize=renormalize), bias)


def test_bias_changes_selection_not_weights():
    cfg = SIGMOID.replace(n_group=1, topk_group=1, renormalize=False, routed_scaling_factor=1.0, top_k=1)
    logits = torch.zeros(1, 16)
    logits[0, 3] = 1.0
    bias = torch.zeros(16)
    bias[7] = 5.0
    got = route(logits, cfg, bias)
    assert got.topk_ids.item() == 7
    assert got.topk_weights.item() == pytest.approx(0.5)  # sigmoid(0): the unbiased score of expert 7


def test_masked_groups_cannot_be_chosen():
    cfg = SIGMOID.replace(top_k=2, topk_group=1)
    logits = torch.full((1, 16), -5.0)
    logits[0, 0] = 5.0  # group 0 wins on its max+second
    logits[0, 1] = 4.0
    logits[0, 5] = 4.5  # best expert of group 1, not allowed
    got = route(logits, cfg, torch.zeros(16))
    assert sorted(got.topk_ids[0].tolist()) == [0, 1]


def test_ties_lower_id_wins():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 1.0] * 2])
    cfg = SOFTMAX.replace(top_k=4)
    got = assert_matches(logits, cfg)
    assert got.topk_ids[0].tolist() == [1, 2, 4, 7]


def test_all_equal_logits():
    got = assert_matches(torch.zeros(3, 12), SOFTMAX)
    assert got.topk_ids.tolist() == [[0, 1, 2]] * 3
    torch.testing.assert_close(got.topk_weights, torch.full((3, 3), 1 / 3))
    got = assert_matches(torch.zeros(2, 16), SIGMOID, torch.zeros(16))
    assert got.topk_ids.tolist() == [[0, 1, 2, 3]] * 2  # groups 0 and 1 (experts 0-7) win the tie; lower ids first


def test_sigmoid_underflow_stays_finite_and_sums_to_scaling():
    g = torch.Generator().manual_seed(3)
    logits = -100.0 + torch.randn(8, 16, generator=g)
    bias = torch.randn(16, generator=g) * 10
    got = assert_matches(logits, SIGMOID, bias)
    assert torch.isfinite(got.topk_weights).all()
    torch.testing.assert_close(got.topk_weights.sum(1), torch.full((8,), 2.5))
    deep = route(torch.full((2, 16), -200.0), SIGMOID, bias)  # sigmoid is exactly 0 in fp32 here
    torch.testing.assert_close(deep.topk_weights.sum(1), torch.full((2,), 2.5))


def test_top_k_equals_num_experts_and_single_group():
    cfg = SOFTMAX.replace(top_k=12)
    got = assert_matches(torch.randn(5, 12), cfg)
    assert sorted(got.topk_ids[0].tolist()) == list(range(12))
    assert_matches(torch.randn(5, 16), SIGMOID.replace(n_group=1, topk_group=1), torch.randn(16))


def test_nonfinite_logits_raise_by_default_and_mask_on_request():
    logits = torch.randn(4, 12)
    logits[2, 5] = float("nan")
    logits[3, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite.*\\[2, 3\\]"):
        route(logits, SOFTMAX)
    got = route(logits, SOFTMAX.replace(nonfinite="mask"))
    assert torch.isfinite(got.topk_weights).all()
    assert 5 not in got.topk_ids[2].tolist() and 1 not in got.topk_ids[3].tolist()
    ref = route(logits[:2], SOFTMAX)
    assert torch.equal(got.topk_ids[:2], ref.topk_ids)


def test_empty_batch():
    got = route(torch.zeros(0, 12), SOFTMAX)
    assert got.topk_ids.shape == (0, 3) and got.topk_weights.shape == (0, 3)
    shared = SIGMOID.replace(shared_expert_intermediate_size=8)
    grouped = append_shared_slots(route(torch.zeros(0, 16), shared, torch.zeros(16)), shared)
    assert grouped.topk_ids.shape == (0, 5) and grouped.topk_weights.shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=13), "top_k must be <= num_experts"),
        (dict(n_group=5), "divisible by n_group"),
        (dict(n_group=4, topk_group=5), "topk_group must be <= n_group"),
        (dict(n_group=4, topk_group=1, top_k=4), "exceeds the experts"),
        (dict(scoring="relu"), "scoring must be"),
    ],
)
def test_bad_config_names_the_argument(kwargs, match):
    base = dict(hidden_size=8, moe_intermediate_size=8, num_experts=12, top_k=3)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="router_logits must have shape"):
        route(torch.randn(4, 11), SOFTMAX)
    with pytest.raises(TypeError, match="floating-point"):
        route(torch.ones(4, 12, dtype=torch.int64), SOFTMAX)
    with pytest.raises(ValueError, match="correction_bias must have shape"):
        route(torch.randn(4, 16), SIGMOID, torch.zeros(15))


def test_shared_slots_appended_with_weight_one_or_gate():
    cfg = SIGMOID.replace(shared_expert_intermediate_size=16)  # two slots of width 8
    got = append_shared_slots(route(torch.randn(5, 16), cfg, torch.zeros(16)), cfg)
    assert got.topk_ids[:, 4:].tolist() == [[16, 17]] * 5
    assert (got.topk_weights[:, 4:] == 1).all()
    gated = cfg.replace(shared_expert_gate=True)
    gate_logits = torch.randn(5, 1)
    routing = Routing(got.topk_ids[:, :4], got.topk_weights[:, :4])
    out = append_shared_slots(routing, gated, gate_logits)
    torch.testing.assert_close(out.topk_weights[:, 4:], torch.sigmoid(gate_logits).expand(5, 2))
    with pytest.raises(ValueError, match="shared_gate_logits must have shape"):
        append_shared_slots(routing, gated, None)

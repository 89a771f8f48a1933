"""The router options of session 34 (``MoEConfig.changed_router_options``), each against a float64 per-token loop
written here: Laguna's logit soft-cap, Kolibri's correction bias on the logits, the group score rule (max / top-2
sum, whatever the bias) and the dropped groups' fill (A.X-K2, Mistral-4), Cohere2-MoE's averaged shared expert,
LongCat-Flash's identity experts and Llama-4's input-weighted experts (the router and the whole layer); their
checks; and the fallback every fused path takes for them.

Shapes: M tokens, E experts, k = top_k, G groups, K hidden, N expert width.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from moekit import MoE, MoEConfig, route
from moekit.losses import configured_aux_loss, z_loss
from moekit.routing import append_shared_slots, fused

BASE = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sigmoid", n_group=4,
                 topk_group=2, use_correction_bias=True, routed_scaling_factor=2.5)


def _group_scores(choice, finite, cfg, biased):
    """Each group's score over its finite experts: the top-2 sum or the max (-inf for a group with none)."""
    size, scores = cfg.num_experts // cfg.n_group, []
    top2 = cfg.group_score == "top2_sum" or (cfg.group_score == "auto" and biased)
    for g in range(cfg.n_group):
        members = sorted((choice[e] for e in range(g * size, (g + 1) * size) if finite[e]), reverse=True)
        if not members:
            scores.append(-math.inf)
        else:
            scores.append(sum(members[:2]) if top2 and len(members) >= 2 else members[0])
    return scores


def reference_route(logits, cfg, bias=None):
    """Per-token float64 loop: cap, score (finite experts only), choose (bias on scores or logits; groups with the
    fill), weight from the unbiased scores, renormalise over the finite chosen, scale (halved when averaged)."""
    ids, weights = [], []
    for raw in logits.double().tolist():
        finite = [math.isfinite(v) for v in raw]
        cap = cfg.router_logit_softcap
        row = [cap * math.tanh(v / cap) if cap and f else v for v, f in zip(raw, finite)]
        if cfg.scoring == "softmax":
            top = max(v for v, f in zip(row, finite) if f)
            exps = [math.exp(v - top) if f else 0.0 for v, f in zip(row, finite)]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) if f else 0.0 for v, f in zip(row, finite)]
        base = scores if cfg.correction_bias_on == "scores" else row
        choice = [base[e] + (0.0 if bias is None else float(bias[e])) if finite[e] else -math.inf
                  for e in range(cfg.router_width)]
        if cfg.n_group > 1:
            size = cfg.num_experts // cfg.n_group
            group_score = _group_scores(choice, finite, cfg, bias is not None)
            kept = sorted(range(cfg.n_group), key=lambda g: (-group_score[g], g))[: cfg.topk_group]
            for e in range(cfg.num_experts):
                if e // size not in kept and finite[e]:
                    choice[e] = 0.0 if cfg.dropped_group_fill == "zero" else -math.inf
        chosen = sorted(range(cfg.router_width), key=lambda e: (not finite[e], -choice[e], e))[: cfg.top_k]
        w = [scores[e] for e in chosen]
        if cfg.renormalize:
            w = [v / sum(w) for v in w]
        scale = cfg.routed_scaling_factor * (0.5 if cfg.shared_expert_combine == "average" else 1.0)
        ids.append(chosen)
        weights.append([v * scale for v in w])
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


def assert_matches(logits, cfg, bias=None):
    got = route(logits, cfg, bias)
    ids, weights = reference_route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-7)
    return got


def _inputs(seed, rows=64, scale=2.0, bias_shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 16, generator=g) * scale, torch.randn(16, generator=g) * 0.5 + bias_shift


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_logit_softcap(scoring, renormalize):
    """Laguna: c * tanh(logits / c) before the scoring; logits of +-10 against c = 3 change the routing."""
    cfg = BASE.replace(scoring=scoring, renormalize=renormalize, router_logit_softcap=3.0, n_group=1, topk_group=1)
    logits, bias = _inputs(1, scale=5.0)
    got = assert_matches(logits, cfg, bias)
    assert not torch.equal(got.topk_weights, route(logits, cfg.replace(router_logit_softcap=0.0), bias).topk_weights)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("groups", [1, 4])
def test_correction_bias_on_the_logits(renormalize, groups):
    """Kolibri: the bias shifts the raw logits for the choice; the weights are the chosen logits' sigmoids."""
    cfg = BASE.replace(correction_bias_on="logits", renormalize=renormalize, n_group=groups,
                       topk_group=min(2, groups), routed_scaling_factor=1.0)
    logits, bias = _inputs(2)
    got = assert_matches(logits, cfg, bias * 4)
    assert not torch.equal(got.topk_ids, route(logits, cfg.replace(correction_bias_on="scores"), bias * 4).topk_ids)


@pytest.mark.parametrize("scoring", ["sigmoid", "softmax"])
@pytest.mark.parametrize("group_score", ["auto", "max", "top2_sum"])
@pytest.mark.parametrize("fill", ["-inf", "zero"])
@pytest.mark.parametrize("biased", [True, False])
def test_group_rules(scoring, group_score, fill, biased):
    """Every group rule with and without a bias, both fills; a bias mostly below 0 lets the zero fill's dropped
    groups win slots (A.X-K2), which the -inf fill never allows."""
    cfg = BASE.replace(scoring=scoring, group_score=group_score, dropped_group_fill=fill)
    logits, bias = _inputs(3, bias_shift=-1.0)
    got = assert_matches(logits, cfg, bias if biased else None)
    size = cfg.num_experts // cfg.n_group
    groups_used = torch.stack([(got.topk_ids // size == g).any(dim=1) for g in range(cfg.n_group)]).sum(dim=0)
    if fill == "-inf":
        assert (groups_used <= cfg.topk_group).all()
    elif biased and scoring == "sigmoid":
        assert (groups_used > cfg.topk_group).any()


def test_masked_experts_with_every_option():
    """nonfinite="mask": a NaN / inf logit's expert takes no mass, is never chosen over a finite one and scores its
    group nothing, with the soft-cap, the bias on the logits, the top-2 sum rule and the zero fill all on."""
    cfg = BASE.replace(nonfinite="mask", router_logit_softcap=4.0, correction_bias_on="logits",
                       group_score="top2_sum", dropped_group_fill="zero")
    logits, bias = _inputs(4, scale=4.0)
    g = torch.Generator().manual_seed(5)
    rows, cols = torch.arange(0, 64, 2), torch.randint(0, 16, (32,), generator=g)
    logits[rows, cols] = torch.tensor([math.nan, math.inf, -math.inf, math.nan]).repeat(8)
    got = assert_matches(logits, cfg, bias)
    assert int(got.masked_tokens) == 0


def test_averaged_shared_expert_halves_both_sides():
    """Cohere2-MoE: the routed weights and the shared slots' weight halved (exactly: a power of 2)."""
    summed = BASE.replace(shared_expert_intermediate_size=16)
    averaged = summed.replace(shared_expert_combine="average")
    logits, bias = _inputs(6)
    assert_matches(logits, averaged, bias)
    half, full = route(logits, averaged, bias), route(logits, summed, bias)
    assert torch.equal(half.topk_ids, full.topk_ids) and torch.equal(half.topk_weights, full.topk_weights * 0.5)
    slots = append_shared_slots(half, averaged).topk_weights[:, -averaged.num_shared_slots:]
    assert torch.equal(slots, torch.full_like(slots, 0.5))


def _mlp(x, w13, w2, b13=0.0, b2=0.0):
    """One gated SiLU MLP in float64: x [K], w13 [2N, K], w2 [K, N] (+ b13 [2N], b2 [K]) -> [K]."""
    b13, b2 = (b if isinstance(b, float) else b.double() for b in (b13, b2))
    gate, up = (w13.double() @ x + b13).chunk(2)
    return w2.double() @ (gate * torch.sigmoid(gate) * up) + b2


@pytest.mark.parametrize("fuse_shared", [True, False])
def test_layer_averages_routed_and_shared(fuse_shared):
    """The whole layer with shared_expert_combine="average": (routed + shared) / 2 per token, against a float64
    loop over the token's experts and the shared MLP (fused slots or the separate MLP)."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2,
                    shared_expert_intermediate_size=16, shared_expert_combine="average")
    torch.manual_seed(7)
    moe = MoE(cfg, fuse_shared=fuse_shared)
    x = torch.randn(9, 16)
    with torch.no_grad():
        got = moe(x).double()
        logits = moe.gate(x)
    ids, weights = reference_route(logits, cfg)
    e = cfg.num_experts
    for t in range(x.shape[0]):
        routed = sum(w * _mlp(x[t].double(), moe.w13[i], moe.w2[i]) for i, w in zip(ids[t].tolist(), weights[t]))
        if fuse_shared:
            shared = sum(_mlp(x[t].double(), moe.w13[s], moe.w2[s]) for s in range(e, e + cfg.num_shared_slots))
        else:
            shared = _mlp(x[t].double(), moe.shared_w13, moe.shared_w2)
        torch.testing.assert_close(got[t], routed + 0.5 * shared.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_layer_with_identity_experts(scoring):
    """LongCat-Flash: the router spans E + Z experts (its gate and bias too); an identity slot adds its weight
    times the token and runs no expert (not counted in the stats), against a float64 loop over the token's slots."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=3, scoring=scoring,
                    renormalize=False, routed_scaling_factor=2.0, use_correction_bias=True, num_identity_experts=4,
                    aux_loss_coef=0.01)
    torch.manual_seed(9)
    moe = MoE(cfg)
    assert moe.gate.weight.shape == (10, 16) and moe.e_score_correction_bias.shape == (10,)
    moe.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(12, 16)
    with torch.no_grad():
        result = moe(x, return_stats=True)
        ids, weights = reference_route(moe.gate(x), cfg, moe.e_score_correction_bias)
    assert (ids >= 6).any() and (ids < 6).any()  # both kinds of slot are exercised
    for t in range(x.shape[0]):
        want = sum(w * (_mlp(x[t].double(), moe.w13[i], moe.w2[i]) if i < 6 else x[t].double())
                   for i, w in zip(ids[t].tolist(), weights[t]))
        torch.testing.assert_close(result.out[t].double(), want.detach(), rtol=1e-5, atol=1e-6)
    assert int(result.stats.counts.sum()) == int((ids < 6).sum()) and result.aux_loss is not None


def test_layer_with_input_weighted_experts():
    """Llama-4: each chosen expert runs on its weight times the token (not weighted after), the shared MLP on the
    token itself (never fused: its slots would be input-weighted too), against a float64 loop."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2, scoring="sigmoid",
                    renormalize=False, shared_expert_intermediate_size=8, expert_weight_on="input")
    torch.manual_seed(10)
    moe = MoE(cfg, fuse_shared=True)
    x = torch.randn(7, 16)
    with torch.no_grad():
        got = moe(x)
        ids, weights = reference_route(moe.gate(x), cfg)
    assert not moe.fuse_shared
    for t in range(x.shape[0]):
        xt = x[t].double()
        want = _mlp(xt, moe.shared_w13, moe.shared_w2) + sum(
            _mlp(w * xt, moe.w13[i], moe.w2[i]) for i, w in zip(ids[t].tolist(), weights[t]))
        torch.testing.assert_close(got[t].double(), want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "grouped_mm"])
def test_input_weighted_experts_with_biases_skip_masked_slots(backend):
    """Llama-4's experts with expert biases and masked experts (nonfinite="mask"): a masked slot's weight is 0 and
    adds nothing, a token with no finite logit outputs 0 (fuzz37: each masked slot ran expert(0 x) = w2 glu(b13) +
    b2, the masked tokens' output was O(1))."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=3, expert_weight_on="input",
                    expert_bias=True, nonfinite="mask")
    torch.manual_seed(11)
    moe = MoE(cfg, backend=backend).eval()
    x = torch.randn(5, 16)
    with torch.no_grad():
        moe.b13.normal_()
        moe.b2.normal_()
        moe.gate.weight[1:5] = float("nan")  # experts 0 and 5 finite: the third slot of every token is masked
        got = moe(x)
        ids, weights = reference_route(moe.gate(x), cfg)
        for t in range(x.shape[0]):
            xt = x[t].double()
            want = sum(_mlp(w * xt, moe.w13[i], moe.w2[i], moe.b13[i], moe.b2[i])
                       for i, w in zip(ids[t].tolist(), weights[t]) if w != 0)
            torch.testing.assert_close(got[t].double(), want, rtol=1e-5, atol=1e-6)
        moe.gate.weight[:] = float("nan")
        result = moe(x, return_stats=True)
    assert result.stats.masked_tokens == 5 and torch.equal(result.out, torch.zeros_like(x))


@pytest.mark.parametrize("changes", [
    {"expert_weight_on": "input", "shared_expert_intermediate_size": 8},
    {"num_identity_experts": 3, "use_correction_bias": True},
    {"shared_expert_intermediate_size": 8, "shared_expert_combine": "average"},
    {"router_logit_softcap": 1.0, "scoring": "sigmoid", "correction_bias_on": "logits", "use_correction_bias": True},
], ids=["input_weighted", "identity", "average", "softcap_logit_bias"])
def test_gradients_through_the_options(changes):
    """float64 gradcheck of the layer's output in x and in the gate weight (the router's weights carry the
    gradient: through the soft-cap, the identity slots' w x, the input-weighted experts' w x)."""
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2, **changes)
    torch.manual_seed(11)
    moe = MoE(cfg).double()
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, gate: moe(x), (x, moe.gate.weight), eps=1e-6, atol=1e-5)


def test_losses_read_the_capped_logits():
    cfg = BASE.replace(router_logit_softcap=3.0, z_loss_coef=1.0)
    logits = _inputs(8, scale=6.0)[0]
    ids = route(logits, cfg).topk_ids
    torch.testing.assert_close(configured_aux_loss(cfg, logits, ids, 64), z_loss(3.0 * torch.tanh(logits / 3.0)))


@pytest.mark.parametrize("changes, says", [
    ({"correction_bias_on": "weights"}, "correction_bias_on must be one of ('scores', 'logits')"),
    ({"group_score": "top3_sum"}, "group_score must be one of ('auto', 'max', 'top2_sum')"),
    ({"dropped_group_fill": 0.0}, "dropped_group_fill must be one of ('-inf', 'zero')"),
    ({"shared_expert_combine": "mean", "shared_expert_intermediate_size": 8}, "shared_expert_combine must be one of"),
    ({"router_logit_softcap": -1.0}, "router_logit_softcap must be a finite number >= 0"),
    ({"router_logit_softcap": math.inf}, "router_logit_softcap must be a finite number >= 0"),
    ({"router_logit_softcap": True}, "router_logit_softcap must be a finite number >= 0"),
    ({"group_score": "top2_sum", "n_group": 16, "topk_group": 4}, "group_score='top2_sum' needs >= 2 experts a group"),
    ({"shared_expert_combine": "average"}, "shared_expert_combine='average' needs shared_expert_intermediate_size"),
    ({"num_identity_experts": -1}, "num_identity_experts must be an int >= 0"),
    ({"expert_weight_on": "both"}, "expert_weight_on must be one of ('output', 'input')"),
    ({"num_identity_experts": 2}, "num_identity_experts > 0 routes without expert groups"),
    ({"num_identity_experts": 2, "n_group": 1, "top_k": 19}, "top_k must be <= num_experts + num_identity_experts"),
])
def test_bad_options_are_named(changes, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        BASE.replace(**changes)


COMPUTED = [{"router_logit_softcap": 30.0}, {"correction_bias_on": "logits"}, {"group_score": "top2_sum"},
            {"group_score": "max"}, {"dropped_group_fill": "zero"},
            {"shared_expert_combine": "average", "shared_expert_intermediate_size": 8}]
ROUTE_ONLY = [{"num_identity_experts": 2, "n_group": 1, "topk_group": 1}, {"expert_weight_on": "input"},
              {"sparsemixer_jitter_eps": 0.2, "scoring": "softmax", "n_group": 1, "topk_group": 1, "top_k": 2,
               "renormalize": False, "use_correction_bias": False, "routed_scaling_factor": 1.0},
              {"shared_expert_combine": "router", "shared_expert_intermediate_size": 8, "n_group": 1, "topk_group": 1}]


def _option_id(changes: dict) -> str:
    return next(iter(changes)) + "=" + str(next(iter(changes.values())))


@pytest.mark.parametrize("changes", ROUTE_ONLY, ids=_option_id)
def test_every_fused_path_falls_back_to_route(changes, monkeypatch):
    """A config with an option the fused kernel does not compute: the layer's "auto" router on CUDA is ``route`` (no
    fused router, hence no one gate + router launch and no decode fast path entry); "fused" raises naming the
    option. The default config keeps the fused router."""
    cfg = BASE.replace(**changes)
    name = next(iter(changes))
    assert cfg.changed_router_options() == {name: changes[name]} and not fused.computes(cfg)
    assert fused.fused_router(cfg, torch.device("cuda")) is None
    assert fused.computes(BASE) and fused.fused_router(BASE, torch.device("cuda")) is not None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=f"the router options it computes; got .*{name}"):
        MoE(cfg, router="fused")
    moe = MoE(cfg, router="auto")
    assert moe._fused_router is None and moe._gate_route is None


@pytest.mark.parametrize("changes", COMPUTED, ids=_option_id)
def test_options_the_fused_router_computes(changes, monkeypatch):
    """An option the fused kernel computes (``tests/test_routing_fused_options.py``): "fused" takes it, and so does
    "auto" on CUDA: the one gate + router launch and the decode fast path with it."""
    cfg = BASE.replace(**changes)
    assert fused.computes(cfg) and fused.fused_router(cfg, torch.device("cuda")) is not None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused.fused_router(cfg, "cpu", "fused") is not None

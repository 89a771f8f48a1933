"""The simulator with a config's router options: its routing is ``moekit.MoE``'s on the same gate weights and
tokens (every option the layer runs), and LongCat-Flash's identity slots are counted apart from the expert loads."""

from __future__ import annotations

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.sim import SimParams, simulate, streams
from moekit.sim.router import draw_tokens, make_router

E, K = 8, 2
SHAPE = dict(moe_intermediate_size=4, num_experts=E, top_k=K)
# Every router option moekit.MoE runs, one config each (the hidden size is set to the router's F below).
OPTIONS = {
    "plain": dict(),
    "softcap": dict(router_logit_softcap=1.5),
    "bias on logits": dict(scoring="sigmoid", use_correction_bias=True, correction_bias_on="logits"),
    "groups": dict(scoring="sigmoid", use_correction_bias=True, n_group=4, topk_group=2, group_score="top2_sum",
                   dropped_group_fill="zero"),
    "average shared": dict(shared_expert_intermediate_size=8, shared_expert_combine="average"),
    "identity experts": dict(num_identity_experts=4, renormalize=False, use_correction_bias=True),
    "input weighted": dict(expert_weight_on="input"),
    "sparsemixer": dict(renormalize=False, sparsemixer_jitter_eps=0.3),
    "inkling": dict(scoring="sigmoid", use_correction_bias=True, shared_expert_intermediate_size=8,
                    shared_expert_combine="router"),
}


def _config(options: dict) -> MoEConfig:
    width = MoEConfig(hidden_size=1, **SHAPE, **options).router_width
    return MoEConfig(hidden_size=width + 1, **SHAPE, **options)  # the layer's x is the router's [g, 1]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_sim_routing_is_the_layers(name):
    cfg = _config(OPTIONS[name])
    router = make_router(E, K, 0.4, seed=3, config=cfg)
    assert router.weight.shape == (cfg.router_width + 1, cfg.router_width)
    moe = MoE(cfg).eval()  # eval: the sparsemixer routes as at inference
    with torch.no_grad():
        moe.gate.weight.copy_(router.weight.t())
    bias = None
    if cfg.use_correction_bias:
        bias = torch.randn(cfg.choice_width, generator=torch.Generator().manual_seed(1)) * 0.1
        moe.e_score_correction_bias.copy_(bias)
    x = draw_tokens(40, router.width, torch.Generator().manual_seed(2))  # [40, F]
    sim = router.route(x, bias)
    layer = moe.route_tokens(x)
    assert torch.equal(sim.topk_ids, layer.selected_ids)
    identity = sim.topk_ids >= E  # [40, k]; the layer skips these slots (id -1, weight 0) and adds weight x token
    torch.testing.assert_close(layer.routing.topk_weights[:, :K], sim.topk_weights.masked_fill(identity, 0.0))
    if cfg.num_identity_experts:
        want = torch.where(identity, sim.topk_weights, 0.0).sum(1, keepdim=True)  # [40, 1]
        torch.testing.assert_close(layer.identity_weights, want)
    if sim.shared_weights is not None:  # Inkling's: appended as the fused shared slots' weights
        torch.testing.assert_close(layer.routing.topk_weights[:, K:], sim.shared_weights)


def test_identity_slots_are_counted_apart_as_the_layer_does():
    """loads [E] are the experts' work and identity_hits [Z] the identity slots, as MoEStats.counts and
    identity_counts count them on the same gate weights and tokens (a loop over the ids)."""
    cfg = _config(OPTIONS["identity experts"])
    params = SimParams(experts=E, top_k=K, tokens=64, skew=0.3, gpus=2, spare_slots=2, capacity_factor=64.0)
    result = simulate(params, cfg)
    router = make_router(E, K, 0.3, params.seed, cfg)
    x = draw_tokens(64, router.width, streams.generator(params.seed, streams.EVAL))
    ids = router.route(x).topk_ids.reshape(-1).tolist()
    want = [ids.count(e) for e in range(E + 4)]
    assert result.loads == want[:E] and result.identity_hits == want[E:]
    assert result.routed_assignments == sum(want[:E]) and result.zero_compute_share == sum(want[E:]) / (64 * K)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.gate.weight.copy_(router.weight.t())
    stats = moe(x, return_stats=True).stats
    assert stats.counts.tolist() == result.loads and stats.identity_counts.tolist() == result.identity_hits
    assert result.drop_rate == 0 and sum(result.kept) == result.routed_assignments
    assert result.router["num_identity_experts"] == 4


@pytest.mark.parametrize("balance", ["aux-loss", "bias"])
@pytest.mark.parametrize("name", ["identity experts", "inkling", "groups"])
def test_balancing_runs_with_the_options(name, balance):
    cfg = _config(OPTIONS[name])
    params = SimParams(experts=E, top_k=K, tokens=64, gpus=2, spare_slots=2, balance=balance, aux_steps=5,
                       bias_batches=5)
    result = simulate(params, cfg)
    assert sum(result.loads) == result.routed_assignments == 64 * K - sum(result.identity_hits)
    assert result.balance.steps == 5


def test_identity_bias_balancing_moves_only_the_routed_entries():
    """The sim's bias runs moekit.balance's rule: the identity experts' entries stay 0."""
    from moekit.sim.balance import update_bias

    cfg = _config(OPTIONS["identity experts"])
    outcome = update_bias(make_router(E, K, 0.6, 1, cfg), 20, seed=1)
    assert outcome.correction_bias.shape == (E + 4,) and outcome.correction_bias[E:].abs().sum() == 0
    assert outcome.correction_bias[:E].abs().sum() > 0


def test_a_config_of_other_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts=8, top_k=2"):
        simulate(SimParams(experts=16, top_k=2), _config({}))

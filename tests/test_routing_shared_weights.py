"""Inkling's router-weighted shared experts (``MoEConfig.shared_expert_combine="router"``) against float64 loops
written here: the router (k chosen of E by sigmoid + bias, then the k and S shared sigmoids renormalised together,
scaled) and the whole layer (shared slots fused or run apart); gradients; its checks (the fused routers' fallback:
``test_routing_options``); moe_from_hf's refusal to leave the shared experts out and the swap following the
router's learned scale.

Shapes: M tokens, E experts, k = top_k, S shared slots, K hidden, N expert width.
"""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch

from _helpers import experts_loop
from moekit import MoE, MoEConfig, route
from moekit.routing import append_shared_slots

INK = MoEConfig(hidden_size=16, moe_intermediate_size=4, num_experts=8, top_k=3, scoring="sigmoid",
                use_correction_bias=True, routed_scaling_factor=2.5, shared_expert_intermediate_size=8,
                shared_expert_combine="router")


def reference_route(logits, cfg, bias):
    """Per-token float64 loop: choose the k best sigmoid(l) + bias of the E (lower id on a tie); weight the k chosen
    and the S shared logits' sigmoids, each over their sum, times the scaling."""
    e, ids, weights = cfg.num_experts, [], []
    for row in logits.double().tolist():
        sig = [1.0 / (1.0 + math.exp(-v)) for v in row]
        chosen = sorted(range(e), key=lambda i: (-(sig[i] + float(bias[i])), i))[: cfg.top_k]
        both = [sig[i] for i in chosen] + sig[e:]
        ids.append(chosen)
        weights.append([v / sum(both) * cfg.routed_scaling_factor for v in both])
    weights = torch.tensor(weights, dtype=torch.float64)
    return torch.tensor(ids, dtype=torch.int32), weights[:, : cfg.top_k], weights[:, cfg.top_k:]


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_router_matches_the_loop(slots):
    cfg = INK.replace(shared_expert_intermediate_size=4 * slots)
    g = torch.Generator().manual_seed(slots)
    logits, bias = torch.randn(64, 8 + slots, generator=g) * 2, torch.randn(8, generator=g) * 0.3
    got = route(logits, cfg, bias)
    ids, routed, shared = reference_route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, ids) and got.shared_weights.shape == (64, slots)
    torch.testing.assert_close(got.topk_weights.double(), routed, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.shared_weights.double(), shared, rtol=1e-5, atol=1e-7)
    total = got.topk_weights.sum(dim=1) + got.shared_weights.sum(dim=1)  # the k + S weights sum to the scaling
    torch.testing.assert_close(total, torch.full((64,), 2.5))
    appended = append_shared_slots(got, cfg)
    assert torch.equal(appended.topk_weights[:, 3:], got.shared_weights)
    assert appended.topk_ids[:, 3:].tolist() == [list(range(8, 8 + slots))] * 64


def reference_layer(moe, x):
    """float64 loop of the whole layer: the router loop, sum_j w_j * expert_j(x) + sum_s w_s * shared_s(x)."""
    cfg, n = moe.config, moe.config.moe_intermediate_size
    logits = x.double() @ moe.gate.weight.double().t()  # [M, E + S]
    ids, routed, shared = reference_route(logits, cfg, moe.e_score_correction_bias.double())
    if moe.fuse_shared:
        w13, w2 = moe.w13.double(), moe.w2.double()  # shared slots in rows E..E+S-1
    else:
        gate_up = moe.shared_w13.double().view(2, -1, n, cfg.hidden_size)  # [2, S, N, K]
        w13 = torch.cat([moe.w13.double(), torch.cat([gate_up[0], gate_up[1]], dim=1)])
        w2 = torch.cat([moe.w2.double(), moe.shared_w2.double().view(cfg.hidden_size, -1, n).transpose(0, 1)])
    shared_ids = torch.arange(cfg.num_experts, cfg.num_experts + cfg.num_shared_slots, dtype=torch.int32)  # [S]
    slots = torch.cat([ids, shared_ids.expand(x.shape[0], -1)], dim=1)  # [M, k + S]
    return experts_loop(x, w13, w2, slots, torch.cat([routed, shared], dim=1))


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_layer_against_the_loop(fuse_shared):
    torch.manual_seed(4)
    moe = MoE(INK, fuse_shared=fuse_shared)
    assert moe.gate.weight.shape == (10, 16) and moe.e_score_correction_bias.shape == (8,)
    assert (moe.shared_w13 is None) == fuse_shared
    with torch.no_grad():
        moe.e_score_correction_bias.normal_(0.0, 0.3)
        x = torch.randn(11, 16)
        torch.testing.assert_close(moe(x).double(), reference_layer(moe, x), rtol=1e-4, atol=1e-5)
        assert moe(x[:0]).shape == (0, 16)  # no tokens


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_gradients_reach_the_shared_logits(fuse_shared):
    """float64 gradcheck in x and the gate weight: the S shared rows of the gate carry a gradient."""
    torch.manual_seed(5)
    moe = MoE(INK.replace(hidden_size=8), fuse_shared=fuse_shared).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, gate: moe(x), (x, moe.gate.weight), eps=1e-6, atol=1e-5)
    moe(x).sum().backward()
    assert moe.gate.weight.grad[8:].abs().sum() > 0


@pytest.mark.parametrize("changes, says", [
    ({"shared_expert_intermediate_size": 0}, "shared_expert_combine='router' needs shared_expert_intermediate_size"),
    ({"shared_expert_intermediate_size": 6}, "a multiple of moe_intermediate_size"),
    ({"scoring": "softmax"}, "{'scoring': 'softmax'}"),
    ({"renormalize": False}, "{'renormalize': False}"),
    ({"n_group": 2, "topk_group": 1}, "{'n_group': 2}"),
    ({"shared_expert_gate": True}, "{'shared_expert_gate': True}"),
    ({"nonfinite": "mask"}, "{'nonfinite': 'mask'}"),
    ({"expert_weight_on": "input"}, "{'expert_weight_on': 'input'}"),
])
def test_bad_combinations_are_named(changes, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        INK.replace(**changes)


def test_shapes_are_named():
    with pytest.raises(ValueError, match=re.escape("router_logits must have shape [M, num_experts + num_shared_slots"
                                                   "=10], got (3, 8)")):
        route(torch.zeros(3, 8), INK)
    with pytest.raises(ValueError, match=re.escape("correction_bias must have shape [num_experts=8], got (10,)")):
        route(torch.zeros(3, 10), INK, torch.zeros(10))



def _inkling_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.inkling import modeling_inkling

    cfg = transformers.models.inkling.configuration_inkling.InklingTextConfig(
        hidden_size=16, moe_intermediate_size=4, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2,
        route_scale=3.0)
    torch.manual_seed(6)
    block = modeling_inkling.InklingMoE(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
        block.gate.global_scale.fill_(1.5)
        block.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return block


def test_swap_runs_the_shared_experts_and_follows_the_learned_scale():
    """moe_from_hf without the shared experts is refused (its router weights them); the swapped block's MoE runs
    them (a copy) and folds the router's global_scale into its scaling, rebuilt when it changes in place."""
    import moekit.hf as moekit_hf

    block = _inkling_block()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="router weights its shared experts"):
        moekit_hf.moe_from_hf(block, shared_expert=False)
    with torch.no_grad():
        want = block(x)
        assert moekit_hf.moe_from_hf(block).config.routed_scaling_factor == 4.5
        for fuse_shared in (False, True):
            assert moekit_hf.use_moekit_blocks(torch.nn.ModuleDict({"mlp": block}), fuse_shared=fuse_shared).swapped
            torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
        block.gate.global_scale.mul_(2.0)
        torch.testing.assert_close(block(x), 2.0 * want, rtol=1e-5, atol=1e-6)
        block.gate.global_scale.fill_(-1.0)
        with pytest.raises(ValueError, match="global_scale is -1.0"):
            moekit_hf.moe_from_hf(block)


def test_softcap_reaches_the_weights():
    """With ``router_logit_softcap`` the k + S weights come from the capped logits, as the choice does (fuzz37: the
    weights read the raw logits, 6-14% off the float64 loop at c = 1.5)."""
    cfg = INK.replace(router_logit_softcap=1.5)
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(16, 10, generator=g) * 3, torch.randn(8, generator=g) * 0.3
    got = route(logits, cfg, bias)
    ids, routed, shared = reference_route(1.5 * torch.tanh(logits.double() / 1.5), cfg, bias)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), routed, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.shared_weights.double(), shared, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cap", [1.5, 0.0])
def test_each_logit_is_capped_once_and_the_routing_is_unchanged(cap, monkeypatch):
    """With ``router_logit_softcap`` the [M, E + S] logits are capped once, not once for the choice and again for
    the weights (session 37: the recursive ``route`` capped the E, ``_with_shared_weights`` all E + S); the result
    equals, bit for bit, what the two caps computed: the k chosen of E by the routed-part config on the logits'
    first E columns, weighted from the whole capped logits."""
    route_module = importlib.import_module("moekit.routing.route")  # the attribute moekit.routing.route is the function
    capped = []
    original = route_module.soft_capped
    monkeypatch.setattr(route_module, "soft_capped", lambda t, c: capped.append(t.numel()) or original(t, c))
    for seed, slots in ((0, 1), (1, 2), (2, 3)):
        cfg = INK.replace(shared_expert_intermediate_size=4 * slots, router_logit_softcap=cap)
        g = torch.Generator().manual_seed(seed)
        logits, bias = torch.randn(33, 8 + slots, generator=g) * 3, torch.randn(8, generator=g) * 0.3
        capped.clear()
        got = route(logits, cfg, bias)
        assert sum(capped) == logits.numel()
        part = cfg.replace(shared_expert_combine="sum", renormalize=False, routed_scaling_factor=1.0)
        ids = route(logits[:, :8], part, bias).topk_ids  # the choice, as the recursive route made it
        whole = original(logits, cfg)  # [M, E + S]
        both = torch.nn.functional.logsigmoid(torch.cat([whole[:, :8].gather(1, ids.long()), whole[:, 8:]], dim=1))
        weights = torch.softmax(both, dim=-1) * 2.5
        assert torch.equal(got.topk_ids, ids)
        assert torch.equal(got.topk_weights, weights[:, :3]) and torch.equal(got.shared_weights, weights[:, 3:])

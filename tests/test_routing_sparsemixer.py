"""Phi-MoE's sparsemixer at inference (``MoEConfig.sparsemixer_jitter_eps``) against a float64 per-token loop written
here; the layer against a float64 loop of the whole layer; its checks (the fused routers' fallback:
``test_routing_options``); training mode refused (its router samples), and the swapped transformers block running
its own forward in training.

Shapes: M tokens, E experts, k = top_k, K hidden, N expert width.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from _helpers import experts_loop
from moekit import MoE, MoEConfig, route

PHI = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=8, top_k=2, renormalize=False,
                sparsemixer_jitter_eps=0.2)


def reference_sparsemixer(logits, cfg):
    """Per-token float64 loop: each round the best expert left (lower id on a tie), weighted by exp(its logit) over
    the sum of exp(l) of the experts left whose logit is near the round's max m: (m - l) / max(|l|, m) <= 2 eps."""
    ids, weights = [], []
    for row in logits.double().tolist():
        left, chosen, w = list(range(len(row))), [], []
        for _ in range(cfg.top_k):
            top = max(row[e] for e in left)
            best = min(e for e in left if row[e] == top)
            near = [e for e in left if (top - row[e]) / max(abs(row[e]), top) <= 2 * cfg.sparsemixer_jitter_eps]
            w.append(math.exp(row[best] - top) / sum(math.exp(row[e] - top) for e in near))
            chosen.append(best)
            left.remove(best)
        ids.append(chosen)
        weights.append(w)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize("eps", [0.0, 0.01, 0.2, 1.0])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_matches_the_loop(eps, top_k):
    """Logits of both signs (a negative max too: its |l| decides the nearness); float32 and float64 logits."""
    cfg = PHI.replace(sparsemixer_jitter_eps=eps, top_k=top_k)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 8, generator=g) * 2 - 0.5
    logits[:4] -= 6.0  # rows whose max is negative
    for dtype in (torch.float32, torch.float64):
        got = route(logits.to(dtype), cfg)
        ids, weights = reference_sparsemixer(logits, cfg)
        assert torch.equal(got.topk_ids, ids) and got.topk_weights.dtype == dtype
        torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-7)
    if eps == 0.2:  # several experts near the max: the weights are not 1 (as they are at eps 0 without ties)
        assert (got.topk_weights < 0.99).float().mean() > 0.3
    if eps == 0.0:
        assert torch.all(got.topk_weights == 1.0)


def test_ties_lower_id_wins_and_share_the_weight():
    cfg = PHI.replace(sparsemixer_jitter_eps=0.0)
    logits = torch.tensor([[1.0, 3.0, 0.5, 3.0, 3.0, -1.0, 0.0, 2.0]])
    got = route(logits, cfg)
    assert got.topk_ids.tolist() == [[1, 3]]
    torch.testing.assert_close(got.topk_weights, torch.tensor([[1 / 3, 1 / 2]]))


def test_masked_experts_weigh_zero():
    """nonfinite="mask": a masked expert is taken only when a round has no finite one left, at weight 0; a token
    with none finite is counted."""
    cfg = PHI.replace(nonfinite="mask", num_experts=3)
    nan = float("nan")
    logits = torch.tensor([[0.5, nan, nan], [nan, nan, nan], [1.0, 0.9, -math.inf]])
    got = route(logits, cfg)
    assert got.topk_ids.tolist()[0][0] == 0 and got.topk_weights[0].tolist() == [1.0, 0.0]
    assert got.topk_weights[1].tolist() == [0.0, 0.0] and int(got.masked_tokens) == 1
    ids, weights = reference_sparsemixer(logits[2:, :2], cfg.replace(num_experts=2, nonfinite="raise"))
    assert torch.equal(got.topk_ids[2:], ids)
    torch.testing.assert_close(got.topk_weights[2:].double(), weights)


def reference_layer(moe, x):
    """float64 loop of the whole layer: gate, the sparsemixer loop, sum_j w_j * w2 @ (silu(gate) * up)."""
    logits = x.double() @ moe.gate.weight.double().t()  # [M, E]
    ids, weights = reference_sparsemixer(logits, moe.config)
    return experts_loop(x, moe.w13, moe.w2, ids, weights)


def test_layer_against_the_loop_and_gradients():
    torch.manual_seed(3)
    moe = MoE(PHI.replace(hidden_size=16)).eval()
    x = torch.randn(9, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).double(), reference_layer(moe, x), rtol=1e-4, atol=1e-5)
    moe = moe.double()
    x = x.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, gate: moe(x), (x, moe.gate.weight), eps=1e-6, atol=1e-5)


def test_training_mode_is_refused():
    moe = MoE(PHI)
    with pytest.raises(NotImplementedError, match="samples its experts in training"):
        moe(torch.randn(3, 8))
    assert moe.eval()(torch.randn(3, 8)).shape == (3, 8)


@pytest.mark.parametrize("changes, says", [
    ({"sparsemixer_jitter_eps": -0.1}, "sparsemixer_jitter_eps must be None or a finite number >= 0"),
    ({"sparsemixer_jitter_eps": True}, "sparsemixer_jitter_eps must be None or a finite number >= 0"),
    ({"renormalize": True}, "{'renormalize': True}"),
    ({"scoring": "sigmoid"}, "{'scoring': 'sigmoid'}"),
    ({"use_correction_bias": True}, "{'use_correction_bias': True}"),
    ({"n_group": 2, "topk_group": 1}, "{'n_group': 2}"),
    ({"num_identity_experts": 2}, "{'num_identity_experts': 2}"),
])
def test_bad_combinations_are_named(changes, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        PHI.replace(**changes)



def test_swapped_phimoe_block_runs_its_own_forward_in_training():
    """Phi-MoE's block in training samples (Gumbel noise, a random 1/3 weight): the swap runs the block's own
    forward there (the same draws under the same seed), moekit's layer in eval; moe_from_hf's MoE takes the
    block's mode."""
    transformers = pytest.importorskip("transformers")
    import moekit.hf as moekit_hf

    cfg = transformers.PhimoeConfig(hidden_size=16, intermediate_size=8, num_local_experts=6, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=11,
                                    router_jitter_noise=0.3)
    block = transformers.PhimoeForCausalLM(cfg).model.layers[0].mlp.float()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.manual_seed(7)
        sampled = block.train()(x)
        want = block.eval()(x)
        assert not moekit_hf.moe_from_hf(block).training
        holder = torch.nn.ModuleDict({"mlp": block})
        assert moekit_hf.use_moekit_blocks(holder).swapped
        torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
        torch.manual_seed(7)
        assert torch.equal(block.train()(x), sampled)

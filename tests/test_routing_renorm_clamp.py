"""ERNIE-4.5-MoE's renormalisation, w / clamp(sum(w), min=moe_norm_min) (``MoEConfig.renorm_clamp``), in moekit's
torch router against transformers' own ``Ernie4_5_MoeTopKRouter`` built offline (the gate weight the identity, so
the hidden state is the logits row; its ``moe_statics`` bias) and a float64 loop written here, at ordinary rows and at
rows where the bias chooses experts whose softmax scores sum below 1e-12 (transformers: the scores / 1e-12, not a
sum of 1). Configs that cannot hold it say why; the fused routers: ``test_routing_fused_renorm_clamp``.

Shapes: M tokens (rows), E experts, k experts a token.
"""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoEConfig, route

transformers = pytest.importorskip("transformers")

E, TOP_K = 16, 4
# the max expert's logit above the rest: the chosen experts' softmax sum is ~k e^-gap (2.1e-11 at 26 and 2.8e-12 at
# 28: the clamp inactive; 3.7e-13 at 30, 1.7e-17 at 40, 1.5e-43 at 100: the weights sum to S / 1e-12)
GAPS = (26.0, 28.0, 30.0, 40.0, 100.0)


def _hf_config():
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(hidden_size=E, intermediate_size=32, moe_intermediate_size=8, moe_num_experts=E,
                              moe_k=TOP_K, num_hidden_layers=2, moe_layer_start_index=0, num_attention_heads=2,
                              num_key_value_heads=2, moe_num_shared_experts=0)


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [M, E] float32, bias [E]): 4 ordinary N(0, 1) rows, then one row a gap in GAPS (expert 0 at the gap,
    the rest N(0, 1) / 10); the bias (+1 on experts 1..k, small elsewhere) chooses experts 1..k on the gap rows."""
    g = torch.Generator().manual_seed(seed)
    ordinary = torch.randn(4, E, generator=g)
    gapped = torch.randn(len(GAPS), E, generator=g) / 10
    gapped[:, 0] = torch.tensor(GAPS)
    bias = torch.randn(E, generator=g) * 1e-3
    bias[1:TOP_K + 1] += 1.0
    return torch.cat([ordinary, gapped]), bias


def _transformers(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [M, k], weights [M, k]) of transformers' router (float32: its forward casts there)."""
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    router = Ernie4_5_MoeTopKRouter(_hf_config())
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        router.moe_statics.e_score_correction_bias.copy_(bias[None])
        _, weights, ids = router(logits)
    return ids, weights


def _float64(logits: torch.Tensor, ids: torch.Tensor, clamp: float) -> torch.Tensor:
    """The family's weights of ``ids`` a token at a time in float64: softmax p_i / max(sum_j p_j, clamp)."""
    out = []
    for row, chosen in zip(logits.double().tolist(), ids.long().tolist()):
        top = max(row)
        total = sum(math.exp(v - top) for v in row)
        p = [math.exp(row[e] - top) / total for e in chosen]
        out.append([w / max(sum(p), clamp) for w in p])
    return torch.tensor(out, dtype=torch.float64)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error relative to each row's largest reference weight (a row of ~0 weights: absolute, tiny)."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    return ((got.double() - want) / scale).abs().max().item()


@pytest.mark.parametrize("seed", [0, 1])
def test_route_against_transformers_and_float64(seed):
    cfg = MoEConfig.from_hf_config(_hf_config())
    assert cfg.renorm_clamp == 1e-12 and cfg.renorm_eps == 0.0 and cfg.scoring == "softmax"
    logits, bias = _rows(seed)
    got = route(logits, cfg, bias)
    ids, weights = _transformers(logits, bias)
    assert torch.equal(got.topk_ids.long(), ids)
    want = _float64(logits, ids, 1e-12)
    assert _rel(got.topk_weights, want) < 2e-5
    # transformers' float32 router where its scores are normal floats (at gap 100 they are subnormal, ~e^-100, and
    # carry their rounding: 2% off the formula there, where moekit's are within 2e-5 of float64 above)
    assert _rel(weights[:-1], want[:-1]) < 2e-5
    assert _rel(got.topk_weights[:-1], weights[:-1].double()) < 2e-5
    sums = got.topk_weights.double().sum(-1)
    assert torch.allclose(sums[:6], torch.ones(6, dtype=torch.float64))  # ordinary, gap 26 and 28: the exact ratio
    assert sums[-3:].max() < 0.5  # below the floor the weights are the scores / 1e-12, below a sum of 1


def test_without_the_clamp_the_underflowing_rows_differ():
    """The test above can fail: the exact ratio (renorm_clamp 0, moekit before) sums to 1 where transformers' do not."""
    cfg = MoEConfig.from_hf_config(_hf_config())
    logits, bias = _rows(0)
    exact = route(logits, cfg.replace(renorm_clamp=0.0), bias).topk_weights
    ids, weights = _transformers(logits, bias)
    assert _rel(exact[-3:], weights[-3:].double()) > 0.5


def test_ordinary_rows_keep_the_exact_ratios_bits():
    cfg = MoEConfig.from_hf_config(_hf_config())
    logits, bias = _rows(2)
    got = route(logits[:5], cfg, bias).topk_weights
    assert torch.equal(got, route(logits[:5], cfg.replace(renorm_clamp=0.0), bias).topk_weights)


def test_the_vl_text_config_reads_the_clamp_too():
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeTextConfig

    text = Ernie4_5_VLMoeTextConfig(hidden_size=E, moe_num_experts=E, moe_k=TOP_K, moe_norm_min=1e-10)
    assert MoEConfig.from_hf_config(text).renorm_clamp == 1e-10


@pytest.mark.parametrize("changes, match", [
    (dict(renorm_clamp=-1e-12), "renorm_clamp must be a finite number >= 0"),
    (dict(renorm_clamp=float("nan")), "renorm_clamp must be a finite number >= 0"),
    (dict(renorm_clamp=True), "renorm_clamp must be a finite number >= 0"),
    (dict(renorm_clamp=1e-12, renorm_eps=1e-20), "renorm_eps and renorm_clamp exclude each other"),
    # no renormalisation, no sum to clamp: route's weights were the plain scores, the clamp dropped without a word
    (dict(renorm_clamp=1e-12, renormalize=False),
     "needs renormalize=True, got renorm_clamp=1e-12 with renormalize=False"),
    (dict(renorm_clamp=1e-12, hash_table_size=10), "renorm_clamp=0"),
    (dict(renorm_clamp=1e-12, scoring="sigmoid", shared_expert_intermediate_size=8,
          shared_expert_combine="router"), "renorm_clamp = 0"),
])
def test_configs_that_cannot_hold_the_clamp_say_why(changes, match):
    base = dict(hidden_size=E, moe_intermediate_size=8, num_experts=E, top_k=TOP_K)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **changes})

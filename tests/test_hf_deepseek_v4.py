"""DeepSeek-V4 (hfz47, v4h47): ``from_hf_config`` reads its top-k layers (sqrt(softplus) scores, the correction bias,
always renormalised, routed scaling, the clamped SwiGLU of its experts and shared MLP) and its hash layers
(``tid2eid[input_ids]``: ``hash_table_size``, a ``HashMoE``); ``moe_from_hf`` and ``use_moekit_blocks`` against a tiny
DeepSeek-V4 built offline by transformers with a random table; ``route``'s new scoring against a float64 loop.

Shapes: M tokens, E experts, k experts a token, K hidden 32.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.hf as moekit_hf  # noqa: E402
from moekit.config import MoEConfig  # noqa: E402
from moekit.hf.blocks import moe_blocks  # noqa: E402
from moekit.hf.variants import clamps_before_act  # noqa: E402
from moekit.layer import MoE  # noqa: E402
from moekit.layer_hash import HashMoE  # noqa: E402
from moekit.routing import route  # noqa: E402
from moekit.routing.fused import computes  # noqa: E402

from _hf_fuzz_models import build_model, family_keys, family_of, tiny_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
KINDS = ["hash_moe", "moe", "moe"]  # layer 0 hash-routes, layers 1 and 2 route top-k


def _loop_route(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float):
    """DeepSeek-V4's top-k router, a float64 loop: s = sqrt(log(1 + e^x)); the k best s + bias (lower id on a tie);
    weights s / sum of the chosen s, times scale."""
    ids, weights = [], []
    for row in logits.double().tolist():
        s = [torch.tensor(x, dtype=torch.float64).exp().log1p().sqrt().item() for x in row]
        order = sorted(range(len(s)), key=lambda e: (-(s[e] + float(bias[e])), e))[:k]
        total = sum(s[e] for e in order)
        ids.append(order)
        weights.append([s[e] / total * scale for e in order])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def test_sqrtsoftplus_routing_matches_a_float64_loop():
    config = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=7, top_k=3, scoring="sqrtsoftplus",
                       use_correction_bias=True, routed_scaling_factor=1.5)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 7, generator=g, dtype=torch.float64) * 4  # [M, E], some far below 0
    bias = torch.randn(7, generator=g) * 0.1
    got = route(logits, config, bias)
    ids, weights = _loop_route(logits, bias, 3, 1.5)
    order = got.topk_ids.long().sort(-1)
    assert torch.equal(order.values, ids.sort(-1).values)
    assert torch.allclose(got.topk_weights.gather(1, order.indices), weights.gather(1, ids.sort(-1).indices),
                          rtol=1e-12, atol=0)
    assert computes(config)  # the fused router scores it too (session 48: tests/test_routing_fused_v4.py)


def test_from_hf_config_reads_the_top_k_and_the_hash_layers():
    cfg = transformers.AutoConfig.for_model("deepseek_v4")  # 43 layers, the first 3 hash-routed
    config = MoEConfig.from_hf_config(cfg)
    assert (config.scoring, config.renormalize, config.use_correction_bias) == ("sqrtsoftplus", True, True)
    assert config.routed_scaling_factor == cfg.routed_scaling_factor and config.num_moe_layers == 43
    assert config.activation.limit == cfg.swiglu_limit and config.shared_activation is None
    assert config.shared_expert_intermediate_size == cfg.moe_intermediate_size
    assert config.hash_table_size is None and MoEConfig.from_hf_config(cfg, layer=3) == config
    hashed = MoEConfig.from_hf_config(cfg, layer=2)
    assert hashed == config.replace(hash_table_size=cfg.vocab_size, use_correction_bias=False)
    only_hash = transformers.AutoConfig.for_model("deepseek_v4", num_hidden_layers=2,
                                                  mlp_layer_types=["hash_moe", "hash_moe"])
    assert MoEConfig.from_hf_config(only_hash).hash_table_size == only_hash.vocab_size


def _model(dtype: torch.dtype, **fields):
    fam = family_of(next(k for k in family_keys() if k.startswith("deepseek_v4:")))
    model = build_model(fam, tiny_config(fam, {"mlp_layer_types": KINDS, **fields}), 0, dtype)
    model.set_experts_implementation("eager")
    return model


def _blocks(model) -> list[nn.Module]:
    return [m.block for m in moe_blocks(model)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("fuse_shared", [False, True])
def test_a_top_k_block_equals_transformers(dtype, tol, fuse_shared):
    """Layer 1's block (top-k) on x large enough that the swiglu_limit clamps bite (limit 3 here)."""
    block = _blocks(_model(dtype, swiglu_limit=3.0, routed_scaling_factor=2.5, num_experts_per_tok=3))[1]
    moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1), dtype=dtype) * 20
    with torch.no_grad():
        want = block(x)
        assert (x.reshape(-1, 32) @ block.experts.gate_up_proj[0].T).abs().max() > 3.0  # the clamps bite
        err = (moe(x) - want).norm() / want.norm()
    assert err < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("fuse_shared", [False, True])
def test_a_hash_block_equals_transformers(dtype, tol, fuse_shared):
    """Layer 0's block (hash-routed; a random table), against the block given the same input ids."""
    block = _blocks(_model(dtype, swiglu_limit=3.0, routed_scaling_factor=2.5, num_experts_per_tok=3))[0]
    assert len(set(block.gate.tid2eid.flatten().tolist())) > 1  # random (the fuzzer's build_model), not all 0
    moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    assert isinstance(moe, HashMoE) and moe.tid2eid is block.gate.tid2eid  # the router's table, not a copy
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1), dtype=dtype) * 20
    ids = torch.randint(0, moe.config.hash_table_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = block(x, input_ids=ids)
        err = (moe(x, token_ids=ids) - want).norm() / want.norm()
    assert err < tol
    bad = block.gate.tid2eid.clone()
    bad[5, 0] = block.experts.num_experts
    block.gate.tid2eid.copy_(bad)
    with pytest.raises(ValueError, match=r"DeepseekV4HashRouter.tid2eid must hold experts in \[0, num_experts=6\)"):
        moekit_hf.moe_from_hf(block)


def test_the_model_swaps_every_block_the_hash_ones_routed_by_the_input_ids(monkeypatch):
    model = _model(torch.float32)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    calls, forward, hashed = [], MoE.forward, HashMoE.forward
    monkeypatch.setattr(MoE, "forward", lambda self, *a, **k: calls.append("top-k") or forward(self, *a, **k))
    monkeypatch.setattr(HashMoE, "forward", lambda self, *a, **k: calls.append("hash") or hashed(self, *a, **k))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = model(ids).logits
        report = moekit_hf.use_moekit_blocks(model)
        got = model(ids).logits
    assert len(report.swapped) == 3 and not report.left
    assert calls == ["hash", "top-k", "top-k"]  # the decoder layers pass input_ids to every block
    assert (got - want).norm() / want.norm() < 1e-5


class _ClampedMLP(nn.Module):
    """A gated MLP clamping at ``limit`` before silu (DeepSeek-V4's) or after it (Step-3.7's)."""

    def __init__(self, before: bool, limit: float = 2.0):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.gate_proj, self.up_proj, self.down_proj = (nn.Linear(a, b, bias=False) for a, b in ((8, 6), (8, 6),
                                                                                                   (6, 8)))
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g)
        self.limit, self.before, self.act_fn = limit, before, nn.SiLU()

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x).clamp(-self.limit, self.limit)
        gate = self.act_fn(gate.clamp(max=self.limit)) if self.before else self.act_fn(gate).clamp(max=self.limit)
        return self.down_proj(gate * up)


def test_a_shared_mlp_clamping_after_its_activation_is_told_apart():
    """moekit's clamped SwiGLU clamps the gate before the activation; a shared MLP that clamps after it (Step-3.7's)
    stays refused, though at limit 10 the two differ by 5e-5 only."""
    assert clamps_before_act(_ClampedMLP(before=True), 2.0, "silu")
    assert not clamps_before_act(_ClampedMLP(before=False), 2.0, "silu")
    assert not clamps_before_act(_ClampedMLP(before=False, limit=10.0), 10.0, "silu")


def test_the_moekit_experts_implementation_serves_the_hash_layers_too(monkeypatch):
    """set_experts_implementation("moekit") keeps every block's router (the hash one's table lookup included) and runs
    the experts on moekit: the model's logits as with eager experts, one moekit experts call a block."""
    model = _model(torch.float64)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(3))
    calls, original = [], moekit_hf.call_backend
    monkeypatch.setattr(moekit_hf, "call_backend", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad():
        want = model(ids).logits
        model.set_experts_implementation("moekit")
        got = model(ids).logits
    assert (got - want).norm() / want.norm() < 1e-12 and len(calls) == 3

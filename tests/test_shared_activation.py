"""``MoEConfig.shared_activation``: the shared MLP's own activation beside the experts' (HY-V4's plain silu beside
its clamped SwiGLU experts). The field's checks; the layer keeps such a shared expert a separate MLP (the fused slots
would run the experts' activation) and equals a float64 loop written here; ``quantize_`` and ``OffloadedMoE`` keep
it. The transformers blocks (HY-V4, HY-V4-VL, GLM-5-Next) are in ``test_hf_swap_walk.py``."""

from __future__ import annotations

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.activations import ActivationSpec
from moekit.offload import OffloadedMoE

from _helpers import rel_l2

K, N, E = 16, 8, 6
CLAMPED = ActivationSpec(name="silu", limit=1.0)
BASE = dict(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2, shared_expert_intermediate_size=2 * N)


@pytest.mark.parametrize("value, error, match", [
    ("nope", ValueError, r"shared_activation must be None .*'nope'"),
    (5, TypeError, r"shared_activation must be None .*got int"),
    (ActivationSpec(name="silu", gated=False), ValueError, "shared_activation must be gated"),
])
def test_a_bad_shared_activation_is_refused_by_name(value, error, match):
    with pytest.raises(error, match=match):
        MoEConfig(**BASE, shared_activation=value)


def test_a_shared_activation_needs_a_shared_expert():
    with pytest.raises(ValueError, match="shared_activation needs shared_expert_intermediate_size > 0"):
        MoEConfig(**dict(BASE, shared_expert_intermediate_size=0), shared_activation="gelu")


def test_the_default_is_the_experts_activation_and_replace_carries_the_field():
    cfg = MoEConfig(**BASE, activation=CLAMPED)
    assert cfg.shared_activation is None and cfg.shared_mlp_activation == CLAMPED and cfg.shared_fusable
    mine = cfg.replace(shared_activation="silu").replace(top_k=1)
    assert mine.shared_mlp_activation == "silu" and not mine.shared_fusable
    assert cfg.replace(shared_activation=CLAMPED).shared_fusable  # the experts' own, named: still fusable


def _reference(moe: MoE, x: torch.Tensor, shared_limit: float | None, w13=None, w2=None) -> torch.Tensor:
    """float64 loop: softmax top-2 renormalised; each expert silu(gate clamped to 1) * up clamped to +-1, the shared
    MLP silu(gate) * up clamped at ``shared_limit`` (None: not), its rows gate then up."""
    def glu(h: torch.Tensor, limit: float | None) -> torch.Tensor:
        gate, up = h.chunk(2)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return torch.nn.functional.silu(gate) * up

    w13 = (moe.w13 if w13 is None else w13).detach().double()
    w2 = (moe.w2 if w2 is None else w2).detach().double()
    gate_w, s13, s2 = (t.detach().double() for t in (moe.gate.weight, moe.shared_w13, moe.shared_w2))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, row in enumerate(x.double()):
        probs = torch.softmax(gate_w @ row, dim=0)
        top = torch.topk(probs, 2)
        for e, w in zip(top.indices.tolist(), top.values / top.values.sum()):
            out[t] += w * (w2[e] @ glu(w13[e] @ row, 1.0))
        out[t] += s2 @ glu(s13 @ row, shared_limit)
    return out


def _layer(dtype=torch.float64) -> tuple[MoE, torch.Tensor]:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(**BASE, activation=CLAMPED, shared_activation="silu"), backend="grouped_mm",
              router="torch", dtype=dtype)
    x = torch.randn(9, K, dtype=dtype) * 3  # past the experts' clamp
    return moe, x


def test_the_layer_keeps_the_shared_mlp_apart_and_runs_its_activation():
    moe, x = _layer()
    assert not moe.fuse_shared and moe.shared_w13 is not None  # fuse_shared=True by default: not exact here
    with torch.no_grad():
        got = moe(x)
    want, clamped = _reference(moe, x, None), _reference(moe, x, 1.0)
    assert rel_l2(clamped, want) > 0.1  # the experts' clamp on the shared MLP is far off these inputs
    assert rel_l2(got, want) < 1e-6


def test_quantize_keeps_the_shared_activation():
    moe, x = _layer()
    moe.quantize_("int8_w8a16")
    assert moe.config.shared_activation == "silu" and moe.quant_scheme == "int8_w8a16"
    with torch.no_grad():  # the routed experts as their int8 weights dequantized, the shared MLP as it was
        want = _reference(moe, x, None, moe.w13.dequantize(torch.float64), moe.w2.dequantize(torch.float64))
        assert rel_l2(moe(x), want) < 1e-5


def test_an_offloaded_layer_keeps_the_shared_activation():
    moe, x = _layer(torch.float32)
    off = OffloadedMoE.from_moe(moe, cache_experts=2)
    assert off.config.shared_activation == "silu"
    with torch.no_grad():
        assert rel_l2(off(x), _reference(moe, x, None).float()) < 1e-5

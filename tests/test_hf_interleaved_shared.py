"""A transformers block whose routed experts keep gate and up rows interleaved (gpt-oss's ``is_concatenated=False``
layout) beside a shared expert with its own gate_proj / up_proj: moekit's layer runs the shared MLP with the experts'
activation spec, so its copy of the shared weights must be laid out in that order too, separate or fused into
slots (fuz44: ``hf/blocks.py`` split them as gate rows then up rows whatever the activation). Built offline: a
Qwen2-MoE block (random weights, float64) whose experts gate the interleaved way, as gpt-oss's do; the block's own
forward is the reference."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.hf as moekit_hf  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2  # noqa: E402


@use_experts_implementation(is_concatenated=False)
class _InterleavedExperts(qwen2.Qwen2MoeExperts):
    """Qwen2-MoE's experts with gpt-oss's row order: row 2i of gate_up_proj is gate i, row 2i + 1 up i."""

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.act_fn(gate_up[..., ::2]) * gate_up[..., 1::2]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for token, (ids, weights) in enumerate(zip(top_k_index.tolist(), top_k_weights)):
            for expert, w in zip(ids, weights):
                h = self._apply_gate(hidden_states[token] @ self.gate_up_proj[expert].t())
                out[token] += w * (h @ self.down_proj[expert].t())
        return out


def _block(slots: int):
    cfg = transformers.Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2,
                                      shared_expert_intermediate_size=8 * slots, norm_topk_prob=True)
    torch.manual_seed(slots)
    block = qwen2.Qwen2MoeSparseMoeBlock(cfg).to(torch.float64).eval()
    block.experts = _InterleavedExperts(cfg).to(torch.float64)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block


@pytest.mark.parametrize("slots", [1, 2])
@pytest.mark.parametrize("fuse_shared", [False, True])
def test_an_interleaved_layers_shared_expert_keeps_its_gate_and_up_rows(slots, fuse_shared):
    block = _block(slots)
    moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    assert moe.config.activation.interleaved and moe.fuse_shared == fuse_shared
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        # float64 weights, float32 routing weights (moekit's contract): 6e-7 here; the gate-then-up copy was 12 off
        torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-6)


def test_a_shared_expert_of_another_activation_is_refused():
    """moekit's shared MLP runs the experts' activation: a block whose shared expert computes gelu(gate) * up beside
    silu experts was computed as silu in silence (a Qwen2-MoE block with its shared act_fn swapped, float64)."""
    cfg = transformers.Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2,
                                      shared_expert_intermediate_size=8)
    torch.manual_seed(0)
    block = qwen2.Qwen2MoeSparseMoeBlock(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    block.shared_expert.act_fn = torch.nn.GELU()
    for fuse_shared in (False, True):
        with pytest.raises(TypeError, match=r"Qwen2MoeMLP computes gelu\(gate\) \* up.*'silu'.*shared_expert=False"):
            moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    routed = moekit_hf.moe_from_hf(block, shared_expert=False)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with torch.no_grad():  # the routed part alone: the block's output less its gated shared expert
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        torch.testing.assert_close(routed(x), block(x) - shared, rtol=1e-5, atol=1e-6)

"""A transformers block whose routed experts keep gate and up rows interleaved (gpt-oss's ``is_concatenated=False``
layout) beside a shared expert with its own gate_proj / up_proj: moekit's layer runs the shared MLP with the experts'
activation spec, so its copy of the shared weights must be laid out in that order too, separate or fused into slots
(fuz44: ``hf/blocks.py`` split them as gate rows then up rows whatever the activation); a shared expert of another
activation runs its own (``MoEConfig.shared_activation``). Built offline: a
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


@pytest.mark.parametrize("interleaved", [False, True])
def test_a_shared_expert_of_another_activation_runs_its_own(interleaved):
    """A block whose shared expert computes gelu(gate) * up beside silu experts (a Qwen2-MoE block with its shared
    act_fn swapped, float64; its experts gate-then-up or interleaved): the MoE's shared MLP runs gelu
    (``shared_activation``, its rows gate then up whatever the experts' order) and equals the block; fusing it into
    slots, which run the experts' silu, is refused by name (moekit's silu shared MLP: 0.06 rel-L2 off here)."""
    cfg = transformers.Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2,
                                      shared_expert_intermediate_size=8)
    block = _block(1) if interleaved else qwen2.Qwen2MoeSparseMoeBlock(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    block.shared_expert.act_fn = torch.nn.GELU()
    with pytest.raises(TypeError, match=r"fuse_shared=True: Qwen2MoeSparseMoeBlock's shared expert computes "
                                        r"gelu\(gate\) \* up"):
        moekit_hf.moe_from_hf(block, fuse_shared=True)
    moe = moekit_hf.moe_from_hf(block)
    assert moe.config.shared_activation == "gelu" and not moe.fuse_shared
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-6)

"""Qwen3-Omni-MoE's talker (``qwen3_omni_moe_talker_text``), the MoE model beside the thinker: its blocks are
Qwen2-MoE's (softmax top-k, renormalised when norm_topk_prob, a shared expert scaled by sigmoid(x @ g)), and its
decoder layer builds one in every layer, whatever mlp_only_layers / decoder_sparse_step say (it overwrites the
thinker's choice).
Its config class does not declare the shared width its block reads; the checkpoints' config.json carries it. The whole
talker model, built offline with random weights, swapped and held to its own forward in float32 and float64."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit import MoEConfig  # noqa: E402

from _helpers import rel_l2  # noqa: E402

omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")


def _config(**fields):
    """A tiny talker text config; layer 1 listed dense and a sparse step of 2, which its decoder layers ignore."""
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                 shared_expert_intermediate_size=20, mlp_only_layers=[1], decoder_sparse_step=2)
    return transformers.Qwen3OmniMoeTalkerTextConfig(**(sizes | fields))


def _model(cfg, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = omni.Qwen3OmniMoeTalkerModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1) + (p.dim() == 1))
    model.set_experts_implementation("eager")  # transformers' own loop, the reference
    return model.to(dtype)


def test_the_talker_config_is_read_as_its_block_computes():
    """from_hf_config reads the talker: Qwen2-MoE's router with its gated shared expert, every decoder layer a MoE
    layer; the omni model's top-level config still reads the thinker's text model."""
    config = MoEConfig.from_hf_config(_config())
    assert (config.shared_expert_intermediate_size, config.shared_expert_gate) == (20, True)
    assert (config.scoring, config.renormalize, config.num_moe_layers, config.top_k) == ("softmax", False, 2, 2)
    assert MoEConfig.from_hf_config(_config(norm_topk_prob=True)).renormalize
    MoEConfig.from_hf_config(_config(), layer=1)  # a MoE layer, though mlp_only_layers lists it
    thinker = MoEConfig.from_hf_config(transformers.Qwen3OmniMoeConfig())
    assert thinker.shared_expert_intermediate_size == 0


# float64: the reference backend (grouped_mm takes no float64), and the hf tests' block bound (_hf_fuzz_check's
# BLOCK_TOLERANCES): the talker's router rounds its weights through float32 (softmax(dtype=torch.float))
@pytest.mark.parametrize("dtype, tol, backend", [(torch.float32, 1e-5, "auto"), (torch.float64, 1e-5, "reference")])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_the_talker_model_swapped_equals_its_own_forward(dtype, tol, backend, norm_topk_prob):
    """Both blocks swapped (none left), the last hidden state of 2 x 7 inputs_embeds (the talker has no token input
    of its own: the thinker's states come in as embeddings) equal to the unswapped model's; restored, bit-equal."""
    model = _model(_config(norm_topk_prob=norm_topk_prob), dtype)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    with torch.no_grad():
        want = model(inputs_embeds=x).last_hidden_state
        report = moekit_hf.use_moekit_blocks(model, backend=backend)
        assert len(report.swapped) == 2 and not report.left
        got = model(inputs_embeds=x).last_hidden_state
        moekit_hf.restore_blocks(model)
        assert torch.equal(model(inputs_embeds=x).last_hidden_state, want)
    assert rel_l2(got, want) < tol

"""Dots-3-Note's vision tower holds MoE blocks of its own (``Dots3NoteVisionMoE``, config model_type
``dots3_note_vision_encoder``): a pyramid, each sparse layer with its own expert count (``per_layer_config``), a sigmoid
router with the block's correction bias, w / (sum + 1e-20) times router_scaling_factor, the text model's experts class.
Before session 50 ``use_moekit_blocks`` left them (no reader). Two layers of the pyramid (4 and 6 experts), random
weights and biases, swapped and held to their own forward in float32 and float64, and read by from_hf_config."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit import MoEConfig  # noqa: E402

from _helpers import rel_l2  # noqa: E402

dots3 = pytest.importorskip("transformers.models.dots3_note.modeling_dots3_note")


def _config():
    """A tiny vision config: layer 0 dense, layers 1 and 2 sparse with 4 and 6 experts, k = 2, scaling 2.5."""
    from transformers.models.dots3_note.configuration_dots3_note import Dots3NoteVisionConfig

    return Dots3NoteVisionConfig(hidden_size=32, moe_intermediate_size=16, intermediate_size=24, num_attention_heads=4,
                                 adapter_in_dim=32, pyramid_num_routed=[0, 4, 6], num_experts_per_tok=2,
                                 router_scale=2.5, num_hidden_layers=3)


def _block(layer: int, dtype: torch.dtype):
    block = dots3.Dots3NoteVisionMoE(_config(), layer).eval()
    g = torch.Generator().manual_seed(layer)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
        block.e_score_correction_bias.copy_(torch.randn(block.e_score_correction_bias.shape, generator=g) * 0.1)
    block.experts.config._experts_implementation = "eager"  # transformers' own loop, the reference
    return block.to(dtype), torch.randn(2, 5, 32, generator=g, dtype=torch.float64).to(dtype)


def test_each_pyramid_layer_is_read_with_its_own_expert_count():
    cfg = _config()
    for layer, experts in ((1, 4), (2, 6)):
        config = MoEConfig.from_hf_config(cfg.per_layer_config[layer])
        assert (config.num_experts, config.top_k, config.scoring, config.renormalize) == (experts, 2, "sigmoid", True)
        assert (config.routed_scaling_factor, config.renorm_eps, config.use_correction_bias) == (2.5, 1e-20, True)
        assert config.num_moe_layers == 2 and config.shared_expert_intermediate_size == 0


# float64: the reference backend (grouped_mm takes no float64); the block rounds nothing through float32 but its
# router's float32 cast, so the hf tests' block bound (_hf_fuzz_check's BLOCK_TOLERANCES)
@pytest.mark.parametrize("dtype, tol, backend", [(torch.float32, 1e-5, "auto"), (torch.float64, 1e-5, "reference")])
@pytest.mark.parametrize("layer", [1, 2])
def test_the_vision_moe_blocks_are_swapped_and_equal_their_forward(layer, dtype, tol, backend):
    block, x = _block(layer, dtype)
    with torch.no_grad():
        want = block(x)
        holder = torch.nn.ModuleDict({"mlp": block})
        report = moekit_hf.use_moekit_blocks(holder, backend=backend)
        assert report.swapped and not report.left
        got = block(x)
    assert rel_l2(got, want) < tol

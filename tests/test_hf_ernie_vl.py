"""ERNIE-4.5-VL's modality block with moekit's layer in its text and vision sparse blocks (one expert width each,
moe_intermediate_size [text, vision]): each swapped block returns its output and router logits flattened, as its
own, and the modality block scatters them by token type; equal to its own forward (fp32, random weights and
correction biases), with only text tokens and with both kinds."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit import MoEConfig  # noqa: E402

from _helpers import rel_l2  # noqa: E402


def _modality_block():
    from transformers.models.ernie4_5_vl_moe import configuration_ernie4_5_vl_moe as conf
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as modeling

    cfg = conf.Ernie4_5_VLMoeTextConfig(hidden_size=32, moe_intermediate_size=[16, 8], moe_num_experts=6, moe_k=2,
                                        moe_num_shared_experts=1, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=11)
    torch.manual_seed(0)
    block = modeling.Ernie4_5_VLMoeMoeBlock(cfg).float().eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, 0.1 if name.endswith("e_score_correction_bias") else p.shape[-1] ** -0.5)
    return cfg, block


def test_config_reads_the_text_width_and_float32_routing():
    cfg, _ = _modality_block()
    c = MoEConfig.from_hf_config(cfg)
    assert (c.moe_intermediate_size, c.num_experts, c.top_k, c.shared_expert_intermediate_size) == (16, 6, 2, 16)
    assert c.use_correction_bias and c.renormalize and c.router_dtype == "float32"
    assert c.num_moe_layers == 1  # its default mlp_layer_types: ["dense", "sparse"]


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_text_and_vision_blocks_swapped_and_scattered(fuse_shared):
    _, block = _modality_block()
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    types = torch.zeros(2, 7, dtype=torch.int64)
    types[0, 2:5], types[1, 6] = 1, 2  # vision tokens (1 image, 2 video) among text ones
    with torch.no_grad():
        want_text, want = block(x), block(x, moe_mm_token_type_ids=types)
        report = moekit_hf.use_moekit_blocks(torch.nn.ModuleDict({"mlp": block}), fuse_shared=fuse_shared)
        assert [b.path for b in report.swapped] == ["mlp.text_moe", "mlp.vision_moe"] and not report.left
        assert block.vision_moe._moekit_swap.moe.config.moe_intermediate_size == 8
        got_text, got = block(x), block(x, moe_mm_token_type_ids=types)
    for g, w in ((got_text, want_text), (got, want)):
        assert rel_l2(g[0], w[0]) < 1e-5 and rel_l2(g[1], w[1]) < 1e-5  # output [B, S, K], router logits [M, E]

"""Llama-4's MoE block (outside the family walk: its experts are not of transformers' experts interface) through
moekit: each chosen expert runs on sigmoid(its logit) x token (``expert_weight_on="input"``), a shared expert is
always added; ``moe_from_hf`` and ``use_moekit_blocks`` against the block's own forward (fp32, < 1e-5)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")

import moekit.hf as moekit_hf  # noqa: E402
from moekit.config import MoEConfig  # noqa: E402

from _helpers import rel_l2  # noqa: E402


def _block(top_k: int):
    """A small Llama-4 text MoE block (4 experts of width 16, hidden 32), random weights, and its input."""
    cfg = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                        num_experts_per_tok=top_k, intermediate_size_mlp=64)
    g = torch.Generator().manual_seed(top_k)
    block = llama4.Llama4TextMoe(cfg).float().eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block, torch.randn(2, 5, 32, generator=g)


def test_the_config_reads_input_weighted_experts():
    cfg = MoEConfig.from_hf_config(transformers.Llama4Config())  # the top-level config: its text config is read
    text = transformers.Llama4TextConfig()
    assert (cfg.scoring, cfg.renormalize, cfg.expert_weight_on) == ("sigmoid", False, "input")
    assert cfg.shared_expert_intermediate_size == text.intermediate_size == cfg.moe_intermediate_size
    assert cfg.num_moe_layers == len(text.moe_layers) and cfg.changed_router_options() == {"expert_weight_on": "input"}


@pytest.mark.parametrize("top_k", [1, 2])
def test_block_through_moekit(top_k):
    """moe_from_hf's layer (asked to fuse the shared expert or not: input weighting keeps it apart) and the swapped
    block (its tuple kept) equal the block's own forward."""
    block, x = _block(top_k)
    with torch.no_grad():
        want, _ = block(x)
        for fuse_shared in (False, True):
            moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
            assert not moe.fuse_shared and moe.config.expert_weight_on == "input"
            assert rel_l2(moe(x).reshape(want.shape), want) < 1e-5
        report = moekit_hf.use_moekit_blocks(torch.nn.ModuleDict({"mlp": block}))
        assert report.swapped and report.swapped[0].tuple_len == 2
        got, none = block(x)
    assert none is None and rel_l2(got.reshape(want.shape), want) < 1e-5  # its own is [M, K]: the layer views it


def test_input_weighting_is_not_output_weighting():
    """The same layer with the weights on the outputs computes another function (the experts are nonlinear)."""
    block, x = _block(1)
    moe = moekit_hf.moe_from_hf(block)
    with torch.no_grad():
        want, _ = block(x)
        moe.config = moe.config.replace(expert_weight_on="output")
        assert rel_l2(moe(x).reshape(want.shape), want) > 1e-3

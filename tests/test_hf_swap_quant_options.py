"""``moe_from_hf`` of a Mixtral block that jitters its input (``router_jitter_noise > 0``) in training warns, once;
in eval mode, without jitter, and inside ``use_moekit_blocks`` (which runs the block's own forward there) it does not.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf import moe_from_hf, use_moekit_blocks  # noqa: E402

import _hf_tiny_models as tiny  # noqa: E402


def _mixtral_block(jitter: float):
    cfg = transformers.MixtralConfig(**tiny.COMMON, intermediate_size=16, num_hidden_layers=1, num_local_experts=4,
                                     num_experts_per_tok=2, router_jitter_noise=jitter)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    return model, next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))


def test_moe_from_hf_warns_once_where_a_training_block_jitters_its_input():
    model, block = _mixtral_block(0.5)
    block.train()
    with pytest.warns(UserWarning, match=r"router_jitter_noise=0\.5.*no input jitter") as record:
        moe = moe_from_hf(block)
    assert len(record) == 1 and moe.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block.eval()
        moe_from_hf(block)  # at inference the block does not jitter: nothing to say
        model.train()
        use_moekit_blocks(model)  # the swapped block runs its own forward in training: nothing lost
        _, still = _mixtral_block(0.0)
        moe_from_hf(still.train())

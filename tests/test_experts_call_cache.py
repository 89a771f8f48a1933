"""``ExpertsCallCache`` (the check once per weight set of ``MoE``'s forward) pickles and copies as a new, empty cache:
a ``MoE`` saved after a forward loads and computes what it computed before (its weak references never pickle)."""

import copy
import io

import torch

from moekit import MoE, MoEConfig
from moekit.experts import ExpertsCallCache


def test_moe_saves_after_a_forward():
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2))
    x = torch.randn(3, 32)
    with torch.no_grad():
        before = moe(x)
        buf = io.BytesIO()
        torch.save(moe, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded(x), before)
        assert torch.equal(copy.deepcopy(moe)(x), before)


def test_a_copy_is_empty():
    cache = ExpertsCallCache()
    cache._refs = ("kept",)
    assert copy.copy(cache)._refs is None and copy.deepcopy(cache)._refs is None

"""``moekit.hf.offload_experts`` on a tiny transformers model built offline (CPU: the cache's "GPU" is
the CPU too): the offloaded model's logits equal the original's, the budget sets the cache, and the
blocks share it."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf import OffloadedBlock, offload_experts  # noqa: E402

from _helpers import rel_l2  # noqa: E402


def _tiny_qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def test_offloaded_model_gives_the_same_logits():
    model = _tiny_qwen3_moe()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    expert_bytes = 3 * 32 * 16 * 4
    cache = offload_experts(model, gpu_budget_bytes=5 * expert_bytes + 7, device="cpu", backend="grouped_mm")
    assert cache.cache_experts == 5  # 3 layers x 8 experts = 24 experts behind 5 slots
    assert sum(isinstance(m, OffloadedBlock) for m in model.modules()) == 3
    with torch.no_grad():
        got = model(ids).logits
    assert rel_l2(got, ref) < 1e-5
    stats = cache.stats
    assert stats.touched == stats.hits + stats.fetched and stats.fetched > 0 and stats.prefetched > 0


def test_a_budget_below_one_expert_is_refused():
    with pytest.raises(ValueError, match="gpu_budget_bytes must be an int of at least one expert"):
        offload_experts(_tiny_qwen3_moe(), gpu_budget_bytes=100, device="cpu")

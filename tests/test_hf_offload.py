"""``moekit.hf.offload_experts`` on a tiny transformers model built offline (CPU: the cache's "GPU" is
the CPU too): the offloaded model's logits equal the original's, the budget sets the cache, and the
blocks share it; an fp8 model (transformers' FP8Experts) offloads its packed experts."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf import OffloadedBlock, moe_from_hf, offload_experts  # noqa: E402

from _helpers import rel_l2  # noqa: E402
import _hf_tiny_models as tiny  # noqa: E402


def test_offloaded_model_gives_the_same_logits():
    model = tiny.qwen3_moe_small()
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


def test_auto_blocks_share_one_measurement_and_keep_the_logits():
    model = tiny.qwen3_moe_small()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    cache = offload_experts(model, gpu_budget_bytes=5 * 3 * 32 * 16 * 4, device="cpu", backend="grouped_mm",
                            compute_misses_on="auto")
    layers = [m.moe for m in model.modules() if isinstance(m, OffloadedBlock)]
    assert layers[0].costs is not None and all(layer.costs is layers[0].costs for layer in layers)
    with torch.no_grad():
        got = model(ids).logits
    assert rel_l2(got, ref) < 1e-5
    assert cache.stats.touched == cache.stats.hits + cache.stats.fetched + cache.stats.cpu_experts


def test_a_budget_below_one_expert_is_refused():
    with pytest.raises(ValueError, match="gpu_budget_bytes must be an int of at least one expert"):
        offload_experts(tiny.qwen3_moe_small(), gpu_budget_bytes=100, device="cpu")


def test_fp8_model_offloads_packed_and_gives_the_plain_fp8_logits():
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    model = tiny.fp8_qwen3_moe()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:  # the plain (resident) fp8 MoE of each block
        layer.mlp = moe_from_hf(layer.mlp, backend="grouped_mm")
        assert layer.mlp.quant_scheme == "fp8_block"
    with torch.no_grad():
        ref = reference(ids).logits
    packed = (2 * 128 * 128 + 2 * 4) + (128 * 128 + 4)  # e4m3 w13 [256, 128] + w2 [128, 128], fp32 scale per 128x128
    cache = offload_experts(model, gpu_budget_bytes=3 * packed, device="cpu", backend="grouped_mm")
    assert cache.cache_experts == 3 and cache.expert_bytes == packed  # the same bytes hold 1 bf16 expert
    with torch.no_grad():
        got = model(ids).logits
    assert rel_l2(got, ref) < 1e-5  # the float32 router stays float32 (bf16, the fp8 logical dtype, gave 1.7e-4)
    stats = cache.stats
    assert stats.fetched > 0 and stats.bytes_transferred == (stats.fetched + stats.prefetched) * packed


def test_a_budget_above_every_expert_is_capped_at_them():
    """3 blocks x 8 experts = 24 experts; a budget of 100 experts' bytes held 100 slots, 76 of them for nothing."""
    model = tiny.qwen3_moe_small()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    budget = 100 * 3 * 32 * 16 * 4
    with pytest.warns(UserWarning, match=rf"^gpu_budget_bytes={budget} asks for 100 expert slots, more than the 24 "):
        cache = offload_experts(model, gpu_budget_bytes=budget, device="cpu", backend="grouped_mm")
    assert cache.cache_experts == 24 and cache.slot_weights[0].shape == (24, 32, 32)
    with torch.no_grad():
        got = model(ids).logits
    assert rel_l2(got, ref) < 1e-5 and cache.stats.touched == cache.stats.hits + cache.stats.fetched


def test_offloading_again_says_the_blocks_are_offloaded():
    model = tiny.qwen3_moe_small()
    offload_experts(model, gpu_budget_bytes=5 * 3 * 32 * 16 * 4, device="cpu")
    with pytest.raises(ValueError, match=r"no MoE block .*: Qwen3MoeForCausalLM; its blocks are offloaded already"):
        offload_experts(model, gpu_budget_bytes=5 * 3 * 32 * 16 * 4, device="cpu")


def test_a_whole_offloaded_model_saves_and_loads():
    """torch.save(model) of the offloaded transformers model (modules pickled, not a state_dict; it failed on the
    cache's typed views, usr44): the loaded model's blocks share one new cache and give the original's logits."""
    import io

    model = tiny.qwen3_moe_small()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    offload_experts(model, gpu_budget_bytes=5 * 3 * 32 * 16 * 4, device="cpu", backend="grouped_mm")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    caches = {id(m.moe.cache) for m in loaded.modules() if isinstance(m, OffloadedBlock)}
    assert len(caches) == 1
    with torch.no_grad():
        assert rel_l2(loaded(ids).logits, ref) < 1e-5

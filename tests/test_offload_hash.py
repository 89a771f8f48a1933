"""Offloaded hash layers (``OffloadedMoE.from_moe(hash_moe)`` -> ``OffloadedHashMoE``, CPU: the cache's "GPU" is the
CPU too): the layer against a float64 per-token loop with misses fetched, computed on the CPU, and in rounds; the
errors naming ``token_ids``; the next hash layer's prefetch told exactly by the table; and the whole-model offload of a
tiny DeepSeek-V4 built offline by transformers (a hash layer and two top-k layers) against its own logits; the layer
keeps the HashMoE's router choice (the one-launch kernel and the gate kernel with "fused", interpreted).

Shapes: M tokens, K hidden 16, N expert width 8, E experts 8, k = top_k 2, V table rows 40.
"""

from __future__ import annotations

import pytest
import torch

from moekit import HashMoE, MoE, MoEConfig
from moekit.offload import ExpertCache, OffloadedMoE, link_layers
from moekit.offload.layer_hash import OffloadedHashMoE

from _hash_loop import hash_layer_loop

V = 40
CFG = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, scoring="sqrtsoftplus",
                routed_scaling_factor=1.5, hash_table_size=V, shared_expert_intermediate_size=8)


def _hash_moe(seed: int, **kwargs) -> HashMoE:
    torch.manual_seed(seed)
    moe = HashMoE(CFG, dtype=torch.float64, **kwargs)
    return moe.load_table_(torch.randint(0, 8, (V, 2), generator=torch.Generator().manual_seed(seed + 100)))


def _ids(shape, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fuse_shared", [False, True])
@pytest.mark.parametrize("misses_on,slots", [("gpu", 3), ("gpu", 8), ("cpu", 3)])
def test_the_offloaded_hash_layer_equals_a_float64_loop(fuse_shared, misses_on, slots):
    """3 slots: the touched experts exceed the cache (rounds on the GPU side; CPU misses); 8: all fit."""
    moe = _hash_moe(0, fuse_shared=fuse_shared)
    off = OffloadedMoE.from_moe(moe, cache_experts=slots, compute_misses_on=misses_on, prefetch=None)
    assert type(off) is OffloadedHashMoE and torch.equal(off.tid2eid, moe.tid2eid)
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = _ids((2, 6))
    with torch.no_grad():
        got, want = off(x, token_ids=ids), hash_layer_loop(moe, x, ids)
    assert ((got - want).norm() / want.norm()).item() < 1e-7  # the partial outputs add in float32 (offload's doc)
    touched = set(moe.tid2eid[ids.reshape(-1)].reshape(-1).tolist())
    assert off.last_stats.touched == len(touched)  # the table's experts of these ids, each once
    assert (off.last_stats.cpu_experts > 0) == (misses_on == "cpu")


def test_errors_name_token_ids_and_a_subclass_of_moe_is_refused():
    off = OffloadedMoE.from_moe(_hash_moe(0), cache_experts=4)
    x = torch.randn(4, 16, dtype=torch.float64)
    with pytest.raises(TypeError, match="token_ids is required"):
        off(x)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, hash_table_size=40\).*\[40\] at tokens \[1\]"):
        off(x, token_ids=torch.tensor([0, 40, 1, 2]))
    with pytest.raises(TypeError, match="moe must be a plain moekit.MoE or a moekit.HashMoE, got OffloadedHashMoE"):
        OffloadedMoE.from_moe(off, cache_experts=4)


def test_a_hash_layer_prefetches_the_next_hash_layer_exactly_and_a_top_k_one_by_its_router():
    """hash -> hash -> top-k, one cache: layer 0 prefetches tid2eid_1[ids] (no router: the table decides), layer 1
    prefetches what layer 2's router chooses on layer 1's input; the chain equals the layers run alone."""
    moes = [_hash_moe(0), _hash_moe(1), MoE(CFG.replace(hash_table_size=None), dtype=torch.float64)]
    cache = ExpertCache(12, device="cpu", policy="lru")
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch="router") for m in moes]
    link_layers(layers)
    x, ids = torch.randn(5, 16, dtype=torch.float64), _ids((5,))
    with torch.no_grad():
        h = layers[0](x, token_ids=ids)
        predicted = set(moes[1].tid2eid[ids].reshape(-1).tolist())
        assert set(cache.cached(layers[1].layer_id)) == predicted  # exactly: nothing of layer 1 ran yet
        assert layers[0].last_stats.prefetched == len(predicted)
        h2 = layers[1](h, token_ids=ids)
        assert layers[1].last_stats.prefetch_used == len(predicted)  # every prefetched expert was run
        routed = set(moes[2].route_tokens(h).router_ids.reshape(-1).tolist())  # on h, layer 1's input: not h2
        assert routed <= set(cache.cached(layers[2].layer_id))
        got = layers[2](h2)
        want = moes[2](moes[1](moes[0](x, token_ids=ids), token_ids=ids))
    assert ((got - want).norm() / want.norm()).item() < 1e-7


def _v4_model():
    pytest.importorskip("transformers", reason="transformers is part of the test extras")
    from _hf_fuzz_models import build_model, family_keys, family_of, tiny_config

    fam = family_of(next(k for k in family_keys() if k.startswith("deepseek_v4:")))
    model = build_model(fam, tiny_config(fam, {"mlp_layer_types": ["hash_moe", "moe", "moe"]}), 0, torch.float32)
    model.set_experts_implementation("eager")
    return model


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("swapped", [False, True])
def test_a_deepseek_v4_model_offloads_its_hash_and_top_k_blocks_and_keeps_its_logits(swapped):
    """The model as transformers built it, or after use_moekit_blocks (its blocks swapped, then offloaded)."""
    from moekit.hf import OffloadedBlock, offload_experts, use_moekit_blocks

    model = _v4_model()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    if swapped:
        assert len(use_moekit_blocks(model).swapped) == 3
    experts = model.config.n_routed_experts
    per_expert = 3 * model.config.hidden_size * model.config.moe_intermediate_size * 4
    cache = offload_experts(model, gpu_budget_bytes=(experts + 2) * per_expert, device="cpu", backend="grouped_mm")
    blocks = [m for m in model.modules() if isinstance(m, OffloadedBlock)]
    assert [type(b.moe).__name__ for b in blocks] == ["OffloadedHashMoE", "OffloadedMoE", "OffloadedMoE"]
    assert cache.cache_experts == experts + 2  # fewer slots than the 3 layers' experts: misses fetched
    with torch.no_grad():
        got = model(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert cache.stats.fetched > 0 and cache.stats.touched == cache.stats.hits + cache.stats.fetched
    with pytest.raises(TypeError, match="token_ids is required"):
        blocks[0](torch.randn(1, 3, model.config.hidden_size))  # a hash block called without the input ids


def test_the_table_travels_in_the_state_dict_and_a_bad_entry_is_refused():
    """Another offloaded hash layer loading the first's state_dict (host experts and table) computes the first's."""
    first, other = (OffloadedMoE.from_moe(_hash_moe(seed), cache_experts=4) for seed in (0, 1))
    state = first.state_dict()
    assert not torch.equal(state["tid2eid"], other.tid2eid)
    other.load_state_dict(state)
    x, ids = torch.randn(6, 16, dtype=torch.float64), _ids((6,))
    with torch.no_grad():
        assert torch.equal(other(x, token_ids=ids), first(x, token_ids=ids))
    state["tid2eid"][3, 1] = 8
    with pytest.raises(ValueError, match=r"tid2eid must hold experts in \[0, num_experts=8\); rows \[3\]"):
        other.load_state_dict(state)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards
@pytest.mark.parametrize("router", ["auto", "torch", "fused"])
def test_the_offloaded_layer_keeps_the_hash_router_asked_for(router, monkeypatch):
    """``from_moe`` hands the layer it builds the HashMoE's router choice (session 48 handed MoE's, "torch": the
    offloaded hash layer routed with the torch twin on the GPU too); with "fused" it routes with the one-launch kernel
    and the gate kernel (interpreted here) and equals the float64 loop."""
    from _helpers import count_calls
    from _triton_helpers import interpreted
    from moekit.routing.hash_fused import FusedHashRouter

    with interpreted("moekit.routing", "moekit.routing.hash_fused"):
        calls = count_calls(monkeypatch, {"router": 0}, [(FusedHashRouter, "__call__", "router")])
        moe = _hash_moe(0, router=router)
        off = OffloadedMoE.from_moe(moe, cache_experts=3, prefetch=None)
        assert off.router == router and (off._hash_router is None) == (router == "torch")
        assert (off._gate_fn is not None) == (router == "fused")  # "auto" off CUDA: the torch twin, F.linear
        x, ids = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), _ids((5,))
        with torch.no_grad():
            got, want = off(x, token_ids=ids), hash_layer_loop(moe, x, ids)
        assert ((got - want).norm() / want.norm()).item() < 1e-7
        assert calls["router"] == (router == "fused")

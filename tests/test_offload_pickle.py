"""``torch.save(model)`` / ``torch.load(..., weights_only=False)`` of a whole model holding ``OffloadedMoE`` layers
(pickling the modules, not their state_dict): it failed in torch ("Cannot save multiple tensors or storages that view
the same data as different types": the ExpertCache's parts and the CPU branch's staging are typed views over byte
buffers; usr44). Now the cache pickles as its host byte blocks and comes back empty (``offload/cache_pickle.py``).
Held to the plain layers the model was offloaded from, computed here before the offload (the offloaded layer's
function), and to the model as saved. CPU: the cache's "GPU" is the CPU too. Shapes: K=32, N=16, E=8, top-2."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.offload import OffloadedMoE
from moekit.offload.cache import ExpertCache
from moekit.offload.layer import link_layers

from _helpers import rel_l2

CONFIG = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2, shared_expert_intermediate_size=16)


def _saved_and_loaded(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _model(scheme: str | None, place: str) -> tuple[torch.nn.Sequential, list[MoE]]:
    """Two layers behind one shared cache of 3 slots (fewer than a batch touches), linked for prefetch."""
    plain = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        moe = MoE(CONFIG, fuse_shared=seed == 0, backend="grouped_mm", router="torch").eval()
        plain.append(moe.quantize_(scheme) if scheme else moe)
    cache = ExpertCache(3, device="cpu", policy="lru")
    layers = [OffloadedMoE.from_moe(m, cache=cache, compute_misses_on=place, prefetch="router") for m in plain]
    link_layers(layers)
    return torch.nn.Sequential(*layers), plain


def _outputs(layers, xs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [layer(x) for x in xs for layer in layers]


@pytest.mark.parametrize("scheme", [None, "int4_w4a16"])
@pytest.mark.parametrize("place", ["gpu", "cpu"])
def test_a_saved_offloaded_model_loads_and_computes_the_same(scheme, place):
    model, plain = _model(scheme, place)
    xs = [torch.randn(m, 32, generator=torch.Generator().manual_seed(m)) for m in (9, 1, 5)]
    want = _outputs(plain, xs)
    _outputs(model, xs[:1])  # a warm cache, staging buffers in use, stats counted
    loaded = _saved_and_loaded(model)
    cache = loaded[0].cache
    assert loaded[1].cache is cache and cache is not model[0].cache and loaded[0].next_layer is loaded[1]
    assert cache.cached(0) == {} and cache.cached(1) == {}  # nothing device-side travels: the first forward fetches
    assert cache.stats.touched == model[0].cache.stats.touched > 0
    got, again = _outputs(loaded, xs), _outputs(model, xs)
    for g, w, a in zip(got, want, again):
        assert rel_l2(g, w) < 1e-5 and rel_l2(g, a) < 1e-6
    assert cache.stats.touched == cache.stats.hits + cache.stats.fetched + cache.stats.cpu_experts


def test_the_loaded_experts_are_its_own():
    """The loaded host store is a copy: writing the saved model's experts (a state_dict load, in place into its host
    store, which on the CPU is the source MoE's own rows) leaves it as it was."""
    model, plain = _model(None, "gpu")
    loaded = _saved_and_loaded(model)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    (want,) = _outputs(plain[:1], [x])
    torch.manual_seed(7)
    model[0].load_state_dict(MoE(CONFIG, fuse_shared=False, backend="grouped_mm", router="torch").state_dict())
    with torch.no_grad():
        assert rel_l2(loaded[0](x), want) < 1e-5 and rel_l2(model[0](x), want) > 1e-2


def test_deepcopy_goes_the_same_way():
    model, plain = _model(None, "cpu")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(4))
    _outputs(model, [x])
    twin = copy.deepcopy(model)
    assert twin[0].cache is twin[1].cache and twin[0].cache is not model[0].cache
    for g, w in zip(_outputs(twin, [x]), _outputs(plain, [x])):
        assert rel_l2(g, w) < 1e-5

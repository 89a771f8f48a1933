"""``moekit.offload`` with quantized experts, on a CPU-only machine (the cache's "GPU" is the CPU): the
offloaded layer equals the plain quantized ``MoE`` of the same scheme through hits, fetches, evictions,
rounds, CPU-computed misses and prefetch; the bytes the cache holds and moves are the packed sizes
computed here from the layout contract (COMMON.md), not the float sizes."""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, expert_nbytes, link_layers

from _helpers import TOLERANCE, rel_l2

E, K, N = 8, 64, 32
OPTIONS = {  # small blocks and groups, so every scale tensor has several entries per expert
    "fp8_block": {"block_shape": (16, 16)},
    "int8_w8a16": {},
    "int4_w4a16": {"group_size": 32},
    "mxfp4": {},
}


def _packed_bytes(scheme: str, options: dict) -> int:
    """One expert's bytes (w13 [2N, K] + w2 [K, N]) in ``scheme``'s layout, from the contract."""

    def weight(r: int, c: int) -> int:
        if scheme == "fp8_block":
            br, bc = options["block_shape"]
            return r * c + math.ceil(r / br) * math.ceil(c / bc) * 4  # e4m3 q + fp32 block scales
        if scheme == "int8_w8a16":
            return r * c + r * 4  # int8 q + fp32 per-row scale
        if scheme == "int4_w4a16":
            return r * math.ceil(c / 2) + r * math.ceil(c / options["group_size"]) * (4 + 1)  # + fp32 scale, u8 zero
        return r * math.ceil(c / 2) + r * math.ceil(c / 32)  # mxfp4: e2m1 pairs + e8m0 scale per 32

    return weight(2 * N, K) + weight(K, N)


def _moe(scheme: str, seed: int = 0, **config) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2, **config),
              backend="grouped_mm", router="torch")
    if moe.b13 is not None:
        with torch.no_grad():
            moe.b13.normal_()
            moe.b2.normal_()
    return moe.quantize_(scheme, **OPTIONS[scheme])


def _x(m: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", sorted(OPTIONS))
@pytest.mark.parametrize("place", ["gpu", "cpu", "auto"])
@pytest.mark.parametrize("slots", [1, 3])
def test_quantized_offloaded_layer_equals_the_plain_quantized_layer(scheme, place, slots):
    moe = _moe(scheme)
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6)  # "auto" mixes the two
    off = OffloadedMoE.from_moe(moe, cache_experts=slots, compute_misses_on=place, costs=costs)
    for seed in range(3):  # later batches meet a warm cache: hits and evictions
        x = _x(11, seed)
        assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    stats, packed = off.cache.stats, _packed_bytes(scheme, OPTIONS[scheme])
    assert stats.touched == stats.hits + stats.fetched + stats.cpu_experts
    assert stats.bytes_transferred == (stats.fetched + stats.admitted + stats.prefetched) * packed
    if place == "gpu":  # 11 tokens x 2 slots touch most of the 8 experts: more fetches than slots, so evictions
        assert stats.cpu_experts == 0 and stats.fetched > slots
    if place == "cpu":
        assert stats.fetched == 0 and stats.cpu_experts > 0 and stats.admitted > 0 and stats.hits > 0


@pytest.mark.parametrize("scheme", sorted(OPTIONS))
def test_a_slot_costs_the_packed_bytes(scheme):
    moe = _moe(scheme)
    packed = _packed_bytes(scheme, OPTIONS[scheme])
    assert expert_nbytes(moe) == packed < 3 * N * K * 4
    off = OffloadedMoE.from_moe(moe, cache_experts=5)
    w13, w2, b13, b2 = off.cache.slot_weights
    assert w13.scheme == w2.scheme == scheme and b13 is None and b2 is None
    assert w13.shape == (5, 2 * N, K) and w2.shape == (5, K, N)
    assert w13.nbytes + w2.nbytes == 5 * packed == 5 * off.cache.expert_bytes
    budget = 3 * N * K * 2 * 4  # four bf16 experts' bytes hold more packed experts
    assert budget // expert_nbytes(moe) > 4


@pytest.mark.parametrize("place", ["gpu", "cpu"])
def test_expert_biases_travel_with_quantized_experts(place):
    moe = _moe("int8_w8a16", expert_bias=True)
    off = OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on=place)
    x = _x(9)
    assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert off.cache.expert_bytes == _packed_bytes("int8_w8a16", {}) + (2 * N + K) * 4  # fp32 b13 + b2 rows


def test_quantized_layers_share_one_budget_and_prefetch():
    moes = [_moe("int4_w4a16", seed) for seed in range(3)]
    cache = ExpertCache(6, device="cpu", policy="lru")
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch="router") for m in moes]
    link_layers(layers)
    for seed in range(3):
        x = y_ref = _x(2, seed)
        for moe, layer in zip(moes, layers):
            y_ref, x = moe(y_ref), layer(x)
        assert rel_l2(x, y_ref) < TOLERANCE[torch.float32]
    stats = cache.stats
    assert stats.prefetched > 0 and stats.prefetch_used > 0
    assert (stats.bytes_transferred
            == (stats.fetched + stats.prefetched) * _packed_bytes("int4_w4a16", OPTIONS["int4_w4a16"]))


def test_layers_of_different_schemes_or_options_cannot_share_slots():
    cache = ExpertCache(4, device="cpu")
    OffloadedMoE.from_moe(_moe("int4_w4a16"), cache=cache)
    with pytest.raises(ValueError, match=r"the cache holds int4_w4a16 experts.*this layer has int8_w8a16 experts"):
        OffloadedMoE.from_moe(_moe("int8_w8a16"), cache=cache)
    other = _moe("int8_w8a16")
    other = MoE(other.config, backend="grouped_mm").quantize_("int4_w4a16", group_size=64)
    with pytest.raises(ValueError, match="'group_size': 32.*'group_size': 64"):
        OffloadedMoE.from_moe(other, cache=cache)
    with pytest.raises(ValueError, match="this layer has float experts"):
        OffloadedMoE.from_moe(MoE(other.config, backend="grouped_mm"), cache=cache)

"""``ExpertCache``'s repr (``moekit.offload.cache_repr``): its slots, device, policy, layers, slots in use and what
the forwards so far did, counted here by hand on a scripted sequence of lookups (usr49: ``print(offload_experts(...))``
showed ``<moekit.offload.cache.ExpertCache object at 0x...>``)."""

from __future__ import annotations

import torch

from moekit.offload import ExpertCache

E, K, N = 4, 16, 8


def _forward(cache: ExpertCache, layer: int, experts: list[int]) -> None:
    """One forward's cache traffic as ``OffloadedMoE`` drives it: look up, fetch the misses, count, release."""
    cache.begin_forward()
    cache.stats.touched += len(experts)
    _, misses = cache.lookup(layer, experts, cache.stats)
    cache.ensure(layer, misses, cache.stats)
    cache.release(layer, experts)


def test_repr_states_the_slots_and_what_the_forwards_did():
    cache = ExpertCache(3, device="cpu", policy="lru")
    assert repr(cache).startswith("ExpertCache(3 slots x 0 MB on cpu, policy='lru', 0 layers; 0 of 3 slots in use")
    for _ in range(2):
        cache.register(torch.randn(E, 2 * N, K), torch.randn(E, K, N))
    _forward(cache, 0, [0, 1])  # 2 misses
    _forward(cache, 0, [0, 1])  # 2 hits
    _forward(cache, 1, [3])  # 1 miss: the third slot
    expert_bytes = (2 * N * K + K * N) * 4  # one fp32 expert: w13's [2N, K] and w2's [K, N]
    assert repr(cache) == (f"ExpertCache(3 slots x {expert_bytes / 1e6:.3g} MB on cpu, policy='lru', 2 layers; 3 of 3 "
                           f"slots in use; hits 2 of 5 touched (40.0%), fetched 3, prefetched 0, "
                           f"{3 * expert_bytes / 1e6:.3g} MB copied)")

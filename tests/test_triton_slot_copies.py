"""Copies into an offload cache's slots (``moekit.offload.ExpertCache``: every fetch writes the slot blocks
in place, bumping the slot weights' ``_version``) under Triton's interpreter: the Triton experts call over
the slots keeps its TMA descriptors and its recorded launch sequence (both hold addresses and layouts, never
values: ``triton_cache.WeightDescriptors``), and every call reads what the slots hold now, equal to a
float64 loop over the host weights of the experts routed.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import TOLERANCE as TOL, experts_loop, rel_l2  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.offload.cache import ExpertCache  # noqa: E402
from moekit.offload.stats import OffloadStats  # noqa: E402

E, K, N, C = 8, 40, 24, 3  # 16-byte weight rows in bf16: the TMA descriptor path runs; 3 slots of 8 experts


def test_slot_copies_keep_descriptors_and_sequence(interpreter, monkeypatch):
    from moekit.experts import triton_cache, triton_lean

    built, real = [], triton_cache.weight_descriptor
    monkeypatch.setattr(triton_cache, "weight_descriptor", lambda w, *blocks: built.append(1) or real(w, *blocks))
    interpreter.clear_launch_caches()
    g = torch.Generator().manual_seed(0)
    host13 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).bfloat16()
    host2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).bfloat16()
    cache = ExpertCache(C, device="cpu", policy="lru")
    layer = cache.register(host13, host2)
    w13, w2, _, _ = cache.slot_weights  # [C, 2N, K], [C, K, N]: views of the slot blocks
    stats = OffloadStats()
    x = torch.randn(4, K, generator=g).bfloat16()
    weights = torch.full((4, 2), 0.5)

    def step(experts: list[int]) -> torch.Tensor:
        """Fetch ``experts`` (those not cached, evicting the others), then one call over the slots."""
        cache.begin_forward()
        _, misses = cache.lookup(layer, experts, stats)  # the hits protected from eviction
        cache.ensure(layer, misses, stats)
        ids = torch.tensor([[experts[t % 2], experts[2]] for t in range(4)], dtype=torch.int32)
        out = interpreter.experts_triton(x, w13, w2, ids, weights, expert_map=cache.slot_map(layer, experts, E))
        cache.release(layer, experts)
        assert rel_l2(out, experts_loop(x, host13, host2, ids, weights)) < TOL[torch.bfloat16]
        return out

    step([0, 1, 2])  # compiles
    step([0, 1, 2])  # records the sequence
    sequences = dict(triton_lean._SEQUENCES)
    assert len(sequences) == 1 and len(built) == 2
    version = w13._version
    for experts in ([3, 4, 5], [6, 7, 0], [1, 3, 6]):  # every slot written over, some twice
        step(experts)
    assert w13._version > version  # the copies did bump the slots' version
    assert len(built) == 2  # no descriptor built again
    assert triton_lean._SEQUENCES == sequences  # the same sequence object under the same key

"""The cache what-if: replay a routing trace through ``ExpertCache`` without weights.

A trace is what a decode run's routers chose: per step, per layer, the set of experts touched, and
(for ``prefetch="router"``) the set layer l's router would pick from layer l-1's input. The replay
drives the same ``ExpertCache`` the layers use, with zero-byte experts, and the same miss decision
(``plan.plan_misses``: fetched, computed on the CPU, admitted afterwards), so the hit rate it predicts
is the cache's own behaviour under that ``compute_misses_on``, not a second model of it. For "cpu" and
"auto" the decision depends on each expert's token count (``RoutingTrace.tokens``) and on the costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.offload.cache import ExpertCache
from moekit.offload.cost import MissCosts
from moekit.offload.plan import plan_misses
from moekit.offload.stats import OffloadStats


@dataclass
class RoutingTrace:
    """touched[step][layer]: experts the layer's batch routed to at that step (sorted, no repeats);
    predicted[step][layer]: the experts the router prediction names for that layer (layer 0: empty);
    tokens[step][layer]: routed assignments per touched expert (None: one each, enough for "gpu")."""

    num_experts: int
    touched: list[list[list[int]]]
    predicted: list[list[list[int]]]
    tokens: list[list[dict[int, int]]] | None = None

    @property
    def num_layers(self) -> int:
        return len(self.touched[0]) if self.touched else 0


def replay(trace: RoutingTrace, cache_experts: int, policy: str = "lfu", prefetch: str | None = None, *,
           place: str = "gpu", costs: MissCosts | None = None, expert_bytes: int = 0,
           admit_per_forward: int | None = None) -> OffloadStats:
    """Hits, fetches, CPU misses, admissions and prefetches of a cache of ``cache_experts`` slots over
    ``trace``, as ``OffloadedMoE`` layers with ``compute_misses_on=place`` (and its ``costs``,
    ``admit_per_forward``, experts of ``expert_bytes``) and ``prefetch`` (None, "previous" or "router")
    would run it."""
    if prefetch not in (None, "previous", "router"):
        raise ValueError(f"prefetch must be None, 'previous' or 'router', got {prefetch!r}")
    cache = ExpertCache(cache_experts, device="cpu", policy=policy)
    empty = torch.empty(trace.num_experts, 0, 0)
    layers = [cache.register(empty, empty) for _ in range(trace.num_layers)]
    last: list[list[int]] = [[] for _ in layers]
    for step, per_layer in enumerate(trace.touched):
        for layer, touched in zip(layers, per_layer):
            counts = trace.tokens[step][layer] if trace.tokens is not None else dict.fromkeys(touched, 1)
            stats = OffloadStats(touched=len(touched))
            cache.begin_forward()
            hits, misses = cache.lookup(layer, touched, stats)
            plan = plan_misses(place, {m: counts[m] for m in misses}, len(hits), expert_bytes, costs,
                               admit_per_forward)
            for _ in cache.rounds(layer, hits, plan.fetch, stats):
                pass  # no weights: the rounds only move the cache's bookkeeping
            if plan.cpu:
                stats.cpu_experts, stats.cpu_tokens = len(plan.cpu), sum(counts[m] for m in plan.cpu)
                cache.admit(layer, plan.admit, stats)
            last[layer] = touched
            nxt = layer + 1
            if prefetch is not None and nxt < len(layers):
                guess = last[nxt] if prefetch == "previous" else trace.predicted[step][nxt]
                cache.prefetch(nxt, guess, stats)
            cache.stats.add(stats)
    return cache.stats

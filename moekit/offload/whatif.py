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
from moekit.offload.plan import plan_forward
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
           admit_per_forward: int | None = None, measure_from: int = 0) -> OffloadStats:
    """Hits, fetches, CPU misses, admissions and prefetches of a cache of ``cache_experts`` slots over
    ``trace``, as ``OffloadedMoE`` layers with ``compute_misses_on=place`` (and its ``costs``,
    ``admit_per_forward``, experts of ``expert_bytes``) and ``prefetch`` (None, "previous" or "router")
    would run it; counted from step ``measure_from`` on (the steps before only warm the cache)."""
    if prefetch not in (None, "previous", "router"):
        raise ValueError(f"prefetch must be None, 'previous' or 'router', got {prefetch!r}")
    cache = ExpertCache(cache_experts, device="cpu", policy=policy)
    empty = torch.empty(trace.num_experts, 0, 0)
    layers = [cache.register(empty, empty) for _ in range(trace.num_layers)]
    options = dict(prefetch=prefetch, place=place, costs=costs, expert_bytes=expert_bytes,
                   admit_per_forward=admit_per_forward)
    drive(cache, layers, trace, range(measure_from), **options)
    cache.stats = OffloadStats()
    drive(cache, layers, trace, range(measure_from, len(trace.touched)), **options)
    return cache.stats


def drive(cache: ExpertCache, layers: list[int], trace: RoutingTrace, steps: range, *, prefetch: str | None = None,
          place: str = "gpu", costs: MissCosts | None = None, expert_bytes: int = 0,
          admit_per_forward: int | None = None) -> None:
    """What the forwards of ``trace``'s ``steps`` do to ``cache`` (its layer ids ``layers``, one per
    trace layer): lookups, the miss plan's fetches and admissions, prefetches; no compute. Copies are
    made as the cache makes them (none for weightless experts or within ``cache.bookkeeping_only()``)."""
    last = [list(t) for t in trace.touched[steps.start - 1]] if steps.start > 0 else [[] for _ in layers]
    for step in steps:
        for i, (layer, touched) in enumerate(zip(layers, trace.touched[step])):
            counts = trace.tokens[step][i] if trace.tokens is not None else dict.fromkeys(touched, 1)
            stats = OffloadStats(touched=len(touched))
            cache.begin_forward()
            hits, misses = cache.lookup(layer, touched, stats)
            issued = []  # "auto"'s early fetches, issued as the layer issues them (before its search)
            plan = plan_forward(cache, layer, place, {m: counts[m] for m in misses}, len(hits), expert_bytes, costs,
                                admit_per_forward,
                                lambda experts: issued.extend(cache.ensure_early(layer, experts, stats)))
            for _ in cache.rounds(layer, hits, [f for f in plan.fetch if f not in issued], stats, issued=issued):
                pass  # no compute: the rounds only move the cache's bookkeeping
            if plan.cpu:
                stats.cpu_experts, stats.cpu_tokens, stats.cpu_forwards = (len(plan.cpu),
                                                                           sum(counts[m] for m in plan.cpu), 1)
                stats.cpu_rows = tuple(counts[m] for m in plan.cpu)
                cache.admit(layer, plan.admit, stats)
            last[i] = touched
            if prefetch is not None and i + 1 < len(layers):
                guess = last[i + 1] if prefetch == "previous" else trace.predicted[step][i + 1]
                cache.prefetch(layers[i + 1], guess, stats)
            cache.stats.add(stats)

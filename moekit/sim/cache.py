"""The expert-cache what-if: hit rate by policy, cache size and prefetch over a simulated decode stream.

    [L synthetic routers, one skew] -> per step: M tokens through every layer -> RoutingTrace
    -> moekit.offload.whatif.replay(trace, C, policy, prefetch) -> hits, fetches, prefetch accuracy

A token's input to layer l+1 is its input to layer l plus ``drift`` x fresh Gaussian content (a residual
stream that moves a little per layer), so the "router" prediction (layer l+1's router on layer l's
input) is informative but not exact; drift 0 makes it exact, large drift makes it a guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.offload.whatif import RoutingTrace, replay
from moekit.routing import Routing
from moekit.sim import streams
from moekit.sim.router import draw_tokens, make_router

PREFETCH_CHOICES = (None, "previous", "router")


@dataclass(frozen=True)
class CacheRow:
    policy: str
    cache_experts: int  # slots for the whole stack (all layers share them)
    cache_fraction: float  # cache_experts / (E * L)
    prefetch: str  # "none", "previous" or "router"
    hit_rate: float  # hits / touched, prefetched experts that were used count as hits
    fetched_per_step: float  # on-demand fetches per decode step, all layers
    prefetch_accuracy: float  # used / prefetched (0 without prefetch)


@dataclass(frozen=True)
class DecodeStream:
    """A simulated decode stream: what the routers chose (to drive real layers) and its trace (to replay)."""

    routings: list[list[Routing]]  # [step][layer]: topk_ids / topk_weights [M, k] on the CPU
    trace: RoutingTrace  # touched and per-expert token counts of ``routings``; the router predictions


def decode_stream(experts: int, top_k: int, layers: int, steps: int, tokens: int, skew: float, drift: float,
                  seed: int) -> DecodeStream:
    """``steps`` decode steps of ``tokens`` tokens through ``layers`` routers of one ``skew``; layer l+1's
    prediction is its router applied to layer l's input."""
    routers = [make_router(experts, top_k, skew, seed * 1009 + layer) for layer in range(layers)]
    gen = streams.generator(seed, streams.CACHE)
    routings, touched, predicted, counts = [], [], [], []
    for _ in range(steps):
        x = draw_tokens(tokens, experts, gen)  # [M, F]
        step_routings, step_predicted, prev = [], [[]], None
        for layer, router in enumerate(routers):
            if prev is not None:
                step_predicted.append(_experts(router.route(prev).topk_ids))
            step_routings.append(router.route(x))
            prev = x
            x = x.clone()
            x[:, :-1] += drift * torch.randn(tokens, experts, generator=gen)
        routings.append(step_routings)
        touched.append([_experts(r.topk_ids) for r in step_routings])
        counts.append([_counts(r.topk_ids) for r in step_routings])
        predicted.append(step_predicted)
    return DecodeStream(routings, RoutingTrace(experts, touched, predicted, counts))


def decode_trace(experts: int, top_k: int, layers: int, steps: int, tokens: int, skew: float, drift: float,
                 seed: int) -> RoutingTrace:
    """``steps`` decode steps of ``tokens`` tokens through ``layers`` routers of one ``skew`` (the trace
    of ``decode_stream``)."""
    return decode_stream(experts, top_k, layers, steps, tokens, skew, drift, seed).trace


def cache_what_if(trace: RoutingTrace, fractions: list[float], policies: list[str]) -> list[CacheRow]:
    """Every (policy, cache fraction, prefetch) over ``trace``; cache sizes are fractions of E * L."""
    total = trace.num_experts * trace.num_layers
    rows = []
    for policy in policies:
        for fraction in fractions:
            slots = max(1, round(fraction * total))
            for prefetch in PREFETCH_CHOICES:
                s = replay(trace, slots, policy, prefetch)
                rows.append(CacheRow(policy, slots, slots / total, prefetch or "none", s.hit_rate,
                                     s.fetched / max(len(trace.touched), 1), s.prefetch_accuracy))
    return rows


def _experts(ids: torch.Tensor) -> list[int]:
    return sorted(set(ids.flatten().tolist()))


def _counts(ids: torch.Tensor) -> dict[int, int]:
    """expert -> routed assignments in ``ids`` [M, k]."""
    experts, counts = torch.unique(ids.flatten(), return_counts=True)
    return dict(zip(experts.tolist(), counts.tolist()))

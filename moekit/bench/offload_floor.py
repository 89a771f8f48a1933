"""The floor of a decode step through offloaded layers: the time the step cannot beat, from rates
measured in the same run and the counts the step itself made. An honest model, not a fit: nothing in
it is derived from the cells' step times, and it has no margin.

What it includes, per layer, in issue order on one host-to-device queue (``timeline_s``):

    fixed:     ``fixed_s``, the layer's cost that does not scale with expert bytes (the touched set's
               device -> host copy and its sync, the host's cache bookkeeping, the experts call's
               launches, the partial sum), measured on all-hit forwards of the same M in the same run
               (``measure_fixed_s``: a step's time over L, less its hits' bytes at the GPU read rate)
    GPU side:  the hits read at the GPU's read rate while the fetches travel at the link's rate
               (``MissCosts.link_cpu_bytes_per_s`` while the layer computes on the CPU), then the
               fetched experts read once they land
    CPU side:  ``cpu_step_s`` + CPU experts x ``cpu_expert_s`` + CPU tokens x ``cpu_token_s`` (the
               rates recalibrated per group of rows, ``calibrate.recalibrate_cpu``); the layer's
               admissions queue behind its fetches, its result's copy back behind them
    link:      the next layer's prefetch queues when the host is free again (after the CPU side); the
               step ends when the link is idle too

What it leaves out (so a step may run above it): a second experts call when a layer has both hits and
fetches, the CPU side's variance (the floor prices the median rate), host-memory contention between
the CPU experts and the link beyond what ``link_cpu_bytes_per_s`` measured, and the CPU caches (the
bench's layers share one host weight set, so an expert the previous layer read may still sit in the
CPU's cache: the only way a step runs below the floor).

``sum_floor_s`` keeps the older, simpler floor next to it: per layer fixed_s + max(GPU reads, fetch
link time, CPU side), summed, and at least every byte the link moved over its rate.
"""

from __future__ import annotations

import statistics
import time

import torch

from moekit.offload import MissCosts, OffloadStats
from moekit.routing import Routing


def cpu_side_s(s: OffloadStats, costs: MissCosts) -> float:
    """The modelled CPU side of one layer's forward (0 without CPU misses), no margin."""
    if not s.cpu_experts:
        return 0.0
    return costs.cpu_step_s + s.cpu_experts * costs.cpu_expert_s + s.cpu_tokens * costs.cpu_token_s


def timeline_s(per_layer: list[OffloadStats], expert_bytes: int, costs: MissCosts, fixed_s: float = 0.0) -> float:
    """A step's floor in seconds (module docstring) from each layer's counts, in layer order."""
    read, link = expert_bytes / costs.gpu_bytes_per_s, expert_bytes / costs.link_bytes_per_s
    busy = expert_bytes / (costs.link_cpu_bytes_per_s or costs.link_bytes_per_s)
    t = free = 0.0  # the layer's start, the link's next idle moment
    for s in per_layer:
        start = t + fixed_s  # fetches are issued once the touched set is on the host
        cpu = cpu_side_s(s, costs)
        rate = busy if s.cpu_experts else link
        fetched_at = max(free, start) + s.fetched * rate
        free = fetched_at + s.admitted * rate
        end = max(start + s.hits * read, fetched_at) + s.fetched * read
        if s.cpu_experts:
            end = max(end, start + cpu, free)
        free = max(free, start + cpu) + s.prefetched * link
        t = end
    return max(t, free)


def sum_floor_s(per_layer: list[OffloadStats], expert_bytes: int, costs: MissCosts, fixed_s: float = 0.0) -> float:
    """The simpler floor in seconds (module docstring): the layers' maxima summed, and the link's total."""
    read, link = expert_bytes / costs.gpu_bytes_per_s, expert_bytes / costs.link_bytes_per_s
    layers = sum(fixed_s + max((s.hits + s.fetched) * read, s.fetched * link, cpu_side_s(s, costs))
                 for s in per_layer)
    moved = sum(s.fetched + s.prefetched + s.admitted for s in per_layer)
    return max(layers, moved * link)


def fixed_from(step_s: list[float], hits_per_step: list[int], layers: int, expert_bytes: int,
               costs: MissCosts) -> float:
    """The fixed per-layer seconds of all-hit steps: the median over steps of (step time - the step's
    hits x bytes / GPU read rate) / ``layers``, at least 0."""
    if layers < 1 or not step_s or len(step_s) != len(hits_per_step):
        raise ValueError(f"need layers >= 1 and one hit count per step time, got layers={layers}, "
                         f"{len(step_s)} times, {len(hits_per_step)} hit counts")
    read = expert_bytes / costs.gpu_bytes_per_s
    return max(0.0, statistics.median((t - h * read) / layers for t, h in zip(step_s, hits_per_step)))


def measure_fixed_s(layers, x: torch.Tensor, steps: list[list[Routing]], costs: MissCosts, repeats: int = 3) -> float:
    """``fixed_from`` timed on ``layers`` (``OffloadedMoE``, gpu mode, no prefetch, sharing a cache that
    holds every expert ``steps`` touch): each step run once untimed (its misses fetched), then
    ``repeats`` times timed, every expert a hit."""
    device = x.device
    for per_layer in steps:
        for layer, routing in zip(layers, per_layer):
            layer.run_routed(x, routing)
    times, hits = [], []
    for _ in range(repeats):
        for per_layer in steps:
            _sync(device)
            start = time.perf_counter()
            for layer, routing in zip(layers, per_layer):
                layer.run_routed(x, routing)
            _sync(device)
            times.append(time.perf_counter() - start)
            hits.append(sum(layer.last_stats.hits for layer in layers))
            if any(layer.last_stats.misses for layer in layers):
                raise ValueError("measure_fixed_s: the cache must hold every expert the steps touch")
    return fixed_from(times, hits, len(layers), layers[0].cache.expert_bytes, costs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""The floor of a decode step through offloaded layers: the time the step cannot beat, from rates
measured in the same run and the counts the step itself made. An honest model, not a fit: nothing in
it is derived from the cells' step times, and it has no margin.

What it includes, per layer, in issue order on one host-to-device queue (``timeline_s``):

    fixed:     ``FixedCosts.layer_s``, the layer's cost that does not scale with expert bytes (the touched
               set's device -> host copy and its sync, the host's cache bookkeeping, one experts call's
               launches, the partial sum), measured on all-hit forwards of the same M in the same run
               (``measure_fixed``: a step's time over L, less its hits' bytes at the GPU read rate; the
               bench times them on an all-hit stack taking its turns among the cells, ``offload_cells``)
    copies:    issued ``FixedCosts.overlap_s`` before the layer's fixed work ends (at most all of it):
               the host's work after it queues a forward's copies (the calls, the sum, the next layer's
               gate) runs while they travel, measured as the link time a forward fetching every touched
               expert hid (``overlap_from``: steps with k = all forced fetches a layer against all hits)
    GPU side:  the hits read at the GPU's read rate while the fetches travel at the link's rate
               (``MissCosts.link_cpu_bytes_per_s`` while the layer computes on the CPU), then the
               fetched experts read once they land; a layer with both hits and fetches makes a second
               experts call, which runs once the fetches land: ``MissCosts.gpu_call_s`` (the bench
               sets it to ``FixedCosts.call_s``, measured as an extra call on all-hit forwards), or one
               call for both once the fetches land, whichever ends first (``cost.one_call``); and a
               layer with any fetch takes at least its hits' reads plus ``MissCosts.fetch_layer_s`` (the
               bench sets it to ``FixedCosts.fetch_layer_s``: the median per layer of steps with one fetch
               forced into every layer less the same steps all hits, ``measure_forced``): what a forward
               with one fetch costs over an all-hit one whatever the link's rate, mostly the host's work
               on the copy path (one H200 run, Qwen3 widths, M = 1: 0.18-0.33 ms against 0.17 ms of link
               time; ``benchmarks/offload_fetch_device_check.py``: the host, not the link, is the wait),
               a term on the layer's own path that a longer copy overlaps (a max, not a sum)
    CPU side:  ``MissCosts.cpu_side_s`` of the layer's CPU experts' rows (``OffloadStats.cpu_rows``): the
               call cost plus each expert's time at its row count (``calibrate``'s grid, scaled to the
               host's rate before each group of rows, ``calibrate.recalibrate_cpu``); the layer's
               admissions queue behind its fetches, its result's copy back behind them
    link:      the next layer's prefetch queues when the host is free again (after the CPU side); the
               step ends when the link is idle too

What it leaves out (so a step may run above it): the CPU side's variance within a group (the floor
prices the probe's median rate), host-memory contention between the CPU experts and the link beyond
what ``link_cpu_bytes_per_s`` measured, and the host's time to issue fetches and evict beyond a forced
one-fetch forward's (``fetch_layer_s``: its slot was free, a cell's evicts; its hits came in one batch).
The bench gives every layer its own host weights, so no CPU cache holds an expert the previous layer
read (with one shared weight set, CPU steps ran at 0.17-0.9x the floor).

``sum_floor_s`` keeps the older, simpler floor next to it: per layer fixed_s + max(GPU reads, fetch
link time, CPU side), summed, and at least every byte the link moved over its rate.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from moekit.experts import call_backend
from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, OffloadStats
from moekit.routing import Routing


@dataclass(frozen=True)
class FixedCosts:
    """The floor's per-layer costs that do not scale with expert bytes (seconds)."""

    layer_s: float  # one layer's forward on all-hit steps, one experts call, its hits' reads taken out
    call_s: float = 0.0  # one more experts call in a layer (its hits and its fetched misses are two calls)
    fetch_layer_s: float = 0.0  # a forward with one fetch over an all-hit one, per layer (``fetch_layer_from``)
    overlap_s: float = 0.0  # how long before a layer's fixed work ends its copies start (``overlap_from``)


def cpu_side_s(s: OffloadStats, costs: MissCosts) -> float:
    """The modelled CPU side of one layer's forward (0 without CPU misses), no margin: by its CPU
    experts' rows where the stats carry them, else one row count per expert from the totals."""
    if not s.cpu_experts:
        return 0.0
    if len(s.cpu_rows) == s.cpu_experts:
        return costs.cpu_side_s(list(s.cpu_rows))
    return costs.cpu_step_s + s.cpu_experts * costs.cpu_expert_s + s.cpu_tokens * costs.cpu_token_s


def timeline_s(per_layer: list[OffloadStats], expert_bytes: int, costs: MissCosts, fixed_s: float = 0.0,
               overlap_s: float = 0.0) -> float:
    """A step's floor in seconds (module docstring) from each layer's counts, in layer order:
    ``fixed_s`` per layer, ``costs.gpu_call_s`` more for a layer with both hits and fetches (the
    second call "auto" prices too, ``cost.gpu_side_s``), a layer with fetches at least its hits' reads
    and ``costs.fetch_layer_s`` past its start (likewise); a layer's copies start ``overlap_s`` (at most
    ``fixed_s``) before its fixed work ends (``FixedCosts.overlap_s``)."""
    read, link = expert_bytes / costs.gpu_bytes_per_s, expert_bytes / costs.link_bytes_per_s
    busy = expert_bytes / (costs.link_cpu_bytes_per_s or costs.link_bytes_per_s)
    ahead = min(overlap_s, fixed_s)
    t = free = 0.0  # the layer's start, the link's next idle moment
    for s in per_layer:
        start = t + fixed_s  # the layer's fixed work done; its copies were issued overlap_s before
        cpu = cpu_side_s(s, costs)
        rate = busy if s.cpu_experts else link
        fetched_at = max(free, start - ahead) + s.fetched * rate
        free = fetched_at + s.admitted * rate
        end = max(start + s.hits * read, fetched_at) + s.fetched * read + (costs.gpu_call_s if s.hits and s.fetched else 0.0)
        end = min(end, max(start, fetched_at) + (s.hits + s.fetched) * read)  # or one call once the fetches land
        if s.fetched:
            end = max(end, start + s.hits * read + costs.fetch_layer_s)
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


def measure_fixed(layers, x: torch.Tensor, steps: list[list[Routing]], costs: MissCosts,
                  repeats: int = 3) -> FixedCosts:
    """``FixedCosts`` timed on ``layers`` (``OffloadedMoE``, gpu mode, no prefetch, sharing a cache that
    holds every expert ``steps`` touch): each step run once untimed (its misses fetched), then
    ``repeats`` times timed each way, every expert a hit: plainly (``layer_s``, by ``fixed_from``) and
    with one more experts call per layer over the same experts, as a forward's fetched group makes
    (``call_s``: the median over steps of the paired difference per layer, at least 0)."""
    for per_layer in steps:
        for layer, routing in zip(layers, per_layer):
            layer.run_routed(x, routing)
    times, hits, extra = [], [], []
    for _ in range(repeats):
        for per_layer in steps:
            plain = _timed_step(layers, x, per_layer, False)
            times.append(plain)
            hits.append(sum(layer.last_stats.hits for layer in layers))
            if any(layer.last_stats.misses for layer in layers):
                raise ValueError("measure_fixed: the cache must hold every expert the steps touch")
            extra.append((_timed_step(layers, x, per_layer, True) - plain) / len(layers))
    return FixedCosts(fixed_from(times, hits, len(layers), layers[0].cache.expert_bytes, costs),
                      max(0.0, statistics.median(extra)))


def measure_forced(layers, x: torch.Tensor, steps: list[list[Routing]], counts=(0, 1, 2, 4),
                   repeats: int = 3) -> dict[int, list[float]]:
    """Step seconds with exactly k fetches in every layer, for each k of ``counts``: ``layers`` (gpu
    mode, no prefetch) on a cache holding every expert ``steps`` touch, each step run once untimed,
    then ``repeats`` times per k, timed, after ``ExpertCache.evict`` of k of each layer's touched
    experts (the lowest ids; fewer where a layer touches fewer). {k: [seconds, one per timed step]}."""
    for per_layer in steps:
        for layer, routing in zip(layers, per_layer):
            layer.run_routed(x, routing)
    touched = [[sorted({e for e in r.topk_ids.reshape(-1).tolist() if e >= 0}) for r in per_layer] for per_layer in steps]
    out: dict[int, list[float]] = {k: [] for k in counts}
    for _ in range(repeats):
        for per_layer, sets in zip(steps, touched):
            for k in counts:
                for layer, experts in zip(layers, sets):
                    layer.cache.evict(layer.layer_id, experts[:k])
                out[k].append(_timed_step(layers, x, per_layer, False))
    return out


def fetch_layer_from(forced: dict[int, list[float]], layers: int) -> float:
    """``FixedCosts.fetch_layer_s`` from ``measure_forced``'s timings at k = 0 and 1 (the same steps in the
    same order): the median over the pairs of (one fetch in every layer - none) / ``layers``, at least 0."""
    if layers < 1 or not forced.get(0) or len(forced.get(1, ())) != len(forced[0]):
        raise ValueError(f"need layers >= 1 and paired timings at k = 0 and 1, got layers={layers}, "
                         f"{ {k: len(v) for k, v in forced.items()} }")
    return max(0.0, statistics.median((one - none) / layers for one, none in zip(forced[1], forced[0])))


def overlap_from(none: list[float], every: list[float], fetched: list[int], layers: int, link_s: float,
                 most: float) -> float:
    """``FixedCosts.overlap_s`` from ``measure_forced``'s timings with no fetch and with every touched expert
    fetched (the same steps in the same order; ``fetched``: each step's fetches over its layers): how much
    less than its copies' link time (``link_s`` an expert) a layer took over an all-hit one, the median over
    the pairs per layer, within [0, ``most``] (the layer's fixed cost: its copies cannot start before its
    touched set is known). Copies of a link-bound forward start while the host still works on the layer
    (its calls, the sum, the next layer's gate): one H200 run's k = 4 fetches a layer took 0.51 ms over all
    hits for 0.70 ms of link time."""
    if layers < 1 or not none or len(every) != len(none) or len(fetched) != len(none):
        raise ValueError(f"need layers >= 1 and paired timings with a fetch count each, got layers={layers}, "
                         f"{len(none)} / {len(every)} timings, {len(fetched)} counts")
    gaps = [(n * link_s - (t - t0)) / layers for t0, t, n in zip(none, every, fetched)]
    return min(max(0.0, statistics.median(gaps)), most)


def _timed_step(layers, x: torch.Tensor, per_layer: list[Routing], second_call: bool) -> float:
    """Seconds of one step through ``layers`` (all hits); ``second_call``: each layer's forward followed
    by one more experts call over its touched experts' slots (its own slot map copied, as a forward's
    fetched group does)."""
    _sync(x.device)
    start = time.perf_counter()
    for layer, routing in zip(layers, per_layer):
        layer.run_routed(x, routing)
        if second_call:
            w13, w2, b13, b2 = layer.cache.slot_weights
            expert_map = layer.cache.slot_map(layer.layer_id, layer._last_touched, layer.config.num_experts)
            call_backend(layer._experts_fn, x, w13, w2, routing.topk_ids, routing.topk_weights,
                         activation=layer.config.activation, expert_map=expert_map, b13=b13, b2=b2)
    _sync(x.device)
    return time.perf_counter() - start


def fixed_costs(shells, steps: list[list[Routing]], costs: MissCosts, device, options, slots: int = 0) -> FixedCosts:
    """The floor's ``FixedCosts`` at these steps' M (``measure_fixed``; ``fetch_layer_s`` by
    ``measure_forced`` and ``fetch_layer_from`` on the same layers) on gpu layers (layer i on
    ``shells[i]``'s host weights, ``options`` their ``CpuOptions``) sharing a cache of ``slots`` slots,
    or more where the steps touch more (each layer's union: no eviction); ``slots``: the cell's cache
    size, so the slot tensors the experts calls read are the cell's."""
    touched = [set() for _ in steps[0]]
    for per_layer in steps:
        for seen, routing in zip(touched, per_layer):
            seen.update(e for e in routing.topk_ids.reshape(-1).tolist() if e >= 0)
    cache = ExpertCache(max(slots, sum(len(seen) for seen in touched)), device=device, policy="lfu")
    layers = [OffloadedMoE.from_moe(shells[i % len(shells)], cache=cache, prefetch=None, costs=costs,
                                    cpu_options=options) for i in range(len(touched))]
    x = torch.randn(steps[0][0].topk_ids.shape[0], shells[0].config.hidden_size, device=device,
                    dtype=shells[0].w13.dtype)
    fixed = measure_fixed(layers, x, steps, costs, repeats=5)  # one H200 run's single pass of 3 read 0.24-0.51 ms at one M
    for layer in layers:  # a forward with a fetch calls as the cells' layers will (``cost.one_call``)
        layer.costs = dataclasses.replace(costs, gpu_call_s=fixed.call_s)
    every, repeats = max(len(seen) for seen in touched), 3  # k = every: each touched expert of each layer
    forced = measure_forced(layers, x, steps, counts=(0, 1, every), repeats=repeats)
    fetched = [sum(len({e for e in r.topk_ids.reshape(-1).tolist() if e >= 0}) for r in per_layer) for per_layer in steps]
    fixed = dataclasses.replace(fixed, fetch_layer_s=fetch_layer_from(forced, len(layers)),
                                overlap_s=overlap_from(forced[0], forced[every], fetched * repeats, len(layers),
                                                       cache.expert_bytes / costs.link_bytes_per_s, fixed.layer_s))
    del layers, cache
    if device.type == "cuda":  # up to every expert of every layer: hand the slots back before the cells' caches
        torch.cuda.empty_cache()
    return fixed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

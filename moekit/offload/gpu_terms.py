"""The GPU side's measured terms of an offloaded layer, timed on all-hit steps and steps with forced copies:
one code path for ``OffloadedMoE.measure_costs`` (``calibrate``: the terms "auto" prices by,
``MissCosts.gpu_call_s`` / ``fetch_layer_s``) and the benchmark's floor (``moekit.bench.offload_floor``:
``FixedCosts``, of which those two are fields too).

    layer_s:          an all-hit forward, its hits' reads at the GPU read rate taken out (``measure_fixed``)
    call_s:           one more experts call over the same slots (a forward's fetched group makes one)
    fetch_layer_s:    a forward with one fetch over the same forward all hits (``measure_forced``: the
                      copy's latency, the cache's work to evict and issue it, the host's calls; a max
                      with the link's time in the floor, not a sum)
    overlap_s:        how long before a layer's fixed work ends its copies start (``overlap_from``)
    issue_s:          the host's time to issue one fetched expert's copies, its victim evicted
                      (``measure_issue``): the CPU branch of a forward starts once its fetches and
                      admissions are issued
    prefetch_layer_s: a layer followed by one prefetch of the next layer's experts over the same layer
                      followed by none (``measure_forced(prefetch=True)``): the host's work to evict and
                      issue a prefetch batch (the same copy path as a fetch's), which a host-bound decode
                      step pays in full; the floor's link timeline priced a prefetch as link time only
    copy_call_s:      an all-hit forward right after a copy into the cache's slots over one right after none
                      (``measure_copy_call``): what a copy (it bumps the slot views' ``_version``) leaves
                      the next experts call to redo. Until the Triton experts' TMA descriptors and launch
                      sequences were keyed on addresses only (``experts.triton_cache``), they were built
                      again after every copy: one H200 run at M = 1, the hits' call 0.28-0.29 ms of host
                      time after an admission, 0.14-0.15 without; an A/B of the two keys (offkey ck1): 0.104
                      ms median (0.077-0.148) with ``_version`` in the key, 0.002 (0.000-0.052) without

    branch_layer_s:   a forward with one expert computed on the CPU over the same forward all hits, the CPU
                      branch's own host time (``CpuPhases.total_s``, what the CPU model prices) and its
                      admissions' issue (``issue_s`` each) taken out (``measure_branch_layer``): the plan for
                      the misses, the second partial and its sum, the admission's plan, on the host's path
                      before and after the branch. One H200 run at M = 1 (offload3 ck1): the cpu mode's steps
                      read 1.14-1.18x a floor with each branch as it ran, ~0.2 ms a layer with a branch

All are medians of paired differences (the same steps in the same order, with and without), at least 0.
Timed on ``layers`` (``OffloadedMoE``, gpu mode, no prefetch) sharing a cache that holds every expert the
steps touch, so that a forced copy is the only one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch

from moekit.experts import call_backend
from moekit.offload.cost import MissCosts
from moekit.offload.stats import OffloadStats
from moekit.routing import Routing


@dataclass(frozen=True)
class FixedCosts:
    """Per-layer costs that do not scale with expert bytes (seconds; module docstring)."""

    layer_s: float  # one layer's forward on all-hit steps, one experts call, its hits' reads taken out
    call_s: float = 0.0  # one more experts call in a layer (its hits and its fetched misses are two calls)
    fetch_layer_s: float = 0.0  # a forward with one fetch over an all-hit one, per layer (``fetch_layer_from``)
    overlap_s: float = 0.0  # how long before a layer's fixed work ends its copies start (``overlap_from``)
    # a layer's prefetch of one expert of the next layer, per layer (``prefetch_layer_from``)
    prefetch_layer_s: float = 0.0
    issue_s: float = 0.0  # host seconds to issue one fetched expert's copies (``measure_issue``)
    # an experts call's extra host seconds right after a copy into the slots (``measure_copy_call``)
    copy_call_s: float = 0.0
    # a forward with a CPU branch over an all-hit one, the branch itself out (``measure_branch_layer``)
    branch_layer_s: float = 0.0

    def priced(self, costs: MissCosts) -> MissCosts:
        """``costs`` with the terms "auto" prices by (``gpu_call_s``, ``fetch_layer_s``, ``issue_s``) set to these."""
        return dataclasses.replace(costs, gpu_call_s=self.call_s, fetch_layer_s=self.fetch_layer_s,
                                   issue_s=self.issue_s)


def measure_terms(layers, x: torch.Tensor, steps: list[list[Routing]], costs: MissCosts,
                  repeats: int = 5, forced_repeats: int = 3) -> FixedCosts:
    """Every ``FixedCosts`` term on ``layers`` (module docstring) over ``steps`` (per step, one routing per
    layer) with input ``x``: ``measure_fixed``, then ``measure_forced`` at 0, 1 and every touched expert a
    layer (the layers deciding one call or two by ``costs`` with the measured ``call_s``, as the decoding
    layers will), then with one prefetch a layer where there is a next layer."""
    fixed = measure_fixed(layers, x, steps, costs, repeats)
    for layer in layers:  # a forward with a fetch calls as decoding layers will (``cost.one_call``)
        layer.costs = dataclasses.replace(costs, gpu_call_s=fixed.call_s)
    touched = [[_touched(r) for r in per_layer] for per_layer in steps]
    every = max(len(t) for per_layer in touched for t in per_layer)
    forced = measure_forced(layers, x, steps, counts=tuple(sorted({0, 1, every})), repeats=forced_repeats)
    fetched = [sum(len(t) for t in per_layer) for per_layer in touched] * forced_repeats
    link_s = layers[0].cache.expert_bytes / costs.link_bytes_per_s
    fixed = dataclasses.replace(fixed, fetch_layer_s=fetch_layer_from(forced, len(layers)),
                                overlap_s=overlap_from(forced[0], forced[every], fetched, len(layers), link_s,
                                                       fixed.layer_s), issue_s=measure_issue(layers, steps[0][0]),
                                copy_call_s=measure_copy_call(layers, x, steps[0]))
    if len(layers) > 1:
        ahead = measure_forced(layers, x, steps, counts=(0, 1), repeats=forced_repeats, prefetch=True)
        fixed = dataclasses.replace(fixed, prefetch_layer_s=fetch_layer_from(ahead, len(layers) - 1))
    return fixed


def measure_issue(layers, routing: Routing, repeats: int = 5) -> float:
    """``FixedCosts.issue_s``: host seconds per expert of ``ExpertCache.ensure`` (the bookkeeping, the policy's
    victims evicted, one copy per block, the batch's event: what the host does for a forward's fetches and
    admissions before its CPU branch can start) on ``layers[0]``, for every other expert of ``routing``'s
    touched set (no two adjacent ids: no shared copy run, as a cell's scattered misses), evicted first and the
    empty slots then filled (``layers``' uncached experts, ``layers[0]``'s touched ones left out) so that
    ``ensure`` evicts as a decode step's does (one H200 run: admissions took 0.25 ms a layer for 1.6 experts
    where this read 66 us an expert into empty slots); timed without a sync (the copies travel after), the
    median over ``repeats``; 0 where none could be evicted. ``layers``: every layer of the cache, which holds
    the same experts after."""
    layer, cache, times = layers[0], layers[0].cache, []
    touched = _touched(routing)
    experts = sorted(touched)[::2]
    before = {other.layer_id: set(cache.cached(other.layer_id)) for other in layers}
    for _ in range(repeats):
        _sync(cache.device)
        evicted = cache.evict(layer.layer_id, experts)
        if not evicted:
            break
        _fill(layers, touched)
        _sync(cache.device)
        start = time.perf_counter()
        cache.ensure(layer.layer_id, evicted, OffloadStats())
        times.append((time.perf_counter() - start) / len(evicted))
        cache.release(layer.layer_id, evicted)
    for other in layers:  # as found: the fillers out, the victims back
        cache.evict(other.layer_id, [e for e in cache.cached(other.layer_id) if e not in before[other.layer_id]])
    for other in layers:
        missing = sorted(before[other.layer_id] - set(cache.cached(other.layer_id)))
        if missing:
            cache.ensure(other.layer_id, missing, OffloadStats())
            cache.release(other.layer_id, missing)
    _sync(cache.device)
    return statistics.median(times) if times else 0.0


def _fill(layers, touched: set[int]) -> None:
    """Every empty slot of ``layers``' cache taken by their uncached experts (``layers[0]``'s ``touched`` left
    out), as far as there are; nothing cached is evicted for them. Bookkeeping only: nothing reads a filler, so
    no bytes are copied (at a cell's cache, hundreds of experts a repeat)."""
    cache = layers[0].cache
    empty = cache.cache_experts - sum(len(cache.cached(layer.layer_id)) for layer in layers)
    with cache.bookkeeping_only():
        for i, layer in enumerate(layers):
            cached = cache.cached(layer.layer_id)
            fillers = [e for e in range(layer.config.num_experts) if e not in cached and (i or e not in touched)]
            fillers = fillers[: max(empty, 0)]
            cache.prefetch(layer.layer_id, fillers, OffloadStats())
            empty -= len(fillers)


def measure_copy_call(layers, x: torch.Tensor, per_layer: list[Routing], repeats: int = 5) -> float:
    """``FixedCosts.copy_call_s``: per layer of ``per_layer`` (all its experts cached), its forward alone
    between syncs right after none of the cache's copies and right after one (a touched expert evicted and
    fetched again, synced before the forward), ``repeats`` times; the median of the second less the median
    of the first, at least 0; 0 where no expert could be evicted."""
    plain, copied = [], []
    for _ in range(repeats):
        for layer, routing in zip(layers, per_layer):
            for after_copy in (False, True):
                if after_copy:
                    expert = sorted(_touched(routing))[:1]
                    if not layer.cache.evict(layer.layer_id, expert):
                        return 0.0
                    layer.cache.ensure(layer.layer_id, expert, OffloadStats())
                    layer.cache.release(layer.layer_id, expert)
                _sync(x.device)
                start = time.perf_counter()
                layer.run_routed(x, routing)
                _sync(x.device)
                (copied if after_copy else plain).append(time.perf_counter() - start)
    return max(0.0, statistics.median(copied) - statistics.median(plain))


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
    """``FixedCosts.layer_s`` and ``call_s`` timed on ``layers``: each step run once untimed (its misses
    fetched), then ``repeats`` times timed each way, every expert a hit: plainly (``layer_s``, by
    ``fixed_from``) and with one more experts call per layer over the same experts, as a forward's
    fetched group makes (``call_s``: the median over steps of the paired difference per layer, at least 0)."""
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
                   repeats: int = 3, prefetch: bool = False) -> dict[int, list[float]]:
    """Step seconds with exactly k copies in every layer, for each k of ``counts``: each step run once
    untimed, then ``repeats`` times per k, timed, after ``ExpertCache.evict`` of k of each layer's touched
    experts (the lowest ids; fewer where a layer touches fewer), which its forward fetches; with
    ``prefetch``, of every layer but the first, each fetched back ahead by a prefetch issued after the
    previous layer's forward (as ``prefetch="router"`` does; the forward then hits). {k: [seconds, one per
    timed step]}."""
    for per_layer in steps:
        for layer, routing in zip(layers, per_layer):
            layer.run_routed(x, routing)
    touched = [[sorted(_touched(r)) for r in per_layer] for per_layer in steps]
    out: dict[int, list[float]] = {k: [] for k in counts}
    for _ in range(repeats):
        for per_layer, sets in zip(steps, touched):
            for k in counts:
                evicted = [layer.cache.evict(layer.layer_id, experts[:k])
                           for i, (layer, experts) in enumerate(zip(layers, sets)) if not prefetch or i]
                ahead = ([[]] + evicted) if prefetch else [[] for _ in layers]
                out[k].append(_timed_step(layers, x, per_layer, False, ahead))
    return out


def measure_branch_layer(layers, x: torch.Tensor, steps: list[list[Routing]], issue_s: float,
                         repeats: int = 3) -> float:
    """``FixedCosts.branch_layer_s`` on ``layers`` (gpu mode, their cache holding every expert the steps
    touch, their ``costs`` the CPU branch's setting): each step run once untimed in the gpu mode (whatever an
    admission evicted fetched back: a full cache), timed all hits, then with one touched expert of every layer
    (the lowest id) evicted and the layers in the cpu mode (that expert computed on the CPU); the median over the pairs
    of (with - the branches' ``total_s`` - the admissions x ``issue_s`` - without) / L, at least 0."""
    touched = [[sorted(_touched(r)) for r in per_layer] for per_layer in steps]
    extra = []
    for _ in range(repeats):
        for per_layer, sets in zip(steps, touched):
            for layer, routing in zip(layers, per_layer):  # untimed first: whatever an admission evicted fetched
                layer.run_routed(x, routing)
            none = _timed_step(layers, x, per_layer, False)
            for layer, experts in zip(layers, sets):
                layer.cache.evict(layer.layer_id, experts[:1])
                layer.compute_misses_on = "cpu"
            try:
                with_branch = _timed_step(layers, x, per_layer, False)
                own = sum(layer.last_cpu.total_s + layer.last_stats.admitted * issue_s
                          for layer in layers if layer.last_cpu is not None)
            finally:
                for layer in layers:
                    layer.compute_misses_on = "gpu"
            extra.append((with_branch - own - none) / len(layers))
    for per_layer in steps:  # as found: every expert the steps touch cached again
        for layer, routing in zip(layers, per_layer):
            layer.run_routed(x, routing)
    return max(0.0, statistics.median(extra)) if extra else 0.0


def fetch_layer_from(forced: dict[int, list[float]], layers: int) -> float:
    """The median over ``measure_forced``'s pairs at k = 0 and 1 (the same steps in the same order) of (one
    copy in each of ``layers`` layers - none) / ``layers``, at least 0: ``FixedCosts.fetch_layer_s``, or
    ``prefetch_layer_s`` from prefetched copies (``layers``: those that prefetch)."""
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


def _timed_step(layers, x: torch.Tensor, per_layer: list[Routing], second_call: bool,
                ahead: list[list[int]] | None = None) -> float:
    """Seconds of one step through ``layers``; ``second_call``: each layer's forward followed by one more
    experts call over its touched experts' slots (its own slot map copied, as a forward's fetched group
    does); ``ahead[i]``: layer i's experts prefetched after layer i - 1's forward."""
    _sync(x.device)
    start = time.perf_counter()
    for i, (layer, routing) in enumerate(zip(layers, per_layer)):
        layer.run_routed(x, routing)
        if second_call:
            w13, w2, b13, b2 = layer.cache.slot_weights
            expert_map = layer.cache.slot_map(layer.layer_id, layer._last_touched, layer.config.num_experts)
            call_backend(layer._experts_fn, x, w13, w2, routing.topk_ids, routing.topk_weights,
                         activation=layer.config.activation, expert_map=expert_map, b13=b13, b2=b2)
        if ahead is not None and i + 1 < len(layers) and ahead[i + 1]:
            nxt = layers[i + 1]
            nxt.cache.prefetch(nxt.layer_id, ahead[i + 1], OffloadStats())
    _sync(x.device)
    return time.perf_counter() - start


def _touched(routing: Routing) -> set[int]:
    return {e for e in routing.topk_ids.reshape(-1).tolist() if e >= 0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

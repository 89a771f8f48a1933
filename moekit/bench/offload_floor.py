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
               time; ``f6f35e93:benchmarks/offload_fetch_device_check.py``: the host, not the link, is the wait),
               a term on the layer's own path that a longer copy overlaps (a max, not a sum)
    CPU side:  ``MissCosts.cpu_side_s`` of the layer's CPU experts' rows (``OffloadStats.cpu_rows``): the
               call cost plus each expert's time at its row count (``calibrate``'s grid, scaled to the
               host's rate before each group of rows, ``calibrate.recalibrate_cpu``), started once the
               host has issued the layer's fetches and admissions (``MissCosts.issue_s`` each: the bench
               sets it to ``FixedCosts.issue_s``; one H200 trace: ~40 us a fetched expert, 1-1.4 ms a layer
               before the CPU branch at M = 8, which the floor had run from the layer's start) and its host
               work beside the branch (``FixedCosts.branch_layer_s``: the misses' plan, the second partial
               and its sum; 0.105-0.243 ms a layer on one H200 run); the layer's admissions queue behind its
               fetches, its result's copy back behind them
    link:      the next layer's prefetch queues when the host is free again (after the CPU side); the
               step ends when the link is idle too

    prefetch:  a layer that prefetches the next layer's experts pays ``FixedCosts.prefetch_layer_s`` on
               the host's path (``gpu_terms.measure_forced(prefetch=True)``: one prefetch forced after every
               layer over none): the cache's work to evict and issue the copies, the same copy path a
               fetch takes; after the layer's CPU branch where it has one (the branch runs on the host
               thread, and the prefetch is issued when ``run_routed`` returns: until session 20 the floor
               let the branch hide it, and the cpu mode's prefetching cells read over their floor). Before it,
               the floor priced a prefetch as link time only, and the M = 1 skewed cells with prefetch ran
               1.18-1.43x it (one H200 run): moving a fetch into a
               prefetch lowered the floor by its ``fetch_layer_s`` and the step by nothing;
               ``prefetch_layer_s`` is timed with one expert a layer, and each further expert of a layer's
               prefetch costs ``MissCosts.issue_s`` more (its victim evicted, its copy issued): at skewed 50%
               router M = 1 (2.25 experts a prefetching layer) the host's time from a gpu layer's end to the
               next layer's start was 0.16-0.28 ms against 0.03-0.04 without prefetch, at 75% (0.93 an
               expert) 0.07-0.09 (``f6f35e93:benchmarks/offload_tail_device_check.py``, raw
               ``...-f963fdf-offload3-ck1``)

    copy call: after a layer that admitted experts (its CPU branch's misses, copied after its own calls) and
               prefetched nothing, ``FixedCosts.copy_call_s`` more on the host's path (a fetch's and a
               prefetch's own terms hold theirs; the last layer's is charged to its own step, as the next
               step's first layer pays it): what a copy into the slots leaves the next experts call to redo.
               While the Triton experts' descriptors and launch sequences were keyed on the slots'
               ``_version`` (which every copy bumps) that was their rebuild, 0.28-0.29 ms of host time
               against 0.14-0.15 at M = 1 (``f6f35e93:benchmarks/offload_step_anatomy.py``); keyed on addresses, an
               A/B read 0.002 ms against 0.104 (``f6f35e93:benchmarks/offload_key_device_check.py``)

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

import torch

from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, OffloadStats
from moekit.offload.gpu_terms import FixedCosts, measure_branch_layer, measure_terms
from moekit.routing import Routing


def cpu_side_s(s: OffloadStats, costs: MissCosts) -> float:
    """The modelled CPU side of one layer's forward (0 without CPU misses), no margin: by its CPU
    experts' rows where the stats carry them, else one row count per expert from the totals."""
    if not s.cpu_experts:
        return 0.0
    if len(s.cpu_rows) == s.cpu_experts:
        return costs.cpu_side_s(list(s.cpu_rows))
    return costs.cpu_step_s + s.cpu_experts * costs.cpu_expert_s + s.cpu_tokens * costs.cpu_token_s


def timeline_s(per_layer: list[OffloadStats], expert_bytes: int, costs: MissCosts, fixed_s: float = 0.0,
               overlap_s: float = 0.0, prefetch_s: float = 0.0, idle: MissCosts | None = None,
               measured: list[float] | None = None, *, copy_call_s: float = 0.0, branch_layer_s: float = 0.0) -> float:
    """A step's floor in seconds (module docstring) from each layer's counts, in layer order:
    ``fixed_s`` per layer, ``costs.gpu_call_s`` more for a layer with both hits and fetches (the
    second call "auto" prices too, ``cost.gpu_side_s``), a layer with fetches at least its hits' reads
    and ``costs.fetch_layer_s`` past its start (likewise), and one that prefetches (``prefetched``:
    the next layer's experts, issued after it) ``prefetch_s`` more on the host's path (after the fetch's
    work and the CPU branch: one host does all three; ``FixedCosts.prefetch_layer_s``); a layer's copies start
    ``overlap_s`` (at most ``fixed_s``) before its fixed work ends (``FixedCosts.overlap_s``). With ``idle`` (the CPU
    model with the link idle; ``costs``' is with it busy) a layer's CPU branch runs at the busy rate while the
    link still moves the copies queued before it (``cpu_branch_s``), at the idle rate after. ``measured``
    (seconds per layer): each layer's CPU branch as it ran, in place of the model: not a floor, a check of
    its other terms against the step. ``copy_call_s``: after a layer that admitted and prefetched nothing
    (``FixedCosts.copy_call_s``, module docstring). ``branch_layer_s``: a layer with a CPU branch's host work
    outside it, before the branch (``FixedCosts.branch_layer_s``)."""
    read, link = expert_bytes / costs.gpu_bytes_per_s, expert_bytes / costs.link_bytes_per_s
    busy = expert_bytes / (costs.link_cpu_bytes_per_s or costs.link_bytes_per_s)
    ahead = min(overlap_s, fixed_s)
    t = free = 0.0  # the layer's start, the link's next idle moment
    for i, s in enumerate(per_layer):
        start = t + fixed_s  # the layer's fixed work done; its copies were issued overlap_s before
        issue = (s.fetched + s.admitted) * costs.issue_s if s.cpu_experts else 0.0
        rate = busy if s.cpu_experts else link
        fetched_at = max(free, start - ahead) + s.fetched * rate
        free = fetched_at + s.admitted * rate
        cpu = issue + branch_layer_s + (measured[i] if measured is not None else cpu_branch_s(
            s, costs, idle, free - start - issue - branch_layer_s)) if s.cpu_experts else 0.0
        end = max(start + s.hits * read, fetched_at) + s.fetched * read + (costs.gpu_call_s if s.hits and s.fetched
                                                                           else 0.0)
        end = min(end, max(start, fetched_at) + (s.hits + s.fetched) * read)  # or one call once the fetches land
        if s.fetched:
            end = max(end, start + s.hits * read + costs.fetch_layer_s)
        if s.cpu_experts:
            end = max(end, start + cpu, free)
        free = max(free, start + cpu) + s.prefetched * link
        if s.prefetched:  # the host issues it after the layer's own host work, a CPU branch included; one
            # expert's issue is in prefetch_s (measured with one), each further one costs issue_s more
            after = start + s.hits * read + (costs.fetch_layer_s if s.fetched else 0.0)
            end = max(end, max(after, start + cpu) + prefetch_s + (s.prefetched - 1) * costs.issue_s)
        t = end + (copy_call_s if s.admitted and not s.prefetched else 0.0)
    return max(t, free)


def cpu_branch_s(s: OffloadStats, busy: MissCosts, idle: MissCosts | None, linked_s: float) -> float:
    """A layer's CPU branch that starts with ``linked_s`` of copies still on the link: at ``busy``'s model
    for that long (at most the whole branch), the rest of its work at ``idle``'s (None: ``busy``'s
    throughout): T = L + (1 - L / T_busy) x T_idle, L = min(max(linked_s, 0), T_busy)."""
    whole = cpu_side_s(s, busy)
    if idle is None or whole <= 0.0:
        return whole
    linked = min(max(linked_s, 0.0), whole)
    return linked + (1.0 - linked / whole) * cpu_side_s(s, idle)


def sum_floor_s(per_layer: list[OffloadStats], expert_bytes: int, costs: MissCosts, fixed_s: float = 0.0) -> float:
    """The simpler floor in seconds (module docstring): the layers' maxima summed, and the link's total."""
    read, link = expert_bytes / costs.gpu_bytes_per_s, expert_bytes / costs.link_bytes_per_s
    layers = sum(fixed_s + max((s.hits + s.fetched) * read, s.fetched * link, cpu_side_s(s, costs))
                 for s in per_layer)
    moved = sum(s.fetched + s.prefetched + s.admitted for s in per_layer)
    return max(layers, moved * link)


def fixed_costs(shells, steps: list[list[Routing]], costs: MissCosts, device, options, slots: int = 0) -> FixedCosts:
    """The floor's ``FixedCosts`` at these steps' M (``gpu_terms.measure_terms``, the path
    ``OffloadedMoE.measure_costs`` times "auto"'s terms by) on gpu layers (layer i on ``shells[i]``'s host
    weights, ``options`` their ``CpuOptions``) sharing a cache of ``slots`` slots, or more where the steps
    touch more (each layer's union: no eviction); ``slots``: the cell's cache size, so the slot tensors the
    experts calls read are the cell's."""
    touched = [set() for _ in steps[0]]
    for per_layer in steps:
        for seen, routing in zip(touched, per_layer):
            seen.update(e for e in routing.topk_ids.reshape(-1).tolist() if e >= 0)
    cache = ExpertCache(max(slots, sum(len(seen) for seen in touched)), device=device, policy="lfu")
    layers = [OffloadedMoE.from_moe(shells[i % len(shells)], cache=cache, prefetch=None, costs=costs,
                                    cpu_options=options) for i in range(len(touched))]
    x = torch.randn(steps[0][0].topk_ids.shape[0], shells[0].config.hidden_size, device=device,
                    dtype=shells[0].w13.dtype)
    # repeats 5: one H200 run's single pass of 3 read 0.24-0.51 ms at one M
    fixed = measure_terms(layers, x, steps, costs)
    fixed = dataclasses.replace(fixed, branch_layer_s=measure_branch_layer(layers, x, steps, fixed.issue_s))
    del layers, cache
    if device.type == "cuda":  # up to every expert of every layer: hand the slots back before the cells' caches
        torch.cuda.empty_cache()
    return fixed

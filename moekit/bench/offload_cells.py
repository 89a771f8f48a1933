"""The timed cells of ``moekit bench --offload`` (``offload_measure``): each run's stack of offloaded layers
decoding the same steps, the runs taking turns step by step, and each step's floor (``offload_floor``).

With ``reference``, an all-hit stack takes its turns too: gpu layers on a cache that holds every expert the
steps touch (each step run once before the timing), whose per-layer time less its hits' reads
(``offload_floor.fixed_from``) is the floor's fixed cost for the group. Measured in the same rotation as the
cells, it sees what they see: the host's speed drifts by tens of percent between moments of one run (the
quiet measurement, ``offload_floor.fixed_costs``, came out 0.27-0.41 ms a layer at M = 1 across one H200
run's groups), and a step that follows another stack's runs slower than one that follows its own (its
Python objects and the driver's state out of the CPU's caches: ~8% at M = 1 on one H200 run,
``f6f35e93:benchmarks/offload_fetch_device_check.py``'s gpu-alone).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from moekit.bench.offload_floor import sum_floor_s, timeline_s
from moekit.bench.offload_probe import CpuProbe
from moekit.offload import CpuOptions, CpuRate, ExpertCache, MissCosts, OffloadedMoE, OffloadStats, expert_nbytes
from moekit.offload.gpu_terms import FixedCosts, fixed_from
from moekit.offload.whatif import RoutingTrace, drive, replay
from moekit.routing import Routing


@dataclass(frozen=True)
class Run:
    """One cell's setting."""

    fraction: float
    slots: int
    policy: str
    prefetch: bool
    place: str
    admit: int | None = None  # admit_per_forward (None: the plan's default)
    label: str = ""  # the row's mode ("": ``place``)
    overrides: tuple = ()  # (MissCosts field, value) pairs for this run's layers and replay
    online: bool = False  # the stack's layers share an ``online.CpuRate`` ("auto" prices the CPU by it)


def run_cells(shells, config, routings: list[list[Routing]], trace: RoutingTrace, runs: list[Run], warm: int,
              costs: MissCosts, device, options: CpuOptions, fixed: FixedCosts = FixedCosts(0.0),
              scale: float = 1.0, reference: bool = False, probes: dict[int, CpuProbe] | None = None) -> list[dict]:
    """Decode ``trace``'s stream once per run, each through L layers sharing a fresh cache: the first
    ``warm`` steps through the cache's bookkeeping only, then ``routings`` (the later steps, on the device; the first
    untimed). The runs take turns step by step (garbage collector off), so slow drifts fall on every mode alike, in
    carry-over balanced orders (``balanced_orders``: each run follows every other once per n - 1 steps; a CPU-heavy step
    leaves the host's threads busy for the next; each row's ``after_ms``: its mean step by the run before it); with
    ``reference``, the all-hit stack (module docstring) among them where it fits (``_reference``). Each step's floor
    (``offload_floor``) with ``fixed``'s costs, its per-layer cost the reference's where there is one. The
    rows' measured fields. ``probes`` (run index -> ``offload_probe.CpuProbe``) run after each timed step of
    their run; its floor's CPU side is its probe's rates (``x_floor_given``: by ``costs`` as given)."""
    stacks = [_stack(shells, trace, run, warm, costs, device, options) for run in runs]
    x = torch.randn(routings[0][0].topk_ids.shape[0], config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    ref = _reference(shells, routings, costs, device, options, x) if reference else None
    if ref is not None:
        stacks.append(ref)
    times, dones, after, branches, ratios = ([[] for _ in stacks] for _ in range(5))  # per stack and step (CPU
    # branch s; ratios: each CPU branch's (measured, modelled) seconds, ``branch_rate``)
    probes, prev = probes or {}, None
    phases = [[0.0] * 6 for _ in runs]  # per run: total, model, stage, wait, compute, back (seconds)
    gc.collect()
    gc.disable()
    try:
        orders = balanced_orders(len(stacks))
        for step, per_layer in enumerate(routings):
            for j in orders[(step - 1) % len(orders)]:  # the timed steps (from 1) start at the first order
                layers, prefetch = stacks[j], j < len(runs) and runs[j].prefetch
                _sync(device)
                start = time.perf_counter()
                done = [_forward(layers, i, x, routing, trace.predicted[warm + step], prefetch)
                        for i, routing in enumerate(per_layer)]
                _sync(device)
                if step:
                    times[j].append(time.perf_counter() - start)
                    after[j].append(prev)
                    dones[j].append(done)
                    branches[j].append([0.0 if l.last_cpu is None else l.last_cpu.total_s for l in layers])
                    if j < len(runs):
                        _add_phases(phases[j], layers, costs, ratios[j])
                    if j in probes:  # the run's latest CPU branch: its last layer with one this step
                        probes[j].run(step,
                                      next((l.last_stats.cpu_rows for l in layers[::-1] if l.last_stats.cpu_rows),
                                           None))
                prev = j
    finally:
        gc.enable()
    expert_bytes = stacks[0][0].cache.expert_bytes
    del stacks, ref  # the caches' slots, before the next group allocates its own
    quiet = fixed.layer_s
    fixed, paired = _from_reference(fixed, times, dones, reference and len(dones) > len(runs), len(routings[0]),
                                    expert_bytes, costs)
    rates = {j: probe.floor_costs() for j, probe in probes.items()}
    return [{**_row(run, times[j],
                    _floors(dones[j], expert_bytes, costs, fixed, quiet, *rates.get(j, (None, None)), branches[j],
                            branch_rate(ratios[j]), paired), _total(dones[j]), trace, warm, costs, expert_bytes,
                    x.shape[0], phases[j]), **(probes[j].summary() if j in probes else {}),
             **_group_fields(fixed, quiet, costs, scale), "branch_rate": branch_rate(ratios[j]) or 0.0,
             "after_ms": _after(times[j], after[j], [_name(r) for r in runs] + ["ref"])} for j, run in enumerate(runs)]


def _from_reference(fixed: FixedCosts, times: list[list[float]], dones: list, fitted: bool, layers: int,
                    expert_bytes: int, costs: MissCosts) -> tuple[FixedCosts, list[float] | None]:
    """``fixed`` with its layer cost the reference's (the last stack's steps, ``fixed_from``), and each timed
    step's own (step - hits' reads) / L of the reference (``_floors``' ``paired``); as given and None where the
    reference did not fit (``fitted`` False)."""
    if not fitted:
        return fixed, None
    hits = [sum(s.hits for s in done) for done in dones[-1]]
    read = expert_bytes / costs.gpu_bytes_per_s
    return (dataclasses.replace(fixed, layer_s=fixed_from(times[-1], hits, layers, expert_bytes, costs)),
            [max(0.0, (t - h * read) / layers) for t, h in zip(times[-1], hits)])


def _group_fields(fixed: FixedCosts, quiet: float, costs: MissCosts, scale: float) -> dict:
    """The fields every row of a group shares: its fixed costs (ms), the CPU expert's price (us) and scale."""
    return {"fixed_ms": fixed.layer_s * 1e3, "fixed_quiet_ms": quiet * 1e3, "call_ms": fixed.call_s * 1e3,
            "fetch_layer_ms": fixed.fetch_layer_s * 1e3, "overlap_ms": fixed.overlap_s * 1e3,
            "prefetch_layer_ms": fixed.prefetch_layer_s * 1e3, "copy_call_ms": fixed.copy_call_s * 1e3,
            "branch_layer_ms": fixed.branch_layer_s * 1e3,
            "cpu_expert_us": costs.cpu_time(1) * 1e6, "cpu_scale": scale}


def branch_rate(branches: list[tuple[float, float]]) -> float | None:
    """The run's CPU rate as its branches got it: the median of its CPU branches' measured over modelled
    seconds, each branch weighted by its modelled seconds (``branches``: (measured, model) pairs; the least
    ratio whose branches at or below it hold half the modelled time; None without any). Weighted by time, as
    the floor prices time: a decode step's branches range from one expert to dozens, and the unweighted
    median (session 18's checkpoint) took the small ones' rate, 5-17% below the time-weighted mean. A median,
    not the mean: a stalled branch (2-19x its model in H200 runs, single ones) stays the step's own cost, not
    the floor's; and the branches' own, not the probe's: a probe run back to back read 10-40% faster than
    a branch that follows the GPU path's host work."""
    if not branches:
        return None
    total, seen = sum(model for _, model in branches), 0.0
    for measured, model in sorted(branches, key=lambda b: b[0] / b[1]):
        seen += model
        if seen >= total / 2:
            return measured / model
    return None  # not reached: the last branch brings ``seen`` to ``total``


def _name(run: Run) -> str:
    return run.label or run.place


def _after(times: list[float], before: list[int | None], names: list[str]) -> dict[str, float]:
    """A run's mean step ms by the run timed just before it (``names``' index; None: none before)."""
    by: dict[str, list[float]] = {}
    for t, j in zip(times, before):
        by.setdefault("-" if j is None else names[j], []).append(t)
    return {name: statistics.fmean(ts) * 1e3 for name, ts in sorted(by.items())}


def _reference(shells, routings: list[list[Routing]], costs: MissCosts, device, options: CpuOptions,
               x: torch.Tensor) -> list[OffloadedMoE] | None:
    """gpu layers on a cache holding every expert ``routings`` touch, each step run once (all hits after);
    None where that cache would take more than half the device's free memory (the runs' caches hold the
    rest: DeepSeek-V3 widths at M = 32 touch nearly every expert, 45 GB for two layers)."""
    touched = [set() for _ in routings[0]]
    for per_layer in routings:
        for seen, routing in zip(touched, per_layer):
            seen.update(e for e in routing.topk_ids.reshape(-1).tolist() if e >= 0)
    slots = max(1, sum(len(seen) for seen in touched))
    if device.type == "cuda" and slots * expert_nbytes(shells[0]) > torch.cuda.mem_get_info(device)[0] / 2:
        return None
    cache = ExpertCache(slots, device=device, policy="lfu")
    layers = [OffloadedMoE.from_moe(shells[i % len(shells)], cache=cache, prefetch=None, costs=costs,
                                    cpu_options=options) for i in range(len(touched))]
    for per_layer in routings:
        for layer, routing in zip(layers, per_layer):
            layer.run_routed(x, routing)
    return layers


def _total(dones: list[list[OffloadStats]]) -> OffloadStats:
    """Every layer's counts of every timed step, added."""
    total = OffloadStats()
    for done in dones:
        for stats in done:
            total.add(stats)
    return total


def _floors(dones: list[list[OffloadStats]], expert_bytes: int, costs: MissCosts, fixed: FixedCosts,
            quiet: float, busy: MissCosts | None = None, idle: MissCosts | None = None,
            branches: list[list[float]] | None = None, rate: float | None = None,
            paired: list[float] | None = None) -> list[list[float]]:
    """Per timed step: the timeline floor (its CPU side by the CPU model as given scaled by ``rate``, the run's
    own branches' median rate, ``branch_rate``, throughout; without a rate by ``busy`` / ``idle``, the probe's
    rates; None: ``costs``' throughout; its fixed cost the same step's all-hit twin's in the same round,
    ``paired``: per timed step, the reference's (step - hits' reads) / L; None: ``fixed.layer_s``), the
    layers' maxima summed, the floor as before the reference, ``fetch_layer_s`` and ``overlap_s`` (the quiet
    fixed cost, no such terms), the timeline floor without ``prefetch_layer_s``, the timeline floor with the
    host terms measured before the group (``gpu_call_s``, ``fetch_layer_s``, ``issue_s``, ``prefetch_layer_s``)
    scaled by the reference's fixed cost over the quiet one (the host's speed among the cells over its
    speed then; 1 without a reference), the timeline floor by ``costs``' CPU model as given, and the
    timeline floor at ``busy``'s rate throughout (no idle rate), and the timeline with each layer's CPU
    branch as it ran (``branches``, per step and layer; without them, the floor), the timeline floor by
    the probe's rates (the first entry without a ``rate``), and the first entry with the group's fixed cost
    (``fixed.layer_s``: the reference's median step) throughout, the headline until session 23. Paired, the
    floor follows the host's speed round by round and its mean holds the all-hit steps' mean, as ``step_ms`` is
    a mean: by the median the all-hit stack itself read 1.07-1.08x its own floor in the cpu cells of one H200
    run, where the host's slow rounds pull its mean up (``f6f35e93:benchmarks/offload_tail_device_check.py``,
    ``...-f963fdf-offload3-ck1``)."""
    given, busy = costs, busy or costs
    costs = dataclasses.replace(costs, cpu_step_s=busy.cpu_step_s, cpu_expert_s=busy.cpu_expert_s,
                                cpu_token_s=busy.cpu_token_s, cpu_rows_s=busy.cpu_rows_s)
    before = dataclasses.replace(costs, fetch_layer_s=0.0)
    r = fixed.layer_s / quiet if quiet > 0 else 1.0
    host = dataclasses.replace(costs, gpu_call_s=costs.gpu_call_s * r, fetch_layer_s=costs.fetch_layer_s * r,
                               issue_s=costs.issue_s * r)
    by_rate = given.scaled(rate) if rate else None
    # every timeline below pays the fixed costs of a call after a slot copy and of a layer beside its CPU branch
    line = functools.partial(timeline_s, copy_call_s=fixed.copy_call_s, branch_layer_s=fixed.branch_layer_s)
    lay, ov, pf = fixed.layer_s, fixed.overlap_s, fixed.prefetch_layer_s

    def head(done, layer_s: float) -> float:
        return (line(done, expert_bytes, by_rate, layer_s, ov, pf) if by_rate
                else line(done, expert_bytes, costs, layer_s, ov, pf, idle))

    return [[head(done, lay if paired is None else layer_s),
             sum_floor_s(done, expert_bytes, costs, lay), timeline_s(done, expert_bytes, before, quiet),
             line(done, expert_bytes, costs, lay, ov, 0.0, idle),
             line(done, expert_bytes, host, lay, ov * r, pf * r, idle, copy_call_s=fixed.copy_call_s * r,
                  branch_layer_s=fixed.branch_layer_s * r),
             line(done, expert_bytes, given, lay, ov, pf),
             line(done, expert_bytes, costs, lay, ov, pf),
             line(done, expert_bytes, costs, lay, ov, pf, idle, ran),
             line(done, expert_bytes, costs, lay, ov, pf, idle),
             head(done, lay)]
            for done, ran, layer_s in zip(dones, branches or [None] * len(dones), paired or [None] * len(dones))]


def balanced_orders(n: int) -> list[list[int]]:
    """n - 1 orders of ``n`` runs (one for n = 1) that, taken in turn and repeated, make every run follow
    every other exactly once per cycle: each ordered pair (a, b), a != b, is adjacent once in the cyclic
    sequence of the orders' runs (the last run of the last order followed by the first of the first). A
    step's time depends on the step before it (a CPU-heavy step leaves the host's threads spinning and its
    caches flushed for the next), so with T timed steps a multiple of n - 1 every run pays each other's
    carry-over equally. Found by depth-first search from the identity order (instant up to n = 8). The
    n! orders taken before balanced only over all n! steps: with 4 runs and 12 timed steps the gpu run
    never followed the cpu run and "auto" did 4 times (one H200 run: auto 2-6% over gpu at M = 1 with
    the same plan; the all-hit reference followed the cpu run 7 of 12 times)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if n == 1:
        return [[0]]
    seq, used = list(range(n)), {(a, a + 1) for a in range(n - 1)}
    found = _extend(seq, used, n)
    if found is None:  # not seen for n <= 8; kept explicit rather than assumed
        raise RuntimeError(f"no carry-over balanced design of {n} runs found")
    return [found[i: i + n] for i in range(0, n * (n - 1), n)]


def _extend(seq: list[int], used: set[tuple[int, int]], n: int) -> list[int] | None:
    """``balanced_orders``' search: extend ``seq`` (whole orders of n, then a partial one) by runs not yet in
    its order whose pair with the run before is unused, to n (n - 1) runs closing the cycle; None if none."""
    if len(seq) == n * (n - 1):
        return list(seq) if (seq[-1], seq[0]) not in used else None
    order = seq[len(seq) - len(seq) % n:]
    for run in range(n):
        pair = (seq[-1], run)
        if run in order or pair in used or run == seq[-1]:
            continue
        used.add(pair)
        seq.append(run)
        found = _extend(seq, used, n)
        if found is not None:
            return found
        seq.pop()
        used.discard(pair)
    return None


def _add_phases(total: list[float], layers: list[OffloadedMoE], costs: MissCosts,
                ratios: list[tuple[float, float]]) -> None:
    """Add the layers' latest CPU branches (measured, predicted, by phase) into ``total``, each one's (measured,
    predicted) seconds to ``ratios``."""
    for layer in layers:
        p = layer.last_cpu
        if p is not None:
            model = costs.cpu_side_s(list(layer.last_stats.cpu_rows))
            if model > 0:
                ratios.append((p.total_s, model))
            for i, v in enumerate((p.total_s, model, p.stage_s, p.wait_s, p.compute_s, p.back_s)):
                total[i] += v


def _stack(shells, trace: RoutingTrace, run: Run, warm: int, costs: MissCosts, device,
           options: CpuOptions) -> list[OffloadedMoE]:
    """L layers (layer i on ``shells[i]``'s host weights) on a fresh cache of ``run``'s size and policy,
    brought through ``trace``'s first ``warm`` steps by bookkeeping only."""
    cache = ExpertCache(run.slots, device=device, policy=run.policy)
    rate = CpuRate() if run.online else None
    layers = [OffloadedMoE.from_moe(shells[i % len(shells)], cache=cache, prefetch=None, compute_misses_on=run.place,
                                    costs=_run_costs(run, costs), admit_per_forward=run.admit, cpu_options=options,
                                    cpu_rate=rate) for i in range(trace.num_layers)]
    with cache.bookkeeping_only():
        drive(cache, [layer.layer_id for layer in layers], trace, range(warm),
              **_options(run, costs, cache.expert_bytes))
    return layers


def _run_costs(run: Run, costs: MissCosts) -> MissCosts:
    """The costs ``run``'s layers decide by: ``costs`` with the run's overrides."""
    return dataclasses.replace(costs, **dict(run.overrides)) if run.overrides else costs


def _options(run: Run, costs: MissCosts, expert_bytes: int) -> dict:
    """What the cell's layers do with misses and predictions, as ``whatif.drive`` / ``replay`` take it."""
    return dict(prefetch="router" if run.prefetch else None, place=run.place, costs=_run_costs(run, costs),
                expert_bytes=expert_bytes, admit_per_forward=run.admit)


def _row(run: Run, times: list[float], floors: list[list[float]], timed: OffloadStats, trace: RoutingTrace, warm: int,
         costs: MissCosts, expert_bytes: int, m: int, phases: list[float]) -> dict:
    """A cell's measured fields, and the what-if's hit rate replayed from the same step."""
    sim = replay(trace, run.slots, run.policy, measure_from=warm + 1, **_options(run, costs, expert_bytes)).hit_rate
    steps, step_s = len(times), statistics.fmean(times)
    floor_s, sum_s, before_s, unfetched_s, host_s, given_s, busy_s, ran_s, probe_s, median_s = (
        statistics.fmean(f[i] for f in floors) for i in range(10))
    sem_s = statistics.stdev(times) / steps ** 0.5 if steps > 1 else 0.0
    return {"step_ms": step_s * 1e3, "step_sem_ms": sem_s * 1e3, "step_times_ms": [t * 1e3 for t in times],
            "floor_times_ms": [f[0] * 1e3 for f in floors], "floor_ms": floor_s * 1e3, "floor_sum_ms": sum_s * 1e3,
            "x_floor_before": step_s / before_s if before_s else float("inf"),
            "x_floor": step_s / floor_s if floor_s else float("inf"),
            "x_floor_no_prefetch": step_s / unfetched_s if unfetched_s else float("inf"),
            "x_floor_host": step_s / host_s if host_s else float("inf"),
            "x_floor_given": step_s / given_s if given_s else float("inf"),
            "x_floor_busy": step_s / busy_s if busy_s else float("inf"),
            "x_floor_cpu_ran": step_s / ran_s if ran_s else float("inf"),
            "x_floor_probe": step_s / probe_s if probe_s else float("inf"),
            "x_floor_median": step_s / median_s if median_s else float("inf"),
            "hit_rate": timed.hit_rate, "sim_hit_rate": sim, "fetched_per_step": timed.fetched / steps,
            "cpu_tokens_per_step": timed.cpu_tokens / steps,
            "link_experts_per_step": (timed.fetched + timed.prefetched + timed.admitted) / steps,
            "admitted_per_step": timed.admitted / steps, "tok_s": m / step_s,
            **{name: v * 1e3 / steps for name, v in zip(_PHASES, phases)}}


_PHASES = ("cpu_ms", "cpu_model_ms", "cpu_stage_ms", "cpu_wait_ms", "cpu_compute_ms", "cpu_back_ms")


def _forward(layers: list[OffloadedMoE], i: int, x, routing: Routing, predicted: list[list[int]],
             prefetch: bool) -> OffloadStats:
    """Layer ``i``'s forward on ``routing``, then (``prefetch``) the next layer's predicted experts
    fetched ahead, as ``prefetch="router"`` does; the forward's stats with the prefetch's."""
    layer = layers[i]
    layer.run_routed(x, routing)
    stats = layer.last_stats
    if prefetch and i + 1 < len(layers):
        ahead = OffloadStats()
        layer.cache.prefetch(layers[i + 1].layer_id, predicted[i + 1], ahead)
        layer.cache.stats.add(ahead)
        stats = dataclasses.replace(stats)
        stats.add(ahead)
    return stats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

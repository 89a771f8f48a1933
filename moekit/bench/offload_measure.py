"""``moekit bench --offload``: decode through a stack of offloaded layers whose experts exceed the GPU budget.

    [measure, once: host->GPU link, GPU read rate, the CPU path on cold experts, staging] -> [warm-up
    once per M] -> per (stream, M): one simulated decode stream, the floor's fixed per-layer cost on
    all-hit steps -> per (cache %, policy, prefetch): the CPU rates fitted again -> per
    compute_misses_on: L layers sharing an ExpertCache of C = fraction x E x L slots; W warm steps
    through the cache's bookkeeping only, one real untimed step, ``timed_steps`` timed ones (the modes
    of one cache %, policy and prefetch take turns step by step) -> step time vs the floor; hit rate vs
    the what-if's replay

Routing comes from the simulator (``moekit.sim.cache.decode_stream``: uniform and skewed routers, a
residual drift between layers), so every cell of a stream replays the same routing, and prefetch
"router" prefetches layer l+1's experts as its router picks them from layer l's input (on skewed
streams the table has prefetch off and on). Each layer has its own host weights, as in a real model
(L x E experts of host memory): with one shared set, an expert the previous layer computed on the CPU
still sat in the CPU's caches, and CPU steps ran up to 6x faster than the cold-expert model.

The floor of a step (``offload_floor``, whose docstring lists what it includes and leaves out), from
rates measured in the same run and the counts measured in the step, no margin: a timeline of the
layers with one host-to-device queue in issue order, each layer paying fixed costs measured on all-hit
steps of the same (stream, M): the layer's, by an all-hit stack taking its turns among the group's cells
(``offload_cells``; the host's speed drifts between moments of a run), and, on a cache of the group's
size before it (``offload_floor.fixed_costs``), a second experts call and the least a forward with a
fetch takes (one fetch forced into every layer), which "auto" prices too (``MissCosts.gpu_call_s`` /
``fetch_layer_s``); its CPU side by the calibrated grid scaled to the host's rate just before its group
of rows (``calibrate.recalibrate_cpu``: the host's rate drifts over a run).
``floor_sum_ms`` keeps the simpler floor next to it (the layers' maxima summed). Each row also carries the CPU
branches' measured host time per step, by phase (``OffloadedMoE.last_cpu``), next to the model's
prediction for the same work; the document's ``cells`` give per cell each mode's x floor and "auto"
over the faster pure mode. Before the table, the warm-up's CPU branches set ``cpu_margin`` to their
measured / modelled time when larger (``MissCosts.observed``). The simulated hit rate replays the same stream, policy,
cache size, prefetch and ``compute_misses_on`` (with the same measured costs) through ``moekit.offload.whatif.replay``.

Shapes: E experts, K hidden, N intermediate, k top-k, M tokens per step, L layers, C cache slots.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass

import torch

from moekit.bench.offload_cells import Run as _Run
from moekit.bench.offload_cells import run_cells
from moekit.bench.offload_floor import fixed_costs
from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_probe import CpuProbe, probe_shape
from moekit.bench.offload_report import by_cell, summary
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.offload import CpuOptions, MissCosts, OffloadedMoE, expert_nbytes
from moekit.offload.calibrate import recalibrate_cpu
from moekit.offload.whatif import replay
from moekit.routing import Routing
from moekit.sim.cache import decode_stream

STREAMS = {"uniform": 0.0, "skewed": 0.3}
DRIFT = 0.3  # the residual stream's change per layer (relative to a token's content)


@dataclass(frozen=True)
class OffloadRow:
    stream: str  # "uniform" or "skewed" (the simulator's router skew)
    cache_fraction: float  # C / (E x L)
    policy: str
    prefetch: str  # "none" or "router"
    compute_misses_on: str
    M: int
    step_ms: float  # mean wall time of one timed decode step through all L layers
    floor_ms: float  # mean floor of the same steps: the timeline (module docstring), each step's fixed cost its
    # all-hit twin's in the same round where the reference ran (``offload_cells._floors``)
    floor_sum_ms: float  # mean of session 8's floor of the same steps (the layers' maxima summed)
    x_floor: float  # step_ms / floor_ms
    hit_rate: float  # measured over the timed steps
    sim_hit_rate: float  # the what-if's replay of the same steps, same mode and costs
    fetched_per_step: float
    cpu_tokens_per_step: float
    link_experts_per_step: float  # fetched + prefetched + admitted
    admitted_per_step: float  # of which admitted (CPU misses copied into the cache after their forward)
    tok_s: float
    cpu_ms: float  # per step: host ms of the layers' CPU branches (``OffloadedMoE.last_cpu``), all phases
    cpu_model_ms: float  # per step: what MissCosts predicts for the same CPU work (no margin)
    cpu_stage_ms: float  # per step, by phase: queueing the inputs' copy to the host,
    cpu_wait_ms: float  # the host waiting for it,
    cpu_compute_ms: float  # the CPU experts,
    cpu_back_ms: float  # the result into pinned memory and its copy queued
    fixed_ms: float = 0.0  # the floor's fixed per-layer cost at this (stream, M, cache) (``offload_cells``' reference)
    fixed_quiet_ms: float = 0.0  # the same measured quietly before the group (``offload_floor.fixed_costs``)
    call_ms: float = 0.0  # the floor's cost of a layer's second experts call, likewise
    fetch_layer_ms: float = 0.0  # the least a forward with a fetch takes over an all-hit one, likewise
    overlap_ms: float = 0.0  # how long before a layer's fixed work ends its copies start, likewise
    prefetch_layer_ms: float = 0.0  # a layer's prefetch of one expert over none, on the host's path, likewise
    copy_call_ms: float = 0.0  # an experts call right after a copy into the slots over one after none, likewise
    branch_layer_ms: float = 0.0  # a forward with a CPU branch over an all-hit one, the branch itself out, likewise
    x_floor_no_prefetch: float = 0.0  # step_ms over the floor without ``prefetch_layer_ms``
    x_floor_host: float = 0.0  # over the floor with the host terms scaled to the reference's speed (``offload_cells``)
    x_floor_before: float = 0.0  # step_ms over the old floor: ``fixed_quiet_ms``, no ``fetch_layer_s``
    cpu_expert_us: float = 0.0  # the CPU time of a one-row expert this group's floor and layers priced
    cpu_scale: float = 1.0  # the group's CPU model over the calibration's (``recalibrate_cpu``'s factor)
    step_sem_ms: float = 0.0  # the standard error of ``step_ms`` over the timed steps
    x_floor_given: float = 0.0  # step_ms over the floor with the CPU model before the group (``cpu_scale``), no probe
    x_floor_busy: float = 0.0  # step_ms over the floor with the probe's busy-link rate throughout
    x_floor_cpu_ran: float = 0.0  # step_ms over the timeline with each CPU branch as it ran (a check, not a floor)
    x_floor_probe: float = 0.0  # step_ms over the floor with the CPU side at the probe's rates (``offload_probe``)
    # over the floor whose fixed cost is the reference's median step throughout (the headline before session 23)
    x_floor_median: float = 0.0
    # the floor's CPU rate where the run has CPU branches: their time-weighted median measured / model
    branch_rate: float = 0.0
    step_times_ms: list = dataclasses.field(default_factory=list)  # each timed step (the turns pair them by index)
    floor_times_ms: list = dataclasses.field(default_factory=list)  # each timed step's floor (``floor_ms``'s terms)
    probe_busy: float = 0.0  # the run's CPU probe, link busy: measured / the group's model (``offload_probe``)
    probe_idle: float = 0.0  # likewise, link idle
    probes: int = 0  # probe calls timed after the run's steps
    probe_shape: str = ""  # experts x rows of a probe call
    after_ms: dict = dataclasses.field(default_factory=dict)  # mean step ms by the run timed before it ("ref": all-hit)


def measure_offload(device: torch.device, *, experts=256, hidden=7168, inter=2048, top_k=8, layers=2,
                    batches=(1, 8, 32), fractions=(0.25, 0.5, 0.75), policies=("lfu", "lru"),
                    places=("gpu", "cpu", "auto"), streams=tuple(STREAMS), steps=3, warm_steps: int | None = None,
                    scheme: str | None = None, on_progress=None, cpu_options: CpuOptions | None = None,
                    observed_margin: bool = True, shells: list[MoE] | None = None, costs: MissCosts | None = None,
                    admit_per_forward: int | None = None, variants: dict[str, tuple[str, dict]] | None = None,
                    online_cpu_rate: bool = False, reference_fixed: bool = True, keep=None,
                    cpu_probe: bool = True) -> dict:
    """Every (stream, M, fraction, policy, prefetch, place): the document ``moekit bench --offload`` writes.
    ``streams``: names in ``STREAMS``. ``scheme``: a ``moekit.quant`` scheme for the experts (packed on the host, in the
    slots, over the link; None: bf16 on CUDA, float32 on the CPU). ``warm_steps``: the bookkeeping-only steps W (None:
    ``default_warm_steps(M)``). ``cpu_options``: the layers' CPU branch. ``observed_margin``: raise the costs'
    ``cpu_margin`` to the CPU branch's measured / predicted time over the warm-up (``MissCosts.observed``). ``shells`` /
    ``costs``: host layers (one per layer) and costs of an earlier call (``host_shells``, ``measure_costs``): reused.
    ``admit_per_forward``: as ``OffloadedMoE.from_moe`` takes it. ``variants``: further runs in every group, label ->
    (place, MissCosts fields replaced: {"refetch": "hit_rate"}), rows labelled so in ``compute_misses_on``.
    ``online_cpu_rate``: each "auto" cell's layers share a ``CpuRate`` (the what-if replays the calibrated costs).
    ``reference_fixed``: the floor's fixed cost from an all-hit stack among the cells. ``keep(stream, M, run)``: False
    skips the group of that first ``offload_cells.Run`` (None: none). ``cpu_probe``: the floor's CPU side by a probe."""
    dtype, options = torch.bfloat16 if device.type == "cuda" else torch.float32, cpu_options or CpuOptions()
    config = MoEConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, top_k=top_k)
    clock = [time.perf_counter()]
    shells = _checked(shells, layers) if shells is not None else host_shells(config, dtype, device, scheme, layers)
    clock.append(time.perf_counter())
    costs = costs if costs is not None else measure_costs(shells[0], device, options, cpu_rows(batches), max(batches))
    clock.append(time.perf_counter())
    warm_rows = _warm_up(shells, config, layers, batches, places, costs, device, options, admit_per_forward)
    if observed_margin and sum(r["cpu_model_ms"] for r in warm_rows) > 0:
        costs = costs.observed(sum(r["cpu_ms"] for r in warm_rows), sum(r["cpu_model_ms"] for r in warm_rows))
    clock.append(time.perf_counter())
    probe = OffloadedMoE.from_moe(shells[0], cache_experts=1, prefetch=None, device=device, cpu_options=options)
    rows, fixed, stacks = [], {}, len(places) + len(variants or {}) + int(reference_fixed)  # a group's stacks
    for stream in streams:
        for m in batches:
            warm = default_warm_steps(m) if warm_steps is None else warm_steps
            data, routings = _stream(config, layers, warm + 1 + balanced_count(timed_steps(steps, m), stacks), m,
                                     stream, warm, device)
            for group in _groups(stream, experts * layers, fractions, policies, places, admit_per_forward, variants):
                if keep is not None and not keep(stream, m, group[0]):
                    continue
                fixed[f"{stream}/{m}/{group[0].fraction:.0%}"] = fixed_s = fixed_costs(
                    shells, routings[:4], costs, device, options, group[0].slots)
                group, group_costs, scale = _prepare(group, fixed_s.priced(costs), probe, 10 * len(rows),
                                                     online_cpu_rate, _rows(m, top_k, experts))
                cpu = _cpu_probes(probe, group, group_costs, data.trace, warm,
                                  10 * len(rows) + 5) if cpu_probe else None
                for run, row in zip(group, run_cells(shells, config, routings, data.trace, group, warm, group_costs,
                                                     device, options, fixed_s, scale, reference_fixed, cpu)):
                    rows.append(OffloadRow(stream, run.fraction, run.policy, "router" if run.prefetch else "none",
                                           run.label or run.place, m, **row))
                    if on_progress:
                        on_progress(rows[-1])
    return {**_costs_doc(costs), "online_cpu_rate": online_cpu_rate, "cpu_options": asdict(options), "experts": experts,
            "hidden": hidden, "inter": inter, "top_k": top_k, "layers": layers, "drift": DRIFT, "skews": STREAMS,
            "timed_steps": {m: balanced_count(timed_steps(steps, m), stacks) for m in batches},
            "warm_steps": {m: default_warm_steps(m) if warm_steps is None else warm_steps for m in batches},
            "dtype": scheme or str(dtype).removeprefix("torch."), "expert_bytes": expert_nbytes(shells[0]),
            "setup_s": {"host_weights": clock[1] - clock[0], "costs": clock[2] - clock[1],
                        "warm_up": clock[3] - clock[2]},
            "table_s": time.perf_counter() - clock[3], **_fixed_doc(fixed), **_tables([asdict(r) for r in rows])}


def _fixed_doc(fixed: dict) -> dict:
    """The document's fixed costs by group key (ms)."""
    return {"fixed_ms": {key: v.layer_s * 1e3 for key, v in fixed.items()},
            "call_ms": {key: v.call_s * 1e3 for key, v in fixed.items()},
            "fetch_layer_ms": {key: v.fetch_layer_s * 1e3 for key, v in fixed.items()}}


def _rows(m: int, top_k: int, experts: int) -> int:
    """Rows an expert at M tokens if the k x M assignments spread over as many experts as they can."""
    return max(1, round(m * top_k / min(experts, m * top_k)))


def _costs_doc(costs: MissCosts) -> dict:
    """The document's fields for the costs the table started from (after the warm-up's margin)."""
    return {"link_GBps": costs.link_bytes_per_s / 1e9, "gpu_read_GBps": costs.gpu_bytes_per_s / 1e9,
            "link_cpu_GBps": (costs.link_cpu_bytes_per_s or 0.0) / 1e9, "refetch": costs.refetch,
            "cpu_expert_us": costs.cpu_expert_s * 1e6, "cpu_token_us": costs.cpu_token_s * 1e6,
            "cpu_step_us": costs.cpu_step_s * 1e6, "cpu_rows_us": {r: t * 1e6 for r, t in costs.cpu_rows_s},
            "cpu_margin": costs.cpu_margin, "hysteresis": costs.hysteresis, "cpu_threads": costs.cpu_threads,
            "cpu_gemm": costs.cpu_gemm, "cpu_tail_us": costs.cpu_tail_s * 1e6}


def _stream(config: MoEConfig, layers: int, count: int, m: int, stream: str, warm: int, device):
    """The simulator's decode stream of ``count`` steps (seed 3) and its routings from step ``warm`` on, on
    ``device``."""
    data = decode_stream(config.num_experts, config.top_k, layers, count, m, STREAMS[stream], DRIFT, seed=3)
    return data, [[Routing(r.topk_ids.to(device), r.topk_weights.to(device)) for r in s] for s in data.routings[warm:]]


def _checked(shells: list[MoE], layers: int) -> list[MoE]:
    if len(shells) != layers:
        raise ValueError(f"shells must hold one host layer per layer ({layers}), got {len(shells)}")
    return shells


def _tables(rows: list[dict]) -> dict:
    """The document's rows, cells and summary."""
    return {"rows": rows, "cells": by_cell(rows), "summary": summary(rows)}


def _prepare(group: list[_Run], costs: MissCosts, probe: OffloadedMoE, start: int, online: bool,
             rows: int = 1) -> tuple[list[_Run], MissCosts, float]:
    """A group's runs (auto's marked ``online`` when asked), the costs its layers and floor price by and
    their CPU scale: with any run computing on the CPU, the CPU model scaled to the host's rate now on
    ``probe`` from cold-expert group ``start``, timed at ``rows`` rows an expert (``calibrate.recalibrate_cpu``)."""
    scale = 1.0
    if any(run.place != "gpu" for run in group):
        costs, scale = recalibrate_cpu(probe, costs, start=start, rows=rows)
    return [dataclasses.replace(run, online=online and run.place == "auto") for run in group], costs, scale


def _cpu_probes(layer: OffloadedMoE, group: list[_Run], costs: MissCosts, trace, warm: int,
                start: int) -> dict[int, CpuProbe]:
    """A ``CpuProbe`` for each run of the group whose replay of the timed steps computes on the CPU (by run
    index), shaped as that run's mean CPU branch; cold-expert groups from ``start`` on."""
    probes = {}
    for j, run in enumerate(group):
        if run.place == "gpu":
            continue
        done = replay(trace, run.slots, run.policy, "router" if run.prefetch else None, place=run.place,
                      costs=dataclasses.replace(costs, **dict(run.overrides)), expert_bytes=layer.cache.expert_bytes,
                      measure_from=warm + 1)
        if done.cpu_experts:
            shape = probe_shape(done.cpu_experts, done.cpu_tokens, done.cpu_forwards)
            probes[j] = CpuProbe(layer, costs, *shape, start=start + 7 * j)
    return probes


def measure_costs(shell: MoE, device, options: CpuOptions, rows: tuple[int, ...] | None = None,
                  warm: int | None = None) -> MissCosts:
    """The miss costs of ``shell``'s layers, measured on an offloaded layer with ``options``, the CPU
    branch timed at ``rows`` rows an expert and warmed up to ``warm`` (``calibrate.measure_costs``; None: its
    default)."""
    layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=options)
    return layer.measure_costs(rows=rows, warm=warm)


def cpu_rows(batches) -> tuple[int, ...]:
    """The row counts a run at these M sees per CPU expert, for the calibration's grid: 1, 2, 4, ... and the
    largest M. Not capped at 16 any more: a CPU GEMM's time need not stay linear in the rows past the table
    (oneDNN's bf16 linear on the H200 hosts: 0.56 ms an expert, both GEMMs, at 16 rows in one run's
    calibration, 10-13 ms one GEMM at 33-61 rows in another's probe), and the worst "auto" cell of the first
    (skewed 25% router M = 32, onednn_fused) ran its CPU branches at 3.35x the line extended from 16 rows."""
    top = max(max(batches), 1)
    return tuple(sorted({1 << i for i in range(top.bit_length()) if 1 << i <= top} | {top}))


def default_warm_steps(m: int) -> int:
    """Bookkeeping-only warm steps at M tokens per step: 48 at M = 1, 17 at 8, 8 at 32 (each step
    touches more experts, so fewer fill the cache)."""
    return max(8, round(48 / m ** 0.5))


def timed_steps(steps: int, m: int) -> int:
    """Timed steps at M tokens: ``steps``, times 4 at M = 1 and 2 at M = 2 (steps of a few ms, where run
    to run jitter is a larger share; they cost little). 24 at M = 1 did not lower the twin's noise on the
    H200 (3.0%, against 2.3% with 12: the host's drift, not the count, sets it). Times 4 at 3 <= M <= 8 too:
    "auto" sends a miss to the CPU there now and then (a few branches a group), and one branch stalled by
    the host (b89fbea skewed/50/none/8: one of 4 timed steps 40.8 ms against ~16) moved a 4-step mean by
    a third; 12 steps cost ~10 s more over the H200 table's nine M = 8 groups (M = 32's steps, 50-280 ms,
    stay at ``steps``: their four take ~3 s a round of the nine groups)."""
    return steps * (4 if 3 <= m <= 8 else max(1, 4 // m))


def balanced_count(steps: int, stacks: int) -> int:
    """``steps`` rounded up to a multiple of ``stacks`` - 1 (at least 1): the timed steps over which
    ``offload_cells.balanced_orders`` has every stack follow every other equally often."""
    cycle = max(1, stacks - 1)
    return -(-steps // cycle) * cycle


def _groups(stream: str, total: int, fractions, policies, places, admit: int | None = None,
            variants: dict[str, tuple[str, dict]] | None = None) -> list[list[_Run]]:
    """The cells of one (stream, M), grouped by (fraction, policy, prefetch): one cell per place in a
    group, then one per variant. Prefetch on and off on skewed streams, off on uniform ones."""
    prefetches = (False, True) if stream == "skewed" else (False,)
    extra = [(place, label, tuple(fields.items())) for label, (place, fields) in (variants or {}).items()]
    return [[_Run(f, max(1, round(f * total)), policy, prefetch, place, admit) for place in places]
            + [_Run(f, max(1, round(f * total)), policy, prefetch, place, admit, label, fields)
               for place, label, fields in extra]
            for f in fractions for policy in policies for prefetch in prefetches]


def _warm_up(shells, config, layers, batches, places, costs, device, options, admit) -> list[dict]:
    """Two steps per (M, place) of a skewed stream through a small cache: compiles the experts kernels
    for every M and runs the CPU path, so no cell pays a first call. The rows of the second steps."""
    rows = []
    for m in batches:
        data = decode_stream(config.num_experts, config.top_k, layers, 3, m, STREAMS["skewed"], DRIFT, seed=99)
        routings = [[Routing(r.topk_ids.to(device), r.topk_weights.to(device)) for r in s] for s in data.routings[1:]]
        runs = [_Run(0.0, 4 * config.top_k, "lfu", False, place, admit) for place in places]
        rows += run_cells(shells, config, routings, data.trace, runs, 1, costs, device, options)
    return rows

"""``OffloadedMoE.measure_costs``: a layer's miss costs (``cost.MissCosts``), measured on its own paths.

    link:      host -> GPU from pinned memory, large copies (``bandwidth.measure_link_bandwidth``)
    GPU read:  a large device copy (``bandwidth.measure_read_bandwidth``)
    CPU:       the layer's whole CPU branch (``cpu_path.CpuPath``: staging in, the wait, the experts,
               the result's copy queued), host seconds, with the link busy as when fetches run beside it,
               on cold experts (no expert timed twice while E allows), the median of ``repeats``, over a
               grid: n experts per call (``experts``: 1, k and 4k by default) x r rows each (``rows``: the
               row counts a run will see; 1, 2, 4 and ``tokens`` by default) -> ``cost.fit_cpu_grid``:
               one call cost (``cpu_step_s``) and a per-expert time at each row count (``cpu_rows_s``)
    link, CPU busy: one large copy while the CPU branch computes (``link_during_cpu``): admissions
               travel then (``plan``)
    GPU terms: a second experts call (``gpu_call_s``) and the least a forward with a fetch takes
               (``fetch_layer_s``), timed at ``batch`` tokens on all-hit forwards and forwards with one
               forced fetch (``gpu_terms.measure_terms``, the path the benchmark's floor is timed by) on a
               probe of the layer: its own host weights (shared, not copied) behind a private cache of
               2k slots on its device (freed after; the layer's cache and stats are left as they were)

Why a grid: one H200 run's CPU branches took 0.42-0.70 ms per expert in calls of ~100 experts (M = 32)
and 0.56-1.4 ms in calls of 1-6 (M = 1), against a model fitted at 1 and k experts of one row; the call's
fixed cost and the per-expert time at the row counts of the run are what the floor and "auto" price.

The thread count and the CPU GEMM are chosen here too where the layer's ``CpuOptions`` leaves them
None: half the logical CPUs (``thread_candidates``: the other half left to the host thread's neighbours), times each of
``cpu_path.CPU_GEMMS``, each timed at k experts x 1 token (a decode step's shape: the weights' bytes, not
FLOPs, set the time, and fewer threads may stream them as fast with less contention); the pair kept goes
in ``MissCosts.cpu_threads`` / ``cpu_gemm`` (``pick_setting``: by the mean of 8+ timings taken in turns,
the fewest threads within 5% of the best). ``cpu_margin`` is ``cost.margin_of`` the grid's timings; ``hysteresis`` is
``HYSTERESIS``.
``recalibrate_cpu`` rescales the fitted CPU model to the host's rate now (a drift factor).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import statistics
from typing import Iterator

import torch

from moekit.offload.cache import ExpertCache
from moekit.offload.cpu_path import CPU_GEMMS, torch_threads
from moekit.offload.bandwidth import link_busy, measure_link_bandwidth, measure_read_bandwidth
from moekit.offload.cost import MissCosts, fit_cpu_grid, margin_of
from moekit.offload.gpu_terms import FixedCosts, measure_terms
from moekit.offload.stats import OffloadStats
from moekit.routing import Routing

HYSTERESIS = 0.05  # measured costs' ``MissCosts.hysteresis``: "auto" takes a CPU split only for a 5% predicted gain
# measured costs' ``MissCosts.cpu_tail_s``: on the H200 host a CPU branch now and then ran 5-35 ms over its model
# (the team waiting at a barrier for one late thread; not CPython's collector, not preemption), so a branch's
# mean exceeds its model by ~the stalls it carries: over 80 steps a stack at M = 8 (raw ...-96560bf-offload4-ck1),
# mean less the unstalled steps' mean per branch 0.4 / 0.9 / 3.6 ms in three auto cells, 0.15 / 0.6 / 0.65 in
# cpu ones; one call's fixed cost is ~0.7 ms. Priced, "auto" at M = 8 stops sending a 1-2 expert split to the
# CPU for a 2-5% predicted gain its stalls turn into a 6-19% loss by the mean (auto 1.06-1.19x gpu by mean,
# 0.97-1.01 by median there); the floor keeps the model alone.
CPU_TAIL_S = 1.0e-3
THREAD_TOLERANCE = 0.05  # ``pick_setting``: fewer threads are kept when their mean branch is within 5% of the best


def default_grid(top_k: int, num_experts: int, tokens: int, rows: tuple[int, ...] | None = None,
                 experts: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(expert counts, row counts) the CPU branch is timed at: ``experts`` or 1, k and 4k (k = max(top_k,
    2)), at most E; ``rows`` or 1, 2, 4 and ``tokens``. Distinct and ascending; two expert counts at least."""
    k = max(top_k, 2)
    ns = sorted({min(n, num_experts) for n in (experts or (1, k, 4 * k)) if n >= 1})
    rs = sorted({r for r in (rows or (1, 2, 4, tokens)) if r >= 1})
    if len(ns) < 2 or not rs:
        raise ValueError(f"need two expert counts and one row count >= 1, got experts={ns}, rows={rs}")
    return tuple(ns), tuple(rs)


def measure_costs(layer, tokens: int = 16, repeats: int = 3, rows: tuple[int, ...] | None = None,
                  experts: tuple[int, ...] | None = None, batch: int = 1, warm: int | None = None) -> MissCosts:
    """``layer``'s (an ``OffloadedMoE``) miss costs (module docstring): every term ``cost`` prices by. Before
    the grid, the CPU GEMM runs once at every row count 1..``warm`` (None: the grid's largest; ``warm_rows``)."""
    if tokens < 2 or repeats < 1 or batch < 1:
        raise ValueError(f"need tokens >= 2, repeats >= 1 and batch >= 1, got tokens={tokens}, repeats={repeats}, "
                         f"batch={batch}")
    c = layer.config
    k = max(c.top_k, 2)
    ns, rs = default_grid(c.top_k, c.num_experts, tokens, rows, experts)
    groups = cold_groups(c.num_experts, max(ns))
    gemms = [layer.cpu_options.gemm] if layer.cpu_options.gemm else cpu_gemms(layer)
    for gemm in gemms:
        branch(layer, next(groups)[:k], 1, 1, None, gemm)  # the first call pays one-off setup

    def timings(n: int, m: int, setting: tuple[int, str]) -> list[float]:
        return [branch(layer, next(groups)[:max(n, k)], n, m, *setting) for _ in range(repeats)]

    candidates = [(t, g) for t in thread_candidates(layer.cpu_options.threads) for g in gemms]
    spread = {s: [] for s in candidates}
    for _ in range(max(2 * repeats, 8)):  # the settings take turns: a slow moment of the host falls on each alike
        for s in candidates:
            spread[s].append(branch(layer, next(groups)[:k], k, 1, *s))
    best = pick_setting(spread)
    warm_rows(layer, warm or max(rs), *best)
    grid = {(n, r): timings(n, r, best) for r in rs for n in ns}
    costs = from_grid(MissCosts(link_bytes_per_s=measure_link_bandwidth(layer.cache.device), cpu_expert_s=0.0,
                                cpu_token_s=0.0), {key: statistics.median(t) for key, t in grid.items()})
    dev = layer.cache.device
    during = [link_during_cpu(layer, next(groups)[:k], *best) for _ in range(repeats)]
    costs = dataclasses.replace(costs, gpu_bytes_per_s=measure_read_bandwidth(dev),
                                cpu_margin=margin_of(list(grid.values())), cpu_threads=best[0], cpu_gemm=best[1],
                                link_cpu_bytes_per_s=statistics.median(during) if None not in during else None,
                                hysteresis=HYSTERESIS, cpu_tail_s=CPU_TAIL_S)
    return gpu_terms(layer, costs, batch).priced(costs)


def cpu_gemms(layer) -> list[str]:
    """The CPU GEMMs ``layer``'s host weights can run: all of ``CPU_GEMMS``, less "direct" for quantized ones."""
    quantized = layer.cache.host(layer.layer_id).scheme is not None
    return [g for g in CPU_GEMMS if not (quantized and g == "direct")]


def gpu_terms(layer, costs: MissCosts, batch: int = 1, steps: int = 4) -> FixedCosts:
    """``gpu_terms.measure_terms`` on a probe of ``layer`` (module docstring) over ``steps`` forwards of
    ``batch`` tokens, each token routed to k distinct experts drawn (seeded) from the first 2k (at most E)."""
    c = layer.config
    pool = min(c.num_experts, 2 * c.top_k)
    probe = _probe(layer, pool)
    dev, dtype = probe.cache.device, probe.cache.host(probe.layer_id).w13_template.dtype
    gen = torch.Generator().manual_seed(0)
    routings = []
    for _ in range(steps):
        ids = torch.stack([torch.randperm(pool, generator=gen)[:c.top_k] for _ in range(batch)]).to(torch.int32)
        routings.append([Routing(ids.to(dev), torch.full(ids.shape, 1.0 / c.top_k, device=dev))])
    x = torch.randn(batch, c.hidden_size, generator=gen).to(dev, dtype)
    terms = measure_terms([probe], x, routings, costs)
    del probe
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return terms


def _probe(layer, slots: int):
    """A shallow copy of ``layer`` (its parameters shared) on a private ``ExpertCache`` of ``slots`` slots
    holding its host weights (views: no copy), computing misses on the GPU, no prefetch, no CPU rate."""
    host = layer.cache.host(layer.layer_id)
    cache = ExpertCache(slots, device=layer.cache.device, policy="lfu")
    probe = copy.copy(layer)
    probe.cache, probe.layer_id = cache, cache.register(*host.rebuild(host.parts))
    probe.prefetch, probe.compute_misses_on, probe.cpu_rate, probe._next = None, "gpu", None, []
    probe.last_stats, probe._last_touched = OffloadStats(), []
    return probe


def warm_rows(layer, most: int, threads: int | None, gemm: str) -> None:
    """Run ``layer``'s CPU experts (``gemm`` at ``threads``) once with one expert at each row count 1..``most``,
    on the CPU alone (zeros in, no staging). oneDNN may build a kernel the first time it sees a GEMM shape
    (this repo's 2-core CPU host, fp32: 3-7 ms a first call at a new row count, 0.15 a second), which a
    forward paid the first time one of its CPU experts had that many rows; the grid then times warm
    kernels as the forwards will run them. (One H200 host's bf16 linear showed no such one-off: 10.2 / 11.8
    ms first / second at 33 rows.)"""
    c = layer.config
    dtype = layer.cache.host(layer.layer_id).w13_template.dtype
    with torch_threads(threads):
        for r in range(1, most + 1):
            inputs = (torch.zeros(r, c.hidden_size, dtype=dtype), torch.zeros(r, 1, dtype=torch.int32),
                      torch.ones(r, 1, dtype=torch.float32))
            layer._cpu_experts(inputs, [0], gemm)


def pick_setting(spread: dict[tuple[int, str], list[float]], tolerance: float = THREAD_TOLERANCE) -> tuple[int, str]:
    """The (threads, gemm) to run the CPU branch at, from its timings at each: the fewest threads (then the
    first listed) whose mean is within ``tolerance`` of the least mean. The mean, not the median: a team of
    as many threads as the host has CPUs stalls whenever another thread takes one of them (the H200 host's
    branch at 16 threads on 16 CPUs: median 3.1 ms, worst 17.7 and 26.7 ms; at 8, worst 1.1x its median),
    and a forward pays its branch's outliers as they come."""
    means = {s: statistics.fmean(t) for s, t in spread.items() if t}
    if not means:
        raise ValueError("pick_setting needs timings for at least one setting")
    least = min(means.values())
    return min((s for s, m in means.items() if m <= least * (1.0 + tolerance)), key=lambda s: s[0])


def monotone_rows(per_expert: dict[int, float]) -> dict[int, float]:
    """``per_expert`` ({rows: seconds per expert}) made nondecreasing in rows by pooling adjacent violators
    (the least-squares nondecreasing fit): an expert with more rows reads the same weights and does more
    FLOPs, so a row count fitted cheaper than a smaller one is the grid's noise (one H200 calibration: 448,
    491, 468, 606, 572, 768 us at 1, 2, 4, 8, 16, 32 rows -> 448, 479.5, 479.5, 589, 589, 768)."""
    blocks: list[list[float]] = []  # [sum, count] of pooled neighbours
    for r in sorted(per_expert):
        blocks.append([per_expert[r], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    values = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return dict(zip(sorted(per_expert), values))


def from_grid(costs: MissCosts, medians: dict[tuple[int, int], float]) -> MissCosts:
    """``costs`` with the CPU model fitted to branch times {(experts, rows): seconds} (``cost.fit_cpu_grid``):
    ``cpu_step_s`` the call cost, ``cpu_rows_s`` the per-expert times made nondecreasing in rows
    (``monotone_rows``), and ``cpu_expert_s`` /
    ``cpu_token_s`` the line through the first and last row counts (what a linear reader of the costs,
    ``moekit analyze``, takes)."""
    call, per_expert = fit_cpu_grid(medians)
    table = tuple(sorted(monotone_rows(per_expert).items()))
    (r0, s0), (r1, s1) = table[0], table[-1]
    token = max(s1 - s0, 0.0) / (r1 - r0) if r1 > r0 else 0.0
    return dataclasses.replace(costs, cpu_step_s=call, cpu_rows_s=table, cpu_token_s=token,
                               cpu_expert_s=max(s0 - r0 * token, 0.0))


def recalibrate_cpu(layer, costs: MissCosts, start: int = 0, rows: int = 1, repeats: int = 3,
                    experts: tuple[int, ...] | None = None) -> tuple[MissCosts, float]:
    """(``costs`` with its CPU model scaled to ``layer``'s CPU branch now, the factor): ``repeats`` rounds,
    each timing the branch once at every count of ``experts`` (default k and 4k, k = max(top_k, 2)) with
    ``rows`` rows each (cold experts from group ``start`` on; link busy; the thread count and GEMM
    ``costs`` chose); a round's sample is its summed time over the model's for the same calls; the
    factor is the median sample. A benchmark calls it before each group of rows: the host's rate drifts
    over a run (the cpu mode's branches ran 0.85-1.53x the first calibration's model across the groups
    of one H200 run), and the floor and "auto" should price the CPU as it runs for those rows. A ratio of
    sums, not a refit: refitting three rates from differences of a few short timings before each group
    gave 0-4.5 ms per expert on one H200 run. The link, GPU and margin stay as measured."""
    if rows < 1 or repeats < 1:
        raise ValueError(f"need rows >= 1 and repeats >= 1, got rows={rows}, repeats={repeats}")
    k = max(layer.config.top_k, 2)
    ns = [min(n, layer.config.num_experts) for n in (experts or (k, 4 * k))]  # distinct experts per call: at most E
    groups = cold_groups(layer.config.num_experts, max(ns), start)
    setting = (costs.cpu_threads, costs.cpu_gemm or CPU_GEMMS[0])
    branch(layer, next(groups)[:k], 1, 1, *setting)  # brings the threads up after whatever ran before
    model = sum(costs.cpu_side_s([rows] * n) for n in ns)
    if model <= 0.0:
        return costs, 1.0
    samples = [sum(branch(layer, next(groups)[:max(n, k)], n, rows, *setting) for n in ns) / model
               for _ in range(repeats)]
    factor = statistics.median(samples)
    return (costs.scaled(factor), factor) if factor > 0.0 else (costs, 1.0)


def link_during_cpu(layer, group: list[int], threads: int | None, gemm: str, nbytes: int = 1 << 28) -> float | None:
    """Host -> GPU bytes/s of one ``nbytes`` pinned copy queued on a side stream just before ``layer``'s
    CPU branch computes ``group``'s experts (1 token each): host memory serves both, so the link may run
    slower than alone. Timed by CUDA events; None off CUDA. Sized to land within the CPU work (256 MiB:
    ~5 ms at 55 GB/s against ~10 ms for 8 DeepSeek-width experts); a copy outlasting it reads fast."""
    dev = layer.cache.device
    if dev.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    x = torch.randn(1, layer.config.hidden_size, dtype=layer.cache.host(layer.layer_id).w13_template.dtype, device=dev)
    ids = torch.tensor([group], dtype=torch.int32, device=dev)
    weights = torch.full((1, len(group)), 1.0 / len(group), dtype=torch.float32, device=dev)
    stream, start, end = (torch.cuda.Stream(dev), torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(stream):
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
    staged = layer._cpu.stage([x, ids, weights])
    on_cpu = sorted(set(group))
    layer._cpu.finish(staged, lambda inputs: layer._cpu_experts(inputs, on_cpu, gemm), dev, len(on_cpu), len(on_cpu),
                      threads)
    end.synchronize()
    return nbytes / (start.elapsed_time(end) * 1e-3)


def thread_candidates(fixed: int | None) -> list[int]:
    """The thread counts to try: ``fixed`` alone, else half of ``most_threads()`` (at least 1). Never more:
    a team that leaves the host too few CPUs stalls whenever another thread (the driver's, the OS's, another
    process's) takes one of them, the whole team waiting at its next barrier. At 16 threads on the H200
    host's 16 CPUs: 17.7 and 26.7 ms against a 3.1 ms median, 15-18x the model in the table's cpu cells at
    M = 1. At 12 (the calibration's pick among 15 / 12 / 8 by the mean of back-to-back branches, which never
    see it), decoding at M = 1 with the GPU path's host work between the branches
    (``f6f35e93:benchmarks/offload_tail_device_check.py``, raw ``...-f963fdf-offload3-ck1``): 17 of 373 branches over
    2x their model, up to 21x (68 ms), with the process's threads preempted through them (1.0 involuntary
    context switches a slow branch, 0.1 the others), cpu x floor 1.37; at 8 threads in the same turns 1 of
    373 (2.03x), no context switch, the same median rate (0.92x the 12-thread model against 0.90), x floor
    1.17. A team's late thread also woke 1-1.5 ms after the call (median) after 10-600 ms of idle host."""
    if fixed is not None:
        return [fixed]
    return [max(1, most_threads() // 2)]


def most_threads() -> int:
    """The CPUs this process may run on (torch may default to the physical cores), at most twice torch's
    count (a container's affinity can list far more CPUs than its share)."""
    n = torch.get_num_threads()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(max(n, usable), 2 * n)


def branch(layer, group: list[int], experts: int, m: int, threads: int | None, gemm: str, busy: bool = True,
           rows: list[int] | None = None, quiet: bool = True) -> float:
    """Host seconds of ``layer``'s CPU branch (``CpuPhases.total_s``) for ``m`` tokens each routed to
    every expert of ``group`` (distinct experts), of which the first ``experts`` run on the CPU (``gemm``);
    the link busy throughout (``link_busy``, sized to the call), or idle with ``busy=False``. ``rows`` (one
    count per CPU expert): max(rows) tokens, the j-th CPU expert routed from the first rows[j] of them (the
    other slots dropped, id -1), the rest of ``group`` from every token; ``m`` is then unused. ``quiet``:
    the whole device waited for first; False: the current stream only, so copies the caller queued on
    another stream run on through the branch (the contention probe of
    ``f6f35e93:benchmarks/offload_key_device_check.py``)."""
    c, dev = layer.config, layer.cache.device
    dtype = layer.cache.host(layer.layer_id).w13_template.dtype
    k = len(group)
    if rows is not None:
        if len(rows) != experts or min(rows) < 1:
            raise ValueError(f"rows must hold {experts} counts >= 1, got {rows}")
        m = max(rows)
    table = [[e if rows is None or j >= experts or t < rows[j] else -1 for j, e in enumerate(group)] for t in range(m)]
    x = torch.randn(m, c.hidden_size, dtype=dtype, device=dev)
    ids = torch.tensor(table, dtype=torch.int32, device=dev)
    weights = torch.full((m, k), 1.0 / k, dtype=torch.float32, device=dev)
    on_cpu = sorted(set(group[:experts]))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev) if quiet else torch.cuda.current_stream(dev).synchronize()
    with link_busy(dev, copies=2 + len(on_cpu) // 4) if busy else contextlib.nullcontext():  # ~5 ms a copy at 55 GB/s
        staged = layer._cpu.stage([x, ids, weights])
        layer._cpu.finish(staged, lambda inputs: layer._cpu_experts(inputs, on_cpu, gemm), dev, len(on_cpu),
                          sum(rows) if rows is not None else m * len(on_cpu), threads)
    return layer._cpu.last.total_s


def cold_groups(num_experts: int, size: int, start: int = 0) -> Iterator[list[int]]:
    """Groups of ``size`` (at most E) distinct experts from group ``start`` on, disjoint until the
    experts run out (then starting over)."""
    size, g = min(size, num_experts), start
    while True:
        yield [(g * size + j) % num_experts for j in range(size)]
        g += 1

"""``OffloadedMoE.measure_costs``: a layer's miss costs (``cost.MissCosts``), measured on its own paths.

    link:      host -> GPU from pinned memory, large copies (``cost.measure_link_bandwidth``)
    GPU read:  a large device copy (``cost.measure_read_bandwidth``)
    CPU:       the layer's whole CPU branch (``cpu_path.CpuPath``: staging in, the wait, the experts,
               the result's copy queued), host seconds, with the link busy as when fetches run beside it,
               on cold experts (no expert timed twice while E allows), the median of ``repeats``:
               1 expert x 1 token, k experts x 1 token, k experts x T tokens -> ``cost.fit_cpu_branch``
    link, CPU busy: one large copy while the CPU branch computes (``link_during_cpu``): admissions
               travel then (``plan``)

The thread count and the CPU GEMM are chosen here too where the layer's ``CpuOptions`` leaves them
None: the logical CPUs, torch's count, 3/4 and 1/2 of it, times each of ``cpu_path.CPU_GEMMS``, each timed at k experts
x 1 token (a decode step's shape: the weights' bytes, not FLOPs, set the time, and fewer threads may
stream them as fast with less contention); the fastest pair is kept in ``MissCosts.cpu_threads`` /
``cpu_gemm``. ``cpu_margin`` is ``cost.margin_of`` those timings; ``hysteresis`` is ``HYSTERESIS``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Iterator

import torch

from moekit.offload.cpu_path import CPU_GEMMS
from moekit.offload.cost import (
    MissCosts, fit_cpu_branch, link_busy, margin_of, measure_link_bandwidth, measure_read_bandwidth,
)

HYSTERESIS = 0.05  # measured costs' ``MissCosts.hysteresis``: "auto" takes a CPU split only for a 5% predicted gain


def measure_costs(layer, tokens: int = 16, repeats: int = 3) -> MissCosts:
    """``layer``'s (an ``OffloadedMoE``) miss costs (module docstring)."""
    if tokens < 2 or repeats < 1:
        raise ValueError(f"need tokens >= 2 and repeats >= 1, got tokens={tokens}, repeats={repeats}")
    c = layer.config
    k = max(c.top_k, 2)
    groups = _cold_groups(c.num_experts, k)
    gemms = [layer.cpu_options.gemm] if layer.cpu_options.gemm else list(CPU_GEMMS)
    for gemm in gemms:
        branch(layer, next(groups), 1, 1, None, gemm)  # the first call pays one-off setup

    def timings(experts: int, m: int, setting: tuple[int, str]) -> list[float]:
        return [branch(layer, next(groups), experts, m, *setting) for _ in range(repeats)]

    candidates = [(t, g) for t in thread_candidates(layer.cpu_options.threads) for g in gemms]
    spread = {s: timings(k, 1, s) for s in candidates}
    best = min(candidates, key=lambda s: statistics.median(spread[s]))
    one, many = timings(1, 1, best), timings(k, tokens, best)
    step, per_expert, per_token = fit_cpu_branch(*(statistics.median(t) for t in (one, spread[best], many)),
                                                 experts=k, tokens=tokens)
    dev = layer.cache.device
    during = [link_during_cpu(layer, next(groups), *best) for _ in range(repeats)]
    return MissCosts(measure_link_bandwidth(dev), per_expert, per_token, cpu_step_s=step,
                     gpu_bytes_per_s=measure_read_bandwidth(dev), cpu_margin=margin_of([one, spread[best], many]),
                     cpu_threads=best[0], cpu_gemm=best[1],
                     link_cpu_bytes_per_s=statistics.median(during) if None not in during else None,
                     hysteresis=HYSTERESIS)


def recalibrate_cpu(layer, costs: MissCosts, start: int = 0, tokens: int = 8, repeats: int = 3) -> MissCosts:
    """``costs`` with the CPU rates (``cpu_step_s``, ``cpu_expert_s``, ``cpu_token_s``) fitted again on
    ``layer``'s CPU branch now, at the thread count and GEMM ``costs`` chose: the median of ``repeats``
    timings each of 1 expert x 1 token, k x 1 and k x ``tokens`` (k = max(top_k, 2); cold experts, the
    groups starting at group ``start``; link busy), as ``measure_costs`` fits them. A benchmark calls it
    before each group of rows: the host's rate drifts over a run (the cpu mode's branches ran 0.85-1.53x
    the first calibration's model across the groups of one H200 run, NVIDIA_H200-offload-2026-12-01-4),
    and the floor and "auto" should price the CPU as it runs for those rows. The link, GPU and margin stay as measured."""
    if tokens < 2 or repeats < 1:
        raise ValueError(f"need tokens >= 2 and repeats >= 1, got tokens={tokens}, repeats={repeats}")
    k = max(layer.config.top_k, 2)
    groups = _cold_groups(layer.config.num_experts, k, start)
    setting = (costs.cpu_threads, costs.cpu_gemm or CPU_GEMMS[0])
    branch(layer, next(groups), 1, 1, *setting)  # brings the threads up after whatever ran before

    def median(experts: int, m: int) -> float:
        return statistics.median(branch(layer, next(groups), experts, m, *setting) for _ in range(repeats))

    step, per_expert, per_token = fit_cpu_branch(median(1, 1), median(k, 1), median(k, tokens), experts=k, tokens=tokens)
    return dataclasses.replace(costs, cpu_step_s=step, cpu_expert_s=per_expert, cpu_token_s=per_token)


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
    stream, start, end = torch.cuda.Stream(dev), torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    """The thread counts to try: ``fixed`` alone, else ``most_threads()``, torch's count, 3/4 and 1/2 of
    it (distinct, largest first)."""
    if fixed is not None:
        return [fixed]
    n = torch.get_num_threads()
    return sorted({most_threads(), n, max(1, 3 * n // 4), max(1, n // 2)}, reverse=True)


def most_threads() -> int:
    """The CPUs this process may run on (torch may default to the physical cores), at most twice torch's
    count (a container's affinity can list far more CPUs than its share)."""
    n = torch.get_num_threads()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(max(n, usable), 2 * n)


def branch(layer, group: list[int], experts: int, m: int, threads: int | None, gemm: str) -> float:
    """Host seconds of ``layer``'s CPU branch (``CpuPhases.total_s``) for ``m`` tokens each routed to
    every expert of ``group`` (distinct experts), of which the first ``experts`` run on the CPU (``gemm``); link busy."""
    c, dev = layer.config, layer.cache.device
    dtype = layer.cache.host(layer.layer_id).w13_template.dtype
    k = len(group)
    x = torch.randn(m, c.hidden_size, dtype=dtype, device=dev)
    ids = torch.tensor([group] * m, dtype=torch.int32, device=dev)
    weights = torch.full((m, k), 1.0 / k, dtype=torch.float32, device=dev)
    on_cpu = sorted(set(group[:experts]))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    with link_busy(dev):
        staged = layer._cpu.stage([x, ids, weights])
        layer._cpu.finish(staged, lambda inputs: layer._cpu_experts(inputs, on_cpu, gemm), dev, len(on_cpu),
                          m * len(on_cpu), threads)
    return layer._cpu.last.total_s


def _cold_groups(num_experts: int, k: int, start: int = 0) -> Iterator[list[int]]:
    """Groups of k distinct experts from group ``start`` on, disjoint until the experts run out (then
    starting over)."""
    g = start
    while True:
        yield [(g * k + j) % num_experts for j in range(k)]
        g += 1

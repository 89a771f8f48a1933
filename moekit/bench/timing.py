"""The one timing helper.

``time_calls(fns)`` runs a list of zero-argument calls (the same op on rotated inputs, so that
repeated calls stream their weights from HBM, not L2) and returns the median microseconds per call:
- CUDA, ``graph=True``: the calls captured once in a CUDA graph, the graph replayed; launch gaps shrink
  to what a serving engine sees (it replays graphs at decode batch sizes);
- CUDA, ``graph=False``: CUDA events around a plain loop over the calls;
- CPU: the wall clock around the loop.
Every method warms up first (compilation and autotuning stay out of the numbers).

``wall_time(fn, device)`` times one long call (a whole ``generate``, a model's prefill) by the wall
clock between two device synchronisations; the caller repeats, interleaves and takes the median.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def time_calls(fns: list[Callable[[], object]], device: torch.device, *, graph: bool = False,
               budget_s: float = 0.3, min_reps: int = 3, max_reps: int = 50) -> float:
    """Median µs per call over repeated passes through ``fns`` (about ``budget_s`` seconds in total)."""
    if device.type != "cuda":
        return _time_cpu(fns, budget_s, min_reps, max_reps)
    return _time_cuda(fns, graph, budget_s, min_reps, max_reps)


def _run_all(fns):
    for fn in fns:
        fn()


def _time_cpu(fns, budget_s, min_reps, max_reps) -> float:
    _run_all(fns)  # warm-up
    t0 = time.perf_counter()
    _run_all(fns)
    once = time.perf_counter() - t0
    times = [once]
    for _ in range(max(min_reps, min(max_reps, int(budget_s / max(once, 1e-9)))) - 1):
        t0 = time.perf_counter()
        _run_all(fns)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(fns) * 1e6


def _time_cuda(fns, graph, budget_s, min_reps, max_reps) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture requires
        _run_all(fns)
        _run_all(fns)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    run = lambda: _run_all(fns)  # noqa: E731
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            _run_all(fns)
        run = g.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end) / 1e3
    times = []
    for _ in range(max(min_reps, min(max_reps, int(budget_s / max(once, 1e-9))))):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # ms -> µs
    return statistics.median(times) / len(fns)


def wall_time(fn: Callable[[], object], device: torch.device) -> tuple[object, float]:
    """(fn's result, seconds it took), the device synchronised before and after."""
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

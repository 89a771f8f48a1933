"""Where the host time of one eager experts call goes (``host_big_device_check.py``'s probes): which path
served each call, how many synchronisations it made, and per-call host µs by function.

    PathCounts   counts, per call, of the entry points a call can take (installed once, module attributes
                 wrapped): the bf16 fast path's launch, the quantized fast path's, the Gluon fast paths, the
                 full path (``triton._unchecked``), the weight-only plain call (``run_experts_wo``), the
                 quantized path recording its entry (``remember_quant``) and keeping it (``_keep``)
    sync_count   synchronising CUDA calls the calls made (torch's sync debug mode, as warnings)
    python_top   cProfile over back-to-back calls: the functions with the most own time, µs a call
    runtime_top  torch.profiler (CPU + CUDA) over back-to-back calls: self CPU µs a call by event (aten ops,
                 CUDA runtime and driver calls) and the kernels one call launched
    launch_states  the kept weight-only plans' launches: compiled launcher kept, C launch
"""

from __future__ import annotations

import cProfile
import importlib
import pstats
import warnings
from collections import Counter

import torch

# (module, attribute, count name, counted only when the call returns something other than None)
WATCHED = (
    ("moekit.experts.triton_fast", "launch_lean", "fast_bf16", False),
    ("moekit.experts.triton_quant_fast", "_launch", "fast_quant", False),
    ("moekit.experts.triton_gluon_lean", "run_fast_gluon", "fast_gluon", True),
    ("moekit.experts.triton_gluon_fp8", "run_fast_fp8", "fast_gluon_fp8", True),
    ("moekit.experts.triton", "_unchecked", "full_path", False),
    ("moekit.experts.triton_wo", "run_experts_wo", "wo_plain", False),
    ("moekit.experts.triton_quant_fast", "remember_quant", "remember_quant", False),
    ("moekit.experts.triton_quant_fast", "_keep", "kept_quant", False),
    ("moekit.experts.triton", "remember", "remember_bf16", False),  # triton.py's own name for it
)


class PathCounts:
    """Counts of the WATCHED entry points since ``install`` (``delta`` between two ``snapshot``s)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def install(self) -> "PathCounts":
        for module_name, attr, name, non_none in WATCHED:
            module = importlib.import_module(module_name)
            setattr(module, attr, self._wrap(getattr(module, attr), name, non_none))
        return self

    def _wrap(self, real, name: str, non_none: bool):
        counts = self.counts

        def counted(*args, **kwargs):
            out = real(*args, **kwargs)
            if not non_none or out is not None:
                counts[name] += 1
            return out

        counted.__wrapped__ = real
        return counted

    def snapshot(self) -> Counter:
        return Counter(self.counts)

    def delta(self, before: Counter, calls: int) -> dict:
        """Counts a call since ``before`` (only the non-zero ones)."""
        return {k: round((self.counts[k] - before[k]) / calls, 2) for k in self.counts if self.counts[k] != before[k]}


def sync_count(calls: list, repeats: int = 2) -> int:
    """Synchronising CUDA calls made by ``repeats`` passes over ``calls`` (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(repeats):
                for c in calls:
                    c()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in seen)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _loop(calls: list, n: int) -> list:
    return [calls[i % len(calls)] for i in range(n)]


def python_top(calls: list, n: int = 32, top: int = 10) -> list[dict]:
    """cProfile over ``n`` back-to-back calls (one sync after): own time µs a call per function, most first.
    cProfile's own overhead inflates every number (~2x); the ranking is what to read."""
    sequence = _loop(calls, n)
    _sync()
    profile = cProfile.Profile()
    profile.enable()
    for c in sequence:
        c()
    profile.disable()
    _sync()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [dict(fn=f"{name} ({file.rsplit('/', 1)[-1]}:{line})", own_us=round(tt / n * 1e6, 2),
                 calls=round(nc / n, 2), cum_us=round(ct / n * 1e6, 2))
            for (file, line, name), (cc, nc, tt, ct, _) in rows]


def runtime_top(calls: list, n: int = 16, top: int = 8) -> dict:
    """torch.profiler over ``n`` back-to-back calls: self CPU µs a call by event name, most first, and
    the kernels a call launched (names shortened, with their count a call)."""
    sequence = _loop(calls, n)
    _sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for c in sequence:
            c()
        _sync()
    events = prof.key_averages()
    cpu = sorted((e for e in events if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)[:top]
    kernels = Counter()
    gpu_us = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name.split("(")[0][:48]] += 1
            gpu_us += e.device_time
    return dict(cpu=[dict(name=e.key[:48], self_us=round(e.self_cpu_time_total / n, 2), count=round(e.count / n, 2))
                     for e in cpu],
                kernels={k: round(v / n, 2) for k, v in kernels.items()}, gpu_us=round(gpu_us / n, 1))


def kernel_times(run, n: int = 1) -> list[tuple[str, float]]:
    """(kernel, GPU µs) of everything ``run()`` executes on the GPU (a graph replay's kernels too), in order,
    averaged over ``n`` runs."""
    _sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(n):
            run()
        _sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    per = len(kernels) // max(n, 1)
    return [(e.name.split("(")[0][:60], round(sum(k.device_time for k in kernels[i::per]) / n, 1))
            for i, e in enumerate(kernels[:per])]


def launch_states() -> list[dict]:
    """Each kept weight-only plan's launches: kernel, whether it keeps a compiled launcher (``cached``), holds
    one, goes through the C launch (``raw``): a launch that never keeps one makes every lean recording fail."""
    from moekit.experts.triton_wo_plan import _WO_PLANS

    rows = []
    for plan in list(_WO_PLANS.values()):
        for field in ("gate_up", "glu", "down", "down_sum", "sum_slots"):
            launch = getattr(plan, field, None)
            if launch is None:
                continue
            rows.append(dict(decode=plan.decode, launch=field, kernel=launch.kernel.fn.__name__, cached=launch.cached,
                             launcher=launch._launcher is not None, raw=launch._raw is not None,
                             grid=launch.grid))
    return rows

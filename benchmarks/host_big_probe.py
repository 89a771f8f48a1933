"""The GPU kernels one run executes, each with its device µs, read from torch.profiler
(``host_big3_device_check.py``'s per-launch table). Session 22's ``host_big_device_check.py`` probed here too (paths
taken, syncs, cProfile and profiler tables, the kept plans' launches): ``git show
87f368f6:benchmarks/host_big_probe.py``.

    kernel_times(lambda: graph.replay(), n=2)     # [(kernel name, µs)], in the order the GPU ran them
"""

from __future__ import annotations

import torch


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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

"""Where one experts call's GPU time goes: each kernel's mean device µs over a few eager calls (torch.profiler).

Eager calls one after another, synchronised between calls, so each kernel runs alone (no PDL overlap with
the call before): the kernels' own durations, whose sum set against the call's CUDA-graph µs shows the
launch gaps and ramps. Used by ``decode_q3_device_check.py`` for the default and the fastest variant of a cell.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch


@dataclass
class KernelTime:
    name: str  # the kernel's name, shortened to 40 characters
    per_call: float  # launches per call
    us: float  # mean device µs per launch


def kernel_breakdown(call, calls: int = 10) -> list[KernelTime]:
    """The kernels of ``call`` in first-launch order, each with its launches per call and mean device µs."""
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    durations = defaultdict(list)
    for e in events:
        durations[e.name[:40]].append(e.time_range.elapsed_us())
    return [KernelTime(name, len(d) / calls, sum(d) / len(d)) for name, d in durations.items()]


def describe(times: list[KernelTime]) -> str:
    """"name x per_call: µs, ..., sum S µs" on one line."""
    total = sum(t.per_call * t.us for t in times)
    parts = [f"{t.name.split('(')[0]}{'' if t.per_call == 1 else f' x{t.per_call:g}'} {t.us:.1f}" for t in times]
    return ", ".join(parts) + f"; sum {total:.1f} us"

"""A step's timeline through offloaded layers: named marks, each a host time and a CUDA event.

    cache.trace = StepTrace(device)      marks are recorded from here on (``ExpertCache.mark``)
    ... a step ...
    marks = cache.trace.read()           [Mark]: host and GPU seconds from the first mark; a new trace
    cache.trace = None                   nothing recorded (the default: one attribute test per mark)

The layers mark where a forward is (``OffloadedMoE.run_routed``): "start", "counted" (the touched set's
copy queued), "touched" (it is on the host), "call_start:<group>" / "call_end:<group>" around each
experts call ("hits", "fetched", "round"), "cpu_start" / "cpu_end" around the CPU branch, "end"; the
cache marks "copy_start:<kind>" / "copy_end:<kind>" on its copy stream around each batch of copies
("fetch", "prefetch", "admit"). A mark's GPU time is when its stream reached it (the compute stream's
unless it is a copy mark): a call's start and end on the GPU bracket its kernels, a copy's its bytes.
Recording costs the host a few microseconds a mark, so a traced step runs a little slower than an
untraced one (``f6f35e93:benchmarks/offload_fetch_device_check.py`` times both). On the CPU the GPU times are None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Mark:
    """One point of a step: what, which layer (its cache id), and when on the host and on the GPU."""

    name: str
    layer: int
    host_s: float  # seconds from the trace's first mark, host clock (when the host got here)
    gpu_s: float | None  # seconds from the first mark's event, GPU clock (None on the CPU)


class StepTrace:
    """Marks in recording order; ``read`` turns them into ``Mark``s (syncing the device once)."""

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._raw: list[tuple[str, int, float, object | None]] = []

    def mark(self, name: str, layer: int, stream=None) -> None:
        """Record ``name`` for ``layer`` now: the host clock, and an event on ``stream`` (default: the
        current stream) on CUDA."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream if stream is not None else torch.cuda.current_stream())
        self._raw.append((name, layer, time.perf_counter(), event))

    def read(self) -> list[Mark]:
        """The marks so far (syncing the device), and a fresh start: later marks begin a new step."""
        raw, self._raw = self._raw, []
        if not raw:
            return []
        if self.cuda:
            torch.cuda.synchronize()
        host0, first = raw[0][2], raw[0][3]
        return [Mark(name, layer, host - host0, None if event is None else first.elapsed_time(event) / 1e3)
                for name, layer, host, event in raw]


def spans(marks: list[Mark], start: str, end: str, gpu: bool = True) -> list[float]:
    """Seconds from each ``start`` mark to the next ``end`` mark of the same layer (GPU clock, or the
    host's with ``gpu=False``), in order; a start without a later end is left out."""
    out, open_at = [], {}
    for m in marks:
        t = m.gpu_s if gpu else m.host_s
        if t is None:
            continue
        if m.name == start:
            open_at[m.layer] = t
        elif m.name == end and m.layer in open_at:
            out.append(t - open_at.pop(m.layer))
    return out

"""The CPU branch of a forward whose misses run on the CPU, in timed phases.

    stage:   [x, ids, weights] -> a device->host copy each into kept pinned views (queued before the GPU work)
    wait:    the host waits for that copy (an event: only the work queued before it, not the GPU's)
    compute: the CPU experts (``threads`` torch threads), one after another, from their host weights
    back:    the [M, K] result into a pinned buffer (at the same thread count), one host->device copy
             queued (not waited for), torch's thread count restored

Why the result's copy runs inside the thread setting: one H200 run with the branch at 8 of torch's 16
threads spent 1.3-8 ms a branch in "back" at M = 32 (5-34 ms a step; at M = 8, 0.2; 0.05-0.2 in a run whose
branch ran at torch's own count): a [32, K] bf16 copy is torch's first parallel op after the count is
restored (one at [8, K] is below its grain: serial), and it paid for the thread team changing size.

``CpuPhases`` holds the host seconds of each phase of the latest forward (``OffloadedMoE.last_cpu``),
so a benchmark sets what the branch really costs against what ``cost.MissCosts`` predicts for it; the
final sum of the partial outputs runs on the device after both sides (``layer._sum``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from moekit.offload import staging

# the misses' CPU experts: grouped_mm's strategies (``layer._cpu_experts_fn``), then ``cpu_direct`` (float weights only)
CPU_GEMMS = ("onednn_fused", "mm_loop", "direct")


@dataclass(frozen=True)
class CpuOptions:
    """How the CPU branch runs. The defaults are the tuned path; ``CpuOptions.baseline()`` the simple one it is
    measured against."""

    threads: int | None = None  # torch intra-op threads for the CPU experts; None: MissCosts.cpu_threads, else torch's
    gemm: str | None = None  # the misses' CPU GEMM (CPU_GEMMS); None: MissCosts.cpu_gemm, else ``unmeasured_gemm``
    reuse_staging: bool = True  # keep the pinned staging buffers (False: one pinned allocation per copy)
    admit_early: bool = True  # queue the forward's admissions before the CPU compute, so they overlap it

    def __post_init__(self) -> None:
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"CpuOptions.threads must be an int >= 1 or None, got {self.threads!r}")
        if self.gemm is not None and self.gemm not in CPU_GEMMS:
            raise ValueError(f"CpuOptions.gemm must be one of {CPU_GEMMS}, got {self.gemm!r}")

    @classmethod
    def baseline(cls) -> "CpuOptions":
        """The simple path: buffers allocated per forward, admissions queued after the CPU compute, the
        oneDNN loop at torch's thread count (now)."""
        return cls(threads=torch.get_num_threads(), gemm="onednn_fused", reuse_staging=False, admit_early=False)


@dataclass(frozen=True)
class CpuPhases:
    """Host seconds of one forward's CPU branch (module docstring), and what it computed."""

    stage_s: float
    wait_s: float
    compute_s: float
    back_s: float
    experts: int
    tokens: int  # routed assignments computed
    threads: int  # torch threads during the compute

    @property
    def total_s(self) -> float:
        return self.stage_s + self.wait_s + self.compute_s + self.back_s


@dataclass
class Staged:
    """A forward's inputs on their way to the host."""

    inputs: list[torch.Tensor]  # views over a host buffer: valid once ``event`` is done
    event: object | None
    stage_s: float


class CpuPath:
    """One layer's CPU branch: its options, staging buffers and the latest forward's phases."""

    def __init__(self, options: CpuOptions, device: torch.device) -> None:
        self.options = options
        self.pin = device.type == "cuda"
        self.buffers = staging.Buffers(pin=self.pin) if options.reuse_staging else None
        self.last: CpuPhases | None = None

    def setting(self, costs, quantized: bool = False) -> tuple[int | None, str]:
        """(threads, gemm) of a forward: the options', else those ``costs`` (a MissCosts or None) were
        measured at, else torch's thread count and ``unmeasured_gemm(quantized)``."""
        threads = self.options.threads or (costs.cpu_threads if costs is not None else None)
        gemm = self.options.gemm or (costs.cpu_gemm if costs is not None else None) or unmeasured_gemm(quantized)
        return threads, gemm

    def stage(self, tensors: list[torch.Tensor]) -> Staged:
        start = time.perf_counter()
        inputs, event = staging.to_host(tensors, pin=self.pin, buffers=self.buffers)
        return Staged(inputs, event, time.perf_counter() - start)

    def finish(self, staged: Staged, compute: Callable[[list[torch.Tensor]], torch.Tensor], device: torch.device,
               experts: int, tokens: int, threads: int | None) -> torch.Tensor:
        """Wait for ``staged``, run ``compute`` on its inputs at ``threads`` (None: as set), queue the
        result's copy to ``device``; returns it there. Records ``last``."""
        clock = [time.perf_counter()]
        if staged.event is not None:
            staged.event.synchronize()
        clock.append(time.perf_counter())
        with torch_threads(threads) as used:  # the result's host copy too: after the count is restored, the
            y = compute(staged.inputs)  # first parallel op (a [32, K] copy) took ms on one H200 host
            clock.append(time.perf_counter())
            out = staging.to_device(y, device, pin=self.pin, buffers=self.buffers)
        clock.append(time.perf_counter())  # back: the copy queued and the thread count restored
        self.last = CpuPhases(staged.stage_s, clock[1] - clock[0], clock[2] - clock[1], clock[3] - clock[2],
                              experts, tokens, used)
        return out


def unmeasured_gemm(quantized: bool) -> str:
    """The misses' CPU GEMM where neither the options nor measured costs name one: "direct" (``cpu_direct``;
    one H200 process, 1 row an expert, 1 / 4 / 8 cold experts: 0.84 / 1.82 / 3.76 ms against onednn_fused's
    1.51 / 2.64 / 4.41, README session 20), grouped_mm's "onednn_fused" for quantized host weights, which
    "direct" does not read."""
    return CPU_GEMMS[0] if quantized else "direct"


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Within: torch's intra-op thread count is ``threads`` (None: unchanged); yields the count in use."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield before
        return
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)

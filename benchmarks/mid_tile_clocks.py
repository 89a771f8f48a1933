"""SM clock and board power while a kernel sequence runs, for ``mid_tile_device_check.py``: whether a
near-ridge cell (weights streamed at close to the copy rate while the tensor cores are busy) runs at the
clock of the compute-only matmul its floor assumes, or is power-limited below it.

The work is enqueued first (about ``seconds`` of it), then the clock and power are read a few times
while the GPU runs it: ``torch.cuda.clock_rate`` / ``power_draw`` (pynvml), else ``nvidia-smi``; None
where neither answers (the device check goes on without them).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable


@dataclass
class ClockSample:
    sm_mhz: float | None  # median of the samples
    power_w: float | None
    source: str  # "pynvml", "nvidia-smi" or why none


def _read_torch() -> tuple[float, float]:
    import torch

    return float(torch.cuda.clock_rate()), float(torch.cuda.power_draw()) / 1000.0  # MHz, mW -> W


def _read_smi() -> tuple[float, float]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                          "--id=0"], capture_output=True, text=True, timeout=5, check=True).stdout
    mhz, watts = out.strip().splitlines()[0].split(",")
    return float(mhz), float(watts)


def _reader() -> tuple[Callable[[], tuple[float, float]] | None, str]:
    for read, name in ((_read_torch, "pynvml"), (_read_smi, "nvidia-smi")):
        try:
            read()
            return read, name
        except Exception as e:  # no pynvml, no nvidia-smi: try the next
            why = f"{name}: {type(e).__name__}"
    return None, f"none ({why})"


def sample_while(step: Callable[[], object], step_s: float, seconds: float = 0.3, samples: int = 4) -> ClockSample:
    """Enqueue ``step`` (about ``step_s`` of GPU time each) for ``seconds``, read the clock ``samples`` times
    while it runs (from a quarter of the way in), then wait for it."""
    import torch

    read, source = _reader()
    if read is None:
        return ClockSample(None, None, source)
    for _ in range(max(1, int(seconds / max(step_s, 1e-6)))):
        step()
    time.sleep(seconds / 4)
    got = []
    for _ in range(samples):
        got.append(read())
        time.sleep(seconds / (2 * samples))
    torch.cuda.synchronize()
    return ClockSample(statistics.median(m for m, _ in got), statistics.median(w for _, w in got), source)


def matmul_clocks(seconds: float = 0.3) -> ClockSample:
    """The clock of the compute-only 8192^3 bf16 matmul (``moekit.bench.ceilings``' mm rate)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ b
    torch.cuda.synchronize()
    return sample_while(lambda: a @ b, 1.4e-3, seconds)


def graph_clocks(fn: Callable[[], object], us: float, seconds: float = 0.3) -> ClockSample:
    """The clock while a CUDA graph of ``fn`` (about ``us`` µs) replays back to back."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return sample_while(g.replay, us * 1e-6, seconds)

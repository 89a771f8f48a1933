"""The one timing helper.

``time_stats(fns)`` runs a list of zero-argument calls (the same op on rotated inputs, so that
repeated calls stream their weights from HBM, not L2) in repeated passes, at least ``MIN_REPEATS``,
and returns a ``Timing``: the median microseconds per call and the spread of the passes:
- CUDA, ``graph=True``: the calls captured once in a CUDA graph, the graph replayed; launch gaps shrink
  to what a serving engine sees (it replays graphs at decode batch sizes);
- CUDA, ``graph=False``: CUDA events around a plain loop over the calls;
- CPU: the wall clock around the loop.
Every method warms up first (compilation and autotuning stay out of the numbers). ``time_calls`` is
the median alone, for callers that need no spread.

``time_eager(fns)`` is what a plain eager caller sees: back-to-back calls, one synchronisation at the
end, no graph, nothing between the calls; it also reports the host's issue time per call.

``time_paired(fns)`` takes both in one run, the eager loops spread between the passes, so both numbers see
the same GPU clock: timed one after the other, a GPU-bound cell's later loops ran throttled (Mixtral
M = 4096 on the H200: 1980 MHz in the first timing, about 1430 MHz in the second).

``host_from_idle(fn, device)`` is the host's issue time alone: each sample starts ``calls`` calls on an idle device
(synchronised first, so no call waits on a full launch queue) and divides the wall clock over their issue by
``calls``; the device check scripts take the median (and min) of the samples.

``wall_time(fn, device)`` times one long call (a whole ``generate``, a model's prefill) by the wall
clock between two device synchronisations; the caller repeats, interleaves and takes the median.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

MIN_REPEATS = 5  # a loaded CPU gives 10-100x outlier passes; the median of 5 passes ignores up to 2
# A cell whose passes spread more than this (interquartile range over the median) is flagged noisy:
# its median is not good to +-10%. Measured on a shared 2-core CPU at load 11, one torch thread: the
# bench's cells spread 2-59%, a third of them above 20%; with two threads competing for the cores,
# 11% to 2500%.
NOISY_SPREAD_PCT = 20.0
# Calls per eager loop: few enough that their launches (about 5-20 per call) stay well inside the
# CUDA launch queue (~1000 entries), so the host never blocks on a full queue and ``host_us`` stays
# the issue cost even when the GPU is the slower side.
EAGER_CALLS = 16


@dataclass(frozen=True)
class Timing:
    """Repeated passes over the calls, per call."""

    us: float  # median µs per call over the passes
    min_us: float  # fastest pass, µs per call
    max_us: float  # slowest pass, µs per call
    spread_pct: float  # interquartile range of the passes / median * 100; >= 0
    repeats: int  # passes timed, >= MIN_REPEATS unless a caller fixed fewer

    @property
    def noisy(self) -> bool:
        """The passes disagree by more than NOISY_SPREAD_PCT: treat the median with care."""
        return self.spread_pct > NOISY_SPREAD_PCT

    @classmethod
    def from_samples(cls, per_call_us: list[float]) -> "Timing":
        median = statistics.median(per_call_us)
        if len(per_call_us) >= 2:
            q1, _, q3 = statistics.quantiles(per_call_us, n=4, method="inclusive")
        else:
            q1 = q3 = median
        return cls(median, min(per_call_us), max(per_call_us), 100 * (q3 - q1) / median if median > 0 else 0.0,
                   len(per_call_us))


@dataclass(frozen=True)
class EagerTiming:
    """Back-to-back eager calls, one synchronisation at the end (medians over MIN_REPEATS loops)."""

    eager_us: float  # wall time of the loop, final sync included, per call
    host_us: float  # wall time to issue the loop (before the final sync), per call: the host cost
    spread_pct: float  # interquartile range of the loops' eager times / eager_us * 100; >= 0
    # host_us over the calls after each loop's first: the steady issue cost. The first call of a loop follows a
    # sync; after a long GPU wait it measured 4-7x the later ones on the H200 (every step of it, pure-CPU ones
    # too: benchmarks/host_mid_device_check.py), which host_us averages in.
    host_rest_us: float = 0.0

    @property
    def noisy(self) -> bool:
        """The loops disagree by more than NOISY_SPREAD_PCT: treat ``eager_us`` with care."""
        return self.spread_pct > NOISY_SPREAD_PCT


def time_stats(fns: list[Callable[[], object]], device: torch.device, *, graph: bool = False,
               budget_s: float = 0.3, min_reps: int = MIN_REPEATS, max_reps: int = 50) -> Timing:
    """Median and spread of µs per call over repeated passes through ``fns`` (about ``budget_s`` in all)."""
    if device.type != "cuda":
        return Timing.from_samples(_time_cpu(fns, budget_s, min_reps, max_reps))
    return Timing.from_samples(_time_cuda(fns, graph, budget_s, min_reps, max_reps))


def time_calls(fns: list[Callable[[], object]], device: torch.device, *, graph: bool = False,
               budget_s: float = 0.3, min_reps: int = MIN_REPEATS, max_reps: int = 50) -> float:
    """Median µs per call (``time_stats`` without the spread)."""
    return time_stats(fns, device, graph=graph, budget_s=budget_s, min_reps=min_reps, max_reps=max_reps).us


def time_eager(fns: list[Callable[[], object]], device: torch.device, *, calls: int = EAGER_CALLS,
               repeats: int = MIN_REPEATS) -> EagerTiming:
    """µs per call of ``calls`` back-to-back calls cycling through ``fns``, and the host's share.

    The host time stops before the final synchronisation, so on the GPU it is the cost of issuing the
    calls (Python, argument checks, launches) whichever side is slower; a backend that synchronises
    inside a call (``reference``) makes the host wait, and its host time includes that wait. On the
    CPU the host does the work, so the two are equal up to noise."""
    loop = _EagerLoop(fns, device, calls)
    _run_all(fns)  # warm-up
    for _ in range(repeats):
        loop.run()
    return loop.timing()


@dataclass(frozen=True)
class PairedTiming:
    """A cell's timed passes and its eager loops, taken in alternation in one run."""

    timing: Timing  # as ``time_stats`` gives it
    eager: EagerTiming  # as ``time_eager`` gives it


def time_paired(fns: list[Callable[[], object]], device: torch.device, *, graph: bool = False,
                budget_s: float = 0.3, min_reps: int = MIN_REPEATS, max_reps: int = 50, calls: int = EAGER_CALLS,
                eager_repeats: int = MIN_REPEATS) -> PairedTiming:
    """``time_stats`` and ``time_eager`` in one run: each eager loop follows a pass, spread evenly over the
    passes (at least ``eager_repeats`` passes), so a clock that drifts over the run moves both alike."""
    one_pass = _cuda_pass(fns, graph) if device.type == "cuda" else _cpu_pass(fns)
    loop = _EagerLoop(fns, device, calls)
    passes = max(eager_repeats, _repeats(one_pass(), budget_s, min_reps, max_reps))
    loops_after = {(j + 1) * passes // eager_repeats - 1 for j in range(eager_repeats)}
    times = []
    for i in range(passes):
        times.append(one_pass())
        if i in loops_after:
            loop.run()
    return PairedTiming(Timing.from_samples([t / len(fns) * 1e6 for t in times]), loop.timing())


class _EagerLoop:
    """Timed loops of back-to-back calls, one synchronisation at the end of each."""

    def __init__(self, fns, device: torch.device, calls: int):
        sequence = [fns[i % len(fns)] for i in range(max(calls, len(fns)))]
        self.first, self.rest, self.device = sequence[0], sequence[1:], device
        self.eager, self.host, self.host_rest = [], [], []  # µs per call, one entry per loop

    def run(self) -> None:
        _sync(self.device)
        t0 = time.perf_counter()
        self.first()
        t_first = time.perf_counter()
        _run_all(self.rest)
        t_issued = time.perf_counter()
        _sync(self.device)
        t_done = time.perf_counter()
        n = 1 + len(self.rest)
        self.host.append((t_issued - t0) / n * 1e6)
        self.host_rest.append((t_issued - t_first) / max(len(self.rest), 1) * 1e6)
        self.eager.append((t_done - t0) / n * 1e6)

    def timing(self) -> EagerTiming:
        loops = Timing.from_samples(self.eager)
        return EagerTiming(loops.us, statistics.median(self.host), loops.spread_pct, statistics.median(self.host_rest))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_all(fns):
    for fn in fns:
        fn()


def _repeats(once_s: float, budget_s: float, min_reps: int, max_reps: int) -> int:
    return max(min_reps, min(max_reps, int(budget_s / max(once_s, 1e-9))))


def _time_cpu(fns, budget_s, min_reps, max_reps) -> list[float]:
    """µs per call of each pass."""
    return _passes(_cpu_pass(fns), len(fns), budget_s, min_reps, max_reps)


def _time_cuda(fns, graph, budget_s, min_reps, max_reps) -> list[float]:
    """µs per call of each pass (CUDA events around the loop or the graph replay)."""
    return _passes(_cuda_pass(fns, graph), len(fns), budget_s, min_reps, max_reps)


def _passes(one_pass: Callable[[], float], calls: int, budget_s, min_reps, max_reps) -> list[float]:
    """µs per call of each of the timed passes; the first pass (timed to size the count) is left out."""
    reps = _repeats(one_pass(), budget_s, min_reps, max_reps)
    return [one_pass() / calls * 1e6 for _ in range(reps)]


def _cpu_pass(fns) -> Callable[[], float]:
    """Seconds of one pass by the wall clock, after a warm-up."""
    _run_all(fns)  # warm-up

    def one_pass() -> float:
        t0 = time.perf_counter()
        _run_all(fns)
        return time.perf_counter() - t0

    return one_pass


def _cuda_pass(fns, graph: bool) -> Callable[[], float]:
    """Seconds of one pass by CUDA events around the loop or the graph replay, after a warm-up (and the
    capture, where ``graph``)."""
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

    def one_pass() -> float:
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3  # ms -> s

    return one_pass


def host_from_idle(fn: Callable[[], object], device: torch.device, *, calls: int = 32,
                   samples: int = 5) -> list[float]:
    """Host µs per call of ``fn``, ``samples`` times: each the wall clock over ``calls`` calls issued right after a
    device synchronisation, divided by ``calls`` (the device synchronised again after the last sample)."""
    times = []
    for _ in range(samples):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    _sync(device)
    return times


@dataclass
class WallTime:
    """One long call timed by the wall clock between two device synchronisations."""

    result: object  # what the call returned
    seconds: float  # wall time of the call, the device synchronised before and after


def wall_time(fn: Callable[[], object], device: torch.device) -> WallTime:
    """Time one call of ``fn`` with the device synchronised before and after."""
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return WallTime(result=result, seconds=time.perf_counter() - t0)

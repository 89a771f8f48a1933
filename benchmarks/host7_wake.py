"""The wake part of ``host7_device_check`` (issue 13: the bench's first call after a sync costs several steady
calls): what the host does right after waiting.

A fixed pure-Python workload (``PY_STEPS`` timestamped steps, no CUDA) and then one Qwen3 bf16 M = 64 experts
call (kept, batched), then a second, started right after waiting ``how``: ``gpu20`` (torch.cuda._sleep ~20 ms, then
synchronize), ``gpu1`` (~1 ms), ``poll20`` (the GPU busy ~20 ms, the stream polled from Python), ``spinbusy20`` (the
GPU busy ~20 ms, a Python spin of 25 ms, then a sync), ``sleep20`` (time.sleep 20 ms, GPU idle), ``spin20`` (a
Python spin of 20 ms, GPU idle), ``graphpass`` / ``eagerpass`` (the bench's pass before an eager loop: 4 calls
replayed as a graph / eagerly, timed by events), ``hot`` (right after the same workload). Medians of ``WAKE_REPS``:
the workload's µs, its largest single step (a gap: the thread preempted; an even slowdown: a cold or slow core), its
first half, the call's µs, the second's, and in how many repetitions the thread changed cpu over the wait.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from host_big3_device_check import QWEN3, _weights
from moekit.bench.cells import Shape, make_sets
from moekit.bench.timing import _cuda_pass
from moekit.experts import get_backend

PY_STEPS, WAKE_REPS = 400, 7


def _py_work(stamps: list) -> None:
    """A fixed pure-Python workload in PY_STEPS steps, each timestamped."""
    d = {i: i for i in range(64)}
    for i in range(PY_STEPS):
        s = 0
        for j in range(16):
            s += d[(i + j) & 63]
        stamps.append(time.perf_counter())


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wait(how: str, passes: dict) -> None:
    """poll20: the GPU busy, the host polling the stream in Python (it never sleeps); spinbusy20: the GPU busy, the
    host spinning in Python (no CUDA call) past it, then a sync; passes: the bench's pass before an eager loop."""
    if how in passes:
        passes[how]()
    elif how in ("gpu1", "gpu20", "poll20", "spinbusy20"):
        torch.cuda._sleep(2_000_000 * (1 if how == "gpu1" else 20))  # ~1 ms a 2e6 cycles at 1.98 GHz
        if how == "poll20":
            stream = torch.cuda.current_stream()
            while not stream.query():
                pass
        _spin(0.025 if how == "spinbusy20" else 0.0)
    torch.cuda.synchronize()
    time.sleep(0.02) if how == "sleep20" else _spin(0.02 if how == "spin20" else 0.0)


def _cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat; Python's os has no sched_getcpu)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def part_wake(results: dict, save) -> None:
    fn, out = get_backend("triton"), results.setdefault("wake", {})
    shape = Shape.from_preset(QWEN3)
    w13, w2 = _weights(shape, "bfloat16")
    s = make_sets(shape, 64, 1, torch.bfloat16, torch.device("cuda"))[0]
    call = lambda: fn(s.x, w13, w2, s.topk_ids, s.topk_weights)  # noqa: E731
    passes = dict(graphpass=_cuda_pass([call] * 4, True), eagerpass=_cuda_pass([call] * 4, False))
    for _ in range(4):
        call()
    for how in ("hot", "gpu1", "gpu20", "poll20", "spinbusy20", "sleep20", "spin20", "graphpass", "eagerpass"):
        rows = []
        for _ in range(WAKE_REPS):
            _wait(how, passes)
            if how == "hot":
                _py_work([])
            cpu0 = _cpu()
            stamps = [time.perf_counter()]
            _py_work(stamps)
            t = time.perf_counter()
            call()
            t_call = time.perf_counter()
            call()
            t_second = time.perf_counter()
            steps = [b - a for a, b in zip(stamps, stamps[1:])]
            rows.append(dict(py=(stamps[-1] - stamps[0]) * 1e6, py_max_step=max(steps) * 1e6,
                             py_first_half=(stamps[PY_STEPS // 2] - stamps[0]) * 1e6, call=(t_call - t) * 1e6,
                             second=(t_second - t_call) * 1e6, moved=int(_cpu() != cpu0)))
        torch.cuda.synchronize()
        row = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        row["moved"] = sum(r["moved"] for r in rows)
        out[how] = row
        print(f"wake {how}: " + json.dumps(row), flush=True)
        save(results)

"""Where a CPU branch's experts run: on the calling thread ("inline"), on one long-lived worker thread with
its own OpenMP team ("worker"), or split into row chunks that a pool of single-threaded workers take as
they free up ("pool"). One of ``CpuOptions.runner``'s values (``RUNNERS``).

    inline:  the caller's thread runs the experts at ``threads`` torch threads (``cpu_path.torch_threads``
             switches torch's count for the call and back)
    worker:  ``BranchWorker``: a daemon thread whose torch count is set once to ``threads`` and whose CPUs
             are the process's last ``threads`` (``branch_cpus``); the caller waits on an event. Its OpenMP
             team is its own (libgomp keeps a team per master thread), never resized, never the caller's
    pool:    ``ChunkPool``: ``threads`` daemon threads at 1 torch thread each, same CPUs; a job is a list of
             tasks (``cpu_pooled``: one GEMM over a block of an expert's weight rows each) taken in order by
             whichever worker is free; once none is left, a free worker runs a task still running elsewhere
             again (a backup) and the first result is kept, so one worker preempted mid-task delays the job
             by at most one task of another's, not by its preemption

Why: on the H200 host a CPU branch now and then took 6-49x its calibrated time (offload3, session 23: at
12 threads 17 of 373 branches over 2x; at 8, one auto branch at 8.9x after 62.6 ms without a branch), the
whole OpenMP region waiting for its slowest thread. Which of these keeps it calibrated is measured in situ
(``benchmarks/offload_stall_device_check.py``); the result is ``CpuOptions.runner``'s default.
"""

from __future__ import annotations

import os
import threading
from typing import Callable

import torch

RUNNERS = ("inline", "worker", "pool")


def branch_cpus(threads: int) -> list[int]:
    """The last ``threads`` CPUs of the process's affinity (all of them where it has no more): the CPUs a
    worker's team or a pool runs on, away from the first ones, where the caller's thread tends to stay."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[-threads:] if threads < len(cpus) else cpus


class BranchWorker:
    """One daemon thread running submitted calls one at a time (module docstring, "worker")."""

    def __init__(self, threads: int, cpus: list[int] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads, self.cpus = threads, list(cpus) if cpus is not None else branch_cpus(threads)
        self._wake, self._done = threading.Condition(), threading.Event()
        self._job: tuple[Callable, tuple] | None = None
        self._result: object = None
        ready = threading.Event()
        threading.Thread(target=self._loop, args=(ready,), daemon=True, name="moekit-cpu-worker").start()
        ready.wait()

    def _loop(self, ready: threading.Event) -> None:
        os.sched_setaffinity(0, self.cpus)  # this thread only (0: the caller); its team, made later, inherits it
        _own_count(self.threads)
        ready.set()
        while True:
            with self._wake:
                while self._job is None:
                    self._wake.wait()
                fn, args = self._job
                self._job = None
            try:
                self._result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                self._result = _Failed(e)
            self._done.set()

    def run(self, fn: Callable, *args):
        """``fn(*args)`` on the worker; returns its result (raises its exception)."""
        self._done.clear()
        with self._wake:
            self._job = (fn, args)
            self._wake.notify()
        self._done.wait()
        result, self._result = self._result, None
        if isinstance(result, _Failed):
            raise result.error
        return result


def _own_count(threads: int) -> None:
    """The calling thread's torch (OpenMP) thread count set to ``threads``, for good: torch sets a thread's
    count from the process-wide last ``set_num_threads`` at the thread's first parallel op (its lazy init),
    so that init is run first (``get_num_threads``). ``_keep_caller_count`` puts the process-wide value back."""
    torch.get_num_threads()
    torch.set_num_threads(threads)


def _keep_caller_count(make: Callable[[], object]) -> object:
    """``make()`` (starting threads that call ``_own_count``) with the calling thread's count, and torch's
    process-wide one (what new threads start at; MKL's), as they were before."""
    before = torch.get_num_threads()  # also this thread's lazy init, before a worker changes the global
    made = make()
    torch.set_num_threads(before)
    return made


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Job:
    """One ``ChunkPool.map`` call: its tasks, which are taken, which are done, their results."""

    def __init__(self, tasks: list[Callable[[], torch.Tensor]]) -> None:
        self.tasks, self.lock, self.done = tasks, threading.Lock(), threading.Event()
        self.results: list[torch.Tensor | None] = [None] * len(tasks)
        self.next, self.left, self.backed = 0, len(tasks), [False] * len(tasks)
        self.error: BaseException | None = None
        if not tasks:
            self.done.set()

    def claim(self) -> int | None:
        """The next untaken task, else one still running without a backup yet, else None."""
        with self.lock:
            if self.done.is_set():
                return None
            if self.next < len(self.tasks):
                self.next += 1
                return self.next - 1
            for i, r in enumerate(self.results):
                if r is None and not self.backed[i]:
                    self.backed[i] = True
                    return i
            return None

    def finish(self, i: int, result: torch.Tensor | None, error: BaseException | None = None) -> None:
        with self.lock:
            if self.done.is_set() or self.results[i] is not None:
                return  # the other run of a backed-up task came first
            if error is not None:
                self.error = error
                self.done.set()
                return
            self.results[i] = result
            self.left -= 1
            if self.left == 0:
                self.done.set()


class ChunkPool:
    """``threads`` daemon workers at one torch thread each (module docstring, "pool")."""

    def __init__(self, threads: int, cpus: list[int] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads, self.cpus = threads, list(cpus) if cpus is not None else branch_cpus(threads)
        self._wake, self._job, self._generation = threading.Condition(), None, 0
        self._ready = threading.Barrier(threads + 1)
        for i in range(threads):
            threading.Thread(target=self._loop, daemon=True, name=f"moekit-cpu-pool-{i}").start()
        self._ready.wait()

    def _loop(self) -> None:
        os.sched_setaffinity(0, self.cpus)
        _own_count(1)  # the pool's threads are the parallelism
        self._ready.wait()
        seen = 0
        while True:
            with self._wake:
                while self._generation == seen:
                    self._wake.wait()
                seen, job = self._generation, self._job
            while (i := job.claim()) is not None:
                try:
                    job.finish(i, job.tasks[i]())
                except BaseException as e:  # noqa: BLE001 - raised again in map's caller
                    job.finish(i, None, e)

    def map(self, tasks: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Every task's result, in order (each run once, or twice where backed up: tasks must be pure)."""
        job = _Job(tasks)
        with self._wake:
            self._job, self._generation = job, self._generation + 1
            self._wake.notify_all()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return list(job.results)


_SHARED: dict[tuple[str, int], object] = {}
_SHARED_LOCK = threading.Lock()


def shared_runner(kind: str, threads: int) -> BranchWorker | ChunkPool | None:
    """The process's one ``BranchWorker`` ("worker") or ``ChunkPool`` ("pool") of ``threads`` threads, made
    on first use (every layer's branch shares it: they run one at a time); None for "inline"."""
    if kind not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {kind!r}")
    if kind == "inline":
        return None
    with _SHARED_LOCK:
        key = (kind, threads)
        if key not in _SHARED:
            kind_class = BranchWorker if kind == "worker" else ChunkPool
            _SHARED[key] = _keep_caller_count(lambda: kind_class(threads))
        return _SHARED[key]

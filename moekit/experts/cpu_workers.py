"""Whole experts spread over worker threads, each running with one OpenMP thread.

At Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8) a batch of M = 512 tokens gives each expert
~32 rows: GEMMs too small for oneDNN to split well over the cores, so the per-expert loop on 2 threads
ran at ~50-70% of the dense fp32 rate (``moekit bench --cpu-experts``). Here whole experts go to the
workers instead: ``run_dynamic`` hands the experts (``largest_first``) to whichever of ``workers`` threads
is free next, share 0's drain on the calling thread and the others on a small thread pool
(``run_shares``), every one of them with ``torch.set_num_threads(1)`` (a thread-local OpenMP setting;
oneDNN's GEMMs then run single-threaded on that thread). Torch kernels release the GIL, so the workers
run in parallel; handing out experts as workers free up (not a fixed deal) keeps both cores busy when a
neighbour on a shared machine slows one of them.

Determinism: which thread runs an expert varies from run to run, so the caller makes each expert's result
depend on that expert alone and combines them in expert order afterwards (``moekit.experts.cpu_packed``).

The calling thread's intra-op thread count is restored after every share (and the process-wide default
that torch hands new threads with it), so nothing outside a call sees a change.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

R = TypeVar("R")

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads) -> pool; a forked child makes its own
_POOLS_LOCK = threading.Lock()


def largest_first(counts: list[int]) -> list[int]:
    """counts [E] rows per expert -> the experts with rows, most rows first (ties: lower id first): the order
    ``run_dynamic`` hands them out in, so the last ones handed out are the shortest."""
    return sorted((e for e, c in enumerate(counts) if c > 0), key=lambda e: (-counts[e], e))


def run_dynamic(items: list[int], workers: int, fn: Callable[[int], None]) -> None:
    """fn(item) for every item, by min(workers, len(items)) single-threaded workers (``run_shares``), each
    taking the next item in list order when it is free. Re-raises the first worker's error (by worker)
    after every worker has stopped; a worker stops at its first error, the others drain the rest."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    lock = threading.Lock()
    taken = [0]  # the next item's index, under the lock

    def drain(_share: list[int]) -> None:
        while True:
            with lock:
                i = taken[0]
                taken[0] += 1
            if i >= len(items):
                return
            fn(items[i])

    run_shares([[w] for w in range(min(workers, len(items)))], drain)


def run_shares(shares: list[list[int]], fn: Callable[[list[int]], R]) -> list[R]:
    """[fn(share) for share in shares], each call on its own thread with one intra-op thread; share 0
    on the calling thread. Returns in share order; re-raises the first share's error (by share order)
    after every share has finished."""
    if not shares:
        return []
    threads = torch.get_num_threads()  # the caller's: what every thread restores
    if len(shares) == 1:
        return [fn(shares[0])]
    pool = _pool(len(shares) - 1)
    modes = _GradModes(torch.is_grad_enabled(), torch.is_inference_mode_enabled())  # the caller's, for the pool
    futures = [pool.submit(_single_threaded, fn, share, threads, modes) for share in shares[1:]]
    try:
        first = _single_threaded(fn, shares[0], threads)
    finally:
        wait(futures)  # no share outlives the call, even when share 0 failed
    return [first, *(f.result() for f in futures)]


@dataclass(frozen=True)
class _GradModes:
    """The caller's autograd modes, thread-local in torch: a pool thread runs its share under them (else a share
    under the caller's ``torch.inference_mode`` recorded autograd on the pool thread: gpt-oss's biases require grad,
    and saving the caller's inference tensors for backward raised)."""

    grad: bool
    inference: bool


def _single_threaded(fn: Callable[[list[int]], R], share: list[int], restore: int,
                     modes: _GradModes | None = None) -> R:
    torch.set_num_threads(1)
    try:
        if modes is None:  # the calling thread: its own modes
            return fn(share)
        with torch.inference_mode(modes.inference), torch.set_grad_enabled(modes.grad):
            return fn(share)
    finally:
        torch.set_num_threads(restore)


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` workers (a fork's child never reuses its parent's dead threads)."""
    key = (os.getpid(), threads)
    with _POOLS_LOCK:
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moekit-experts")
        return pool

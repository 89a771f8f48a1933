"""Whole experts split across worker threads, each running its share with one OpenMP thread.

At Qwen3-30B-A3B expert shapes (E=128, N=768, K=2048, k=8) a batch of M = 512 tokens gives each expert
~32 rows: GEMMs too small for oneDNN to split well over the cores, so the per-expert loop on 2 threads
ran at ~50-70% of the dense fp32 rate (``moekit bench --cpu-experts``). Here the loop is split by whole
experts instead: ``balance_by_rows`` deals the experts to ``workers`` shares (greedy by rows), and
``run_shares`` runs share 0 on the calling thread and the others on a small thread pool, every one of them
with ``torch.set_num_threads(1)`` (a thread-local OpenMP setting; oneDNN's GEMMs then run single-threaded
on that thread). Torch kernels release the GIL, so the shares run in parallel.

Determinism: the shares are a function of the per-expert row counts and the worker count alone, each
share's function writes only its own buffers, and ``run_shares`` returns the results in share order, so a
caller that combines them in that order gets the same bits on every run, whatever the threads' timing.

The calling thread's intra-op thread count is restored after every share (and the process-wide default
that torch hands new threads with it), so nothing outside a call sees a change.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, TypeVar

import torch

R = TypeVar("R")

_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads) -> pool; a forked child makes its own
_POOLS_LOCK = threading.Lock()


def balance_by_rows(counts: list[int], workers: int) -> list[list[int]]:
    """counts [E] rows per expert -> at most ``workers`` shares of the experts with rows, each ascending.

    Greedy: the experts by rows, largest first (ties: lower id first), each to the share with the fewest
    rows so far (ties: the lower share). Shares that would get no expert are left out, so the result
    has min(workers, experts with rows) shares, never an empty one.
    """
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    busy = sorted((e for e, c in enumerate(counts) if c > 0), key=lambda e: (-counts[e], e))
    shares: list[list[int]] = [[] for _ in range(min(workers, len(busy)))]
    loads = [0] * len(shares)
    for expert in busy:
        least = loads.index(min(loads))
        shares[least].append(expert)
        loads[least] += counts[expert]
    return [sorted(share) for share in shares]


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
    futures = [pool.submit(_single_threaded, fn, share, threads) for share in shares[1:]]
    try:
        first = _single_threaded(fn, shares[0], threads)
    finally:
        wait(futures)  # no share outlives the call, even when share 0 failed
    return [first, *(f.result() for f in futures)]


def _single_threaded(fn: Callable[[list[int]], R], share: list[int], restore: int) -> R:
    torch.set_num_threads(1)
    try:
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

"""The raw rates ``calibrate`` measures the miss costs (``cost.MissCosts``) from: the host -> device link
from pinned memory, the device's read rate, and the link kept busy while the CPU branch is timed."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch


def measure_link_bandwidth(device: torch.device | str, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Host -> ``device`` bytes/s from pinned memory, the best of ``repeats`` copies of ``nbytes``."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def measure_read_bandwidth(device: torch.device | str, nbytes: int = 1 << 28, repeats: int = 3) -> float:
    """Bytes/s ``device`` reads in a large device-to-device copy (each copied byte read once and written
    once: 2 x ``nbytes`` over the best time), the rate an experts call streams cached weights at."""
    device = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


@contextlib.contextmanager
def link_busy(device: torch.device | str, nbytes: int = 1 << 28, copies: int = 8) -> Iterator[None]:
    """Keep the host -> ``device`` link busy while the body runs: ``copies`` copies of ``nbytes`` from
    pinned memory queued on a side stream (about 40 ms at 55 GB/s), waited for on exit. CPU misses run
    while fetches stream from host memory, so the CPU path is timed that way too. Nothing on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(copies):
            dst.copy_(src, non_blocking=True)
    try:
        yield
    finally:
        stream.synchronize()

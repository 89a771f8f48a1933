"""Device <-> host moves of a forward's small tensors in one copy each way (the CPU-miss path).

    to_host([x [M, K], ids [M, k], weights [M, k]])  ->  one cat on the device, one copy into one pinned
                                                          buffer, typed views over it
    to_device(y [M, K])                               ->  y in a pinned buffer, one asynchronous copy

On CUDA both copies are asynchronous: ``to_host`` returns an event to wait on before the views are
read, so the host keeps queueing GPU work while the bytes travel; a pinned source lets ``to_device``
return before the copy lands (a pageable one makes the host wait for it).
"""

from __future__ import annotations

import time

import torch


def to_host(tensors: list[torch.Tensor], *, pin: bool) -> tuple[list[torch.Tensor], object | None]:
    """(``tensors`` on the CPU as views over one host buffer, in the given order; a CUDA event recorded
    after the copy, or None when the sources are on the CPU or the copy was synchronous). The tensors
    are packed by element size, largest first, so every view starts at a multiple of its own size."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    flat = torch.cat([tensors[i].detach().reshape(-1).view(torch.uint8) for i in order])  # one launch
    buffer = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=pin)
    buffer.copy_(flat, non_blocking=pin)
    event = None
    if pin and flat.device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
    views: list[torch.Tensor | None] = [None] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        views[i] = buffer[offset: offset + nbytes].view(t.dtype).view(t.shape)
        offset += nbytes
    return views, event


def to_device(y: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """``y`` (CPU) on ``device``, copied from a pinned buffer when ``pin`` (asynchronously on CUDA)."""
    if device.type == "cpu":
        return y
    source = y
    if pin:
        source = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
        source.copy_(y)
    return source.to(device, non_blocking=pin)


def round_trip_s(tokens: int, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device | str,
                 repeats: int = 3) -> float:
    """Seconds of one forward's staging on ``device``: ``to_host`` of x [tokens, hidden], ids and weights
    [tokens, top_k], the host's wait for them, and ``to_device`` of a [tokens, hidden] result, landed
    (the best of ``repeats``; ~0 when ``device`` is the CPU)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    ids = torch.zeros(tokens, top_k, dtype=torch.int32, device=device)
    weights = torch.ones(tokens, top_k, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        (y, _, _), event = to_host([x, ids, weights], pin=cuda)
        if event is not None:
            event.synchronize()
        to_device(y, device, pin=cuda)
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best

"""The CPU-miss path's staging before session 21 (``moekit.offload.staging`` then), kept as the baseline of
``offload_step_anatomy.py``'s "cpu-old" stack: one copy each way.

    to_host([x [M, K], ids [M, k], weights [M, k]])  ->  one cat on the device, one copy into one pinned
                                                          buffer, typed views over it
    to_device(y [M, K])                               ->  y in a pinned buffer, one asynchronous copy

On CUDA both copies are asynchronous: ``to_host`` returns an event to wait on before the views are
read, so the host keeps queueing GPU work while the bytes travel; a pinned source lets ``to_device``
return before the copy lands (a pageable one makes the host wait for it).

With a ``Buffers`` the pinned buffers are kept and reused (grown to a power of two when a forward
needs more): no pinned allocation per forward. Without one each call allocates its buffer (torch's
caching host allocator), as session 7's path did.
"""

from __future__ import annotations

import torch


class Buffers:
    """One layer's reused pinned staging buffers: one for the inputs (device -> host), one for the result
    (host -> device). The inputs' buffer is free again once the host has read it (the CPU experts run
    synchronously); the result's once its copy has landed (an event, waited for before the next write)."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._inputs: torch.Tensor | None = None  # [capacity] uint8
        self._result: torch.Tensor | None = None  # [capacity] uint8
        self._result_read: object | None = None  # CUDA event after the last copy out of ``_result``

    def inputs(self, nbytes: int) -> torch.Tensor:
        """[nbytes] uint8 over the inputs' buffer."""
        self._inputs = _grown(self._inputs, nbytes, self.pin)
        return self._inputs[:nbytes]

    def result(self, nbytes: int) -> torch.Tensor:
        """[nbytes] uint8 over the result's buffer, once its previous copy to the device has landed."""
        if self._result_read is not None:
            self._result_read.synchronize()
            self._result_read = None
        self._result = _grown(self._result, nbytes, self.pin)
        return self._result[:nbytes]

    def result_sent(self, device: torch.device) -> None:
        """Record that a copy out of the result's buffer was queued on ``device``'s current stream."""
        if self.pin and device.type == "cuda":
            self._result_read = torch.cuda.Event()
            self._result_read.record(torch.cuda.current_stream(device))


def _grown(buffer: torch.Tensor | None, nbytes: int, pin: bool) -> torch.Tensor:
    if buffer is not None and buffer.numel() >= nbytes:
        return buffer
    capacity = 1 << max(nbytes - 1, 1).bit_length()
    return torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)


def to_host(tensors: list[torch.Tensor], *, pin: bool,
            buffers: Buffers | None = None) -> tuple[list[torch.Tensor], object | None]:
    """(``tensors`` on the CPU as views over one host buffer, in the given order; a CUDA event recorded
    after the copy, or None when the sources are on the CPU or the copy was synchronous). The tensors
    are packed by element size, largest first, so every view starts at a multiple of its own size. The
    buffer is ``buffers``' inputs buffer, or a new one (pinned when ``pin``)."""
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    flat = torch.cat([tensors[i].detach().reshape(-1).view(torch.uint8) for i in order])  # one launch
    if buffers is None:
        buffer = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=pin)
    else:
        buffer = buffers.inputs(flat.numel())
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


def to_device(y: torch.Tensor, device: torch.device, *, pin: bool, buffers: Buffers | None = None) -> torch.Tensor:
    """``y`` (CPU) on ``device``, copied from a pinned buffer when ``pin`` (asynchronously on CUDA): the
    result buffer of ``buffers``, or a new one."""
    if device.type == "cpu":
        return y
    source = y
    if pin:
        nbytes = y.numel() * y.element_size()
        raw = buffers.result(nbytes) if buffers is not None else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        source = raw.view(y.dtype).view(y.shape)
        source.copy_(y)
    out = source.to(device, non_blocking=pin)
    if buffers is not None:
        buffers.result_sent(device)
    return out

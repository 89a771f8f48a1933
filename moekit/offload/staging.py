"""Device <-> host moves of a forward's small tensors (the CPU-miss path), with as few host calls as they take.

    to_host([x [M, K], ids [M, k], weights [M, k]])  ->  one copy per tensor straight into typed pinned views,
                                                          one event recorded after them
    to_device(y [M, K])                               ->  y into a typed pinned view, one asynchronous copy

On CUDA both directions are asynchronous: ``to_host`` returns an event to wait on before the views are
read, so the host keeps queueing GPU work while the bytes travel; a pinned source lets ``to_device``
return before the copy lands (a pageable one makes the host wait for it).

With a ``Buffers`` the pinned buffers, the typed views over them and the events are kept and reused: a
forward of shapes seen before makes no tensor but the device result, only the copies and one event
record each way (the buffers grow to a power of two when a forward needs more, and the views are made
again). Every torch call costs the host microseconds on the decode path: the previous staging (one cat
of byte views on the device, one copy, the views made per forward) took ~25 calls each way. One H200 run
at M = 1 (``f6f35e93:benchmarks/offload_step_anatomy.py``, Qwen3-30B-A3B widths): stage 123 -> 44 us, back 70 -> 32 us
alone; in the cpu mode's steps, the branch's stage 0.21 -> 0.09 ms and back 0.15 -> 0.11 ms, the step
6.84 -> 6.49 ms (skewed 75%) and 8.10 -> 7.57 ms (skewed 50%, prefetch), the two stacks taking turns.
Without a ``Buffers`` each call allocates its buffers (torch's caching host allocator).
"""

from __future__ import annotations

import torch

_SIGNATURES = 16  # kept view sets per buffer (one per distinct shapes; cleared beyond)


class Buffers:
    """One layer's reused pinned staging: the inputs' buffer (device -> host) with its typed views by the
    inputs' shapes and dtypes, the result's (host -> device) likewise, and one reused CUDA event each way.
    The inputs' buffer is free again once the host has read it (the CPU experts run synchronously);
    the result's once its copy has landed (its event, waited for before the next write)."""

    def __init__(self, *, pin: bool) -> None:
        self.pin = pin
        self._inputs: torch.Tensor | None = None  # [capacity] uint8
        self._result: torch.Tensor | None = None  # [capacity] uint8
        self._views: dict[tuple, list[torch.Tensor]] = {}  # inputs' signature -> typed views over _inputs
        self._result_views: dict[tuple, torch.Tensor] = {}  # result's signature -> a typed view over _result
        self._staged = torch.cuda.Event() if pin else None  # after the inputs' copies
        self._sent = torch.cuda.Event() if pin else None  # after the result's copy
        self._result_pending = False

    def __getstate__(self) -> dict:  # scratch: pickled (torch.save of a model, deepcopy) as new, empty buffers
        return {"pin": self.pin}

    def __setstate__(self, state: dict) -> None:
        self.__init__(pin=state["pin"])

    def input_views(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Typed views over the inputs' buffer shaped as ``tensors``, packed by element size (largest
        first, so each starts at a multiple of its own size); the same views for the same signature."""
        key = tuple((tuple(t.shape), t.dtype) for t in tensors)
        views = self._views.get(key)
        if views is None:
            order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            if self._inputs is None or self._inputs.numel() < nbytes:
                self._inputs, self._views = _grown(nbytes, self.pin), {}
            views = _typed(self._inputs, tensors, order)
            if len(self._views) >= _SIGNATURES:
                self._views = {}
            self._views[key] = views
        return views

    def result_view(self, y: torch.Tensor) -> torch.Tensor:
        """A typed view shaped as ``y`` over the result's buffer, once its previous copy to the device has landed."""
        if self._result_pending:
            self._sent.synchronize()
            self._result_pending = False
        key = (tuple(y.shape), y.dtype)
        view = self._result_views.get(key)
        if view is None:
            nbytes = y.numel() * y.element_size()
            if self._result is None or self._result.numel() < nbytes:
                self._result, self._result_views = _grown(nbytes, self.pin), {}
            view = _typed(self._result, [y], [0])[0]
            if len(self._result_views) >= _SIGNATURES:
                self._result_views = {}
            self._result_views[key] = view
        return view

    def staged(self, device: torch.device) -> object | None:
        """The inputs' event, recorded now on ``device``'s current stream (None off CUDA)."""
        if self._staged is None or device.type != "cuda":
            return None
        self._staged.record(torch.cuda.current_stream(device))
        return self._staged

    def result_sent(self, device: torch.device) -> None:
        """Record that a copy out of the result's buffer was queued on ``device``'s current stream."""
        if self._sent is not None and device.type == "cuda":
            self._sent.record(torch.cuda.current_stream(device))
            self._result_pending = True


def _grown(nbytes: int, pin: bool) -> torch.Tensor:
    capacity = 1 << max(nbytes - 1, 1).bit_length()
    return torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)


def _typed(buffer: torch.Tensor, tensors: list[torch.Tensor], order: list[int]) -> list[torch.Tensor]:
    """Views over ``buffer`` with ``tensors``' shapes and dtypes, laid out one after another in ``order``."""
    views: list[torch.Tensor | None] = [None] * len(tensors)
    offset = 0
    for i in order:
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        views[i] = buffer[offset: offset + nbytes].view(t.dtype).view(t.shape)
        offset += nbytes
    return views


def to_host(tensors: list[torch.Tensor], *, pin: bool,
            buffers: Buffers | None = None) -> tuple[list[torch.Tensor], object | None]:
    """(``tensors`` on the CPU, each copied once into its view over one host buffer, in the given order; a
    CUDA event recorded after the copies, or None when the sources are on the CPU or the copies were
    synchronous). The buffer and views are ``buffers``' (``Buffers.input_views``), or new (pinned when ``pin``)."""
    if buffers is None:
        order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
        views = _typed(_grown(sum(t.numel() * t.element_size() for t in tensors), pin), tensors, order)
    else:
        views = buffers.input_views(tensors)
    for view, t in zip(views, tensors):
        view.copy_(t.detach(), non_blocking=pin)
    device = tensors[0].device if tensors else torch.device("cpu")
    if not pin or device.type != "cuda":
        return views, None
    if buffers is not None:
        return views, buffers.staged(device)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return views, event


def to_device(y: torch.Tensor, device: torch.device, *, pin: bool, buffers: Buffers | None = None) -> torch.Tensor:
    """``y`` (CPU) on ``device``, copied from a pinned buffer when ``pin`` (asynchronously on CUDA): the
    result view of ``buffers``, or a new one."""
    if device.type == "cpu":
        return y
    source = y
    if pin:
        source = buffers.result_view(y) if buffers is not None else torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
        source.copy_(y)
    out = source.to(device, non_blocking=pin)
    if buffers is not None:
        buffers.result_sent(device)
    return out

"""Eager calls replayed from CUDA graphs: a function of one tensor, captured once per kind of input and
then replayed, so that a small eager call costs one input copy, one graph launch and one output copy
of host time instead of every launch and every line of Python of the function (issue 13: a whole
``MoE`` layer at decode sizes is host-bound, its GPU work a few tens of µs).

    graphs = EagerGraphs(max_rows=64)
    out = graphs.run(fn, x, key, tensors)   # fn(x) -> Tensor; None where the call must run eagerly

A call is replayed only where that is sound: x on a CUDA device with at most ``max_rows`` rows, no
autograd (the caller says so through ``key``'s owner: see ``MoE``), nothing capturing or compiling,
no dispatch mode, plain tensors. ``key`` names everything the captured work depends on besides x's
values: the addresses of the caller's tensors (a new tensor is a new key; an in-place update is seen
by the graph, which reads the same memory), x's shape, dtype, device and strides (added here), the
current stream and the inference-mode state. A graph keeps the ``tensors`` it was captured with alive,
so their addresses cannot pass to other tensors while it exists (``clear`` lets them go: call it when
the caller's tensors are replaced). Graphs are kept per key, the oldest dropped past ``max_graphs``;
each has its own memory pool (two graphs may then replay on different streams without sharing
temporaries). What a replay returns is a fresh tensor, never the graph's output buffer.

Threads: a graph is kept per stream, not per thread, and two threads share the default stream (a server's
request threads calling one model). Its input copy, replay and output copy run under the owner's lock, so they
reach the stream as one unit: before session 54 a second thread's input copy could land between the first's copy
and replay, which then computed the second thread's tokens for the first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

MAX_GRAPHS = 16
WARMUP_CALLS = 2  # eager runs on a side stream before capture: lazy inits, compiles, cached plans


@dataclass(eq=False)
class Captured:
    """One captured call: its graph, the static input it reads and the static output it writes."""

    graph: torch.cuda.CUDAGraph
    static_x: torch.Tensor
    static_out: torch.Tensor
    tensors: tuple  # what the graph reads besides static_x, kept alive


class EagerGraphs:
    """Captured calls of one owner (a layer), by key."""

    def __init__(self, max_rows: int, max_graphs: int = MAX_GRAPHS) -> None:
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        self.max_rows, self.max_graphs = max_rows, max_graphs
        self._graphs: OrderedDict[tuple, Captured] = OrderedDict()
        self._lock = threading.Lock()  # one thread at a time between a static input's copy and its output's clone
        self.captures = 0  # graphs captured so far (a test and a user can see recaptures)

    def __reduce__(self):
        """A copy or a pickle (``copy.deepcopy``, ``torch.save`` of the layer) is a new, empty one: a lock does not
        pickle, nor does a CUDA graph, and a copy's graphs would read the original's tensors."""
        return type(self), (self.max_rows, self.max_graphs)

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` may be replayed (see the module docstring)."""
        return (x.is_cuda and x.shape[0] <= self.max_rows and type(x) is torch.Tensor
                and not torch.compiler.is_compiling() and not torch._C._len_torch_dispatch_stack()
                and not torch.cuda.is_current_stream_capturing())

    def run(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, key: tuple,
            tensors: tuple = ()) -> torch.Tensor | None:
        """fn(x), replayed from the graph of this kind of call (captured on first sight); None where the
        call is not eligible."""
        if not self.eligible(x):
            return None
        full_key = (key, x.shape, x.dtype, x.device, x.stride(), torch.is_inference_mode_enabled(), self._stream(x))
        with self._lock:
            captured = self._graphs.get(full_key)
            if captured is None:
                captured = self._capture(fn, x, tensors)
                if len(self._graphs) >= self.max_graphs:
                    self._graphs.popitem(last=False)
                self._graphs[full_key] = captured
            else:
                self._graphs.move_to_end(full_key)
            captured.static_x.copy_(x)
            captured.graph.replay()
            return captured.static_out.clone()

    @staticmethod
    def _stream(x: torch.Tensor) -> int:
        """The stream a replay would run on (graphs are kept per stream)."""
        return torch._C._cuda_getCurrentRawStream(x.device.index) if x.is_cuda else 0

    def _capture(self, fn, x: torch.Tensor, tensors: tuple) -> Captured:
        static_x = x.clone()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn(static_x)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(static_x)
        self.captures += 1
        return Captured(graph, static_x, static_out, tensors)

    def clear(self) -> None:
        """Drop every captured graph (their memory goes back to the allocator)."""
        with self._lock:
            self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)

"""Output buffers of the gate and the fused router kept between calls, for a caller whose routing never
leaves it (``MoE.forward`` without stats): the logits, ids and weights of one call are read by the
experts kernels of the same call, on the same stream, and dead before the next call writes them again.

    [Gate -> Route] write into these buffers -> Group -> Experts -> Combine (fresh output)

Why: on the H200's host an allocation costs as much as a launch (``torch.empty`` 6.6 µs, a Triton raw
launch ~5 µs; ``benchmarks/layer_host_device_check.py``), and a layer call made three of them for the
routing alone. Buffers are kept per kind of call: (M, device, stream, thread, logits dtype, slots), so
two streams or two threads never share one; none while compiling or capturing a CUDA graph. At most
MAX_ENTRIES kinds are kept (the oldest goes first): a server that sees many batch sizes keeps the last ones.
Each kind also keeps the counters of ``moekit.routing.gate_route`` (gate and router in one launch) and, above 8
rows, the tensor-core gate's split-K partials (``gate_mma``), which must not be shared by two launches in flight at
once: hence their place here. A call without kept buffers
(a CUDA graph capture, a call that returns its routing) takes ``fresh_buffers``, so it runs the same launches.

Shapes: M tokens, E experts, k + S slots.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from moekit._bounded import put_bounded
from moekit.routing import gate, gate_mma
from moekit.triton_bind import current_stream

MAX_ENTRIES = 32  # ~40 KB each at Qwen3's M = 64; DeepSeek-V3 at M = 512: 0.3 MB


@dataclass(frozen=True)
class RouteBuffers:
    logits: torch.Tensor  # [M, E] the gate's output dtype
    ids: torch.Tensor  # [M, k(+S)] int32
    weights: torch.Tensor  # [M, k(+S)] float32
    # int32, 0 between launches: the one-launch gate and router's programs done (gate_route): [1] up to
    # ``gate.MAX_TOKENS`` rows, above the tensor-core gate's tile and row-block counters (``gate_mma.scratch_sizes``)
    count: torch.Tensor
    part: torch.Tensor  # [SPLIT_K * M * E] fp32: the tensor-core gate's split-K partials ([1] where it needs none)


class RouteWorkspace:
    """``get`` returns this kind of call's buffers (made on its first call), or None where they must not be
    kept: while compiling or capturing a CUDA graph."""

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple, RouteBuffers] = {}

    def clear(self) -> None:
        self._buffers.clear()

    def __len__(self) -> int:
        return len(self._buffers)

    def get(self, x2d: torch.Tensor, num_experts: int, num_slots: int, dtype: torch.dtype) -> RouteBuffers | None:
        if torch.compiler.is_compiling():
            return None
        cuda = x2d.is_cuda
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        key = (x2d.shape[0], x2d.get_device(), current_stream() if cuda else 0, threading.get_ident(), dtype, num_slots)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = put_bounded(self._buffers, key, fresh_buffers(x2d, num_experts, num_slots, dtype), MAX_ENTRIES)
        return buffers


def fresh_buffers(x2d: torch.Tensor, num_experts: int, num_slots: int, dtype: torch.dtype) -> RouteBuffers:
    """One call's buffers, kept by nobody: a CUDA graph capture's (from the graph's pool; the counter's zero fill is
    recorded with it) or those of a call whose routing outlives it (``MoE.route_tokens`` without a workspace)."""
    m, device = x2d.shape[0], x2d.device
    counters, partials = 1, 1
    if gate.MAX_TOKENS < m <= gate_mma.MAX_ROWS:
        counters, partials = gate_mma.scratch_sizes(m, num_experts, x2d.shape[1], dtype)
        partials = max(partials, 1)
    return RouteBuffers(logits=torch.empty(m, num_experts, dtype=dtype, device=device),
                        ids=torch.empty(m, num_slots, dtype=torch.int32, device=device),
                        weights=torch.empty(m, num_slots, dtype=torch.float32, device=device),
                        count=torch.zeros(counters, dtype=torch.int32, device=device),
                        part=torch.empty(partials, dtype=torch.float32, device=device))

"""``moekit::cpu_experts``: ``experts_grouped_mm``'s eager CPU path as one opaque op, for ``torch.compile``.

On the CPU without autograd, ``experts_grouped_mm`` runs a per-expert loop (``cpu_gemm="auto"``:
``moekit.experts.cpu_packed``'s, on oneDNN-packed weights, whole experts dealt to single-threaded
workers): it reads the per-expert row counts back to the host, loops in Python, keeps packed copies
in a cache keyed by the weight tensors and runs worker threads, none of which a compiler traces.
Traced, the call used to take the grouped GEMM path instead (``moekit::group_gemm``). Now a compiled
CPU call that needs no gradient runs this op: dynamo sees only its fake (out [M, K] in x.dtype, as
every backend returns), and the compiled graph calls the eager ``experts_grouped_mm`` with the same
arguments, so compiled runs what eager runs, layout and chunking included. The op is registered through
``op_library.define_inference_op`` (no Python autograd layer: ~7 us a call against ``custom_op``'s ~17).

The options cross the schema as plain values (a schema takes no dataclasses; bools, ints and strs
are constants to the compiler): the activation as its spec's fields (``spec_fields``),
``memory_budget_bytes``, ``layout``, ``cpu_gemm``. The packed-weight cache is touched only in the
op's body, where the real weight tensors arrive; the fake never looks at it. The cache keys a packed
copy by its weight tensor's storage base and watches that tensor's version counter, so a weight must
arrive as the module's parameter itself: inductor passes a graph input as is, but a view made in the
graph (transformers' transposed gpt-oss storage read as [E, 2N, K]) as a fresh alias with no base and a
version counter of its own (measured, torch 2.13), whose packed copies would die with the call. Such a
weight crosses in its stored layout (``w13_transposed`` / ``w2_transposed``) and is transposed inside.

Not through the op (``experts_grouped_mm`` decides): calls that need a gradient (the op has no
backward; the traced grouped GEMM path has one), which trace as before, and weight-only quantized
weights, which take ``moekit::cpu_quant_experts`` (``moekit.experts.cpu_quant_op``).

Shapes: M tokens, k slots, E experts, K hidden, N intermediate, R = 2N (gated) or N (ungated) w13 rows.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from moekit.activations import ActivationSpec
from moekit.experts import backend_fn
from moekit.experts.op_library import define_inference_op


def _cpu_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
    activation: str, gated: bool, interleaved: bool, alpha: float, limit: Optional[float], up_shift: float,
    limit_after_act: bool, memory_budget_bytes: Optional[int], layout: str, cpu_gemm: str, w13_transposed: bool,
    w2_transposed: bool,
) -> torch.Tensor:
    """x [M, K], w13 [E, R, K] ([E, K, R] when ``w13_transposed``), w2 [E, K, N] ([E, N, K] when ``w2_transposed``),
    topk_ids / topk_weights [M, k], expert_map [E_global] or None, b13 [E, R] / b2 [E, K] or None, the
    activation's ``spec_fields`` and grouped_mm's options -> [M, K]."""
    w13 = w13.transpose(1, 2) if w13_transposed else w13
    w2 = w2.transpose(1, 2) if w2_transposed else w2
    return backend_fn("grouped_mm", x.device)(
        x, w13, w2, topk_ids, topk_weights, activation=_spec(activation, gated, interleaved, alpha, limit, up_shift,
                                                                limit_after_act),
        expert_map=expert_map, b13=b13, b2=b2, memory_budget_bytes=memory_budget_bytes, layout=layout,
        cpu_gemm=cpu_gemm)


def _cpu_experts_fake(x, w13, w2, topk_ids, topk_weights, expert_map, b13, b2, activation, gated, interleaved, alpha,
                      limit, up_shift, limit_after_act, memory_budget_bytes, layout, cpu_gemm, w13_transposed,
                      w2_transposed):
    return x.new_empty(x.shape)  # [M, K], x.dtype, row-major: what the eager path returns


cpu_experts_op = define_inference_op("cpu_experts", _cpu_experts, _cpu_experts_fake)


@functools.lru_cache(maxsize=256)
def _spec(name: str, gated: bool, interleaved: bool, alpha: float, limit: float | None,
          up_shift: float, limit_after_act: bool) -> ActivationSpec:
    """The op's activation fields as the spec, built (and checked) once per kind of call."""
    return ActivationSpec(name, gated, interleaved, alpha, limit, up_shift, limit_after_act)

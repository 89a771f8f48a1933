"""``moekit::cpu_quant_experts``: the eager CPU loop on weight-only quantized experts (``moekit.experts.cpu_quant``)
as one opaque op, for ``torch.compile``.

Traced, a call on QuantizedWeights used to take ``run_quantized``: every one of the E experts of both matrices
dequantized inside the graph on every call (Qwen3-30B-A3B at M = 1: 8 experts touched, 128 dequantized). Now a
compiled CPU call that needs no gradient, on two weights of one weight-only scheme, runs this op: dynamo sees only
its fake (out [M, K] in x.dtype), and the compiled graph calls the eager ``experts_grouped_mm`` on the same
QuantizedWeights, rebuilt from what crossed the schema, so compiled runs what eager runs.

A QuantizedWeight crosses the schema as its scheme's tensors (``tensor_fields`` order, a Tensor[]) and the fields
its tensors cannot tell (``cols``, ``group_size``; 0 where the scheme has none) and its logical dtype; the
activation as its spec's fields (``spec_fields``). The tensors arrive as the module's own (graph inputs pass as
they are), so ``cpu_quant``'s RepackCache, keyed by the q tensor and its version, keeps its entries across calls.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate, R = 2N (gated) or N w13 rows.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from moekit.activations import spec_fields
from moekit.experts.cpu_op import _spec
from moekit.experts.op_library import define_inference_op
from moekit.quant import QuantizedWeight
from moekit.quant.schemes import SCHEME_CLASSES

_META_FIELDS = ("cols", "group_size")  # the weight-only schemes' fields besides tensors and dtype


def _meta(w: QuantizedWeight) -> list[int]:
    return [getattr(w, name, 0) for name in _META_FIELDS]


def _rebuilt(scheme: str, tensors: list[torch.Tensor], meta: list[int], dtype: torch.dtype) -> QuantizedWeight:
    cls = SCHEME_CLASSES[scheme]
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {name: value for name, value in zip(_META_FIELDS, meta) if name in names}
    return cls(**dict(zip(cls.tensor_fields, tensors)), **fields, dtype=dtype)


def _cpu_quant_experts(
    x: torch.Tensor, w13_tensors: list[torch.Tensor], w2_tensors: list[torch.Tensor], topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor], b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor], scheme: str, w13_meta: list[int], w2_meta: list[int], w13_dtype: torch.dtype,
    w2_dtype: torch.dtype,
    activation: str, gated: bool, interleaved: bool, alpha: float, limit: Optional[float], up_shift: float,
    limit_after_act: bool, memory_budget_bytes: Optional[int], cpu_gemm: str,
) -> torch.Tensor:
    """x [M, K], w13 / w2 a ``scheme`` QuantizedWeight's tensors (logical [E, R, K] / [E, K, N]), ``_META_FIELDS``
    and logical dtype, topk_ids / topk_weights [M, k], expert_map [E_global] or None, b13 [E, R] / b2 [E, K] or
    None, the activation's ``spec_fields``, grouped_mm's options -> [M, K] in x.dtype."""
    from moekit.experts.grouped_mm import experts_grouped_mm  # it imports this module

    w13 = _rebuilt(scheme, w13_tensors, w13_meta, w13_dtype)
    w2 = _rebuilt(scheme, w2_tensors, w2_meta, w2_dtype)
    return experts_grouped_mm(x, w13, w2, topk_ids, topk_weights, expert_map=expert_map, b13=b13, b2=b2,
                              activation=_spec(activation, gated, interleaved, alpha, limit, up_shift, limit_after_act),
                              memory_budget_bytes=memory_budget_bytes, layout="contiguous", cpu_gemm=cpu_gemm)


def _cpu_quant_experts_fake(x, w13_tensors, w2_tensors, topk_ids, topk_weights, expert_map, b13, b2, scheme, w13_meta,
                            w2_meta, w13_dtype, w2_dtype, activation, gated, interleaved, alpha, limit, up_shift,
                            limit_after_act, memory_budget_bytes, cpu_gemm):
    return x.new_empty(x.shape)  # [M, K], x.dtype, row-major: what the eager loop returns


cpu_quant_experts_op = define_inference_op("cpu_quant_experts", _cpu_quant_experts, _cpu_quant_experts_fake)


def cpu_quant_experts(x, w13: QuantizedWeight, w2: QuantizedWeight, topk_ids, topk_weights, *, activation,
                      expert_map, b13, b2, memory_budget_bytes, cpu_gemm) -> torch.Tensor:
    """``experts_grouped_mm``'s quantized CPU loop through ``moekit::cpu_quant_experts`` (the caller checked that
    the eager call would run that loop: ``grouped_mm._runs_quantized_loop``)."""
    return cpu_quant_experts_op(
        x, list(w13.tensors().values()), list(w2.tensors().values()), topk_ids, topk_weights, expert_map, b13, b2,
        w13.scheme, _meta(w13), _meta(w2), w13.dtype, w2.dtype,
        *spec_fields(activation), memory_budget_bytes, cpu_gemm)

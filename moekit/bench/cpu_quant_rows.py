"""The quantized rows of ``moekit bench --cpu-experts --dtype SCHEME``: moekit's CPU experts on weight-only
quantized weights beside the unquantized rows of the same interleaved rounds (``moekit.bench.cpu_measure``).

Per scheme s (weights quantized once from the run's float weights):
- ``moekit[s]``: ``experts_grouped_mm`` on the QuantizedWeights, what ``backend="auto"`` runs on the CPU (each
  touched expert dequantized or run by torch's weight-only kernel: ``moekit.experts.cpu_quant``);
- ``dequant_all[s]``: the path before session 30, every expert of both matrices dequantized to x's dtype per
  call, then the unquantized call (what ``run_quantized`` did);
- ``<kernel>[s]``: the CPU loop with one ``QuantKernels`` kernel forced ("dequant", "int8pack", "int4pack").

Each row records its relative L2 error against the ``reference`` backend on the same quantized weights
(float32 accumulation over the dequantized weights) and the weight bytes its call reads: the packed bytes of
the touched experts (``nbytes_per_expert``; ``dequant_all`` reads every expert's packed bytes, writes every
dequantized copy and reads the touched ones; the unquantized rows read the touched experts' float weights).

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from moekit.activations import as_spec
from moekit.experts import backend_fn
from moekit.experts.cpu_packed import ExpertParams, experts_cpu_fused
from moekit.experts.cpu_quant import SCHEME_KERNELS, WEIGHT_ONLY_SCHEMES, QuantKernels
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.quant import QuantizedWeight, quantize

_ROW = re.compile(r"^(?P<kind>[a-z0-9_]+)\[(?P<scheme>[a-z0-9_]+)\]$")


def row_scheme(name: str) -> str | None:
    """``"moekit[mxfp4]"`` -> ``"mxfp4"``; None for an unquantized row."""
    match = _ROW.match(name)
    return match["scheme"] if match else None


def quantized_weights(w13: torch.Tensor, w2: torch.Tensor,
                      schemes: list[str]) -> dict[str, tuple[QuantizedWeight, QuantizedWeight]]:
    """scheme -> (w13, w2) quantized once (round to nearest, the schemes' defaults)."""
    unknown = sorted(set(schemes) - set(WEIGHT_ONLY_SCHEMES))
    if unknown:
        raise ValueError(f"--dtype: no CPU loop for {unknown}; weight-only schemes: {', '.join(WEIGHT_ONLY_SCHEMES)}")
    return {s: (quantize(w13, s), quantize(w2, s)) for s in schemes}


def quant_calls(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                quantized: dict[str, tuple[QuantizedWeight, QuantizedWeight]]) -> dict[str, Callable[[], torch.Tensor]]:
    """Row name -> a zero-argument call, every quantized row of every scheme (module docstring)."""
    calls = {}
    for scheme, (q13, q2) in quantized.items():
        calls[f"moekit[{scheme}]"] = lambda a=q13, b=q2: experts_grouped_mm(x, a, b, ids, weights)
        calls[f"dequant_all[{scheme}]"] = lambda a=q13, b=q2: experts_grouped_mm(
            x, a.dequantize(x.dtype), b.dequantize(x.dtype), ids, weights)
        for kernel in SCHEME_KERNELS[scheme]:
            kernels = QuantKernels(**{scheme: kernel})
            ex = ExpertParams(q13, q2, None, None, as_spec("silu"))
            calls[f"{kernel}[{scheme}]"] = lambda e=ex, k=kernels: experts_cpu_fused(
                x, e, ids, weights, None, None, workers=torch.get_num_threads(), quant=k).to(x.dtype)
    return calls


def errors_vs_reference(calls: dict[str, Callable[[], torch.Tensor]], x: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor, quantized: dict) -> dict[str, float]:
    """Relative L2 error of each quantized row against the reference backend on its scheme's weights."""
    reference = backend_fn("reference", x.device)
    refs = {s: reference(x, q13, q2, ids, weights).double() for s, (q13, q2) in quantized.items()}
    out = {}
    for name, fn in calls.items():
        scheme = row_scheme(name)
        if scheme is not None:
            ref = refs[scheme]
            out[name] = float((fn().double() - ref).norm() / ref.norm().clamp_min(1e-30))
    return out


def bytes_read(name: str, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, quantized: dict) -> int:
    """The weight bytes the row's call reads (module docstring); ``w13`` / ``w2`` the unquantized rows' weights."""
    touched = int(torch.unique(ids).numel())
    scheme = row_scheme(name)
    if scheme is None:
        return touched * (w13[0].numel() * w13.element_size() + w2[0].numel() * w2.element_size())
    q13, q2 = quantized[scheme]
    if name.startswith("dequant_all["):  # every expert read packed and written dense, the touched ones read dense
        per_expert = (q13.shape[1:].numel() + q2.shape[1:].numel()) * w13.element_size()
        return q13.nbytes + q2.nbytes + (q13.num_experts + touched) * per_expert
    return touched * (q13.nbytes_per_expert + q2.nbytes_per_expert)

"""The Triton backend on quantized weights: ``moekit.quant``'s objects onto the fp8 and weight-only kernels.

    QuantizedWeight pair -> fp8_block: triton_fp8.fused_experts_fp8 (activations quantized 1 x BC in the path; expert
                            biases and any gated activation spec, gpt-oss's included: ``_kernels/gemm_fp8``), or
                            the fp8 Gluon path (triton_gluon_fp8) for the large plain SiLU calls without biases its
                            choice wants on Hopper (a variant call stays on the fused Triton kernels at every M)
                         -> int8_w8a16 / int4_w4a16 / mxfp4: triton_wo.fused_experts_wo (dequantized in registers;
                            expert biases and a gated activation spec, gpt-oss's included, on its tile, register,
                            mma and gemv decodes: ``triton_wo_plan.VARIANT_DECODES``)

What the quantized kernels do not run (an ungated activation; weight-only with float32 activations) goes to
``grouped_mm``'s quantized path (dequantized per call, the same definition) with a warning once per kind, naming
what, so the answer is never a different function.
"""

from __future__ import annotations

import functools
import warnings

import torch

from moekit.activations import ActivationSpec, as_spec
from moekit.quant import QuantizedWeight, check_quantized_pair
from moekit.experts.triton_launch import LaunchOptions

_GROUP = {"int8_w8a16": None, "int4_w4a16": "group_size", "mxfp4": 32}


def is_quantized(w13, w2) -> bool:
    return isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight)


def run_quantized_triton(x: torch.Tensor, w13: QuantizedWeight, w2: QuantizedWeight, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, *, activation: str | ActivationSpec, expert_map,
                         b13, b2, options: LaunchOptions, fp8_choice=None, checked: bool | None = None) -> torch.Tensor:
    """out [M, K] from quantized w13 [E, 2N, K] / w2 [E, K, N] through the scheme's fused kernels. fp8_block
    calls that ``fp8_choice`` (``triton_gluon_fp8.Fp8GluonChoice``; None: its default, from 3e11 FLOPs and 128
    assignments per expert) wants and that fit run on the fp8 Gluon GEMMs (``gluon_fp8_takes``: Hopper, no
    tracing, no backward; biases and activation variants only with ``Fp8GluonChoice.variants``); the rest on the
    fused Triton kernels. With
    ``checked`` (True: ``check_experts_args`` passed, False: the caller vouches) a fused call keeps its entry
    for the fast path (``triton_quant_fast``)."""
    scheme = check_quantized_pair(w13, w2)
    reason = _unsupported(scheme, x.dtype, activation)
    if reason is not None:
        _warn_once(scheme, reason)
        from moekit.experts.grouped_mm import experts_grouped_mm

        return experts_grouped_mm(x, w13, w2, topk_ids, topk_weights, activation=activation, expert_map=expert_map,
                                  b13=b13, b2=b2)
    if scheme == "fp8_block":
        from moekit.experts.triton_fp8 import fused_experts_fp8
        from moekit.experts.triton_gluon_fp8 import DEFAULT_FP8_CHOICE, fp8_fast_key, gluon_fp8_takes, launch_gluon_fp8

        choice = DEFAULT_FP8_CHOICE if fp8_choice is None else fp8_choice
        if gluon_fp8_takes(x, w13, w2, topk_weights, activation, b13, b2, choice):  # its checks: launched unchecked
            return launch_gluon_fp8(x, w13.q, w13.scale, w2.q, w2.scale, topk_ids, topk_weights, expert_map,
                                    fast_key=fp8_fast_key(w13, w2, activation, choice), activation=activation,
                                    b13=b13, b2=b2)

        out = fused_experts_fp8(x, w13.q, w13.scale, w2.q, w2.scale, topk_ids, topk_weights, activation=activation,
                                expert_map=expert_map, block_shape=tuple(w13.block_shape), options=options, b13=b13,
                                b2=b2)
    else:
        from moekit.experts.triton_wo import fused_experts_wo

        out = fused_experts_wo(x, _wo(w13), _wo(w2), topk_ids, topk_weights, expert_map=expert_map, options=options,
                               activation=activation, b13=b13, b2=b2)
    if checked is not None and fp8_choice is None and expert_map is None:
        from moekit.experts.triton_quant_fast import remember_quant

        remember_quant(x, w13, w2, topk_ids, topk_weights, activation, options, checked, b13, b2)
    return out


def _unsupported(scheme: str, dtype: torch.dtype, activation) -> str | None:
    """Why the fused quantized kernels cannot take this call, or None. Both families take expert biases and any gated
    activation spec (``triton_wo``; fp8: ``_kernels/gemm_fp8``'s module docstring)."""
    spec = as_spec(activation)
    if scheme != "fp8_block" and dtype not in (torch.bfloat16, torch.float16):
        return f"{str(dtype).removeprefix('torch.')} activations (the weight-only kernels take bf16/fp16)"
    return None if spec.gated else f"the ungated activation spec {spec} (the {scheme} kernels are gated)"


@functools.lru_cache(maxsize=None)
def _warn_once(scheme: str, reason: str) -> None:
    warnings.warn(f"moekit triton: {scheme} weights with {reason} run through grouped_mm's dequantizing path "
                  "(same result, not the fused kernels)", stacklevel=4)


def _wo(w: QuantizedWeight):
    from moekit.experts.triton_wo import WoWeight

    group = _GROUP[w.scheme]
    group_size = 0 if group is None else (w.group_size if group == "group_size" else group)
    return WoWeight(w.scheme, w.q, w.scale, getattr(w, "zero", None), group_size)

"""QuantizedWeights out of transformers' quantized experts, without dequantizing (transformers 5.x).

What transformers builds (read from transformers 5.24):

- ``FineGrainedFP8Config`` (DeepSeek-V3's format, or quantizing on the fly on a GPU): each ``*.experts``
  module becomes ``transformers.integrations.finegrained_fp8.FP8Experts`` with ``gate_up_proj``
  [E, 2N, K] float8_e4m3fn, ``gate_up_proj_scale_inv`` [E, ceil(2N/BR), ceil(K/BC)], ``down_proj``
  [E, K, N], ``down_proj_scale_inv`` [E, ceil(K/BR), ceil(N/BC)] (float32, or float8_e8m0fnu with
  ``scale_fmt="ue8m0"``), ``block_size`` (BR, BC). ``fp8_experts_weights`` reads them.
  On a machine without a GPU transformers loads such a checkpoint dequantized (plain bf16 experts).
  ``FP8Experts`` dispatches through its own ``FP8ExpertsInterface`` (not ``ExpertsInterface``): a
  "moekit" implementation must be registered there too to reach these weights.
- gpt-oss MXFP4 (``Mxfp4Config``): transformers swaps in ``Mxfp4GptOssExperts`` whose ``gate_up_proj``
  and ``down_proj`` become triton_kernels tensors in a swizzled layout (scales inside a
  ``PrecisionConfig``), or, without a GPU, dequantizes to bf16. Neither keeps the checkpoint's bytes,
  so moekit reads the checkpoint's tensors themselves: ``gpt_oss_experts_weights`` takes the
  ``mlp.experts.*`` entries of the safetensors state dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moekit.quant.formats import from_deepseek_fp8, from_gpt_oss_mxfp4
from moekit.quant.fp8_block import FP8_DTYPE, Fp8BlockWeight
from moekit.quant.mxfp4 import Mxfp4Weight


def fp8_experts_weights(experts: nn.Module) -> tuple[Fp8BlockWeight, Fp8BlockWeight]:
    """(w13 [E, 2N, K], w2 [E, K, N]) of a transformers ``FP8Experts`` module, its tensors as they are."""
    name = type(experts).__name__
    if not hasattr(experts, "gate_up_proj_scale_inv") or not hasattr(experts, "down_proj_scale_inv"):
        raise TypeError(f"experts must be transformers' FP8Experts (gate_up_proj + gate_up_proj_scale_inv), got {name}")
    if experts.gate_up_proj.dtype != FP8_DTYPE or experts.down_proj.dtype != FP8_DTYPE:
        raise TypeError(f"{name}: only float8_e4m3fn experts are supported (not FP4-packed ones), "
                        f"got {experts.gate_up_proj.dtype}")
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{name}: only activation_scheme='dynamic' (per-token scales) is supported, "
                         f"got {experts.activation_scheme!r}")
    if experts.block_size is None:
        raise ValueError(f"{name}: per-tensor fp8 (block_size None) is not a block scheme; moekit runs fp8_block")
    block = tuple(int(b) for b in experts.block_size)
    config = getattr(experts, "config", None)
    # the model's (logical) dtype; not the deprecated torch_dtype (transformers 5: the same value, behind a
    # logged warning that torch.compile cannot trace)
    dtype = getattr(config, "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.bfloat16
    w13 = from_deepseek_fp8(experts.gate_up_proj.detach(), experts.gate_up_proj_scale_inv.detach(),
                            block_shape=block, dtype=dtype)
    w2 = from_deepseek_fp8(experts.down_proj.detach(), experts.down_proj_scale_inv.detach(),
                           block_shape=block, dtype=dtype)
    return w13, w2


def quantized_experts_weights(experts: nn.Module) -> tuple[Fp8BlockWeight, Fp8BlockWeight] | None:
    """(w13, w2) QuantizedWeights of a transformers experts module whose weights are quantized in a form
    moekit reads (today: ``FP8Experts`` with e4m3 weights), None for float experts. Each call wraps the
    module's tensors anew (a few checks, no copy): cache the pair per module where host time matters."""
    quantized = getattr(getattr(experts, "gate_up_proj", None), "dtype", None) == FP8_DTYPE
    return fp8_experts_weights(experts) if quantized and hasattr(experts, "gate_up_proj_scale_inv") else None


@dataclass(frozen=True)
class GptOssExpertsWeights:
    """One gpt-oss layer's experts as they ship: MXFP4 weights (gate/up rows interleaved) and biases."""

    w13: Mxfp4Weight  # [E, 2N, K]; row 2i gate, 2i+1 up
    w2: Mxfp4Weight  # [E, K, N]
    b13: torch.Tensor | None  # [E, 2N], interleaved like w13
    b2: torch.Tensor | None  # [E, K]


def gpt_oss_experts_weights(state_dict: dict[str, torch.Tensor], prefix: str,
                            dtype: torch.dtype = torch.bfloat16) -> GptOssExpertsWeights:
    """The experts of the layer whose keys start with ``prefix`` (e.g. "model.layers.0.mlp.experts."):
    ``gate_up_proj_blocks``/``_scales``/``_bias`` and ``down_proj_blocks``/``_scales``/``_bias``."""
    needed = [prefix + k for k in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                                   "down_proj_scales")]
    missing = [k for k in needed if k not in state_dict]
    if missing:
        raise KeyError(f"state_dict lacks the gpt-oss MXFP4 tensors {missing}")
    w13 = from_gpt_oss_mxfp4(state_dict[needed[0]], state_dict[needed[1]], dtype=dtype)
    w2 = from_gpt_oss_mxfp4(state_dict[needed[2]], state_dict[needed[3]], dtype=dtype)
    return GptOssExpertsWeights(w13=w13, w2=w2, b13=state_dict.get(prefix + "gate_up_proj_bias"),
                                b2=state_dict.get(prefix + "down_proj_bias"))

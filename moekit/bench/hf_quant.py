"""``moekit bench --hf --hf-quant fp8``: the benchmark's model with transformers' fine-grained fp8 experts.

    random float model ──replace_with_fp8_linear──▶ every ``*.experts`` an ``FP8Experts`` (meta)
                       ──Fp8Quantize (transformers' quantizer op)──▶ e4m3 weights + ``*_scale_inv``

The same two pieces ``from_pretrained(..., quantization_config=FineGrainedFP8Config())`` runs when it
quantizes a float checkpoint on load (its quantizer's ``_process_model_before_weight_loading`` and its
quantize op), called on the model in memory: no hub, no checkpoint written, and the CPU too (transformers'
quantizer refuses to quantize without a GPU; the ops themselves are plain torch). DeepSeek-V3's recipe:
128 x 128 weight blocks, activations scaled per token per 128 columns at run time (``activation_scheme``
"dynamic").

Only the experts are quantized (``modules_to_not_convert`` names every other linear): transformers' fp8
linear layers (attention, LM head) run only through its hub kernels (``kernels-community/finegrained-fp8``,
DeepGEMM), which an offline run cannot fetch, and they would cost every implementation the same anyway.
gpt-oss has no form here: ``FP8Experts`` takes no biases (``--hf-quant fp8_block`` runs it: moekit's own fp8
quantization of its swapped blocks, as the weight-only values int8_w8a16, int4_w4a16, mxfp4 do: ``hf_wo``).

The float64 reference (``hf_fp64``) runs the stored fp8 weights dequantized exactly (e4m3 x scale in
float64) through ``FP8Experts``' own loop, which takes a float weight as a plain ``F.linear``: the model
as stored, without the recipe's activation rounding, which therefore shows in every row's error.
"""

from __future__ import annotations

import re
import types

import torch
from torch import nn

from moekit.bench.hf_wo import BLOCK_QUANTS
from moekit.quant.fp8_block import DEFAULT_BLOCK_SHAPE, FP8_DTYPE

HF_QUANTS = ("fp8", *BLOCK_QUANTS)  # the --hf-quant values: transformers' fp8 experts, moekit's quantized blocks
# Widths of the tiny fp8 models: transformers quantizes whole 128 x 128 blocks only (a weight whose rows or
# columns are not multiples of 128 stays float), so hidden and expert widths are 128 here, not --tiny's 64 / 32.
FP8_TINY = {
    "qwen3": dict(hidden_size=128, moe_intermediate_size=128, head_dim=32),
    "mixtral": dict(hidden_size=128, intermediate_size=128, head_dim=32),
    "deepseek-v3": dict(hidden_size=128, moe_intermediate_size=128),
}
QUANTIZE_EXPERTS = 8  # experts a call of transformers' quantize op (quantize_experts_fp8): its temporaries' size
# FP8ExpertsInterface entries that are not switchable experts implementations: deepgemm_megamoe is a load-time
# choice (set_experts_implementation refuses to switch to or from it)
_LOAD_TIME_IMPLS = ("deepgemm_megamoe",)
# moekit's own rows, which run wherever moekit does (its reference backend emulates the recipe on the CPU)
_MOEKIT_IMPLS = ("moekit", "moekit_blocks", "no_experts")
FP8_METHOD = ("; fp8 (--hf-quant): every experts module is transformers' FP8Experts holding transformers' own "
              "quantization of the random weights (e4m3, a float32 scale per 128 x 128 block, activations quantized "
              "per token per 128 columns at run time), the rest of the model in dtype; eager is FP8Experts' own "
              "loop; the float64 reference runs the stored fp8 weights dequantized exactly (no activation rounding)")
NOT_ON_CPU = ("NotOnCPU: transformers' fp8 experts run only through its CUDA hub kernels (finegrained-fp8, "
              "DeepGEMM); not attempted")
# transformers' experts implementations whose modules require CUDA (transformers.integrations.deepgemm: Hopper and
# DeepGEMM's hub kernels; .sonicmoe: CUTLASS DSL kernels): left out of a default list off CUDA, refused when named
CUDA_ONLY_IMPLS = ("deepgemm", "sonicmoe")


def check_quant(quant: str | None, model: str) -> None:
    """ValueError naming ``hf-quant`` where ``quant`` is not a known value or ``model`` has no fp8 form (every
    model has the weight-only ones: moekit's blocks quantize whatever they swap)."""
    if quant is None or quant in BLOCK_QUANTS:
        return
    if quant not in HF_QUANTS:
        raise ValueError(f"hf-quant must be one of {HF_QUANTS}, got {quant!r}")
    if model not in FP8_TINY:
        raise ValueError(f"hf-quant {quant} runs {list(FP8_TINY)} (gpt-oss-20b: transformers' FP8Experts takes no "
                         "biases; deepseek-v4, step-3.7: their clamped fp8 experts not wired here; every model runs "
                         f"fp8_block), got hf-model {model!r}")


def quant_models(quant: str | None, names: list[str]) -> list[str]:
    """``names`` (--hf-model all) less the models ``quant`` has no form of."""
    return [n for n in names if n in FP8_TINY] if quant == "fp8" else names


def fp8_implementations() -> list[str]:
    """Every switchable fp8 experts implementation transformers knows in this process ("moekit" included once
    ``moekit.hf`` is imported), without the reference ("eager": ``FP8Experts``' own loop)."""
    import moekit.hf  # noqa: F401  (registers "moekit" in FP8ExpertsInterface)
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    return [n for n in ALL_FP8_EXPERTS_FUNCTIONS.valid_keys() if n not in _LOAD_TIME_IMPLS]


def unavailable(impl: str, quant: str | None, device: torch.device) -> str | None:
    """Why ``impl`` is not attempted on ``device`` (transformers' fp8 experts, or a CUDA-only implementation, off
    CUDA), else None."""
    if quant == "fp8" and device.type != "cuda" and impl not in _MOEKIT_IMPLS:
        return NOT_ON_CPU
    if impl in CUDA_ONLY_IMPLS and device.type != "cuda":
        return (f"NotOnCPU: transformers' {impl} runs on CUDA only (its module's requirements), and the device is "
                f"{device.type}; not attempted")
    return None


def quantize_experts_fp8(model: nn.Module, block_shape: tuple[int, int] = DEFAULT_BLOCK_SHAPE) -> int:
    """Turn every ``*.experts`` module of ``model`` into transformers' ``FP8Experts`` holding transformers'
    quantization of its weights, in place, on the weights' device; returns how many. ValueError where an
    expert weight is not whole blocks (transformers would leave it float)."""
    import transformers
    from transformers.integrations import finegrained_fp8 as fp8

    names = [n for n, _ in model.named_modules() if n.endswith(".experts")]
    if not names:
        raise ValueError(f"{type(model).__name__} has no *.experts module to quantize")
    weights = {n: {k: p.detach() for k, p in model.get_submodule(n).named_parameters()} for n in names}
    device = next(iter(weights[names[0]].values())).device
    _check_whole_blocks(weights[names[0]], block_shape)
    keep = [re.escape(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)]  # every other linear
    config = transformers.FineGrainedFP8Config(weight_block_size=block_shape, modules_to_not_convert=keep)
    fp8.replace_with_fp8_linear(model, modules_to_not_convert=keep, quantization_config=config)
    quantize = fp8.Fp8Quantize(types.SimpleNamespace(quantization_config=config))
    for name in names:
        experts = model.get_submodule(name).to_empty(device=device)
        for key, value in weights.pop(name).items():
            _quantize_into(experts, quantize, key, value)
    return len(names)


def _quantize_into(experts: nn.Module, quantize, key: str, value: torch.Tensor) -> None:
    """``value`` [E, R, C] quantized by transformers' op ``QUANTIZE_EXPERTS`` experts at a time into ``experts``'
    ``key`` and ``key_scale_inv``: the op works block by block, so the result is the whole weight's, and its float32
    temporaries are a chunk's (on a whole DeepSeek-V3 gate_up_proj, 15 GB in bf16, they were four 30 GB copies)."""
    for start in range(0, value.shape[0], QUANTIZE_EXPERTS):
        for out_key, out in quantize.convert({key: value[start:start + QUANTIZE_EXPERTS]}).items():
            getattr(experts, out_key).data[start:start + QUANTIZE_EXPERTS].copy_(out)


def _check_whole_blocks(weights: dict[str, torch.Tensor], block_shape: tuple[int, int]) -> None:
    for key, w in weights.items():
        if w.dim() == 3 and (w.shape[1] % block_shape[0] or w.shape[2] % block_shape[1]):
            raise ValueError(f"fp8 experts: {key} {list(w.shape)} is not whole {block_shape} blocks "
                             "(hidden and expert widths must be multiples of the block)")


def dequantized_float64(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every e4m3 weight of ``model`` that has a ``*_scale_inv`` and a ``block_size`` beside it (``FP8Experts``,
    ``FP8Linear``), by its full name, as its exact float64 value (``dequantize_float64``)."""
    out = {}
    for prefix, module in model.named_modules():
        for name, w in module.named_parameters(recurse=False):
            scale = block_scale(module, name)
            if scale is not None:
                out[f"{prefix}.{name}" if prefix else name] = dequantize_float64(w, scale, module.block_size)
    return out


def block_scale(module: nn.Module, name: str) -> torch.Tensor | None:
    """The ``*_scale_inv`` of ``module``'s parameter ``name`` where that parameter is e4m3 with block scales (a
    ``block_size`` on the module), else None."""
    scale = getattr(module, name + "_scale_inv", None)
    if getattr(module, name).dtype != FP8_DTYPE or getattr(module, "block_size", None) is None:
        return None
    return scale


def dequantize_float64(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 ``w`` [.., R, C] x its ``block`` (BR, BC) scales [.., ceil(R/BR), ceil(C/BC)], exactly, in float64.
    Scaled in place block row by block row, so the copy is the only weight-sized allocation (the float64 pass's fit
    check counts it alone; the scales expanded whole took two more copies: a 3 GiB allocation failed the fp8 pass on
    an 80 GB H100)."""
    br, bc = block
    value = w.double()  # [.., R, C]
    for i in range(scale.shape[-2]):  # a block row at a time: no temporary of the weight's size
        rows = value[..., i * br:(i + 1) * br, :]  # [.., br, C] (fewer in the tail)
        rows *= scale[..., i, :].double().repeat_interleave(bc, -1)[..., None, :w.shape[-1]]
    return value

"""A quantized swapped block without its float experts (``use_moekit_blocks(model, quant=..., keep_float=False)``):
the experts module's float ``gate_up_proj`` / ``down_proj`` Parameters are removed and the quantized weights the
block's ``MoE`` computes with become the module's buffers, so the model holds each expert once, quantized.

    experts.gate_up_proj [E, 2N, K] (gpt-oss: [E, K, 2N])  ──▶  experts.gate_up_proj_q, _scale (, _zero)  (w13)
    experts.down_proj    [E, K, N]  (gpt-oss: [E, N, K])   ──▶  experts.down_proj_q,    _scale (, _zero)  (w2)

The buffers hold the ``QuantizedWeight``'s own tensors (moekit's layout: w13 [E, 2N, K], w2 [E, K, N], quantized
along the last dim, whatever the family's float layout), the very tensors the ``MoE`` reads: ``state_dict``,
``torch.save`` and a move see them once. What the tensors alone cannot say (group size, block shape, the logical
dtype) is in ``FreedExperts``. Expert biases (gpt-oss), the router and a shared expert stay float Parameters.
A move or cast of the block moves the buffers and never casts them (their dtypes are the scheme's); the
``MoE`` is rebuilt over them (``build_freed_moe``), never requantized.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from moekit.hf.blocks import block_moe
from moekit.hf.variants import build_plan
from moekit.quant import install_quantized_experts_
from moekit.quant.base import QuantizedWeight
from moekit.quant.schemes import SCHEME_CLASSES

FLOAT_NAMES = ("gate_up_proj", "down_proj")  # the experts' float Parameters freed: w13's, then w2's


class FloatExpertsFreedError(RuntimeError):
    """A path that needs a block's float experts, which ``use_moekit_blocks(..., keep_float=False)`` freed."""


@dataclass(frozen=True)
class FreedExperts:
    """What a block whose float experts were freed keeps of them (no tensor): enough to rebuild the quantized
    weights from the experts' buffers and to put float Parameters back (``restore_float_experts``)."""

    scheme: str  # the moekit.quant scheme of both weights
    # each weight's non-tensor fields (group_size, block_shape, cols, dtype: the logical dtype, which a cast of the
    # block follows), in FLOAT_NAMES order
    fields: tuple[dict, dict]
    transposed: bool  # the family stores its float experts [E, K, 2N] / [E, N, K] (gpt-oss)
    requires_grad: bool  # the float Parameters' flag, given back by restore_float_experts
    order: tuple[str, ...]  # the experts module's Parameter names before, in order (restore keeps it)
    freed_bytes: int  # bytes of the float Parameters removed

    @property
    def dtype(self) -> torch.dtype:
        """The logical dtype of the quantized experts: the float dtype they stand for."""
        return self.fields[0]["dtype"]


def buffer_names(freed: FreedExperts) -> list[str]:
    """The experts module's buffers that hold the quantized weights, e.g. ``gate_up_proj_q``, ``down_proj_scale``."""
    return [f"{name}_{field}" for name in FLOAT_NAMES for field in SCHEME_CLASSES[freed.scheme].tensor_fields]


def free_float_experts(block: nn.Module, moe: nn.Module) -> FreedExperts:
    """Remove ``block.experts``' float ``gate_up_proj`` / ``down_proj`` and register the quantized ``moe.w13`` /
    ``moe.w2`` tensors in their place (buffers, ``buffer_names``); the caller drops every other reference."""
    experts = block.experts
    weights = (moe.w13, moe.w2)
    if not all(isinstance(w, QuantizedWeight) for w in weights):
        raise ValueError("keep_float=False frees float experts that the MoE no longer reads: its experts must be "
                         "quantized (use_moekit_blocks(..., quant=scheme))")
    floats = [experts._parameters[name] for name in FLOAT_NAMES]
    freed = FreedExperts(
        scheme=weights[0].scheme, fields=tuple(_meta(w) for w in weights), transposed=build_plan(experts).transposed,
        requires_grad=any(p.requires_grad for p in floats), order=tuple(experts._parameters),
        freed_bytes=sum(p.numel() * p.element_size() for p in floats))
    del floats
    for name, w in zip(FLOAT_NAMES, weights):
        del experts._parameters[name]
        for field, t in w.tensors().items():
            experts.register_buffer(f"{name}_{field}", t)
    return freed


def quantized_weights(experts: nn.Module, freed: FreedExperts) -> tuple[QuantizedWeight, QuantizedWeight]:
    """(w13, w2) made of the experts module's buffers as they are now (no copy)."""
    cls = SCHEME_CLASSES[freed.scheme]
    return tuple(cls(**meta, **{field: experts._buffers[f"{name}_{field}"] for field in cls.tensor_fields})
                 for name, meta in zip(FLOAT_NAMES, freed.fields))


def build_freed_moe(block: nn.Module, backend: str, freed: FreedExperts, shared_expert: bool) -> nn.Module:
    """The block's quantized ``MoE`` over its experts' buffers: ``block_moe`` reads the layer's structure from
    stand-ins of the float experts (their shape, dtype and device over one element: zero strides, no storage to
    speak of), then the quantized weights are installed as they are. Never requantizes."""
    experts = block.experts
    w13, w2 = quantized_weights(experts, freed)
    for name, w in zip(FLOAT_NAMES, (w13, w2)):
        shape = (w.shape[0], w.shape[2], w.shape[1]) if freed.transposed else tuple(w.shape)
        stand_in = torch.zeros((), dtype=freed.dtype, device=w.device).expand(shape)
        experts._parameters[name] = nn.Parameter(stand_in, requires_grad=False)
    try:
        moe = block_moe(block, backend=backend, shared_expert=shared_expert, transposed="view",
                        output_norm="caller")
    finally:
        for name in FLOAT_NAMES:
            del experts._parameters[name]
    install_quantized_experts_(moe, w13, w2)
    return moe.eval()


def take_buffers(experts: nn.Module, freed: FreedExperts) -> dict[str, torch.Tensor]:
    """The quantized buffers, taken out of the module (so a cast of the module passes them by)."""
    return {name: experts._buffers.pop(name) for name in buffer_names(freed)}


def put_buffers(experts: nn.Module, freed: FreedExperts, held: dict[str, torch.Tensor], fn) -> FreedExperts:
    """Put ``take_buffers``' tensors back, moved to the device ``fn`` maps to and never cast (read off empty probes,
    as ``moekit.quant.move_quantized_``); returns ``freed`` with the logical dtype ``fn`` casts a float to. From the
    meta device (``to_empty``: the block's own tensors passed ``fn`` already) they are new, uninitialised ones until
    ``load_state_dict`` fills them (session 54: copying out of meta raised)."""
    for name, t in held.items():
        device = fn(torch.empty(0, device=t.device)).device
        experts._buffers[name] = torch.empty_like(t, device=device) if t.is_meta else t.to(device)
    dtype = fn(torch.empty(0, dtype=freed.dtype)).dtype
    if not dtype.is_floating_point or dtype == freed.dtype:
        return freed
    return dataclasses.replace(freed, fields=tuple({**meta, "dtype": dtype} for meta in freed.fields))


def restore_float_experts(block: nn.Module, moe: nn.Module, freed: FreedExperts) -> None:
    """Float ``gate_up_proj`` / ``down_proj`` Parameters again, dequantized from ``moe``'s weights in their logical
    dtype and the family's layout (an expert at a time: no float32 temporary of a whole layer), in the module's
    Parameter order; the quantized buffers go. The quantization's rounding stays."""
    experts = block.experts
    restored = {}
    for name, w in zip(FLOAT_NAMES, (moe.w13, moe.w2)):
        shape = (w.shape[0], w.shape[2], w.shape[1]) if freed.transposed else tuple(w.shape)
        value = torch.empty(shape, dtype=freed.dtype, device=w.device)  # the family's [E, *, *]
        for expert in range(w.num_experts):
            rows = w.dequantize_expert(expert, freed.dtype)  # [R, C]
            value[expert] = rows.T if freed.transposed else rows
        restored[name] = nn.Parameter(value, requires_grad=freed.requires_grad)
    for name in buffer_names(freed):
        del experts._buffers[name]
    kept = dict(experts._parameters)
    experts._parameters.clear()
    experts._parameters.update({name: restored.get(name, kept.get(name)) for name in freed.order})


def floats_present(block: nn.Module) -> bool:
    """Whether the experts module has float ``gate_up_proj`` / ``down_proj`` now (``torch.func.functional_call``
    may hand them in for one call)."""
    return all(isinstance(getattr(block.experts, name, None), torch.Tensor) for name in FLOAT_NAMES)


def freed_error(block_cls: type, why: str) -> FloatExpertsFreedError:
    """The error of a path that needs the float experts; ``why`` says what needed them."""
    return FloatExpertsFreedError(
        f"{block_cls.__name__}'s float experts were freed by use_moekit_blocks(..., keep_float=False), and {why}; "
        "swap with keep_float=True to keep them, or restore_blocks(model) to get dequantized float experts back")


def _meta(w: QuantizedWeight) -> dict:
    return {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name not in w.tensor_fields}

"""Quantizing an ``MoE``'s routed expert weights in place (``MoE.quantize_``) and keeping them on the
module's device. The router and the shared expert stay in the model dtype.

A quantized ``w13``/``w2`` is a plain attribute holding a ``QuantizedWeight`` (not a Parameter: it is
not trainable); ``MoE._apply`` calls ``move_quantized_`` so ``moe.to(device)`` moves it. Dtype casts
(``moe.half()``) leave it as it is: its tensors' dtypes are the scheme's. ``state_dict`` holds its
tensors as ``w13.q``, ``w13.scale`` (``w13.zero``), ...; ``load_state_dict`` reads them back into a
module quantized with the same scheme and options (quantize first, then load).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from moekit.quant.base import QuantizedWeight
from moekit.quant.schemes import check_scheme, quantize

EXPERT_WEIGHTS = ("w13", "w2")


def quant_scheme_of(w) -> str | None:
    """The scheme of a weight, None for a plain tensor."""
    return w.scheme if isinstance(w, QuantizedWeight) else None


def quantize_experts_(module: nn.Module, scheme: str, **options) -> None:
    """Replace ``module.w13`` [E, 2N, K] and ``module.w2`` [E, K, N] by their quantized weights."""
    check_scheme(scheme)
    current = quant_scheme_of(module.w13)
    if current is not None:
        raise ValueError(f"the experts are already quantized ({current!r}); quantize a float MoE")
    if getattr(module, "fuse_shared", False):
        raise ValueError("quantize_ keeps the shared expert in the model dtype, but this MoE fuses it into "
                         "w13/w2 (fuse_shared=True): build it with fuse_shared=False")
    with torch.no_grad():
        quantized = {name: quantize(getattr(module, name).detach(), scheme, **options) for name in EXPERT_WEIGHTS}
    for name, w in quantized.items():
        delattr(module, name)  # the Parameter goes; the quantized weight is a plain attribute
        setattr(module, name, w)
    module.register_state_dict_post_hook(_save_quantized)
    module.register_load_state_dict_pre_hook(_load_quantized)


def _save_quantized(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in EXPERT_WEIGHTS:
        w = module.__dict__.get(name)
        if isinstance(w, QuantizedWeight):
            state_dict.update({f"{prefix}{name}.{field}": t for field, t in w.tensors().items()})


def _load_quantized(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Rebuild each quantized weight from its ``{prefix}{name}.{field}`` entries (taken out of the dict, so
    they are not reported unexpected), keeping the module's scheme and options; absent ones are missing."""
    for name in EXPERT_WEIGHTS:
        w = module.__dict__.get(name)
        if not isinstance(w, QuantizedWeight):
            continue
        keys = {field: f"{prefix}{name}.{field}" for field in w.tensor_fields}
        if not all(k in state_dict for k in keys.values()):
            missing_keys.extend(k for k in keys.values() if k not in state_dict)
            continue
        tensors = {field: state_dict.pop(k).to(w.device) for field, k in keys.items()}
        meta = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name not in w.tensor_fields}
        try:
            module.__dict__[name] = type(w)(**meta, **tensors)
        except (TypeError, ValueError) as err:
            error_msgs.append(f"{prefix}{name}: {err}")


def move_quantized_(module: nn.Module, fn) -> None:
    """After ``nn.Module._apply(fn)``: move the quantized expert weights to the device ``fn`` maps to
    (read off an empty probe tensor, so a dtype cast in ``fn`` never touches them)."""
    for name in EXPERT_WEIGHTS:
        w = module.__dict__.get(name)
        if isinstance(w, QuantizedWeight):
            module.__dict__[name] = w.to(fn(torch.empty(0, device=w.device)).device)

"""Quantizing an ``MoE``'s routed expert weights in place (``MoE.quantize_``) and keeping them on the
module's device. The router and the shared expert stay in the model dtype (a fused shared expert is un-fused
into the separate MLP first).

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
from moekit.quant.schemes import check_scheme, quantize, scheme_of_tensors, scheme_options
from moekit.routing.shared import unfused_shared

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
    slots = module.config.num_shared_slots if getattr(module, "fuse_shared", False) else 0  # S fused shared rows
    rows = module.w13.shape[0] - slots  # the routed experts' rows (E, or L on an EP rank)
    with torch.no_grad():  # quantized before anything changes: a refused option leaves the layer as it was
        quantized = {name: quantize(getattr(module, name).detach()[:rows], scheme, **options)
                     for name in EXPERT_WEIGHTS}
    if slots:
        _unfuse_shared_(module, rows)
    install_quantized_experts_(module, quantized["w13"], quantized["w2"])


def _unfuse_shared_(module: nn.Module, rows: int) -> None:
    """Move a fused shared expert out of ``w13``/``w2``'s rows ``rows:`` into the separate MLP's ``shared_w13``
    [2SN, K] / ``shared_w2`` [K, SN] (Parameters in the model dtype), keep the routed rows of ``w13``/``w2``/
    ``b13``/``b2`` (the shared slots' biases are zero) and set ``fuse_shared`` False: the layer then computes as
    one built with ``fuse_shared=False``."""
    with torch.no_grad():
        grad = module.w13.requires_grad
        shared = unfused_shared(module.w13[rows:], module.w2[rows:],  # [2SN, K], [K, SN]
                                module.config.activation)
        module.shared_w13, module.shared_w2 = (nn.Parameter(w, requires_grad=grad) for w in shared)
        for name in ("w13", "w2", "b13", "b2"):
            w = getattr(module, name)
            if w is not None:  # w13/w2: views (no copy), the quantized weights replace them next; the biases copied
                setattr(module, name, nn.Parameter(w[:rows] if name in EXPERT_WEIGHTS else w[:rows].clone(),
                                                   requires_grad=w.requires_grad))
    module.fuse_shared = False


def install_quantized_experts_(module: nn.Module, w13: QuantizedWeight, w2: QuantizedWeight) -> None:
    """Make QuantizedWeights taken as they are (a checkpoint's, transformers' fp8 experts') the module's
    ``w13`` [E, 2N, K] / ``w2`` [E, K, N]: never requantized, saved and loaded like ``quantize_experts_``'s."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, QuantizedWeight):
            raise TypeError(f"{name} must be a moekit.quant QuantizedWeight, got {type(w).__name__}")
        current = module.__dict__.get(name, getattr(module, name, None))
        rows_free = current is not None and current.shape[0] == 0  # built with no expert rows to fill
        if current is not None and tuple(current.shape)[rows_free:] != tuple(w.shape)[rows_free:]:
            raise ValueError(f"{name} must have the module's shape {tuple(current.shape)}, got {tuple(w.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if name in module._parameters:
            delattr(module, name)  # the Parameter goes; the quantized weight is a plain attribute
        setattr(module, name, w)
    if not module.__dict__.get("_quantized_hooks"):  # once per module, however often weights are installed
        module.register_state_dict_post_hook(_save_quantized)
        module.register_load_state_dict_pre_hook(_load_quantized)
        module.__dict__["_quantized_hooks"] = True


def _save_quantized(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    for name in EXPERT_WEIGHTS:
        w = module.__dict__.get(name)
        if isinstance(w, QuantizedWeight):
            state_dict.update({f"{prefix}{name}.{field}": t for field, t in w.tensors().items()})


def _load_quantized(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """Rebuild each quantized weight from its ``{prefix}{name}.{field}`` entries (taken out of the dict, so
    they are not reported unexpected), keeping the module's scheme and options; absent ones are missing. Entries
    of another scheme's layout, or a float tensor, are an error saying what the state_dict holds (taken out too)."""
    for name in EXPERT_WEIGHTS:
        w = module.__dict__.get(name)
        if not isinstance(w, QuantizedWeight):
            continue
        keys = {field: f"{prefix}{name}.{field}" for field in w.tensor_fields}
        own = all(k in state_dict and state_dict[k].dtype == w.tensor_dtypes[f] for f, k in keys.items())
        held = None if own else _held_layout(state_dict, prefix + name)  # the dict's keys read on a mismatch only
        if held is not None and held != w.scheme:
            error_msgs.append(f"{prefix}{name}: the state_dict holds {held} experts, this layer's are {w.scheme}: "
                              f"{_load_advice(held)}")
            _take_out(state_dict, prefix + name)
            continue
        if not all(k in state_dict for k in keys.values()):
            missing_keys.extend(k for k in keys.values() if k not in state_dict)
            continue
        tensors = {field: state_dict.pop(k).to(w.device) for field, k in keys.items()}
        meta = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name not in w.tensor_fields}
        try:
            module.__dict__[name] = type(w)(**meta, **tensors)
        except (TypeError, ValueError) as err:  # the same scheme saved with other options (group size, block shape)
            options = ", ".join(f"{k}={meta[k]}" for k in scheme_options(w.scheme) if k in meta)
            error_msgs.append(f"{prefix}{name}: {err} (this layer's {w.scheme} options: {options or 'none'}; quantize_ "
                              "it with the options the state_dict was saved with)")


def refuse_quantized_into_float(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                error_msgs):
    """A load pre-hook's arguments (``MoE._load_from_state_dict`` runs it first): where the layer's ``w13`` / ``w2``
    are float and the state_dict holds a quantized layout for them, an error naming the scheme and the order that
    works (torch reported ``w13`` missing and ``w13.q`` ... unexpected)."""
    for name in EXPERT_WEIGHTS:
        if isinstance(module.__dict__.get(name), QuantizedWeight) or prefix + name in state_dict:
            continue
        held = _held_layout(state_dict, prefix + name)
        if held is not None:
            error_msgs.append(f"{prefix}{name}: the state_dict holds {held} experts, this layer's are float: "
                              f"{_load_advice(held)}")
            _take_out(state_dict, prefix + name)


def _held_layout(state_dict: dict, key: str) -> str | None:
    """What ``state_dict`` holds for the weight at ``key``: "float" (a tensor at ``key``), a scheme (its ``key.field``
    entries' names and dtypes, ``scheme_of_tensors``), or None (nothing recognisable)."""
    fields = {k[len(key) + 1:]: k for k in state_dict if k.startswith(key + ".")}
    if key in state_dict and not fields:
        return "float"
    return scheme_of_tensors({field: state_dict[k] for field, k in fields.items()}) if fields else None


def _take_out(state_dict: dict, key: str) -> None:
    """Remove the weight's entries (``key`` and ``key.*``): reported as one error, not again as unexpected keys
    (``load_state_dict`` hands the hooks its own copy of the dict)."""
    for k in [k for k in state_dict if k == key or k.startswith(key + ".")]:
        del state_dict[k]


def _load_advice(held: str) -> str:
    if held == "float":
        return "load it into a float MoE, then quantize_ it"
    return f"load it into a float MoE quantized first with quantize_({held!r}) and the options it was saved with"


def move_quantized_(module: nn.Module, fn) -> None:
    """After ``nn.Module._apply(fn)``: move the quantized expert weights to the device ``fn`` maps to
    (read off an empty probe tensor, so a dtype cast in ``fn`` never touches them)."""
    for name in EXPERT_WEIGHTS:
        w = module.__dict__.get(name)
        if isinstance(w, QuantizedWeight):
            module.__dict__[name] = w.to(fn(torch.empty(0, device=w.device)).device)

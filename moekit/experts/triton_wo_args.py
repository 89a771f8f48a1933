"""The weight-only Triton experts' weights and the checks of a call's arguments (``triton_wo``): ``WoWeight``, one
quantized expert weight as raw tensors in its scheme's layout (``triton_wo``'s module docstring), and
``check_wo_args``, a clear error naming each argument that is not what the kernels take (x bf16 / fp16 [M, K], both
weights of one scheme and of the call's shape, the routing, an expert map, b13 [E, 2N] / b2 [E, K], a gated
activation).

Shapes: M tokens, k slots, E local experts, K hidden, N intermediate, R rows and C columns of a weight, g the group
size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec, as_spec
from moekit.experts.triton_wo_gemm import SCHEME_IDS

SCHEMES = tuple(SCHEME_IDS)
GROUP_SIZES = {"int8_w8a16": (0,), "int4_w4a16": (32, 64, 128), "mxfp4": (32,)}
X_DTYPES = (torch.bfloat16, torch.float16)
_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class WoWeight:
    """One quantized expert weight [E, R, C] as raw tensors (layouts in the module docstring). The
    logical C is not stored (a packed row of ceil(C/2) bytes holds C or C+1 values): the call knows it."""

    scheme: str  # one of SCHEMES
    q: torch.Tensor  # int8 [E, R, C] or uint8 [E, R, ceil(C/2)]
    scale: torch.Tensor  # fp32 [E, R] (int8), fp32 [E, R, ceil(C/g)] (int4), uint8 [E, R, ceil(C/32)] (mxfp4)
    zero: torch.Tensor | None = None  # int4 only: uint8 [E, R, ceil(C/g)]
    group_size: int = 0  # int4: 32, 64 or 128; mxfp4: 32; int8: 0 (per output row)


def _expected(scheme: str, rows: tuple, cols: int, group_size: int) -> dict:
    """name -> (dtype, shape) of each tensor of a weight [*rows, cols] in ``scheme``."""
    if scheme == "int8_w8a16":
        return {"q": (torch.int8, (*rows, cols)), "scale": (torch.float32, rows)}
    groups = (*rows, -(-cols // group_size))
    if scheme == "int4_w4a16":
        return {"q": (torch.uint8, (*rows, -(-cols // 2))), "scale": (torch.float32, groups),
                "zero": (torch.uint8, groups)}
    return {"q": (torch.uint8, (*rows, -(-cols // 2))), "scale": (torch.uint8, groups)}


def check_wo_weight(w, name: str, rows: tuple, cols: int, device: torch.device) -> None:
    """A clear error naming ``name`` (w13 or w2) unless ``w`` is a WoWeight of shape [*rows, cols]."""
    if not isinstance(w, WoWeight):
        raise TypeError(f"{name} must be a WoWeight, got {type(w).__name__}")
    if w.scheme not in SCHEMES:
        raise ValueError(f"{name}.scheme must be one of {SCHEMES}, got {w.scheme!r}")
    if w.group_size not in GROUP_SIZES[w.scheme]:
        raise ValueError(f"{name}.group_size must be one of {GROUP_SIZES[w.scheme]} for {w.scheme}, got {w.group_size}")
    expected = _expected(w.scheme, rows, cols, w.group_size)
    if w.zero is not None and "zero" not in expected:
        raise ValueError(f"{name}.zero must be None for {w.scheme}")
    for part, (dtype, shape) in expected.items():
        t = getattr(w, part)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}.{part} must be a tensor for {w.scheme}, got {type(t).__name__}")
        if t.dtype != dtype or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}.{part} must be {dtype} of shape {tuple(shape)} for {w.scheme}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name}.{part} must be on {device} like x, got {t.device}")


def check_wo_args(x, w13, w2, topk_ids, topk_weights, expert_map, activation: str | ActivationSpec,
                  b13=None, b2=None) -> None:
    """Every argument of a weight-only call, each with a clear error naming it."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be a [M, K] tensor of one of {X_DTYPES}, got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not as_spec(activation).gated:  # as_spec raises for a wrong name or type, naming the argument
        raise ValueError("activation must be gated for the weight-only kernels (w13 [E, 2N, K]), got an ungated spec")
    if not isinstance(w13, WoWeight) or w13.q.dim() != 3 or w13.q.shape[1] % 2:
        raise ValueError("w13 must be a WoWeight of logical shape [E, 2N, K]")
    (num_experts, two_n), hidden = w13.q.shape[:2], x.shape[1]
    check_wo_weight(w13, "w13", (num_experts, two_n), hidden, x.device)
    check_wo_weight(w2, "w2", (num_experts, hidden), two_n // 2, x.device)
    if w2.scheme != w13.scheme:
        raise ValueError(f"w13 and w2 must share a scheme, got {w13.scheme} and {w2.scheme}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids must be int32/int64 of shape [M={x.shape[0]}, k], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating of shape {tuple(topk_ids.shape)}, got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    for arg, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("expert_map", expert_map)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{arg} must be on {x.device} like x, got {t.device}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in _ID_DTYPES):
        raise ValueError(f"expert_map must be 1-D int32/int64, got {expert_map.dtype} {tuple(expert_map.shape)}")
    for arg, bias, shape in (("b13", b13, (num_experts, two_n)), ("b2", b2, (num_experts, hidden))):
        if bias is None:
            continue
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() or tuple(bias.shape) != shape:
            raise ValueError(f"{arg} must be a floating tensor of shape {shape} or None, got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
        if bias.device != x.device:
            raise ValueError(f"{arg} must be on {x.device} like x, got {bias.device}")

"""The dispatch phase of ``opg35_device_check`` (and of session 34's ``op34_device_check``, removed: ``git show
87f368f6:benchmarks/op34_device_check.py``): one kernel that only returns zeros like x, registered the ways moekit's
ops are (or could be), in the scratch namespace ``op34``. triton_experts' schema: x, w13, w2, ids, weights, three
optional tensors, the activation's 6 fields and 20 launch options (ints and bools); cpu_experts': 19 arguments."""

from __future__ import annotations

from typing import Optional

import torch

from moekit.experts.op_library import define_inference_op

_LIB = torch.library.Library("op34", "FRAGMENT")
_TRITON_OPTIONS = 20  # LaunchOptions.as_op_args()'s length
_TRITON_SCHEMA = ("(Tensor x, Tensor w13, Tensor w2, Tensor topk_ids, Tensor topk_weights, Tensor? expert_map, "
                  "Tensor? b13, Tensor? b2, str activation, bool gated, bool interleaved, float alpha, float? limit, "
                  "float up_shift, " + ", ".join(f"int o{i}" for i in range(_TRITON_OPTIONS)) + ") -> Tensor")


def _fresh(x, *rest):
    return torch.zeros_like(x)  # [M, K], zeros: opcheck compares eager with traced outputs


def _fake(x, *rest):
    return x.new_empty(x.shape)


def _backward(ctx, grad):
    return (grad,) + (None,) * (13 + _TRITON_OPTIONS)


def _no_context(ctx, inputs, output):
    pass


def _cpu_schema_kernel(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
    activation: str, gated: bool, interleaved: bool, alpha: float, limit: Optional[float], up_shift: float,
    memory_budget_bytes: Optional[int], layout: str, cpu_gemm: str, w13_transposed: bool, w2_transposed: bool,
) -> torch.Tensor:
    return torch.zeros_like(x)  # [M, K], zeros: opcheck compares eager with traced outputs


def registered() -> dict:
    """variant -> the op's default overload."""
    ops = {}
    custom = torch.library.custom_op("op34::triton_custom_op", mutates_args=(), schema=_TRITON_SCHEMA)(_fresh)
    custom.register_fake(_fake)
    custom.register_autograd(_backward, setup_context=_no_context)
    ops["triton schema: custom_op + autograd"] = torch.ops.op34.triton_custom_op.default
    ops["triton schema: library + autograd"] = _library_op("triton_library", autograd=True)
    ops["triton schema: library, no autograd"] = _library_op("triton_inference", autograd=False)
    torch.library.custom_op("op34::cpu_custom_op", _cpu_schema_kernel, mutates_args=()).register_fake(_fake)
    ops["cpu schema: custom_op"] = torch.ops.op34.cpu_custom_op.default
    ops["cpu schema: library (op_library)"] = define_inference_op("op34_cpu_inference", _cpu_schema_kernel, _fake)
    return ops


def _library_op(name: str, autograd: bool) -> torch._ops.OpOverload:
    """triton_experts' schema through ``torch.library.Library``: with ``register_autograd``, or as
    ``op_library.define_inference_op`` registers (no autograd kernel, the kernel refusing a call needing a gradient)."""
    _LIB.define(name + _TRITON_SCHEMA, tags=(torch.Tag.pt2_compliant_tag,))
    if autograd:
        _LIB.impl(name, _fresh, "CompositeExplicitAutograd")
        torch.library.register_autograd(f"op34::{name}", _backward, setup_context=_no_context, lib=_LIB)
    else:
        _LIB.impl(name, _refusing_grad, "CompositeExplicitAutograd")
    torch.library.register_fake(f"op34::{name}", _fake, lib=_LIB)
    return getattr(torch.ops.op34, name).default


def _refusing_grad(*args):
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        raise RuntimeError("no backward")
    return _fresh(*args)


def args_for(name: str, x: torch.Tensor) -> tuple:
    """The variant's arguments: x [1, K] and small routed tensors on x's device, the rest plain values."""
    ids = torch.zeros(1, 8, dtype=torch.long, device=x.device)
    w = torch.zeros(4, 8, 8, dtype=x.dtype, device=x.device)
    head = (x, w, w, ids, ids.float(), None, None, None, "silu", True, False, 1.0, None, 0.0)
    if name.startswith("triton"):
        return head + (0,) * _TRITON_OPTIONS
    return head + (None, "auto", "auto", False, False)

"""Experts on torch's grouped GEMM (``torch.nn.functional.grouped_mm`` or ``torch._grouped_mm``),
falling back to a loop over the non-empty experts where the installed torch or device lacks it.

Assignments are sorted by expert (a contiguous permutation without padding); rows are gathered,
run through two grouped GEMMs, weighted, and summed back per token.

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moekit.activations import act_and_mul
from moekit.layouts.grouping import rank_within_groups, to_local_ids


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch runs a grouped GEMM of ``dtype`` on ``device_type`` (probed once)."""
    fn = _grouped_mm_fn()
    if fn is None:
        return False
    try:
        a = torch.ones(4, 16, dtype=dtype, device=device_type)
        b = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        fn(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device_type))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _group_gemm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [A, in] grouped by expert (rows offs[e-1]:offs[e]) times w[e] [out, in]^T -> [A, out].

    Under ``torch.compile`` it runs as the custom op ``moekit::group_gemm``: the compiler sees only
    its fake (a shape), never ``_grouped_mm``'s meta, which accepts bf16 alone although the CPU kernel
    runs fp32 and fp16 too, nor the support probe or the fallback loop's host sync. Eager calls skip
    the op's dispatch, so eager speed is unchanged.
    """
    if torch.compiler.is_compiling():
        return group_gemm_op(a, w, offs)
    return _group_gemm_eager(a, w, offs)


def _group_gemm_eager(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    # torch's grouped GEMM needs 16-byte aligned row strides on both operands.
    aligned = (a.shape[1] * a.element_size()) % 16 == 0 and (w.shape[1] * w.element_size()) % 16 == 0
    if aligned and grouped_mm_supported(a.device.type, a.dtype):
        return _grouped_mm_fn()(a.contiguous(), w.transpose(1, 2), offs=offs)
    out = a.new_zeros(a.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):  # host sync: the fallback loops over experts
        if end > start:
            out[start:end] = a[start:end] @ w[expert].t()
        start = end
    return out


@torch.library.custom_op("moekit::group_gemm", mutates_args=())
def group_gemm_op(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``_group_gemm`` as one opaque op: a [A, in], w [E, out, in], offs [E] int32 -> [A, out]
    (rows past offs[-1] are unspecified, as with ``_grouped_mm``)."""
    return _group_gemm_eager(a, w, offs)


@group_gemm_op.register_fake
def _(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], w.shape[1])


@torch.library.custom_op("moekit::group_gemm_weight_grad", mutates_args=())
def group_gemm_weight_grad_op(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """dL/dw of ``group_gemm_op``: grad [A, out], a [A, in], offs [E] -> [E, out, in],
    w_grad[e] = grad[rows of e]^T @ a[rows of e]."""
    out = grad.new_zeros(offs.shape[0], grad.shape[1], a.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):  # host sync: only the compiled backward comes here
        if end > start:
            out[expert] = grad[start:end].t() @ a[start:end]
        start = end
    return out


@group_gemm_weight_grad_op.register_fake
def _(grad: torch.Tensor, a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offs.shape[0], grad.shape[1], a.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    a, w, offs = ctx.saved_tensors
    grad_a = group_gemm_op(grad, w.transpose(1, 2).contiguous(), offs) if ctx.needs_input_grad[0] else None  # [A, in]
    grad_w = group_gemm_weight_grad_op(grad, a, offs) if ctx.needs_input_grad[1] else None  # [E, out, in]
    return grad_a, grad_w, None


group_gemm_op.register_autograd(_backward, setup_context=_setup_context)


def experts_grouped_mm(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, 2N, K]
    w2: torch.Tensor,  # [E, K, N]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    local = to_local_ids(topk_ids, num_experts, expert_map)  # [A]; E = not routed here
    groups = rank_within_groups(local, num_experts)
    order = groups.order  # [A] grouped by expert
    offs = groups.starts[1:].to(torch.int32)  # [E] end row of each expert
    routed = (local[order] < num_experts)[:, None]  # [A, 1]; rows past offs[-1] are left unwritten by the GEMM

    xs = x[order // top_k]  # [A, K]
    h = _group_gemm(xs, w13, offs)  # [A, 2N]
    h = torch.where(routed, h, torch.zeros_like(h))
    y = _group_gemm(act_and_mul(h, activation), w2, offs)  # [A, K]
    acc = torch.promote_types(x.dtype, torch.float32)  # weight and sum in fp32 (fp64 for fp64 inputs)
    y = torch.where(routed, y.to(acc) * topk_weights.reshape(-1)[order, None].to(acc), 0.0)  # [A, K]
    per_slot = torch.empty_like(y).index_copy_(0, order, y)  # [A, K] back in assignment order
    return per_slot.view(num_tokens, top_k, x.shape[1]).sum(dim=1).to(x.dtype)  # [M, K]

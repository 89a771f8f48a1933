"""The Triton experts path's backward for the variants its fused backward lacks (expert biases, an
``ActivationSpec`` other than a plain gated one: interleaved rows, alpha, a clamp before or after the
activation, up_shift, ungated, an activation outside ``BACKWARD_ACTIVATIONS``): recomputation.

    backward(dout) = autograd of experts_grouped_mm(x, w13, w2, topk_ids, topk_weights, spec, b13, b2) at dout

The forward ran on the Triton kernels and saved only its inputs; the backward re-runs the same contract on
``moekit.experts.grouped_mm`` (the differentiable path: the contiguous layout's grouped GEMMs within its
memory budget, chunked beyond it) with autograd on, and takes ``torch.autograd.grad`` for exactly the inputs
that need one. Cost: one grouped_mm forward + backward inside the backward pass (about 3x the forward's
GEMM FLOPs, on torch's grouped GEMM instead of the fused kernels), its activations held only while the op
runs. Exact up to the two paths' rounding: the reference gradients are those of the same formulas.

It runs as one opaque op, ``moekit::triton_experts_recompute_backward``, so torch.compile traces the
backward through its fake and the recompute runs eagerly inside it (as the fused backward's op does).
Inside a custom op's kernel autograd's dispatch keys are excluded (its autograd layer ran above);
``_autograd_inside`` lifts that exclusion for the recompute alone.

Shapes: M tokens, k slots, E local experts, K hidden, N intermediate, R = 2N gated / N ungated w13 rows.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from moekit.activations import ActivationSpec
from moekit.func_ops import transform_function, transforming

# the inputs that may need a gradient, in the order of the op's ``needs`` and of its outputs
GRAD_NAMES = ("x", "w13", "w2", "topk_weights", "b13", "b2")
# the autograd dispatch keys a custom op's autograd layer excludes for its kernel (``_AutoDispatchBelowAutograd``),
# and ADInplaceOrView, which a compiled graph's call also runs without: views written in place must be tracked
_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")


@contextlib.contextmanager
def _autograd_inside():
    """Autograd recording on inside a custom op's kernel: the thread's excluded dispatch keys less autograd's."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _AUTOGRAD_KEYS:
        exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@torch.library.custom_op("moekit::triton_experts_recompute_backward", mutates_args=())
def _recompute_op(
    dout: torch.Tensor, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor, expert_map: Optional[torch.Tensor], b13: Optional[torch.Tensor],
    b2: Optional[torch.Tensor], activation: str, gated: bool, interleaved: bool, alpha: float, limit: Optional[float],
    up_shift: float, limit_after_act: bool, needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [M, K], dw13 [E, R, K], dw2 [E, K, N], dweights [M, k], db13 [E, R], db2 [E, K]) (``GRAD_NAMES``' order),
    an empty [0] where ``needs`` says no."""
    from moekit.experts.grouped_mm import experts_grouped_mm  # imports the layouts: lazily, at the first backward

    inputs = (x, w13, w2, topk_weights, b13, b2)
    spec = ActivationSpec(activation, gated, interleaved, alpha, limit, up_shift, limit_after_act)
    with _autograd_inside():
        leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        out = experts_grouped_mm(leaves[0], leaves[1], leaves[2], topk_ids, leaves[3], activation=spec,
                                 expert_map=expert_map, b13=leaves[4], b2=leaves[5])  # [M, K] x.dtype
        # allow_unused: no routed slot (every id -1 or off this rank) leaves x's graph empty
        found = iter(torch.autograd.grad(out, wanted, dout.to(out.dtype), allow_unused=True) if out.requires_grad
                     else [None] * len(wanted))
    grads = []
    for t, need in zip(inputs, needs):
        grad = next(found) if need else None
        grads.append(x.new_empty(0) if not need else torch.zeros_like(t) if grad is None else grad)
    return tuple(grads)


@_recompute_op.register_fake
def _recompute_fake(dout, x, w13, w2, topk_ids, topk_weights, expert_map, b13, b2, activation, gated, interleaved,
                    alpha, limit, up_shift, limit_after_act, needs):
    return tuple(t.new_empty(t.shape) if need else x.new_empty(0)
                 for t, need in zip((x, w13, w2, topk_weights, b13, b2), needs))


# the op as a torch.func transform reaches it (func_ops): it has no derivative of its own
_RECOMPUTE_FUNCTION = transform_function(
    "TritonExpertsRecomputeBackward", torch.ops.moekit.triton_experts_recompute_backward, None, None,
    "the triton experts backward has no derivative of its own (grad of grad, hessian, a jvp of a vjp): "
    "take second derivatives on backend='reference' or 'grouped_mm'")


def recompute_grads(dout: torch.Tensor, saved: tuple, spec_fields: tuple, needs: tuple[bool, ...]) -> list:
    """The grads of ``GRAD_NAMES`` (None where ``needs`` says no) from ``saved`` = (x, w13, w2, topk_ids,
    topk_weights, expert_map, b13, b2), the forward's inputs, and the activation's ``spec_fields``."""
    x, w13, w2, ids, weights, expert_map, b13, b2 = saved
    backward = _RECOMPUTE_FUNCTION.apply if transforming() else torch.ops.moekit.triton_experts_recompute_backward
    grads = backward(dout, x, w13, w2, ids, weights, expert_map, b13, b2, *spec_fields, list(needs))
    return [grad if need else None for grad, need in zip(grads, needs)]

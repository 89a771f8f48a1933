"""torch.func transforms (grad, vjp, jacrev, ``functional_call`` + grad, vmap) through moekit's custom ops.

``torch.library.custom_op(...).register_autograd`` builds its ``autograd.Function`` without a
``setup_context`` (torch 2.8 to 2.13 at least, pytorch/pytorch#170834 and #179652; seen here on 2.13),
and ``Function.apply`` refuses such a class while any functorch transform is active ("it must override
the setup_context staticmethod"); an op with no autograd at all runs under ``torch.func.jvp`` with a
tangent of zero.
A call made while a transform is active therefore goes through the ``autograd.Function`` that
``transform_function`` builds instead: its forward is the op, its ``setup_context`` and ``backward``
are the op's registered ones, so functorch lifts it like any function written for it. Plain autograd
and torch.compile keep the custom op and its registered autograd (the switch is one C call, in eager
mode only: ``transforming``).

What such a function lacks raises ``NotImplementedError`` with the caller's message, never a zero:
- ``jvp`` (forward mode: ``torch.func.jvp``, ``jacfwd``, ``hessian``): moekit's Triton ops have none;
- a derivative of the backward (grad of grad): the backward's own op goes through a function whose
  ``backward`` and ``jvp`` refuse.
vmap comes from the forward run under vmap (``generate_vmap_rule``): the op meets torch's batching
fallback, one call per batch entry (correct, with torch's performance warning).
"""

from __future__ import annotations

from typing import Callable

import torch

transforming = torch._C._are_functorch_transforms_active  # one C call: whether any torch.func transform is active


def transform_function(name: str, op: Callable, setup_context: Callable | None, backward: Callable | None,
                       refusal: str) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` (named ``name``) whose forward is ``op(*inputs)``, with ``setup_context(ctx,
    inputs, output)`` and ``backward(ctx, *grads)`` as registered on the op; ``jvp``, and ``backward`` where it is
    None, raise ``NotImplementedError(refusal)``. Call it as ``Function.apply(*inputs)``, every argument of the
    op's schema positional (``setup_context`` reads them by position)."""

    def forward(*inputs):
        return op(*inputs)

    def setup(ctx, inputs, output) -> None:
        if setup_context is not None:
            setup_context(ctx, inputs, output)

    def derivative(ctx, *grads):
        if backward is None:
            raise NotImplementedError(refusal)
        return backward(ctx, *grads)

    def jvp(ctx, *tangents):
        raise NotImplementedError(refusal)

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup), "backward": staticmethod(derivative),
        "jvp": staticmethod(jvp), "generate_vmap_rule": True,
    })

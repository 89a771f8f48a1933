"""moekit's inference-only custom ops, registered through ``torch.library.Library``: one kernel, one fake, no
autograd layer.

``torch.library.custom_op`` wraps every call in two Python layers besides the kernel: an Autograd kernel (a
Python function that checks grad mode and ``requires_grad``, then redispatches) and a backend wrapper (a
``torch._disable_dynamo`` frame and an output aliasing check). For an op that never carries a gradient that is
pure host overhead on every call of every layer of a compiled model, where inductor calls the op as a fallback
kernel. Measured on the 2-core Xeon (torch 2.13, ``benchmarks/op_dispatch.py``): ``moekit::cpu_experts``'s
19-argument schema with an empty body dispatched in ~17 us a call under ``no_grad`` as a ``custom_op``, ~7 us
registered here (this module's grad check included); the body alone ~2 us.

``define_inference_op`` keeps what ``custom_op`` gave these ops: the schema inferred from the function's
annotations (``torch.library.infer_schema``), the ``pt2_compliant_tag``, the fake. The kernel is registered for
``CompositeExplicitAutograd`` (every backend); the Autograd key falls through to torch's C++ fallback, which runs
the kernel with autograd still recording, so the kernel refuses a call that needs a gradient (one check, < 1 us;
under ``no_grad`` only the grad-mode test) where ``custom_op`` ran it and failed at backward: callers send such
calls elsewhere (``grouped_mm._runs_cpu_op``, ``needs_grad``). ``torch.library.opcheck`` holds each op to its fake
(tests).
"""

from __future__ import annotations

from typing import Callable

import torch

_LIB = torch.library.Library("moekit", "FRAGMENT")


def define_inference_op(name: str, kernel: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define ``moekit::<name>`` with ``kernel``'s inferred schema (no argument mutated), ``kernel`` for every
    backend and ``fake`` for tracing; returns the op's default overload (call it like ``kernel``, positionally)."""
    schema = torch.library.infer_schema(kernel, mutates_args=())

    def no_grad_kernel(*args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            raise RuntimeError(f"moekit::{name} has no backward: call it with no input that needs a gradient")
        return kernel(*args)

    _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    _LIB.impl(name, no_grad_kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"moekit::{name}", fake, lib=_LIB)
    return getattr(torch.ops.moekit, name).default


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether grad mode is on and one of ``tensors`` (None skipped) needs a gradient: a call an inference op
    refuses. Attribute reads only, so torch.compile decides it at trace time (grad mode and ``requires_grad`` are
    guarded) and a compiled graph holds one op or the other, never a graph break."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False

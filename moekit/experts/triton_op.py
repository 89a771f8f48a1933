"""The fused Triton experts path as ops: ``moekit::triton_experts`` (with autograd, for calls that need a gradient)
and its inference twin ``moekit::triton_experts_infer`` (for every other call). What a compiled graph, a dispatch
mode, a tensor subclass or a functorch transform runs; eager calls launch the kernels directly (``triton``).

One kernel body (``_experts_kernel``: the launch options and the activation rebuilt from their fields, then
``fused_experts``) and one fake, registered twice: as a ``torch.library.custom_op`` with ``register_autograd``
(``triton_backward``'s gradients), and through ``op_library.define_inference_op`` (no Python autograd layer, no
backend wrapper: the dispatcher calls the kernel). ``experts_op`` picks the op a call runs: the custom op where
grad mode is on and an input (x, w13, w2, topk_weights, a bias) needs a gradient, else the twin. Both tests are
constants while dynamo traces (``requires_grad`` is part of a tensor's guard, grad mode a global one), so a
compiled graph holds one op or the other and a call never breaks the graph to choose: ``generate`` (no_grad)
compiles to the twin, a training step to the custom op and its backward. An empty body at this 33-argument
schema under ``no_grad``, µs a call as the custom op / through op_library: 35.7 / 18.1 on an H100's host (op34),
28.7 / 12.1 on the 2-core Xeon (``benchmarks/opg35_dispatch_cpu.py``). A CUDA-graph replay runs neither: the cut
counts where inductor's call runs the op each step (no CUDA graphs) and where eager calls go through an op.

The launch options cross the op boundary as their fields, primitive arguments: an op's schema has no
dataclasses, and plain bools and ints are constants to torch.compile (baked into the graph, no guard on any
global) and to a CUDA graph (fixed at capture). They are resolved for the device inside the op, where tracing
never looks (resolving asks the CUDA driver for the device's capability). The activation crosses the same way:
its spec's fields (``activations.spec_fields``), the biases as optional tensors.

Shapes: M tokens, k slots, E local experts, K hidden, N intermediate (R = 2N gated, N ungated w13 rows).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from moekit.activations import plan_activation, spec_fields
from moekit.experts import check_experts_args, register_traced_path
from moekit.func_ops import transform_function
from moekit.experts.op_library import define_inference_op
from moekit.experts.triton import _DEFAULT_OPTIONS, experts_triton_unchecked, fused_experts
from moekit.experts.triton_launch import LaunchOptions


def _experts_kernel(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    expert_map: Optional[torch.Tensor], b13: Optional[torch.Tensor], b2: Optional[torch.Tensor],
    activation: str, gated: bool, interleaved: bool, alpha: float, limit: Optional[float], up_shift: float,
    limit_after_act: bool, weight_descriptors: bool, dependent_launch: bool, poison_workspace: bool,
    align_small_max: int, align_small_max_bins: int, direct_eager: bool, cache_plans: bool, cached_launcher: bool,
    reuse_workspace: bool, raw_launcher: bool, align_one_launch_max: int, align_two_launch_max: int,
    align_fold_max: int, sum_fold_max: int, sum_tail_max: int, lean_launch: bool, align_scan_fold: bool,
    fast_path: bool, align_one_pass_from: int, shortcut_max_tokens: int,
) -> torch.Tensor:
    """x [M, K], w13 [E, R, K], w2 [E, K, N], topk_ids / topk_weights [M, k], expert_map [E_global] or None,
    b13 [E, R] / b2 [E, K] or None, the activation's fields, ``LaunchOptions``' fields -> out [M, K] (x.dtype)."""
    # The op never reuses workspaces, whatever ``reuse_workspace`` says: compiled callers run it inside
    # CUDA-graph trees, whose warm-up runs allocate from the graph's private pool, and a buffer kept
    # from there breaks the tree (measured on the H200: generate with a static cache and
    # "reduce-overhead" failed, "tensor(s) in the cudagraph pool not tracked as outputs").
    options = _options_of(weight_descriptors, dependent_launch, poison_workspace, align_small_max, align_small_max_bins,
                          direct_eager, cache_plans, cached_launcher, raw_launcher, align_one_launch_max,
                          align_two_launch_max, align_fold_max, sum_fold_max, sum_tail_max, lean_launch,
                          align_scan_fold, fast_path, align_one_pass_from, shortcut_max_tokens)
    spec = plan_activation(activation, gated, interleaved, alpha, limit, up_shift, limit_after_act)
    return fused_experts(x, w13, w2, topk_ids, topk_weights, expert_map, spec, options=options, b13=b13, b2=b2)


@functools.lru_cache(maxsize=64)
def _options_of(weight_descriptors, dependent_launch, poison_workspace, align_small_max, align_small_max_bins,
                direct_eager, cache_plans, cached_launcher, raw_launcher, align_one_launch_max, align_two_launch_max,
                align_fold_max, sum_fold_max, sum_tail_max, lean_launch, align_scan_fold, fast_path,
                align_one_pass_from, shortcut_max_tokens) -> LaunchOptions:
    """The op's option fields as ``LaunchOptions`` (``reuse_workspace`` off), built and validated once per set of
    values: a compiled graph passes the same constants on every call, and building them (``__post_init__``'s checks,
    ``as_op_args``, the hash) on every call was over half the body's host time (2-core Xeon, launches stubbed,
    ``benchmarks/opg35_body_cpu.py``: 20.1 µs a call before, 8.8 with this cache)."""
    return LaunchOptions(weight_descriptors, dependent_launch, poison_workspace, align_small_max, align_small_max_bins,
                         direct_eager, cache_plans, cached_launcher, reuse_workspace=False, raw_launcher=raw_launcher,
                         align_one_launch_max=align_one_launch_max, align_two_launch_max=align_two_launch_max,
                         align_fold_max=align_fold_max, sum_fold_max=sum_fold_max, sum_tail_max=sum_tail_max,
                         lean_launch=lean_launch, align_scan_fold=align_scan_fold, fast_path=fast_path,
                         align_one_pass_from=align_one_pass_from, shortcut_max_tokens=shortcut_max_tokens)


def _experts_fake(x, w13, w2, topk_ids, topk_weights, expert_map, b13, b2, activation, gated, interleaved, alpha,
                  limit, up_shift, limit_after_act, *options):
    return x.new_empty(x.shape)  # [M, K], x.dtype, row-major: what fused_experts returns


_experts_op = torch.library.custom_op("moekit::triton_experts", _experts_kernel, mutates_args=())
_experts_op.register_fake(_experts_fake)

# The op's gradients (x, w13, w2, topk_weights; the biases' too, for a variant) come from triton_backward, which
# reads the op's schema by name.
from moekit.experts.triton_backward import backward_experts_op, setup_experts_op  # noqa: E402

_experts_op.register_autograd(backward_experts_op, setup_context=setup_experts_op)

# the twin: the same kernel and fake, no autograd (it refuses a call that needs a gradient; experts_op never sends one)
define_inference_op("triton_experts_infer", _experts_kernel, _experts_fake)

# what a call runs while a torch.func transform is active (``func_ops``): the twin as the forward of an
# autograd.Function with the custom op's setup_context and backward
TRANSFORM_FUNCTION = transform_function(
    "TritonExperts", torch.ops.moekit.triton_experts_infer, setup_experts_op, backward_experts_op,
    "the triton experts backend has no forward-mode derivative (torch.func.jvp, jacfwd, hessian): take those on "
    "backend='reference' or 'grouped_mm'; grad, vjp and jacrev work here")


def experts_op(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, b13, b2):
    """The op a call with these tensors runs: ``torch.ops.moekit.triton_experts`` (its backward) where grad mode is
    on and one of them needs a gradient, else the twin ``torch.ops.moekit.triton_experts_infer``. Attribute reads
    only, so dynamo decides at trace time (no graph break) and guards on what it read."""
    if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad
                                    or topk_weights.requires_grad or (b13 is not None and b13.requires_grad)
                                    or (b2 is not None and b2.requires_grad)):
        return torch.ops.moekit.triton_experts
    return torch.ops.moekit.triton_experts_infer


_DEFAULT_OP_ARGS = _DEFAULT_OPTIONS.as_op_args()


def traced_triton_experts(x, w13, w2, topk_ids, topk_weights, activation, b13=None, b2=None) -> torch.Tensor:
    """What ``experts_triton_unchecked`` with its default options comes to while torch.compile traces a call with
    plain weights and no expert map: the op ``experts_op`` picks. Its eager-only branches (the fast path, the Gluon
    route, the direct-eager tests) are not traced, so dynamo installs no guards for them on every compiled call.
    Shapes and dtypes are compared here (constants under tracing; ``check_experts_args`` runs only to name a
    misfit), the dtype itself and the activation when the op builds its plan."""
    x_shape, ids_shape = x.shape, topk_ids.shape
    if (len(x_shape) != 2 or len(ids_shape) != 2 or ids_shape[0] != x_shape[0] or topk_weights.shape != ids_shape
            or w13.dim() != 3 or w13.shape[2] != x_shape[1] or w2.dim() != 3 or w2.shape[0] != w13.shape[0]
            or w2.shape[1] != x_shape[1] or w13.dtype != x.dtype or w2.dtype != x.dtype
            or topk_ids.is_floating_point()):
        check_experts_args(x, w13, w2, topk_ids, topk_weights, activation=activation, b13=b13, b2=b2)
    op = experts_op(x, w13, w2, topk_weights, b13, b2)
    return op(x, w13, w2, topk_ids, topk_weights, None, b13, b2, *spec_fields(activation), *_DEFAULT_OP_ARGS)


register_traced_path(experts_triton_unchecked, traced_triton_experts)

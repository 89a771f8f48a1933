"""Main's (024707d) registrations of moekit's four other GPU ops, for ``opq36_device_check``'s "before": each a
``torch.library.custom_op`` with the op's fake and no backward (custom_op's Autograd kernel and backend wrapper on
every call), around main's body (its ``LaunchOptions`` built per call; the alignment's options resolved and plan
built per call, the router's ``RouterMath`` built per call), under ``moekit_before::<the op's name>`` with the op's
schema (its body's signature now). ``use_before(True)`` points ``torch.ops.moekit.<name>`` at these (what the
library's callers look up, at trace time too) and ``use_before(False)`` back; the ops' kernels are moekit's own.

    import opq36_before as before
    before.OPS["route_fused"](*args)              # main's form of the call
    before.use_before(True)                       # a compiled stack traced now holds main's forms
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional  # noqa: F401  (Optional: the schema's annotations are evaluated here)

import torch

from moekit.experts import triton_align, triton_fp8, triton_wo
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
from moekit.experts.triton_wo_plan import weight_args
from moekit.layouts.block_aligned import use_naive
from moekit.layouts.grouping import max_padded_rows
from moekit.routing import fused
from moekit.routing.router_math import RouterMath


def _fp8(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights, expert_map, block_n, block_k,
         weight_descriptors, dependent_launch, poison_workspace):
    options = LaunchOptions(weight_descriptors=weight_descriptors, dependent_launch=dependent_launch,
                            poison_workspace=poison_workspace)
    return triton_fp8.fused_experts_fp8_launch(x, w13_q, w13_scale, w2_q, w2_scale, topk_ids, topk_weights,
                                               expert_map, (block_n, block_k), options=options)


def _wo(x, q13, s13, z13, g13, q2, s2, z2, g2, topk_ids, topk_weights, expert_map, scheme, activation,
        dependent_launch, decode=""):
    options = LaunchOptions(dependent_launch=dependent_launch, reuse_workspace=False)
    return triton_wo.run_experts_wo(x, weight_args(q13, s13, z13, g13), weight_args(q2, s2, z2, g2), topk_ids,
                                    topk_weights, expert_map, scheme, activation, options=options,
                                    decode=decode or None)


def _route(logits, bias, gate_logits, top_k, n_group, topk_group, sigmoid, renormalize, scaling, check_finite,
           num_shared, elements_per_program, softcap, bias_on_logits, group_score, fill_zero, shared_weight,
           assert_in_kernel=False):  # blk36's argument: the schema is the op's now (_register)
    math = RouterMath(softcap, bias_on_logits, group_score, fill_zero, shared_weight)
    plan = fused._plan(logits.shape[1], top_k, n_group, topk_group, sigmoid, renormalize, scaling, check_finite,
                       num_shared, elements_per_program, math)
    return fused._launch(plan, logits, bias, gate_logits, assert_in_kernel)


def _align(topk_ids, num_experts, block_size, expert_map, allow_naive, dependent_launch, align_small_max,
           align_small_max_bins, align_one_launch_max=2048, align_two_launch_max=4096):
    options = resolve_launch_options(
        LaunchOptions(dependent_launch=dependent_launch, align_small_max=align_small_max,
                      align_small_max_bins=align_small_max_bins, cached_launcher=False,
                      align_one_launch_max=align_one_launch_max, align_two_launch_max=align_two_launch_max),
        topk_ids.device)
    topk_ids = topk_ids.contiguous()
    num_assignments = topk_ids.numel()
    naive = allow_naive and use_naive(num_assignments, num_experts, expert_map)
    num_rows = num_assignments * block_size if naive else max_padded_rows(num_assignments, num_experts, block_size)
    num_global = None if expert_map is None else expert_map.numel()
    plan = triton_align.plan_align(num_assignments, num_experts, block_size, num_global, num_rows, options, naive)
    buffers = {name: torch.empty(shape, dtype=dtype, device=topk_ids.device) for name, dtype, shape in plan.regions}
    triton_align.run_align(plan, topk_ids, None if expert_map is None else expert_map.contiguous(), buffers)
    return buffers["sorted_ids"], buffers["expert_ids"], buffers["num_padded"], buffers["counts"]


# op name -> (main's body, the op's body now (its signature: the schema), the op's fake)
_FORMS = {"triton_experts_fp8": (_fp8, triton_fp8._fp8_kernel, triton_fp8._fp8_fake),
          "triton_experts_wo": (_wo, triton_wo._wo_kernel, triton_wo._wo_fake),
          "route_fused": (_route, fused._route_kernel, fused._route_fake),
          "align_block_triton": (_align, triton_align._align_kernel, triton_align._align_fake)}


def _register(name: str, body: Callable, now: Callable, fake: Callable) -> torch._ops.OpOverload:
    body.__signature__ = inspect.signature(now)  # the same schema, inferred from the annotations now
    op = torch.library.custom_op(f"moekit_before::{name}", body, mutates_args=())
    op.register_fake(fake)
    return getattr(torch.ops.moekit_before, name).default


OPS = {name: _register(name, *form) for name, form in _FORMS.items()}
_NOW = {name: getattr(torch.ops.moekit, name) for name in _FORMS}


def use_before(on: bool) -> None:
    """``torch.ops.moekit.<name>`` of the four ops: main's forms (on) or the shipped ops (off)."""
    for name in _FORMS:
        setattr(torch.ops.moekit, name, getattr(torch.ops.moekit_before, name) if on else _NOW[name])

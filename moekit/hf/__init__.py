"""transformers interop: build a ``MoE`` from a transformers MoE block, and run a whole transformers
model's experts through moekit.

Importing this module registers moekit as a transformers experts implementation named ``"moekit"``,
so ``model.set_experts_implementation("moekit")`` sends every experts call through
``moekit.experts.call_backend`` (backend ``moekit.hf.HF_BACKEND``, "auto" by default), for every variant
of transformers' experts interface: ``variants`` turns a module's flags and code into an ``ExpertsPlan``
(an ``ActivationSpec``, biases, transposed views) once per module, and what moekit does not fuse runs
through ``composed`` with the module's own code, saying so once per class (``ComposedPathWarning``); on a model
with no experts module transformers would dispatch, ``set_experts_implementation("moekit")`` warns (``set_check``);
``save_pretrained`` of a model whose swapped blocks freed their float experts writes those beside the checkpoint,
for ``load_quantized_experts`` after ``from_pretrained`` (``saving``, ``loading``).
``blocks.moe_from_hf`` turns a MoE block into a ``MoE``; ``swap.use_moekit_blocks`` gives every block of a
model moekit's whole layer forward in place (``restore_blocks`` undoes it). The backend
comes from ``moekit.experts.backend_fn``, cached per (HF_BACKEND, device type) and resolved at import
for the CPU and CUDA: resolving imports modules, which ``torch.compile(fullgraph=True)`` cannot trace,
so a compiled model only ever meets the cache.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from moekit._checks import check_module
from moekit.experts import backend_fn, call_backend, traced_path_of
from moekit.hf.blocks import moe_from_hf
from moekit.hf.composed import run_composed
from moekit.hf.offload import OffloadedBlock, offload_experts
from moekit.hf.loading import load_quantized_experts, wrap_dispatch, wrap_missing_keys_move, wrap_stubs_missing
from moekit.hf.saving import wrap_save_pretrained
from moekit.hf.set_check import (
    IMPLEMENTATION, NOT_SERVED, is_interface_experts, wrap_from_pretrained, wrap_post_init,
    wrap_set_experts_implementation,
)
from moekit.hf.swap import BlockSwapReport, restore_blocks, use_moekit_blocks
from moekit.hf.swap_free import FloatExpertsFreedError
from moekit.hf.variants import PLAN_ATTR, ComposedPathWarning, ExpertsPlan, experts_plan
from moekit.quant.hf import fp8_experts_weights

_FP8_ATTR = "_moekit_fp8_weights"  # on an FP8Experts module: (its tensors' addresses, (w13, w2))

__all__ = ["HF_BACKEND", "BlockSwapReport", "ComposedPathWarning", "ExpertsPlan", "FloatExpertsFreedError",
           "MissingExtraError", "load_quantized_experts", "moe_from_hf",
           "moekit_experts_forward", "moekit_fp8_experts_forward", "OffloadedBlock", "offload_experts", "prepare",
           "restore_blocks", "use_moekit_blocks"]

# The experts backend the "moekit" transformers implementation uses; "auto" picks the best available.
HF_BACKEND = "auto"


def moekit_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers ``ExpertsInterface`` entry: hidden_states [M, K], top_k_index [M, k], top_k_weights [M, k].

    Every variant of the interface runs: the module's ``ExpertsPlan`` (built on its first call, then
    cached on it; ``moekit.hf.variants``) says which weights to read and either the ``ActivationSpec``
    the backend fuses or that the composed path runs. transformers' expert-parallel sentinel (an id
    >= num_experts with weight 0) is skipped like moekit's -1.
    """
    plan = getattr(self, PLAN_ATTR, None) or experts_plan(self)
    w13, w2 = getattr(self, plan.up_name), self.down_proj
    if plan.transposed:  # stored [E, K, 2N] / [E, N, K]: strided views, no copy
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    b13 = getattr(self, plan.up_name + "_bias") if plan.has_bias else None
    b2 = self.down_proj_bias if plan.has_bias else None
    if plan.activation is None:
        return run_composed(self, plan, hidden_states, w13, w2, top_k_index, top_k_weights, b13, b2)
    fn = _backend_fn(hidden_states.device)
    if torch.compiler.is_compiling():  # the backend's traced entry: none of its eager branches traced and guarded
        traced = traced_path_of(fn)
        if traced is not None:
            return traced(hidden_states, w13, w2, top_k_index, top_k_weights, plan.activation, b13, b2)
    return call_backend(fn, hidden_states, w13, w2, top_k_index, top_k_weights, activation=plan.activation, b13=b13,
                        b2=b2)


def moekit_fp8_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers ``FP8ExpertsInterface`` entry (``FineGrainedFP8Config``'s ``FP8Experts``, DeepSeek-V3's
    fp8 format): the module's e4m3 weights and ``*_scale_inv`` run as moekit ``fp8_block`` weights, as
    they are (never dequantized or requantized; the Triton backend's fp8 kernels on CUDA). An activation
    moekit does not fuse runs composed on the dequantized weights (correct, slow, said once)."""
    plan = getattr(self, PLAN_ATTR, None) or experts_plan(self)
    w13, w2 = _fp8_weights(self)
    if plan.activation is None:
        dtype = hidden_states.dtype
        return run_composed(self, plan, hidden_states, w13.dequantize(dtype), w2.dequantize(dtype), top_k_index,
                            top_k_weights, None, None)
    return call_backend(_backend_fn(hidden_states.device), hidden_states, w13, w2, top_k_index, top_k_weights,
                        activation=plan.activation)


def _backend_fn(device: torch.device):
    """The experts function of ``HF_BACKEND`` on ``device`` (``backend_fn``'s cache); a name that is no backend, or
    one ``device`` lacks, raises naming the setting (the user set it, not a ``backend=`` argument)."""
    try:
        return backend_fn(HF_BACKEND, device)
    except (ValueError, RuntimeError) as err:
        raise type(err)(f"moekit.hf.HF_BACKEND = {HF_BACKEND!r}: {err}") from None


def _fp8_weights(module: nn.Module):
    """The module's (w13, w2) fp8_block weights, wrapped once per set of weight tensors (a load replaces them);
    wrapped anew in a traced call (dynamo cannot compare data pointers: the cache broke the graph there)."""
    if torch.compiler.is_compiling():
        return fp8_experts_weights(module)
    key = (module.gate_up_proj.data_ptr(), module.down_proj.data_ptr(), module.gate_up_proj_scale_inv.data_ptr(),
           module.down_proj_scale_inv.data_ptr())
    cached = module.__dict__.get(_FP8_ATTR)
    if cached is None or cached[0] != key:
        cached = module.__dict__[_FP8_ATTR] = (key, fp8_experts_weights(module))
    return cached[1]


def prepare(model: nn.Module) -> list[ExpertsPlan]:
    """Build the plan of every experts module in ``model`` now (eagerly), e.g. before
    ``torch.compile(fullgraph=True)``, which cannot trace the probing; returns the plans. A model without such a
    module (a dense one) warns, as ``set_experts_implementation("moekit")`` does: no plan, moekit never called."""
    check_module("model", model)
    plans = [experts_plan(m) for m in model.modules() if is_interface_experts(m)]
    if not plans:
        warnings.warn(f"prepare: {type(model).__name__} {NOT_SERVED}: no plan built, and the experts implementation "
                      f"{IMPLEMENTATION!r} would never be called (use_moekit_blocks swaps MoE blocks moekit knows)",
                      UserWarning, stacklevel=2)
    return plans


class MissingExtraError(ImportError):
    """``moekit.hf`` imported without transformers >= 5 (the ``hf`` extra); the message says what to install."""


def _register() -> None:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:  # no transformers, or one older than v5 (no experts interface)
        raise MissingExtraError('moekit.hf needs transformers >= 5.0, which is not installed: '
                                'pip install "moekit[hf]"', name=err.name) from err

    ExpertsInterface.register(IMPLEMENTATION, moekit_experts_forward)
    wrap_set_experts_implementation()
    wrap_from_pretrained()
    wrap_post_init()
    wrap_missing_keys_move()
    wrap_dispatch()
    wrap_stubs_missing()
    wrap_save_pretrained()
    try:  # fine-grained fp8 experts dispatch through their own interface (transformers >= 5.x)
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except ImportError:
        return
    FP8ExpertsInterface.register(IMPLEMENTATION, moekit_fp8_experts_forward)


_register()
backend_fn(HF_BACKEND, "cpu")
if torch.cuda.is_available():
    backend_fn(HF_BACKEND, "cuda")

"""transformers interop: build a ``MoE`` from a transformers MoE block, and run a whole transformers
model's experts through moekit.

Importing this module registers moekit as a transformers experts implementation named ``"moekit"``,
so ``model.set_experts_implementation("moekit")`` sends every experts call through
``moekit.experts.call_backend`` (backend ``moekit.hf.HF_BACKEND``, "auto" by default), for every variant
of transformers' experts interface: ``variants`` turns a module's flags and code into an ``ExpertsPlan``
(an ``ActivationSpec``, biases, transposed views) once per module, and what moekit does not fuse runs
through ``composed`` with the module's own code, saying so once per class (``ComposedPathWarning``).
``blocks.moe_from_hf`` turns a MoE block into a ``MoE``. The backend
comes from ``moekit.experts.backend_fn``, cached per (HF_BACKEND, device type) and resolved at import
for the CPU and CUDA: resolving imports modules, which ``torch.compile(fullgraph=True)`` cannot trace,
so a compiled model only ever meets the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.experts import backend_fn, call_backend
from moekit.hf.blocks import moe_from_hf
from moekit.hf.composed import run_composed
from moekit.hf.variants import PLAN_ATTR, ComposedPathWarning, ExpertsPlan, experts_plan

__all__ = ["HF_BACKEND", "ComposedPathWarning", "ExpertsPlan", "MissingExtraError", "moe_from_hf",
           "moekit_experts_forward", "prepare"]

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
    return call_backend(
        backend_fn(HF_BACKEND, hidden_states.device), hidden_states, w13, w2, top_k_index, top_k_weights,
        activation=plan.activation, b13=b13, b2=b2,
    )


def prepare(model: nn.Module) -> list[ExpertsPlan]:
    """Build the plan of every experts module in ``model`` now (eagerly), e.g. before
    ``torch.compile(fullgraph=True)``, which cannot trace the probing; returns the plans."""
    return [experts_plan(m) for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


class MissingExtraError(ImportError):
    """``moekit.hf`` imported without transformers >= 5 (the ``hf`` extra); the message says what to install."""


def _register() -> None:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as err:  # no transformers, or one older than v5 (no experts interface)
        raise MissingExtraError('moekit.hf needs transformers >= 5.0, which is not installed: '
                                'pip install "moekit[hf]"', name=err.name) from err

    ExpertsInterface.register("moekit", moekit_experts_forward)


_register()
backend_fn(HF_BACKEND, "cpu")
if torch.cuda.is_available():
    backend_fn(HF_BACKEND, "cuda")

"""transformers interop: build a ``MoE`` from a transformers MoE block, and run a whole transformers
model's experts through moekit.

Importing this module registers moekit as a transformers experts implementation named ``"moekit"``,
so ``model.set_experts_implementation("moekit")`` sends every experts call through
``moekit.experts.call_backend`` (backend ``moekit.hf.HF_BACKEND``, "auto" by default). The backend
comes from ``moekit.experts.backend_fn``, cached per (HF_BACKEND, device type) and resolved at import
for the CPU and CUDA: resolving imports modules, which ``torch.compile(fullgraph=True)`` cannot trace,
so a compiled model only ever meets the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.config import MoEConfig
from moekit.experts import backend_fn, call_backend
from moekit.hf.composed import run_composed
from moekit.hf.variants import PLAN_ATTR, ComposedPathWarning, ExpertsPlan, experts_plan
from moekit.layer import MoE

# The experts backend the "moekit" transformers implementation uses; "auto" picks the best available.
HF_BACKEND = "auto"


def moe_from_hf(block: nn.Module, *, fuse_shared: bool = False, backend: str = "auto") -> MoE:
    """A ``MoE`` computing the same function as a transformers ``Qwen3MoeSparseMoeBlock``,
    ``Qwen2MoeSparseMoeBlock``, ``MixtralSparseMoeBlock`` or ``DeepseekV3MoE``.

    With ``fuse_shared=False`` (default) the routed experts' weights and the router are *shared* with
    the block (the same ``Parameter`` objects) and the shared expert's are copied into a separate MLP.
    With ``fuse_shared=True`` the shared expert becomes extra routed slots, so the expert weights are
    copied into one concatenated tensor.
    """
    experts, router = getattr(block, "experts", None), getattr(block, "gate", None)
    if experts is None or router is None or not hasattr(experts, "gate_up_proj"):
        raise TypeError(
            f"block must be a transformers MoE block with .gate and .experts.gate_up_proj, got {type(block).__name__}"
        )
    config = MoEConfig.from_hf_config(experts.config)
    moe = MoE(config, backend=backend, fuse_shared=fuse_shared, dtype=experts.gate_up_proj.dtype,
              device=experts.gate_up_proj.device)
    moe.gate.weight = router.weight
    if moe.e_score_correction_bias is not None:
        moe.e_score_correction_bias = router.e_score_correction_bias
    shared_mlp = getattr(block, "shared_experts", None) or getattr(block, "shared_expert", None)
    shared_w13, shared_w2 = _shared_weights(shared_mlp) if shared_mlp is not None else (None, None)
    if moe.fuse_shared:
        slots, n_dim = config.num_shared_slots, config.moe_intermediate_size
        gate_rows, up_rows = shared_w13.view(2, slots, n_dim, -1).unbind(0)  # [S, N, K] each
        with torch.no_grad():
            moe.w13.copy_(torch.cat([experts.gate_up_proj, torch.cat([gate_rows, up_rows], dim=1)]))
            moe.w2.copy_(torch.cat([experts.down_proj, shared_w2.view(-1, slots, n_dim).transpose(0, 1)]))
    else:
        moe.w13, moe.w2 = experts.gate_up_proj, experts.down_proj
        if shared_w13 is not None:
            with torch.no_grad():
                moe.shared_w13.copy_(shared_w13)
                moe.shared_w2.copy_(shared_w2)
    if moe.shared_gate is not None:
        moe.shared_gate.weight = block.shared_expert_gate.weight
    return moe


def _shared_weights(mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers gated MLP -> (w13 [2SN, K] gate rows then up rows, w2 [K, SN])."""
    return torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), mlp.down_proj.weight.detach()


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

"""The stated expert shape the simulator prices its runs with: Mixtral-8x7B's, with E and k replaced.

Mixtral-8x7B (``moekit.presets``): hidden 4096, expert intermediate 14336, 32 MoE layers, grouped-query
attention, 32k vocabulary. One expert costs 3·4096·14336 = 176M parameters per layer. The bill is
``moekit.analysis.param_bill`` of that config with ``num_local_experts = E`` and
``num_experts_per_tok = k``; at the lesson's E = 64, k = 2 it gives 362.4B total, 12.9B active, 28.1×
(the lesson's page shows 362.9G / 13.4G / 27.0×; it counts about 0.5B more non-expert parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.analysis import get_gpu, param_bill
from moekit.analysis.roofline import expert_flops
from moekit.presets import hf_config_of_preset

PRESET = "mixtral-8x7b"
EP_GPU = "h100"  # the GPU whose dense bf16 peak prices an expert's work in the EP what-if
EP_DTYPE = "bf16"


@dataclass
class ParamCounts:
    """Whole-model parameters for the stated shape with E experts and top-k."""

    total: int  # every parameter, all E experts resident
    active: int  # what one token reads: everything but the E - k experts it did not pick
    sparsity: float  # total / active
    shape: str  # the stated shape, in words


def model_config(num_experts: int, top_k: int) -> dict:
    """The preset's config.json fields with E and k replaced."""
    cfg = hf_config_of_preset(PRESET)
    cfg.update(num_local_experts=num_experts, num_experts_per_tok=top_k)
    return cfg


def param_counts(num_experts: int, top_k: int, routed_per_token: float | None = None) -> ParamCounts:
    """The bill with E and k; ``routed_per_token`` (k·E/(E + Z) with identity experts, whose slots read no
    expert) prices the active experts instead of k."""
    cfg = model_config(num_experts, top_k)
    bill = param_bill(cfg)
    active = bill.active
    if routed_per_token is not None and routed_per_token != top_k:
        active -= round(bill.active_routed_experts * (1 - routed_per_token / top_k))
    shape = (f"{PRESET} shapes (d={cfg['hidden_size']}, d_ff={cfg['intermediate_size']}, "
             f"{cfg['num_hidden_layers']} layers) with E={num_experts}, k={top_k}")
    if routed_per_token is not None and routed_per_token != top_k:
        shape += f" ({routed_per_token:g} of them experts on average)"
    return ParamCounts(total=bill.total, active=active, sparsity=bill.total / active, shape=shape)


def seconds_per_assignment() -> float:
    """Cost model of the EP what-if: one routed token-assignment costs 6·d·d_ff FLOPs in one layer
    (w13 and w2, multiply-add) at the EP GPU's dense peak; 0.36 µs for Mixtral's expert on an H100."""
    cfg = hf_config_of_preset(PRESET)
    flops = expert_flops(1, 1, cfg["hidden_size"], cfg["intermediate_size"])
    return flops / get_gpu(EP_GPU).flops_per_s(EP_DTYPE)

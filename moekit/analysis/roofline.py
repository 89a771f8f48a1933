"""FLOPs, compulsory bytes, arithmetic intensity, the ridge batch and time floors of MoE layers.

Shapes: B = tokens in the batch, E = routed experts, k = experts per token, K = hidden size (d),
N = one expert's intermediate size (d_ff), b_w = bytes per weight element.

One routed expert holds 3·K·N weights (w13 [2N, K] and w2 [K, N]) and costs 6·K·N FLOPs per token routed to it
(ungated experts, up [N, K] and down [K, N], hold 2·K·N: ``matrices`` = 2, a refused family's billed layer,
``moekit.analysis.billed``; every formula below scales alike and I is unchanged). A batch therefore does F =
B·k·6·K·N FLOPs and must read Q = E_touched(B)·3·K·N·b_w weight bytes, so I = F/Q = 2·B·k / (b_w·E_touched(B)): K
and N cancel. Activations are O(B·K) bytes against O(E·K·N) of weights; they are reported but left out of I and the
floors, which count routed expert weights only (no attention, no shared expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moekit.analysis.formats import WeightFormat
from moekit.analysis.gpus import GpuSpec
from moekit.analysis.touch import experts_touched, experts_touched_from_inclusion, solve_increasing
from moekit.config import MoEConfig

ACTIVATION_BYTES = 2  # bf16 activations in and out of the layer
MAX_BATCH = 2**53  # batches enter float64 arithmetic, which holds every integer exactly up to 2^53


@dataclass(frozen=True)
class BatchCost:
    """The byte model of one batch size; per-layer fields are for one MoE layer's routed experts."""

    batch: int  # B, tokens
    experts_touched: float  # expected distinct experts read, k <= . <= E
    flops: float  # B·k·6·K·N (4·K·N ungated)
    weight_bytes: float  # compulsory: experts_touched·3·K·N·b_w (2·K·N ungated)
    activation_bytes: float  # x read once and out written once: 2·B·K·2 (bf16)
    intensity: float  # flops / weight_bytes, FLOP per byte
    memory_time_s: float  # weight_bytes / bandwidth: the weight-streaming floor
    compute_time_s: float  # flops / dense peak of the format's compute dtype
    time_floor_s: float  # max(memory_time_s, compute_time_s), one layer
    step_time_floor_s: float  # time_floor_s × MoE layers: one decode step's routed experts
    bound: str  # "memory" or "compute": which floor is higher
    num_moe_layers: int  # layers in step_time_floor_s; 1 when the model's layer count is unknown


def expert_params(cfg: MoEConfig) -> int:
    """3·K·N: weights of one routed expert."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def expert_flops(num_tokens: float, top_k: int, hidden_size: int, moe_intermediate_size: int,
                 matrices: int = 3) -> float:
    """F = B·k·6·K·N (B·k·4·K·N ungated, ``matrices=2``): each routed assignment does one multiply-add per weight of
    its expert."""
    return num_tokens * top_k * 2.0 * (matrices * hidden_size * moe_intermediate_size)


def expert_weight_bytes(experts_touched: float, hidden_size: int, moe_intermediate_size: int,
                        bytes_per_weight: float, matrices: int = 3) -> float:
    """Q = E_touched·3·K·N·b_w (2·K·N ungated): compulsory bytes, each weight of each touched expert read once."""
    return experts_touched * (matrices * hidden_size * moe_intermediate_size) * bytes_per_weight


def activation_bytes(num_tokens: float, hidden_size: int, bytes_per_element: float = ACTIVATION_BYTES) -> float:
    """2·B·K·b: x [B, K] read once and out [B, K] written once."""
    return 2.0 * num_tokens * hidden_size * bytes_per_element


def touched(cfg: MoEConfig, batch: float, inclusion: np.ndarray | None = None) -> float:
    """Expected experts touched: uniform routing, or skewed with per-expert ``inclusion`` [E] (sums to k; k·E/(E+Z)
    with Z identity experts, ``MoEConfig.routed_slots_per_token``, as everywhere in this byte model)."""
    if inclusion is None:
        return experts_touched(batch, cfg.num_experts, cfg.routed_slots_per_token)
    return experts_touched_from_inclusion(batch, inclusion)


def check_inclusion(cfg: MoEConfig, inclusion: np.ndarray) -> None:
    """Raise unless ``inclusion`` has one probability per routed expert and they sum to k."""
    k = cfg.routed_slots_per_token
    if inclusion.shape != (cfg.num_experts,) or not np.isclose(inclusion.sum(), k):
        raise ValueError(f"inclusion must have shape [{cfg.num_experts}] and sum to top_k={k:g}, got shape "
                         f"{inclusion.shape} summing to {inclusion.sum():.4g}")


def batch_cost(cfg: MoEConfig, batch: int, fmt: WeightFormat, gpu: GpuSpec,
               inclusion: np.ndarray | None = None, matrices: int = 3) -> BatchCost:
    """The byte model at one batch size, for uniform routing or skewed ``inclusion`` [E]; ``matrices``: an expert's
    weights in K·N (3 gated, 2 ungated). ``cfg.num_moe_layers`` None counts as one layer."""
    if not 1 <= batch <= MAX_BATCH:
        raise ValueError(f"batch must be in [1, 2^53 = {MAX_BATCH}], got {batch}")
    if inclusion is not None:
        check_inclusion(cfg, inclusion)
    touched_experts = touched(cfg, batch, inclusion)
    flops = expert_flops(batch, cfg.routed_slots_per_token, cfg.hidden_size, cfg.moe_intermediate_size, matrices)
    weight_bytes = expert_weight_bytes(touched_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                       fmt.bytes_per_weight, matrices)
    memory_s = weight_bytes / gpu.bandwidth_bytes_s
    compute_s = flops / gpu.flops_per_s(fmt.compute_dtype)
    floor = max(memory_s, compute_s)
    layers = cfg.num_moe_layers or 1
    return BatchCost(
        batch=batch,
        experts_touched=touched_experts,
        flops=flops,
        weight_bytes=weight_bytes,
        activation_bytes=activation_bytes(batch, cfg.hidden_size),
        intensity=flops / weight_bytes,
        memory_time_s=memory_s,
        compute_time_s=compute_s,
        time_floor_s=floor,
        step_time_floor_s=floor * layers,
        bound="memory" if memory_s >= compute_s else "compute",
        num_moe_layers=layers,
    )


def intensity_at_batch_one(fmt: WeightFormat) -> float:
    """I(1) = 2/b_w: one token reads k experts and does one multiply-add per weight, like a dense GEMV."""
    return 2.0 / fmt.bytes_per_weight


def asymptotic_slope(cfg: MoEConfig, fmt: WeightFormat) -> float:
    """dI/dB once every expert is touched: 2k/(b_w·E), the dense slope 2/b_w divided by E/k."""
    return 2.0 * cfg.routed_slots_per_token / (fmt.bytes_per_weight * cfg.num_experts)


def ridge_batch(cfg: MoEConfig, fmt: WeightFormat, gpu: GpuSpec, inclusion: np.ndarray | None = None) -> float:
    """The batch where I(B) reaches the GPU's ridge I* and the expert GEMMs turn compute-bound.

    Solved exactly (I is increasing in B, skewed or not); under uniform routing, once all experts are
    touched it is b_w·I*·E/(2k), the dense crossover b_w·I*/2 multiplied by E/k. Returns 1.0 when
    batch 1 is already compute-bound.
    """
    target = gpu.ridge_intensity(fmt.compute_dtype)

    def intensity(b: float) -> float:
        return 2.0 * b * cfg.routed_slots_per_token / (fmt.bytes_per_weight * touched(cfg, b, inclusion))

    if intensity(1.0) >= target:
        return 1.0
    return solve_increasing(intensity, target, 1.0, 2.0)


def dense_step_floor_s(params: float, batch: int, fmt: WeightFormat, gpu: GpuSpec) -> float:
    """Decode-step floor of a dense model with ``params`` weights: it reads them all once per step
    whatever the batch, and does 2 FLOPs per weight per token."""
    memory_s = params * fmt.bytes_per_weight / gpu.bandwidth_bytes_s
    compute_s = 2.0 * params * batch / gpu.flops_per_s(fmt.compute_dtype)
    return max(memory_s, compute_s)

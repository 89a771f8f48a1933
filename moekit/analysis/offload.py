"""The byte model of host-resident experts: a decode step when only C experts fit on the GPU.

Per MoE layer and batch B (k, K, N, b_w as in ``roofline``): the batch touches T(B) experts; a fraction
h of them (the hit rate) is in the GPU cache, the other T(1 - h) are misses. Fetched over a host link
of L bytes/s a miss costs 3·K·N·b_w / L and the copies overlap the GPU's work, so one layer takes

    fetch:  max(GPU floor of the T touched experts, T(1 - h)·3·K·N·b_w / L)
    CPU:    max(GPU floor of the T·h hits, CPU step + T(1 - h)·3·K·N·b_w / CPU read rate
                                           + misses' tokens · 6·K·N / CPU FLOP/s)

(a miss computed on the CPU carries B·k / T tokens on average). At decode the CPU path is bound by
streaming each missed expert's weights from host memory once (``moekit bench --offload`` measures
about 1.8 ms per 88 MB DeepSeek-V3 expert on the H200's host: ~49 GB/s) plus a fixed price per
forward (staging the inputs and the result); the FLOP term alone, the model before session 8,
predicts a decode step's CPU work as nearly free. With no measured hit rate the cache
holds each expert with probability C / (E·layers): uniform routing and a cache shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.analysis.formats import WeightFormat
from moekit.analysis.gpus import GpuSpec
from moekit.analysis.roofline import batch_cost, expert_weight_bytes
from moekit.config import MoEConfig


@dataclass(frozen=True)
class OffloadCost:
    """One batch size; ``*_time_s`` are per layer, ``step_*`` over the model's MoE layers."""

    batch: int
    experts_touched: float  # T(B), per layer
    hit_rate: float  # h: touched experts found in the GPU cache
    missed_experts: float  # T(1 - h), per layer
    gpu_time_s: float  # the GPU floor of all T touched experts (roofline.batch_cost)
    link_time_s: float  # the misses' weight bytes over the host link
    cpu_time_s: float | None  # the misses on the CPU: step + weight bytes + tokens (None without a CPU rate)
    step_time_s: float  # layers x max(gpu_time_s, link_time_s): misses fetched
    step_time_cpu_s: float | None  # layers x max(GPU floor of the hits, cpu_time_s): misses on the CPU


def offload_cost(cfg: MoEConfig, batch: int, fmt: WeightFormat, gpu: GpuSpec, *, link_bytes_s: float,
                 cache_experts: int, hit_rate: float | None = None, cpu_flops: float | None = None,
                 cpu_read_bytes_s: float | None = None, cpu_step_s: float = 0.0) -> OffloadCost:
    """The step time of ``batch`` tokens with ``cache_experts`` GPU slots for the whole model; the CPU
    column when ``cpu_flops`` or ``cpu_read_bytes_s`` is given (the other term is then 0)."""
    if link_bytes_s <= 0:
        raise ValueError(f"link bandwidth must be > 0, got {link_bytes_s}")
    layers = cfg.num_moe_layers or 1
    if cache_experts < 0:
        raise ValueError(f"cache_experts must be >= 0, got {cache_experts}")
    h = min(1.0, cache_experts / (cfg.num_experts * layers)) if hit_rate is None else hit_rate
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"hit rate must be in [0, 1], got {h}")
    cost = batch_cost(cfg, batch, fmt, gpu)
    touched, misses = cost.experts_touched, cost.experts_touched * (1 - h)
    link_s = expert_weight_bytes(misses, cfg.hidden_size, cfg.moe_intermediate_size,
                                 fmt.bytes_per_weight) / link_bytes_s
    cpu_s = step_cpu = None
    if cpu_flops is not None or cpu_read_bytes_s is not None:
        tokens_per_expert = batch * cfg.routed_slots_per_token / touched
        flops = misses * tokens_per_expert * 6 * cfg.hidden_size * cfg.moe_intermediate_size
        cpu_s = (flops / cpu_flops if cpu_flops else 0.0) + (cpu_step_s if misses > 0 else 0.0)
        if cpu_read_bytes_s:
            cpu_s += link_s * link_bytes_s / cpu_read_bytes_s  # the misses' weight bytes, streamed once
        step_cpu = layers * max(cost.time_floor_s * h, cpu_s)
    return OffloadCost(batch=batch, experts_touched=touched, hit_rate=h, missed_experts=misses,
                       gpu_time_s=cost.time_floor_s, link_time_s=link_s, cpu_time_s=cpu_s,
                       step_time_s=layers * max(cost.time_floor_s, link_s), step_time_cpu_s=step_cpu)

"""The main job, ``moekit demo``: on a small embedded MoE, prove grouped dispatch equals a naive
per-token loop, then measure load imbalance, drops and effective sparsity across batch sizes and
capacity factors, and experts touched against the uniform-routing prediction E*(1-(1-k/E)^B).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.routing import route

# The lesson's toy: 128 tokens x top-2 = 256 tiny per-token matmuls become 16 grouped ones.
DEMO_CONFIG = MoEConfig(hidden_size=64, moe_intermediate_size=128, num_experts=16, top_k=2)
BATCHES = (1, 8, 64, 512)
CAPACITY_FACTORS = (1.0, 1.25, 2.0, None)  # None = dropless
TOUCH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 512)
TRIALS = 16


@dataclass
class ExactnessCheck:
    tokens: int
    naive_matmuls: int  # per-token, per-slot expert calls of the naive loop
    grouped_matmuls: int  # experts with work in the grouped dispatch
    max_abs_diff: float  # float64 grouped vs naive


@dataclass
class SweepRow:
    batch: int
    capacity_factor: float | None  # None = dropless
    imbalance: float  # max expert load / mean expert load, before drops (mean over trials)
    drop_rate: float  # dropped assignments / (batch * k)
    effective_sparsity: float  # E / experts touched (mean over trials)


@dataclass
class TouchRow:
    batch: int
    measured: float  # distinct experts touched, mean over trials
    predicted: float  # E * (1 - (1 - k/E)^B) under uniform independent routing


@dataclass
class DemoReport:
    device: str
    config: dict
    exactness: ExactnessCheck
    sweep: list[SweepRow] = field(default_factory=list)
    touch: list[TouchRow] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def naive_per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The lesson's naive loop: route each token, then run its k experts one matmul at a time."""
    routing = moe.route_tokens(x).routing
    n = moe.config.moe_intermediate_size
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(routing.topk_ids[t].tolist(), routing.topk_weights[t].tolist()):
            h = moe.w13[e] @ x[t]
            out[t] += w * (moe.w2[e] @ (F.silu(h[:n]) * h[n:]))
    return out


def check_exactness(seed: int, device: str) -> ExactnessCheck:
    torch.manual_seed(seed)
    moe = MoE(DEMO_CONFIG, backend="grouped_mm", dtype=torch.float64, device=device)
    x = torch.randn(128, DEMO_CONFIG.hidden_size, dtype=torch.float64, device=device)
    with torch.no_grad():
        result = moe(x, return_stats=True)
        naive = naive_per_token(moe, x)
    diff = float((result.out - naive).abs().max())
    if diff > 1e-10:
        raise AssertionError(f"grouped dispatch differs from the naive per-token loop by {diff:.3e}")
    return ExactnessCheck(128, 128 * DEMO_CONFIG.top_k, result.stats.experts_touched, diff)


def predicted_touched(batch: int, num_experts: int, top_k: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def run_demo(seed: int = 0, device: str = "cpu", advance: Callable[[], None] = lambda: None) -> DemoReport:
    """Everything ``moekit demo`` prints; ``advance`` is called once per unit of work (for a progress bar)."""
    start = time.perf_counter()
    cfg = DEMO_CONFIG
    report = DemoReport(device=device, config=asdict(cfg), exactness=check_exactness(seed, device))
    advance()
    torch.manual_seed(seed)
    layers = {cf: MoE(cfg, capacity_factor=cf, device=device) for cf in CAPACITY_FACTORS}
    state = layers[None].state_dict()
    for layer in layers.values():
        layer.load_state_dict(state)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for batch in BATCHES:  # every capacity factor sees the same batches
            inputs = [torch.randn(batch, cfg.hidden_size, generator=g, device=device) for _ in range(TRIALS)]
            for cf, layer in layers.items():
                report.sweep.append(_sweep_cell(layer, inputs, cf))
                advance()
        for batch in TOUCH_BATCHES:
            touched = [_stats(layers[None], batch, g, device).experts_touched for _ in range(TRIALS)]
            report.touch.append(TouchRow(batch, sum(touched) / TRIALS,
                                         predicted_touched(batch, cfg.num_experts, cfg.top_k)))
            advance()
    report.seconds = time.perf_counter() - start
    return report


def total_steps() -> int:
    return 1 + len(BATCHES) * len(CAPACITY_FACTORS) + len(TOUCH_BATCHES)


def _stats(layer: MoE, batch: int, g: torch.Generator, device: str):
    x = torch.randn(batch, layer.config.hidden_size, generator=g, device=device)
    return layer(x, return_stats=True).stats


def _sweep_cell(layer: MoE, inputs: list[torch.Tensor], cf: float | None) -> SweepRow:
    cfg, batch = layer.config, inputs[0].shape[0]
    imbalance = drop_rate = sparsity = 0.0
    for x in inputs:
        stats = layer(x, return_stats=True).stats
        asked = route(layer.gate(x), cfg).topk_ids.reshape(-1).long()  # before any capacity drop
        loads = torch.bincount(asked, minlength=cfg.num_experts).float()
        imbalance += float(loads.max() / loads.mean())
        drop_rate += stats.dropped / (batch * cfg.top_k)
        sparsity += cfg.num_experts / stats.experts_touched
    n = len(inputs)
    return SweepRow(batch, cf, imbalance / n, drop_rate / n, sparsity / n)

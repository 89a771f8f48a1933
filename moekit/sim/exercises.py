"""The lesson's three exercises, answered with the simulator and the real ``MoE`` layer.

1. Effective sparsity vs batch size: the first batch at which a step touches > 90% of the experts.
2. Capacity factor vs output quality: the capacity-dropping ``MoE`` against the dropless one.
3. Expert parallelism on 8 GPUs: step time as max over GPUs vs mean; the throughput a 2× imbalance costs.

Shapes: E experts, k = top_k, B batch, M tokens, G GPUs. All three use the synthetic router
(``moekit.sim.router``) so skew means the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.analysis import batch_for_fraction, experts_touched
from moekit.config import MoEConfig
from moekit.layer import MoE
from moekit.sim import streams
from moekit.sim.balance import expert_loads
from moekit.sim.ep import EPReport, ep_what_if
from moekit.sim.router import draw_tokens, make_router

LESSON_SKEW = 0.55


@dataclass
class SparsityCurve:
    """Fraction of the E experts a batch touches, per batch size, at one skew."""

    skew: float
    batches: list[int]  # B = 1..max_batch
    simulated: list[float]  # mean fraction touched over the trials
    first_over: int | None  # first B whose simulated fraction exceeds the threshold; None if none does


@dataclass
class Exercise1:
    experts: int
    top_k: int
    threshold: float  # 0.9
    predicted: list[float]  # uniform prediction of the fraction touched, per B in the curves' batches
    predicted_first_over: int  # first integer B with predicted fraction > threshold
    predicted_b: float  # B_p = ln(1-p)/ln(1-k/E), the real-valued crossing
    curves: list[SparsityCurve]  # skew 0 (uniform router) and the lesson's skew


def exercise1(experts: int = 64, top_k: int = 2, threshold: float = 0.9, max_batch: int = 1024,
              trials: int = 64, seed: int = 5, skews=(0.0, LESSON_SKEW)) -> Exercise1:
    """Sweep B = 1..max_batch: a batch's touched set is the experts among its tokens' choices.

    The fraction gains only (1 - f)·k/E ≈ 0.3% per token near 90% (E=64, k=2), so the crossing is
    sensitive to noise: 64 trials put the mean curve within about ±0.5% of its expectation there."""
    batches = list(range(1, max_batch + 1))
    predicted = [experts_touched(b, experts, top_k) / experts for b in batches]
    curves = []
    for skew in skews:
        router = make_router(experts, top_k, skew, seed)
        gen = streams.generator(seed, streams.TOUCH)
        touched = torch.zeros(max_batch)
        for _ in range(trials):
            ids = router.route(draw_tokens(max_batch, experts, gen)).topk_ids.long()  # [B_max, k]
            first = torch.full((experts,), max_batch, dtype=torch.long)  # first token index using expert e
            first.scatter_reduce_(0, ids.reshape(-1), torch.arange(max_batch).repeat_interleave(top_k), "amin")
            touched += (first[None, :] < torch.arange(1, max_batch + 1)[:, None]).sum(dim=1)  # [B_max]
        fraction = (touched / (trials * experts)).tolist()
        curves.append(SparsityCurve(skew, batches, fraction, _first_over(batches, fraction, threshold)))
    return Exercise1(experts, top_k, threshold, predicted, _first_over(batches, predicted, threshold),
                     batch_for_fraction(threshold, experts, top_k), curves)


def _first_over(batches: list[int], values: list[float], threshold: float) -> int | None:
    return next((b for b, v in zip(batches, values) if v > threshold), None)


@dataclass
class CapacityPoint:
    capacity_factor: float
    drop_rate: float  # dropped assignments / (M·k)
    relative_error: float  # ||y_cf - y_dropless|| / ||y_dropless||


@dataclass
class CapacityCurve:
    skew: float
    points: list[CapacityPoint]  # ascending capacity factor
    last_with_drops: float | None  # the largest capacity factor that still drops something
    last_over_tolerance: float | None  # the largest capacity factor whose error exceeds the tolerance


@dataclass
class Exercise2:
    tokens: int
    experts: int
    top_k: int
    tolerance: float  # relative output error that "matters" (1%)
    curves: list[CapacityCurve]


CAPACITY_FACTORS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)


def exercise2(experts: int = 64, top_k: int = 2, tokens: int = 512, intermediate: int = 64,
              tolerance: float = 0.01, seed: int = 5, skews=(0.0, LESSON_SKEW),
              capacity_factors=CAPACITY_FACTORS) -> Exercise2:
    """The real ``MoE`` layer (float32, random experts) whose gate is the synthetic router, run dropless
    and with each capacity factor on the same tokens and weights."""
    curves = []
    for skew in skews:
        router = make_router(experts, top_k, skew, seed)
        config = MoEConfig(hidden_size=router.num_features, moe_intermediate_size=intermediate,
                           num_experts=experts, top_k=top_k)
        with torch.random.fork_rng():  # seeded expert weights without touching the caller's RNG
            torch.manual_seed(seed)
            dropless = MoE(config)
        with torch.no_grad():
            dropless.gate.weight.copy_(router.weight.t())  # [E, F]: the gate computes the router's logits
        x = draw_tokens(tokens, experts, streams.generator(seed, streams.EVAL))  # [M, F]
        with torch.no_grad():
            reference = dropless(x)  # [M, F]
            points = [_capacity_point(dropless, config, x, reference, cf) for cf in capacity_factors]
        curves.append(CapacityCurve(
            skew, points,
            max((p.capacity_factor for p in points if p.drop_rate > 0), default=None),
            max((p.capacity_factor for p in points if p.relative_error > tolerance), default=None),
        ))
    return Exercise2(tokens, experts, top_k, tolerance, curves)


def _capacity_point(dropless: MoE, config: MoEConfig, x: torch.Tensor, reference: torch.Tensor,
                    capacity_factor: float) -> CapacityPoint:
    capped = MoE(config, capacity_factor=capacity_factor)
    capped.load_state_dict(dropless.state_dict())
    result = capped(x, return_stats=True)
    error = float(torch.linalg.vector_norm(result.out - reference) / torch.linalg.vector_norm(reference))
    return CapacityPoint(capacity_factor, result.stats.dropped / (x.shape[0] * config.top_k), error)


@dataclass
class SkewPoint:
    skew: float
    ep: EPReport  # contiguous, round-robin and EPLB priced at this skew


@dataclass
class Exercise3:
    experts: int
    top_k: int
    tokens: int
    gpus: int
    spare_slots: int
    target_imbalance: float  # 2.0
    analytic_throughput_lost: float  # 1 - 1/target: what a max/mean = target costs, by definition
    sweep: list[SkewPoint]
    at_target: SkewPoint | None  # the first skew whose contiguous placement reaches the target imbalance


def exercise3(experts: int = 64, top_k: int = 2, tokens: int = 4096, gpus: int = 8, spare_slots: int = 8,
              target_imbalance: float = 2.0, seed: int = 5, skews=None) -> Exercise3:
    """Sweep the skew on a large batch (so the loads are the router's, not sampling noise) and price
    each placement; report the first skew at which the contiguous placement runs 2× imbalanced."""
    skews = [round(0.02 * i, 2) for i in range(41)] if skews is None else list(skews)
    sweep = []
    for skew in skews:
        router = make_router(experts, top_k, skew, seed)
        x = draw_tokens(tokens, experts, streams.generator(seed, streams.EVAL))  # [M, F]
        loads = expert_loads(router.route(x).topk_ids, experts).tolist()  # [E]
        sweep.append(SkewPoint(skew, ep_what_if(loads, gpus, spare_slots)))
    at_target = next((p for p in sweep if p.ep.placements[0].imbalance >= target_imbalance), None)
    return Exercise3(experts, top_k, tokens, gpus, spare_slots, target_imbalance,
                     1.0 - 1.0 / target_imbalance, sweep, at_target)

"""How many distinct experts a batch touches: the quantity the weight traffic of an MoE layer follows.

Shapes: B = tokens in the batch, E = routed experts, k = experts per token.

Under uniform routing with independent tokens each token misses a given expert with probability
1 - k/E, so the expected number touched is E·(1 - (1 - k/E)^B): k at B = 1, E as B → ∞.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np


def solve_increasing(f: Callable[[float], float], target: float, lo: float, hi: float, steps: int = 100) -> float:
    """The x >= ``lo`` where an increasing ``f`` reaches ``target``: ``hi`` is doubled until f(hi) >= target,
    then ``steps`` bisections (100 reach float64 resolution from a doubled bracket); returns the upper end."""
    while f(hi) < target:
        lo, hi = hi, hi * 2.0
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return hi


def _check(num_experts: int, top_k: int) -> None:
    if not 0 < top_k <= num_experts:  # a fraction with identity experts (MoEConfig.routed_slots_per_token)
        raise ValueError(f"need 0 < top_k <= num_experts, got top_k={top_k}, num_experts={num_experts}")


def experts_touched(batch: float, num_experts: int, top_k: int) -> float:
    """Expected distinct experts touched by ``batch`` tokens under uniform, independent routing."""
    _check(num_experts, top_k)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def batch_for_fraction(fraction: float, num_experts: int, top_k: int) -> float:
    """B_p = ln(1-p) / ln(1-k/E): the batch at which a fraction p of the experts is touched on average.

    The half-way batch is ``batch_for_fraction(0.5, ...)``; it is 0 when k = E (one token touches all).
    """
    _check(num_experts, top_k)
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if top_k == num_experts:
        return 0.0
    return math.log(1.0 - fraction) / math.log(1.0 - top_k / num_experts)


def experts_touched_from_inclusion(batch: float, inclusion: Sequence[float] | np.ndarray) -> float:
    """Expected distinct experts touched for non-uniform routing, exact for independent tokens.

    ``inclusion[e]`` is the probability that one token routes to expert e (its marginal inclusion
    probability; the entries sum to k). Tokens are independent, so expert e is missed by all B of them
    with probability (1 - inclusion[e])^B, whatever the correlations between experts within a token.
    """
    pi = np.asarray(inclusion, dtype=np.float64)  # [E]
    if pi.ndim != 1 or pi.size == 0 or pi.min() < 0 or pi.max() > 1:
        raise ValueError(f"inclusion must be a non-empty 1-D array of probabilities in [0, 1], got {pi}")
    return float(np.sum(1.0 - (1.0 - pi) ** batch))


def batch_for_fraction_from_inclusion(fraction: float, inclusion: Sequence[float] | np.ndarray) -> float:
    """The batch at which a fraction p of all E experts is touched on average under skewed routing,
    solved by bisection (the expectation increases with B); ``inf`` when fewer than p·E experts ever
    receive tokens."""
    pi = np.asarray(inclusion, dtype=np.float64)  # [E]
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    target = fraction * pi.size
    if np.count_nonzero(pi) <= target:
        return math.inf
    return solve_increasing(lambda b: experts_touched_from_inclusion(b, pi), target, 0.0, 1.0)


def inclusion_from_counts(counts: Sequence[int] | np.ndarray, num_tokens: int) -> np.ndarray:
    """Inclusion probabilities measured from per-expert counts over ``num_tokens`` tokens: counts / M.
    Dropless routing gives every token k assignments, so M = sum(counts) / k when only counts are known."""
    c = np.asarray(counts, dtype=np.float64)  # [E]; c[e] = tokens routed to expert e
    if num_tokens < 1 or c.min() < 0 or c.max() > num_tokens:
        raise ValueError(f"counts must lie in [0, num_tokens={num_tokens}], got min {c.min()}, max {c.max()}")
    return c / num_tokens


def inclusion_from_weights(weights: Sequence[float] | np.ndarray, top_k: int) -> np.ndarray:
    """Inclusion probabilities when each token draws k distinct experts with probability ∝ ``weights``
    (successive sampling without replacement, as Gumbel top-k does).

    That has no closed form; this is the standard Poisson approximation pi_e = 1 - exp(-t·w_e), with t
    solved so the pi_e sum to k. It is exact for uniform weights, and the tests hold it against a
    Monte-Carlo simulation of the sampling for skewed ones.
    """
    w = np.asarray(weights, dtype=np.float64)  # [E]
    if w.ndim != 1 or w.min() < 0 or np.count_nonzero(w) < top_k:
        raise ValueError(f"weights must be 1-D, non-negative, with at least top_k={top_k} positive entries")
    if np.count_nonzero(w) == top_k:  # every token takes exactly the positive-weight experts
        return (w > 0).astype(np.float64)
    w = w / w.sum()
    t = solve_increasing(lambda t: float(np.sum(1.0 - np.exp(-t * w))), top_k, 0.0, 1.0)
    return 1.0 - np.exp(-t * w)


def experts_touched_from_counts(counts: Sequence[int] | np.ndarray) -> int:
    """Distinct experts a measured batch touched: the experts with a non-zero count."""
    return int(np.count_nonzero(np.asarray(counts)))

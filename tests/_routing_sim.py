"""Monte-Carlo routing for the analysis tests: each token draws k distinct experts, with probability
proportional to ``weights`` (successive sampling, via Gumbel top-k), uniform when ``weights`` is None.

Shapes: T = trials, B = tokens per batch, E = experts, k = experts per token.
"""

from __future__ import annotations

import numpy as np


def simulate_counts(rng: np.random.Generator, trials: int, batch: int, num_experts: int, top_k: int,
                    weights: np.ndarray | None = None) -> np.ndarray:
    """counts [T, E]: counts[t, e] is the number of the B tokens of trial t routed to expert e."""
    keys = rng.gumbel(size=(trials, batch, num_experts))  # [T, B, E]
    if weights is not None:
        keys += np.log(weights)
    ids = np.argpartition(-keys, top_k - 1, axis=-1)[..., :top_k]  # [T, B, k]; the k largest keys
    flat = ids + num_experts * np.arange(trials)[:, None, None]  # [T, B, k]; expert id offset per trial
    return np.bincount(flat.ravel(), minlength=trials * num_experts).reshape(trials, num_experts)


def within(samples: np.ndarray, expected: float, sigmas: float = 5.0) -> bool:
    """Whether the sample mean is within ``sigmas`` standard errors of ``expected``, plus 1e-4 relative
    slack for rare events a sample of this size cannot see (its standard error can then be zero)."""
    se = samples.std(ddof=1) / np.sqrt(samples.size)
    return abs(samples.mean() - expected) <= sigmas * se + 1e-4 * max(1.0, abs(expected))

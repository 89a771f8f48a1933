"""The padding tax: padded rows / real rows when each expert's rows are rounded up to a whole tile.

Shapes: B = tokens, E = routed experts, k = experts per token, m_e = rows of expert e (sum = B·k),
b = block height (the tile M of the block-aligned layout, or the segment alignment of the contiguous one).

Both the block-aligned index layout (vLLM's moe_align_block_size) and the contiguous permuted layout
(DeepGEMM's, aligned to 128 rows) give expert e ceil(m_e/b)·b rows, so one expectation covers both.
Under uniform, independent routing each token picks expert e with probability k/E, so m_e is exactly
Binomial(B, k/E), and E[padded rows] = E · Σ_m P(m) · ceil(m/b)·b is computed exactly over that pmf.
The masked layout instead gives every expert max_e(m_e) rows, rounded up to the block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

CONTIGUOUS_ALIGN = 128  # DeepGEMM's block-M for its contiguous grouped GEMM


def _log_choose(n: int, m: np.ndarray) -> np.ndarray:
    """ln C(n, m) for each entry of ``m`` (integers in [0, n]), through lgamma so n in the millions is fine."""
    return np.array([math.lgamma(n + 1) - math.lgamma(v + 1) - math.lgamma(n - v + 1) for v in m], dtype=np.float64)


def binomial_pmf(n: int, p: float) -> np.ndarray:
    """P(m) for m = 0..n of Binomial(n, p), in log space so n in the millions stays finite.

    Entries more than 40 standard deviations + 10 from the mean are left 0: by a Chernoff bound their
    mass is below 1e-30, and skipping them keeps a million-token batch to a few thousand lgamma calls.
    """
    if n < 0 or not 0.0 <= p <= 1.0:
        raise ValueError(f"need n >= 0 and 0 <= p <= 1, got n={n}, p={p}")
    pmf = np.zeros(n + 1)
    if p in (0.0, 1.0):
        pmf[n if p == 1.0 else 0] = 1.0
        return pmf
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    lo, hi = max(0, math.floor(mean - 40 * sd - 10)), min(n, math.ceil(mean + 40 * sd + 10))
    m = np.arange(lo, hi + 1)
    pmf[lo:hi + 1] = np.exp(_log_choose(n, m) + m * math.log(p) + (n - m) * math.log1p(-p))
    return pmf


def expected_padded_rows(batch: int, num_experts: int, top_k: int, block: int) -> float:
    """E[Σ_e ceil(m_e/b)·b] under uniform, independent routing; empty experts cost no rows."""
    if block < 1 or not 1 <= top_k <= num_experts or batch < 0:
        raise ValueError(f"need block >= 1, 1 <= top_k <= num_experts, batch >= 0; got {block}, {top_k}, "
                         f"{num_experts}, {batch}")
    pmf = binomial_pmf(batch, top_k / num_experts)  # [B+1]; P(m_e = m) for any one expert
    rows = np.ceil(np.arange(batch + 1) / block) * block  # [B+1]; padded rows of an expert with m rows
    return num_experts * float(pmf @ rows)


def padding_factor_from_inclusion(batch: int, inclusion: Sequence[float] | np.ndarray, block: int) -> float:
    """Expected padding factor under skewed routing: tokens are independent, so expert e's rows are
    exactly Binomial(B, inclusion[e]); real rows are B·k with k = sum(inclusion)."""
    pi = np.asarray(inclusion, dtype=np.float64)  # [E]
    if batch < 1 or block < 1 or pi.ndim != 1 or pi.min() < 0 or pi.max() > 1:
        raise ValueError(f"need batch >= 1, block >= 1 and inclusion probabilities in [0, 1]; got {batch}, {block}")
    m = np.arange(batch + 1, dtype=np.float64)  # [B+1]
    rows = np.ceil(m / block) * block  # [B+1]; padded rows of an expert with m rows
    inner = pi[(pi > 0) & (pi < 1)]  # [E']; p = 0 costs no rows, p = 1 costs rows[B]
    log_pmf = _log_choose(batch, m) + m * np.log(inner)[:, None] + (batch - m) * np.log1p(-inner)[:, None]  # [E', B+1]
    padded = float((np.exp(log_pmf) @ rows).sum())  # an empty [0] sum is 0
    padded += np.count_nonzero(pi == 1) * rows[batch]
    return padded / (batch * pi.sum())


def padding_factor(batch: int, num_experts: int, top_k: int, block: int) -> float:
    """Expected padded rows / real rows (B·k) for block height ``block``; >= 1, → 1 as B grows."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return expected_padded_rows(batch, num_experts, top_k, block) / (batch * top_k)


def expected_padding_factor(batch: int, num_experts: int, top_k: int, block: int,
                            inclusion: Sequence[float] | np.ndarray | None = None) -> float:
    """The expected factor under uniform routing, or under skewed routing with per-expert ``inclusion`` [E]."""
    if inclusion is None:
        return padding_factor(batch, num_experts, top_k, block)
    return padding_factor_from_inclusion(batch, inclusion, block)


def contiguous_padding_factor(batch: int, num_experts: int, top_k: int, align: int = CONTIGUOUS_ALIGN) -> float:
    """The contiguous layout's factor: segments start on ``align``-row boundaries (128 for DeepGEMM)."""
    return padding_factor(batch, num_experts, top_k, align)


def padding_factor_from_counts(counts: Sequence[int] | np.ndarray, block: int) -> float:
    """Measured factor of the block-aligned / contiguous layouts from per-expert row counts [E]."""
    c = np.asarray(counts, dtype=np.int64)  # [E]
    real = int(c.sum())
    if real == 0:
        raise ValueError("counts are all zero: no rows to pad")
    return float(np.sum(-(-c // block) * block)) / real


def masked_padding_factor_from_counts(counts: Sequence[int] | np.ndarray, block: int) -> float:
    """Measured factor of the masked layout: every expert is given the busiest one's rows, block-rounded."""
    c = np.asarray(counts, dtype=np.int64)  # [E]
    real = int(c.sum())
    if real == 0:
        raise ValueError("counts are all zero: no rows to pad")
    return float(c.size * (-(-int(c.max()) // block) * block)) / real

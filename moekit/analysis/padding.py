"""The padding tax: padded rows / real rows when each expert's rows are rounded up to a whole tile.

Shapes: B = tokens, E = routed experts, k = experts per token, m_e = rows of expert e (sum = B·k),
b = block height (the tile M of the block-aligned layout, or the segment alignment of the contiguous one).

Both the block-aligned index layout (vLLM's moe_align_block_size) and the contiguous permuted layout
(DeepGEMM's, aligned to 128 rows) give expert e ceil(m_e/b)·b rows, so one expectation covers both.
Under uniform, independent routing each token picks expert e with probability k/E, so m_e is exactly
Binomial(B, k/E), and E[padded rows] = E·(B·k/E + E[(-m) mod b]); the expected gap E[(-m) mod b] is
computed exactly from the distribution of m mod b (``expected_gap``), in time and memory independent of B.
The masked layout instead gives every expert max_e(m_e) rows, rounded up to the block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CONTIGUOUS_ALIGN = 128  # DeepGEMM's block-M for its contiguous grouped GEMM


def expected_gap(batch: int, inclusion: np.ndarray, block: int) -> np.ndarray:
    """E[(-m_e) mod b] per expert for m_e ~ Binomial(B, inclusion[e]): the rows ceil(m/b)·b adds to m.

    Exact for any B in O(E·b log b) time and memory, by the roots-of-unity filter: with ω = e^{2πi/b},
    φ_j = E[ω^{j·m}] = (1 - p + p·ω^j)^B and P(m ≡ r mod b) = (1/b)·Σ_j ω^{-j·r}·φ_j, an inverse DFT.
    For p > 1/2 the count of misses B - m ~ Binomial(B, 1 - p) is used instead, so the base
    1 - q + q·ω^j (q <= 1/2) stays away from the unit circle and B·arg(base) stays small wherever
    |base|^B is not already 0; that keeps the phases accurate at B = 1e12.
    """
    p = np.asarray(inclusion, dtype=np.float64)  # [E]
    flip = p > 0.5  # [E]; count misses instead of hits
    q = np.where(flip, 1.0 - p, p)[:, None]  # [E, 1], in [0, 1/2]
    omega = np.exp(2j * np.pi * np.arange(block) / block)  # [b]
    with np.errstate(divide="ignore"):  # q = 1/2 at ω^j = -1: base 0, log -inf, power 0
        phi = np.exp(batch * np.log(1.0 - q + q * omega))  # [E, b]; E[ω^{j·m}], m ~ Binomial(B, q)
    residue = np.fft.fft(phi, axis=1).real / block  # [E, b]; P(m ≡ r mod b)
    r = np.arange(block)  # [b]
    gap = np.where(flip[:, None], (r - batch) % block, (-r) % block)  # [E, b]; for misses r, hits are B - r
    return (residue * gap).sum(axis=1)  # [E]


def expected_padded_rows(batch: int, num_experts: int, top_k: int, block: int) -> float:
    """E[Σ_e ceil(m_e/b)·b] under uniform, independent routing; empty experts cost no rows."""
    if block < 1 or not 0 < top_k <= num_experts or batch < 0:
        raise ValueError(f"need block >= 1, 0 < top_k <= num_experts, batch >= 0; got {block}, {top_k}, "
                         f"{num_experts}, {batch}")
    p = top_k / num_experts
    return num_experts * (batch * p + float(expected_gap(batch, np.array([p]), block)[0]))


def padding_factor_from_inclusion(batch: int, inclusion: Sequence[float] | np.ndarray, block: int) -> float:
    """Expected padding factor under skewed routing: tokens are independent, so expert e's rows are
    exactly Binomial(B, inclusion[e]); real rows are B·k with k = sum(inclusion)."""
    pi = np.asarray(inclusion, dtype=np.float64)  # [E]
    if batch < 1 or block < 1 or pi.ndim != 1 or pi.min() < 0 or pi.max() > 1:
        raise ValueError(f"need batch >= 1, block >= 1 and inclusion probabilities in [0, 1]; got {batch}, {block}")
    real = batch * pi.sum()
    return (real + float(expected_gap(batch, pi, block).sum())) / real


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

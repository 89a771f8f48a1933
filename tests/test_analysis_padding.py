"""Padding factor: the exact binomial expectation against an exact rational sum over the pmf, against
Monte-Carlo routing and against the real layouts' own padding, plus its limits."""

import math
import time
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest
import torch

from _routing_sim import simulate_counts, within
from moekit.analysis.padding import (
    contiguous_padding_factor,
    expected_padded_rows,
    masked_padding_factor_from_counts,
    padding_factor,
    padding_factor_from_counts,
    padding_factor_from_inclusion,
)
from moekit.layouts.block_aligned import align_block
from moekit.layouts.contiguous import permute_contiguous


@pytest.mark.parametrize("num_experts,top_k,batch,block", [(256, 8, 64, 16), (128, 8, 48, 16), (60, 4, 30, 128),
                                                           (32, 4, 200, 64), (8, 2, 100, 16)])
def test_expected_padding_matches_simulation(num_experts, top_k, batch, block):
    counts = simulate_counts(np.random.default_rng(3), 1000, batch, num_experts, top_k)  # [T, E]
    padded = (-(-counts // block) * block).sum(axis=1)  # [T]
    assert within(padded, expected_padded_rows(batch, num_experts, top_k, block))


def test_padding_limits():
    for e, k in ((256, 8), (128, 8), (8, 2)):
        for block in (16, 64, 128):
            assert padding_factor(1, e, k, block) == pytest.approx(block)  # k rows, each its own tile
            assert 1.0 <= padding_factor(4096, e, k, block) <= block
        assert padding_factor(1_000_000, e, k, 128) < 1.005  # ~E·64 wasted rows / (B·k)
        assert padding_factor(50, e, k, 1) == pytest.approx(1.0)  # no alignment, no padding
    assert contiguous_padding_factor(512, 256, 8) == padding_factor(512, 256, 8, 128)


def _exact_padded_rows(batch: int, p: Fraction, block: int) -> Fraction:
    """Σ_m C(B, m)·p^m·(1-p)^(B-m)·ceil(m/b)·b in rational arithmetic: the definition, term by term."""
    return sum(math.comb(batch, m) * p**m * (1 - p) ** (batch - m) * (-(-m // block)) * block for m in range(batch + 1))


@pytest.mark.parametrize("batch", [0, 1, 2, 7, 64, 300])
@pytest.mark.parametrize("num_experts,top_k", [(256, 8), (8, 2), (4, 3), (2, 1), (16, 16), (5, 4)])
@pytest.mark.parametrize("block", [1, 3, 16, 128])
def test_expected_padded_rows_is_the_exact_sum(batch, num_experts, top_k, block):
    exact = num_experts * _exact_padded_rows(batch, Fraction(top_k, num_experts), block)
    assert expected_padded_rows(batch, num_experts, top_k, block) == pytest.approx(float(exact), rel=1e-12, abs=1e-9)


def test_padding_from_inclusion_is_the_exact_sum():
    pi = [Fraction(n, 20) for n in (0, 20, 19, 12, 10, 6, 4, 2, 7)]  # 0, 1, p > 1/2, p = 1/2, p < 1/2
    for batch in (1, 5, 40, 200):
        for block in (4, 16, 64):
            exact = sum(_exact_padded_rows(batch, p, block) for p in pi) / (batch * sum(pi))
            got = padding_factor_from_inclusion(batch, np.array([float(p) for p in pi]), block)
            assert got == pytest.approx(float(exact), rel=1e-12)


def test_padding_at_a_trillion_tokens_is_fast_exact_and_small():
    # Once B·p·(1-p) >> b², m mod b is uniform: each expert pads (b-1)/2 rows on average.
    tracemalloc.start()
    start = time.perf_counter()
    uniform = padding_factor(10**12, 256, 8, 128)
    skewed = padding_factor_from_inclusion(10**12, np.array([1 - 1e-6, 1.0, 0.5, 1e-6, 0.0]), 16)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert uniform == pytest.approx(1 + 256 * 63.5 / (8 * 10**12), rel=1e-14)
    # expert 1 (p = 1) pads (-B) mod 16 = 0 rows, expert 4 (p = 0) none, the other three 7.5 each
    assert skewed == pytest.approx(1 + 3 * 7.5 / (10**12 * 2.5), rel=1e-14)
    assert elapsed < 1.0 and peak < 1_000_000  # O(E·b), not O(B): the old pmf needed 8 TB here


def test_seed_chapter_example():
    # DeepSeek-V3 at batch 64, BLOCK_SIZE_M = 16: ~222 experts x 16 ~ 3,552 padded rows, 6.9 per real row.
    assert expected_padded_rows(64, 256, 8, 16) == pytest.approx(3552, rel=0.005)
    assert padding_factor(64, 256, 8, 16) == pytest.approx(6.9, abs=0.06)


@pytest.mark.parametrize("block", [16, 64])
def test_from_counts_matches_block_aligned_layout(block):
    topk_ids = torch.stack([torch.randperm(32)[:4] for _ in range(50)]).to(torch.int32)  # [M=50, k=4], E=32
    counts = torch.bincount(topk_ids.flatten().long(), minlength=32).numpy()  # [E]
    layout = align_block(topk_ids, 32, block)
    assert padding_factor_from_counts(counts, block) == pytest.approx(layout.padding_factor())


def test_from_counts_matches_contiguous_layout():
    topk_ids = torch.stack([torch.randperm(16)[:2] for _ in range(300)]).to(torch.int32)  # [M=300, k=2], E=16
    counts = torch.bincount(topk_ids.flatten().long(), minlength=16).numpy()
    layout = permute_contiguous(torch.randn(300, 8), topk_ids, 16, align=128)
    assert padding_factor_from_counts(counts, 128) == pytest.approx(layout.padding_factor())


def test_masked_from_counts():
    assert masked_padding_factor_from_counts([4, 4, 4, 4], 4) == 1.0  # balanced
    assert masked_padding_factor_from_counts([8, 0, 0, 0], 4) == 4.0  # every expert gets the busiest's rows
    with pytest.raises(ValueError, match="all zero"):
        padding_factor_from_counts([0, 0], 16)
    with pytest.raises(ValueError, match="all zero"):
        masked_padding_factor_from_counts([0, 0], 16)


def test_padding_under_skew_matches_simulation():
    rng = np.random.default_rng(4)
    weights = 1.0 / np.arange(1, 33) ** 1.2  # Zipf-like over 32 experts, k = 4
    calibration = simulate_counts(rng, 1, 200_000, 32, 4, weights)[0]  # [E]
    inclusion = calibration / 200_000
    counts = simulate_counts(rng, 1000, 40, 32, 4, weights)  # [T, E]
    for block in (16, 64):
        factor = (-(-counts // block) * block).sum(axis=1) / (40 * 4)  # [T]
        assert within(factor, padding_factor_from_inclusion(40, inclusion, block), sigmas=6)
        assert padding_factor_from_inclusion(40, inclusion, block) < padding_factor(40, 32, 4, block)


def test_padding_from_inclusion_reduces_to_uniform():
    for batch, block in ((1, 16), (64, 16), (512, 128)):
        assert padding_factor_from_inclusion(batch, np.full(256, 8 / 256), block) == pytest.approx(
            padding_factor(batch, 256, 8, block))
    pinned = np.zeros(8)
    pinned[:2] = 1.0  # every token on experts 0 and 1: 5 rows each, padded to 8
    assert padding_factor_from_inclusion(5, pinned, 4) == pytest.approx(16 / 10)

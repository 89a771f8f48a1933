"""Padding factor: the exact binomial expectation against Monte-Carlo routing and against the real
layouts' own padding, plus its limits."""

import numpy as np
import pytest
import torch

from _routing_sim import simulate_counts, within
from moekit.analysis.padding import (
    binomial_pmf,
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


def test_binomial_pmf():
    pmf = binomial_pmf(4096, 8 / 256)
    assert pmf.sum() == pytest.approx(1.0)
    assert pmf @ np.arange(4097) == pytest.approx(4096 * 8 / 256)
    assert binomial_pmf(3, 1.0).tolist() == [0, 0, 0, 1]


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

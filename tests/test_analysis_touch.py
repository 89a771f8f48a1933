"""Experts touched: closed forms against Monte-Carlo routing, limits as properties, the seed's numbers."""

import math

import numpy as np
import pytest

from _routing_sim import simulate_counts, within
from moekit.analysis.touch import (
    batch_for_fraction,
    batch_for_fraction_from_inclusion,
    experts_touched,
    experts_touched_from_counts,
    experts_touched_from_inclusion,
    inclusion_from_counts,
    inclusion_from_weights,
)


@pytest.mark.parametrize("num_experts,top_k,batch", [(256, 8, 1), (256, 8, 22), (256, 8, 64), (128, 8, 11),
                                                     (60, 4, 7), (8, 2, 3)])
def test_uniform_touch_matches_simulation(num_experts, top_k, batch):
    counts = simulate_counts(np.random.default_rng(0), 1000, batch, num_experts, top_k)  # [T, E]
    touched = (counts > 0).sum(axis=1)  # [T]
    assert within(touched, experts_touched(batch, num_experts, top_k))


def test_touch_limits():
    for e, k in ((256, 8), (128, 8), (8, 2), (4, 4)):
        assert experts_touched(1, e, k) == pytest.approx(k)
        assert experts_touched(10**6, e, k) == pytest.approx(e)
        series = [experts_touched(b, e, k) for b in range(1, 300)]
        assert all(a <= b + 1e-9 for a, b in zip(series, series[1:]))  # non-decreasing
        assert all(t <= min(e, b * k) + 1e-9 for b, t in enumerate(series, start=1))


def test_batch_for_fraction_inverts_touch():
    for p in (0.1, 0.5, 0.95, 0.999):
        b = batch_for_fraction(p, 256, 8)
        assert experts_touched(b, 256, 8) / 256 == pytest.approx(p)
    assert batch_for_fraction(0.5, 8, 8) == 0.0
    with pytest.raises(ValueError, match="fraction"):
        batch_for_fraction(1.0, 256, 8)


def test_seed_chapter_numbers():
    # B_1/2 = 21.8 and 10.7, B_95 = 94 and 46 for DeepSeek-V3 and Qwen3-30B-A3B.
    assert round(batch_for_fraction(0.5, 256, 8), 1) == 21.8
    assert round(batch_for_fraction(0.5, 128, 8), 1) == 10.7
    assert round(batch_for_fraction(0.95, 256, 8)) == 94
    assert round(batch_for_fraction(0.95, 128, 8)) == 46
    # 64 tokens touch ~222 of DeepSeek-V3's 256 experts (87%).
    assert round(experts_touched(64, 256, 8)) == 222


def test_inclusion_touch_is_exact_for_measured_skew():
    rng = np.random.default_rng(1)
    weights = 1.0 / np.arange(1, 65) ** 1.1  # Zipf-like skew over 64 experts
    calibration = simulate_counts(rng, 1, 200_000, 64, 6, weights)[0]  # [E] over many tokens
    inclusion = inclusion_from_counts(calibration, 200_000)
    assert inclusion.sum() == pytest.approx(6)
    counts = simulate_counts(rng, 3000, 16, 64, 6, weights)  # [T, E]
    touched = (counts > 0).sum(axis=1)
    # The inclusion probabilities themselves carry sampling error: allow it on top of the MC error.
    assert within(touched, experts_touched_from_inclusion(16, inclusion), sigmas=6)
    assert experts_touched_from_inclusion(16, inclusion) < experts_touched(16, 64, 6)  # skew touches fewer


def test_inclusion_from_weights_approximation():
    e, k = 64, 6
    assert inclusion_from_weights(np.ones(e), k) == pytest.approx(np.full(e, k / e))  # exact when uniform
    weights = 1.0 / np.arange(1, e + 1) ** 1.1
    pi = inclusion_from_weights(weights, k)
    assert pi.sum() == pytest.approx(k) and pi.max() <= 1.0
    measured = simulate_counts(np.random.default_rng(2), 1, 200_000, e, k, weights)[0] / 200_000  # [E]
    # Documented approximation: within 0.02 absolute per expert and 2% on the touched count at B = 16.
    assert np.abs(pi - measured).max() < 0.02
    assert experts_touched_from_inclusion(16, pi) == pytest.approx(experts_touched_from_inclusion(16, measured),
                                                                   rel=0.02)
    assert inclusion_from_weights([1, 1, 0, 0], 2) == pytest.approx([1, 1, 0, 0])


def test_touched_from_counts():
    assert experts_touched_from_counts([0, 3, 0, 1]) == 2
    with pytest.raises(ValueError, match="counts"):
        inclusion_from_counts([5, 1], 4)
    assert math.isclose(experts_touched_from_inclusion(3, [1.0, 0.0, 0.5]), 1 + 0 + 0.875)


def test_batch_for_fraction_under_skew():
    uniform = np.full(256, 8 / 256)
    assert batch_for_fraction_from_inclusion(0.5, uniform) == pytest.approx(batch_for_fraction(0.5, 256, 8))
    skewed = inclusion_from_weights(1.0 / np.arange(1, 257), 8)
    b = batch_for_fraction_from_inclusion(0.5, skewed)
    assert b > batch_for_fraction(0.5, 256, 8)  # skew reaches half the experts later
    assert experts_touched_from_inclusion(b, skewed) == pytest.approx(128)
    idle = np.zeros(8)
    idle[:2] = 1.0  # every token goes to experts 0 and 1: 6 of 8 are never touched
    assert batch_for_fraction_from_inclusion(0.5, idle) == math.inf

"""The three exercises on small sweeps: the answers' structure and the facts they rest on."""

import pytest

from moekit.sim.exercises import exercise1, exercise2, exercise3


def test_exercise1_ninety_percent_batch():
    ex = exercise1(max_batch=160, trials=32)
    assert ex.predicted_b == pytest.approx(72.525, abs=1e-3)  # ln 0.1 / ln(62/64)
    assert ex.predicted_first_over == 73
    uniform, skewed = ex.curves
    # The simulated uniform router agrees with the prediction (the curve is flat there: 0.3% per token).
    assert uniform.simulated[72] == pytest.approx(ex.predicted[72], abs=0.02)
    assert abs(uniform.first_over - ex.predicted_first_over) <= 10
    assert skewed.first_over is None or skewed.first_over > uniform.first_over
    assert uniform.simulated[0] == pytest.approx(2 / 64)  # one token: exactly k experts


def test_exercise2_dropless_above_the_max_load_and_error_grows_with_drops():
    ex = exercise2(tokens=128, capacity_factors=(0.5, 1.0, 2.0, 32.0), skews=(0.0,))
    (curve,) = ex.curves
    points = {p.capacity_factor: p for p in curve.points}
    assert points[32.0].drop_rate == 0.0 and points[32.0].relative_error == 0.0  # C = M: nothing can drop
    assert points[0.5].drop_rate >= 0.5  # C is half the mean load
    errors = [p.relative_error for p in curve.points]
    assert errors == sorted(errors, reverse=True)
    assert curve.last_with_drops is not None and curve.last_with_drops < 32.0


def test_exercise3_two_x_imbalance_and_replication():
    ex = exercise3(tokens=1024, skews=[0.0, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert ex.analytic_throughput_lost == 0.5
    target = ex.at_target
    contiguous, eplb = target.ep.placements[0], target.ep.placements[2]
    assert contiguous.imbalance >= 2.0
    assert contiguous.step_time_us >= 2.0 * contiguous.balanced_time_us - 1e-9  # max over GPUs, not mean
    assert contiguous.throughput_lost >= 0.5
    assert eplb.throughput_lost < contiguous.throughput_lost

"""``simulate``: the per-run accounting and its properties."""

import pytest

from moekit.analysis import experts_touched, param_bill
from moekit.sim import SimParams, simulate
from moekit.sim.report import format_params
from moekit.sim.shape import model_config


@pytest.fixture(scope="module")
def default_run():
    return simulate(SimParams())


def test_loads_sum_to_tokens_times_k(default_run):
    p = SimParams()
    assert sum(default_run.loads) == p.tokens * p.top_k
    assert len(default_run.loads) == p.experts


def test_capacity_accounting_is_exact(default_run):
    r = default_run
    assert r.capacity == 5  # ceil(1.25 * 128 * 2 / 64)
    assert r.kept == [min(load, r.capacity) for load in r.loads]
    assert r.dropped == sum(r.loads) - sum(r.kept)
    assert r.drop_rate == r.dropped / (128 * 2)
    assert r.imbalance == max(r.loads) / (sum(r.loads) / len(r.loads))
    assert r.experts_touched == sum(1 for load in r.loads if load > 0)


def test_huge_capacity_drops_nothing():
    r = simulate(SimParams(skew=1.0, capacity_factor=64.0))  # C = 256 >= every possible load (128)
    assert r.dropped == 0 and r.drop_rate == 0.0 and r.kept == r.loads


def test_same_seed_same_result_and_another_seed_differs():
    params = SimParams(skew=0.3, balance="bias", bias_batches=20, experts=16, gpus=4)
    assert simulate(params).to_dict() == simulate(params).to_dict()
    other = SimParams(skew=0.3, balance="bias", bias_batches=20, experts=16, gpus=4, seed=6)
    assert simulate(other).loads != simulate(params).loads


def test_touched_per_batch_against_prediction(default_run):
    points = {t.batch: t for t in default_run.touched_by_batch}
    assert sorted(points) == [1, 8, 64, 512]
    assert points[1].simulated == 2.0  # one token touches exactly k experts
    for t in points.values():
        assert t.predicted == pytest.approx(experts_touched(t.batch, 64, 2))
    # Skew 0.55 concentrates traffic: fewer experts than the uniform prediction at B = 64.
    assert points[64].simulated < points[64].predicted


def test_uniform_router_touches_what_the_prediction_says():
    r = simulate(SimParams(skew=0.0))
    for t in r.touched_by_batch:
        assert t.simulated == pytest.approx(t.predicted, rel=0.1)


def test_params_follow_the_stated_shape(default_run):
    bill = param_bill(model_config(64, 2))
    assert (default_run.total_params, default_run.active_params) == (bill.total, bill.active)
    assert default_run.sparsity == pytest.approx(bill.total / bill.active)
    # The numbers moekit.sim.shape states for the lesson's E = 64, k = 2.
    assert (format_params(default_run.total_params), format_params(default_run.active_params)) == ("362.4G", "12.9G")


def test_json_has_the_issue_fields(default_run):
    d = default_run.to_dict()
    for key in ("loads", "capacity", "dropped", "drop_rate", "imbalance", "experts_touched",
                "total_params", "active_params", "sparsity", "touched_by_batch", "ep", "balance"):
        assert key in d


@pytest.mark.parametrize("params", [None, {"experts": 8, "tokens": 16}])
def test_params_that_are_no_simparams_are_named(params):
    """simulate({"experts": 8, ...}) failed on "'dict' object has no attribute 'experts'"."""
    with pytest.raises(TypeError, match=r"^params must be a moekit.sim.SimParams \(SimParams\(\*\*settings\)\), got "):
        simulate(params)
    assert simulate(SimParams(experts=8, tokens=16)).params["experts"] == 8

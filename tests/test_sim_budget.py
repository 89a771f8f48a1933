"""The work budget: the value it names is the largest that fits, and the changes it asks for suffice."""

import re
from dataclasses import replace

import pytest

from moekit.sim import SimParams
from moekit.sim.budget import BUDGET_S, OverBudgetError, check_budget, predicted_seconds


def _refusal(params: SimParams) -> OverBudgetError:
    with pytest.raises(OverBudgetError) as info:
        check_budget(params)
    return info.value


def test_the_lessons_defaults_fit_with_every_balancing_method():
    for balance in ("none", "aux-loss", "bias"):
        check_budget(SimParams(balance=balance))


@pytest.mark.parametrize("params, name", [
    (SimParams(experts=512, balance="aux-loss"), "aux_steps"),
    (SimParams(experts=64, balance="bias", bias_batches=2000), "bias_batches"),
    (SimParams(experts=512, top_k=8, tokens=4096, spare_slots=0, gpus=4), "tokens"),
])
def test_the_named_value_is_the_largest_that_fits(params, name):
    error = _refusal(params)
    assert (error.parameter, str(error)) == (name, error.message) and isinstance(error, ValueError)
    assert predicted_seconds(replace(params, **{name: error.largest})) <= BUDGET_S
    assert predicted_seconds(replace(params, **{name: error.largest + 1})) > BUDGET_S
    assert f"lower {name} to at most {error.largest} (got {getattr(params, name)})" in str(error)


def test_every_alternative_offered_fits_on_its_own():
    params = SimParams(experts=512, balance="bias")
    error = _refusal(params)
    alternatives = re.findall(r"or (\w+) to at most (\d+)", str(error))
    assert alternatives  # fewer experts would do too
    for name, value in alternatives:
        assert predicted_seconds(replace(params, **{name: int(value)})) <= BUDGET_S


def test_when_one_change_is_not_enough_all_the_named_changes_fit_together():
    params = SimParams(experts=512, top_k=16, tokens=4096, gpus=512, spare_slots=512, balance="aux-loss",
                       aux_steps=1000)
    error = _refusal(params)
    changes = {n: int(v) for n, v in re.findall(r"(\w+) to at most (\d+) \(got", str(error))}
    assert len(changes) > 1 and next(iter(changes)) == error.parameter == "aux_steps"
    assert predicted_seconds(replace(params, **changes)) <= BUDGET_S


def test_a_served_models_router_width_is_priced_and_its_experts_never_named():
    """LongCat-Flash routes over E + Z = 768 columns: dearer than 512, and E (the model's) is not a setting."""
    params = SimParams(experts=512, top_k=12, balance="bias")
    assert predicted_seconds(params, width=768) > predicted_seconds(params) == predicted_seconds(params, width=None)
    with pytest.raises(OverBudgetError) as info:
        check_budget(params, width=768)
    assert info.value.parameter == "bias_batches" and "experts" not in str(info.value)
    changes = {n: int(v) for n, v in re.findall(r"(\w+) to at most (\d+) \(got", str(info.value))}
    assert predicted_seconds(replace(params, **changes), width=768) <= BUDGET_S

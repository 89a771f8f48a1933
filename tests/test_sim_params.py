"""SimParams: the lesson's defaults and a clear error for every bad value."""

import pytest

from moekit.sim import SimParams


def test_defaults_are_the_lessons():
    p = SimParams()
    assert (p.experts, p.top_k, p.tokens, p.capacity_factor, p.skew, p.seed,
            p.balance) == (64, 2, 128, 1.25, 0.55, 5, "none")


@pytest.mark.parametrize("values, message", [
    ({"experts": "abc"}, "experts must be an integer"),
    ({"skew": "1.5"}, r"skew must be in \[0, 1\]"),
    ({"capacity_factor": "nan"}, "capacity_factor must be a number"),
    ({"capacity_factor": "0"}, "capacity_factor must be in"),
    ({"top_k": "9", "experts": "8"}, r"top_k must be <= experts \(8\)"),
    ({"balance": "magic"}, "balance must be one of none, aux-loss, bias"),
    ({"gpus": "16", "experts": "8"}, r"gpus must be <= experts"),
    ({"spare_slots": "100", "experts": "8", "gpus": "2"}, r"spare_slots must be <= experts"),
    ({"tokens": "1.5"}, "tokens must be an integer"),
    ({"seed": "-1"}, r"seed must be in \[0, 2147483647\]; got -1"),  # the bound as an int, not 2.14748e\+09
    ({"color": "red"}, "unknown parameter"),
])
def test_bad_values_raise_naming_the_parameter(values, message):
    with pytest.raises(ValueError, match=message):
        SimParams.from_strings(values)


def test_from_strings_parses():
    p = SimParams.from_strings({"experts": "16", "skew": "0.25", "balance": "bias"})
    assert (p.experts, p.skew, p.balance) == (16, 0.25, "bias")

"""``LaunchOptions`` as a plan key: equal and same hash exactly when every field is equal, whichever
object a caller built (each function's default ``LaunchOptions()`` is its own object; the custom op
builds one per call), so a plan built through one path is found through the others."""

from __future__ import annotations

from dataclasses import fields, replace

from moekit.experts.triton_launch import LaunchOptions


def test_equal_exactly_when_every_field_is():
    a, b = LaunchOptions(), LaunchOptions()
    assert a is not b and a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    for f in fields(LaunchOptions):
        value = getattr(a, f.name)
        other = replace(a, **{f.name: (not value) if isinstance(value, bool) else value - 1})  # all in range
        assert other != a and a != other, f.name
        assert replace(other, **{f.name: value}) == a, f.name


def test_never_equal_to_another_type():
    a = LaunchOptions()
    assert a != a.as_op_args() and a != None and a != 0  # noqa: E711

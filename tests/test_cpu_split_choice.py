"""moekit.experts.cpu_split_choice: the online choice between the split and the unsplit CPU loop at decode sizes,
on scripted times and a fake clock (no timing here), and ``cpu_gemm="auto"`` through it: both modes the same bits,
both against test_cpu_packed's float64 loop."""

import pytest
import torch

from _helpers import experts_loop
from moekit.experts import cpu_loop, cpu_packed
from moekit.experts.cpu_split_choice import (
    CHOSEN_BELOW, PROBE_MAX, PROBE_MIN, SPLIT, UNSPLIT, WINDOW, SplitChooser, split_chooser,
)
from moekit.experts.grouped_mm import experts_grouped_mm
from test_cpu_packed import rel_err
from test_cpu_workers import needs_onednn, problem

KEY = "key"


def run_calls(chooser: SplitChooser, times: dict[str, float], calls: int) -> list[str]:
    """``calls`` calls of KEY, each mode taking ``times[mode]`` seconds: the modes run, in order."""
    ran = []
    for _ in range(calls):
        mode = chooser.choose(KEY)
        chooser.record(KEY, mode, times[mode])
        ran.append(mode)
    return ran


def test_warm_up_alternates_the_modes_then_runs_the_faster():
    chooser = SplitChooser()
    ran = run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 5.0}, 2 * WINDOW + PROBE_MIN - 1)
    assert ran[:2 * WINDOW] == [SPLIT, UNSPLIT] * WINDOW
    assert ran[2 * WINDOW:] == [UNSPLIT] * (PROBE_MIN - 1)
    assert chooser.modes() == {KEY: UNSPLIT}
    assert SplitChooser().modes() == {}  # nothing timed yet: no mode to report


def test_losing_probes_come_at_doubling_intervals_up_to_the_cap():
    chooser = SplitChooser()
    ran = run_calls(chooser, {SPLIT: 5.0, UNSPLIT: 9.0}, 2 * WINDOW + 4 * PROBE_MAX)
    probes = [i for i, mode in enumerate(ran) if mode == UNSPLIT and i >= 2 * WINDOW]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    want, interval = [], PROBE_MIN
    while len(want) < len(gaps):
        interval = min(2 * interval, PROBE_MAX)
        want.append(interval)
    assert probes[0] == 2 * WINDOW + PROBE_MIN
    assert gaps == want and gaps[-1] == PROBE_MAX


def test_a_running_mode_that_slows_loses_within_two_calls():
    chooser = SplitChooser()
    run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 5.0}, 2 * WINDOW)  # quiet: unsplit runs
    ran = run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 60.0}, 4)  # a neighbour takes a core
    assert ran == [UNSPLIT, UNSPLIT, SPLIT, SPLIT]


def test_a_probe_faster_than_the_running_mode_is_confirmed_and_takes_over():
    chooser = SplitChooser()
    run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 60.0}, 2 * WINDOW)  # loaded: split runs
    ran = run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 5.0}, PROBE_MIN + 4)  # the neighbour left
    assert ran[:PROBE_MIN] == [SPLIT] * PROBE_MIN
    assert ran[PROBE_MIN:] == [UNSPLIT] * 4  # the probe, its confirmation, then unsplit runs
    assert chooser.modes() == {KEY: UNSPLIT}


def test_keys_are_timed_apart_and_clear_forgets():
    chooser = SplitChooser()
    run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 5.0}, 2 * WINDOW)
    assert chooser.choose("other") == SPLIT  # a new key warms up on its own
    chooser.clear()
    assert chooser.modes() == {} and chooser.choose(KEY) == SPLIT


def test_call_times_the_run_on_the_clock_and_returns_its_result():
    ticks = iter([10.0, 10.5, 20.0, 20.25])
    chooser = SplitChooser(clock=lambda: next(ticks))
    assert chooser.call(KEY, lambda mode: mode + "!") == SPLIT + "!"
    assert chooser.call(KEY, lambda mode: mode) == UNSPLIT
    state = chooser._states[KEY]
    assert list(state.samples[SPLIT]) == [0.5] and list(state.samples[UNSPLIT]) == [0.25]


class _Fixed(SplitChooser):
    """Runs ``mode`` always and keeps the keys it was asked about."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode, self.keys = mode, []

    def choose(self, key):
        self.keys.append(key)
        return self.mode


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not cpu_packed.fused_loop_supported(torch.bfloat16), reason="no oneDNN bf16 linear on this CPU (AVX2): "
    "bf16 calls take the dense path, which has no split choice"))])
def test_auto_at_decode_runs_the_chosen_mode_with_the_same_bits(monkeypatch, dtype):
    x, w13, w2, ids, weights = problem(m=3, k=4, seed=11)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    ran = []
    split, phased = cpu_packed.run_dynamic, cpu_loop.experts_cpu_phased
    monkeypatch.setattr(cpu_packed, "run_dynamic", lambda items, n, fn: ran.append(n) or split(items, n, fn))
    monkeypatch.setattr(cpu_loop, "experts_cpu_phased", lambda *a, **kw: ran.append("phased") or phased(*a, **kw))
    outs = {}
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for mode in (SPLIT, UNSPLIT):
            chooser = _Fixed(mode)
            monkeypatch.setattr(cpu_loop, "split_chooser", lambda: chooser)
            outs[mode] = experts_grouped_mm(x, w13, w2, ids, weights)
            assert chooser.keys == [(2, dtype, tuple(w13.shape), 2)]  # M = 3: M's bit length
        big = problem(m=CHOSEN_BELOW, k=2, seed=12)  # not a decode size: always split, never asked
        experts_grouped_mm(*big)
        assert chooser.keys == [(2, dtype, tuple(w13.shape), 2)]
    finally:
        torch.set_num_threads(before)
    assert ran == [2, "phased", 2]  # split: one worker a thread; unsplit: in phases
    assert torch.equal(outs[SPLIT], outs[UNSPLIT])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(outs[SPLIT].float(), experts_loop(x.float(), w13.float(), w2.float(), ids, weights)) < tol


def test_the_process_wide_chooser_is_one_object():
    assert split_chooser() is split_chooser() and isinstance(split_chooser(), SplitChooser)


def test_the_mode_left_behind_by_a_slowdown_is_timed_again_soon():
    chooser = SplitChooser()
    run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 5.0}, 2 * WINDOW + 3 * PROBE_MIN)  # quiet long enough to back off
    for _ in range(4):  # a burst, until the split takes over (two unsplit calls, a probe may come between)
        run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 60.0}, 1)
        if chooser.modes() == {KEY: SPLIT}:
            break
    assert chooser.modes() == {KEY: SPLIT}
    ran = run_calls(chooser, {SPLIT: 7.0, UNSPLIT: 5.0}, PROBE_MIN + 3)  # the burst passed
    assert ran[:PROBE_MIN] == [SPLIT] * PROBE_MIN and ran[PROBE_MIN:] == [UNSPLIT] * 3

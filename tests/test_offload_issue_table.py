"""``benchmarks/offload_issue_table.py``'s per-step reads of a table run: the median step over the median floor,
stalled steps, auto against the better pure mode paired by step, and the "never slower" verdict with the twin's
noise in its margin; on rows built here with closed-form answers."""

from __future__ import annotations

import os
import statistics
import sys

from moekit.bench.offload_report import modes_by_cell

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from offload_issue_table import median_x, never_slower, paired, paired_vs_best, stalled, twin_rms  # noqa: E402


def _row(mode: str, steps: list[float], floors: list[float], m: int = 8, fraction: float = 0.5) -> dict:
    return {"stream": "skewed", "cache_fraction": fraction, "policy": "lfu", "prefetch": "none", "M": m,
            "compute_misses_on": mode, "step_ms": statistics.fmean(steps), "step_times_ms": steps,
            "floor_times_ms": floors}


def test_median_and_stalled_read_each_step_against_its_own_floor():
    r = _row("auto", [10.0, 11.0, 40.0, 12.0], [10.0, 10.0, 10.0, 10.0])
    assert median_x(r) == statistics.median([10.0, 11.0, 40.0, 12.0]) / 10.0  # 1.15: the stall moves the mean only
    assert stalled(r) == 1  # 40 > 1.5 x 10, the others not
    assert median_x({"step_times_ms": [1.0]}) is None and stalled({"step_times_ms": [1.0]}) is None


def test_auto_is_paired_with_the_pure_mode_of_the_lower_mean():
    modes = {"gpu": _row("gpu", [10.0, 10.0, 10.0], []), "cpu": _row("cpu", [20.0, 20.0, 20.0], []),
             "auto": _row("auto", [11.0, 10.0, 12.0], [])}
    mean, sem, n = paired_vs_best(modes)
    d = [1.0, 0.0, 2.0]
    assert n == 3 and abs(mean - statistics.fmean(d) / 10.0) < 1e-12
    assert abs(sem - statistics.stdev(d) / 3 ** 0.5 / 10.0) < 1e-12
    assert paired(modes, "auto", "cpu")[0] < 0 and paired_vs_best({"gpu": modes["gpu"]}) is None


def test_never_slower_holds_auto_to_the_paired_error_and_the_twins_noise():
    def cell(fraction, auto, gpu2):
        gpu = [10.0, 10.2, 9.8, 10.0]
        return [_row("gpu", gpu, [], fraction=fraction), _row("cpu", [30.0] * 4, [], fraction=fraction),
                _row("auto", auto, [], fraction=fraction), _row("gpu2", gpu2, [], fraction=fraction)]
    rows = cell(0.25, [12.0, 12.2, 11.8, 12.0], [10.1, 10.3, 9.9, 10.1]) + cell(0.5, [10.0, 10.2, 9.8, 10.0],
                                                                                   [9.9, 10.1, 9.7, 9.9])
    cells = modes_by_cell(rows)
    assert abs(twin_rms(cells)[8] - 0.01) < 1e-9  # +1% and -1%
    lines = never_slower(cells)
    auto = next(line for line in lines if line.startswith("auto vs best pure at M = 8"))
    assert "SLOWER" in auto and "cells slower beyond their margin: 1: skewed/25%/none +0.200" in auto
    twin = next(line for line in lines if line.startswith("twin gpu2 vs gpu (null) at M = 8"))
    assert "not slower" in twin and "beyond their margin: 0" in twin  # +-1% within 2 x the twin's own 1%

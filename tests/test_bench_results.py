"""``moekit bench`` as a user meets it on the CPU (issue 12 "the first hour", issue 13 item 3): results
never overwritten, an unavailable backend refused up front, a line per cell while it runs, the spread
and the eager / host numbers of every cell, and ceilings printed in units that fit the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moekit.bench import run, timing
from moekit.bench.ceilings import Ceilings
from moekit.bench.cells import Shape
from moekit.bench.report import footnotes, format_flops, plot_title, results_path, write_json
from moekit.bench.timing import Timing, time_eager, time_paired, time_stats
from moekit.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)
CPU_CEILINGS = Ceilings(copy_TBps=0.0069, mm_TFLOPs=0.0249, mm_dtype="float32")  # a busy 2-core CPU
BENCH = ["bench", "--device", "cpu", "--shapes", "mixtral-8x7b", "--no-plot"]
ONE_CELL = ["--batches", "1", "--backends", "grouped_mm"]


@pytest.fixture
def fixed_ceilings(monkeypatch):
    """The CLI runs without the ceiling probes (seconds on a busy CPU): fixed CPU-sized ceilings."""
    monkeypatch.setattr(run, "measure_ceilings", lambda device: CPU_CEILINGS)


def test_timing_reports_median_and_spread():
    t = Timing.from_samples([10.0, 11.0, 12.0, 13.0, 1000.0])  # one pass hit a busy moment
    assert t.us == 12.0 and t.min_us == 10.0 and t.max_us == 1000.0 and t.repeats == 5
    assert t.spread_pct == pytest.approx(100 * (13.0 - 11.0) / 12.0)  # the outlier moves the IQR little
    assert not t.noisy and Timing.from_samples([10.0, 10.0, 20.0, 30.0, 30.0]).noisy
    a = torch.randn(64, 64)
    stats = time_stats([lambda: a @ a], torch.device("cpu"), budget_s=0.01)
    assert stats.repeats >= 5 and stats.min_us <= stats.us <= stats.max_us and stats.spread_pct >= 0
    eager = time_eager([lambda: a @ a], torch.device("cpu"), calls=4, repeats=3)
    assert eager.eager_us > 0 and 0 < eager.host_us <= eager.eager_us
    assert eager.spread_pct >= 0 and isinstance(eager.noisy, bool)


def test_host_rest_leaves_out_each_loops_first_call():
    """host_rest_us is the issue time of the calls after each loop's first: a first call that takes 40 ms (as
    the first call after a long GPU wait can take several times the others) lifts host_us, not host_rest_us."""
    count = [0]

    def call():
        count[0] += 1
        if count[0] % 4 == 2:  # the warm-up is call 1; each loop of 4 then starts at 2, 6, 10, ...
            time.sleep(0.04)

    eager = time_eager([call], torch.device("cpu"), calls=4, repeats=3)
    assert count[0] == 1 + 3 * 4
    assert eager.host_us >= 0.9 * 40_000 / 4 and eager.host_rest_us < 2_000


def test_paired_timing_spreads_eager_loops_over_a_drifting_clock(monkeypatch):
    """A device that slows down over the run (a GPU throttling as it heats): each call takes longer than the
    last. Timed one after the other, the eager loops come last and read slower than the passes; paired,
    the loops sit between the passes and both medians see the same mid-run speed. The clock is the test's
    own (each call advances it), so a loaded machine's sleep overshoot cannot blur the drift."""
    count, now = [0], [0.0]

    def call():
        count[0] += 1
        now[0] += 0.001 * (1 + count[0] / 8)  # 1 ms, then 1/8 ms slower per call

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    cpu = torch.device("cpu")
    stats = time_stats([call], cpu, budget_s=0, min_reps=10, max_reps=10)
    eager = time_eager([call], cpu, calls=4, repeats=5)
    assert eager.eager_us > 1.6 * stats.us  # the sequential order's bias: about 2x
    count[0] = 0
    paired = time_paired([call], cpu, budget_s=0, min_reps=10, max_reps=10, calls=4, eager_repeats=5)
    assert count[0] == 2 + 10 + 5 * 4  # warm-up, sizing pass, 10 passes, 5 loops of 4
    assert paired.timing.repeats == 10
    assert 0.8 < paired.eager.eager_us / paired.timing.us < 1.4  # about 1.13: each loop follows its pass
    assert 0 < paired.eager.host_us <= paired.eager.eager_us


def test_results_are_never_overwritten(tmp_path, fixed_ceilings, capsys):
    assert main([*BENCH, *ONE_CELL, "--out", str(tmp_path)]) == 0
    (first,) = tmp_path.glob("*.json")
    before = first.read_text()
    assert main([*BENCH, *ONE_CELL, "--out", str(tmp_path)]) == 0
    second = first.with_name(f"{first.stem}-2.json")
    assert sorted(tmp_path.glob("*.json")) == sorted([first, second])
    assert first.read_text() == before and json.loads(second.read_text())["cells"]
    captured = capsys.readouterr()
    assert f"wrote {second}" in captured.out.replace("\n", "") and "never overwritten" in captured.out
    lines = captured.err.splitlines()  # the CLI's progress: one line per step on stderr, twice
    assert sum(line.startswith("[1/1] mixtral-8x7b/16 M=1 grouped_mm: ") for line in lines) == 2
    assert sum(line.startswith("[0/1] ceilings: ") for line in lines) == 4
    doc = json.loads(before)
    assert results_path(tmp_path, doc).name == f"{first.stem}-3.json"
    with pytest.raises(FileExistsError):
        write_json(doc, first)


def test_progress_line_per_cell(fixed_ceilings):
    seen = []
    run.run_bench(torch.device("cpu"), shapes=[TINY], batches=[1, 5], backends=["grouped_mm"], on_progress=seen.append)
    assert [(p.done, p.total) for p in seen] == [(0, 2), (0, 2), (1, 2), (2, 2)]
    assert seen[1].message == "ceilings: copy 6.9 GB/s, matmul 24.9 GFLOP/s (float32)"
    assert seen[2].message.startswith("tiny M=1 grouped_mm: ") and "eager" in seen[2].message
    assert seen[3].message.startswith("tiny M=5 grouped_mm: ") and "host" in seen[3].message


def test_unavailable_backend_is_refused_with_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "moekit", *BENCH, "--batches", "1", "--backends", "triton", "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--backends: ['triton'] cannot run on cpu" in proc.stderr
    assert "available on this device: ['reference', 'grouped_mm']" in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran or was written


def test_ceilings_in_units_that_fit_the_device():
    assert format_flops(CPU_CEILINGS.mm_TFLOPs * 1e12) == "24.9 GFLOP/s"
    assert format_flops(754.6e12) == "755 TFLOP/s" and format_flops(1.5e6) == "1.5 MFLOP/s"
    doc = {"device": "cpu", "commit": "abc", "ceilings": vars(CPU_CEILINGS), "noisy_spread_pct": 20.0,
           "cpu_threads": 2, "cells": [{"pct_floor": 130.0, "noisy": True}]}
    title = plot_title(doc)
    assert "0.0 TFLOP/s" not in title and "24.9 GFLOP/s" in title and "6.9 GB/s" in title
    above, noisy = footnotes(doc)
    assert above.startswith("%floor above 100") and "caches" in above
    assert "1 cell(s) marked noisy" in noisy and "OMP_NUM_THREADS=1" in noisy

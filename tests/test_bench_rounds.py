"""The device checks' shared timing and run logic (``benchmarks/bench_rounds.py``, ``benchmarks/bench_run.py``)
on the CPU: interleaved and settled rounds driven by a fake timer, the win counts against hand-counted rounds, the
run log's lines, its watchdog in a child process, the held-weights cell loop of ``held_run``, the JSON header.
Nothing here times anything."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_rounds as br  # noqa: E402
import bench_run  # noqa: E402

CPU = torch.device("cpu")


class FakeGraph:
    """Counts its replays and writes each one to a shared trace."""

    def __init__(self, name: str, trace: list):
        self.name, self.trace, self.replays = name, trace, 0

    def replay(self) -> None:
        self.replays += 1
        self.trace.append(self.name)


def scripted_timer(ms: list):
    """A timer that runs what it times and returns the next of ``ms``."""
    values = iter(ms)

    def timer(run):
        run()
        return next(values)

    return timer


def test_interleaved_replays_each_graph_in_turn_and_scales_to_us_a_call():
    trace: list = []
    graphs = {"pick": FakeGraph("pick", trace), "wide": FakeGraph("wide", trace)}
    ms = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # round 0: pick, wide; round 1: pick, wide; ...
    got = br.interleaved(graphs, calls=4, dev=CPU, rounds=3, replays=5, timer=scripted_timer(ms))
    # µs a call = ms x 1e3 / (replays x calls), each round's value its own
    assert got == {"pick": [1e3 / 20, 3e3 / 20, 5e3 / 20], "wide": [2e3 / 20, 4e3 / 20, 6e3 / 20]}
    assert trace == (["pick"] * 5 + ["wide"] * 5) * 3
    assert graphs["pick"].replays == graphs["wide"].replays == 15


def test_interleaved_stops_past_until_after_one_round(capsys):
    graphs = {"a": FakeGraph("a", []), "b": FakeGraph("b", [])}
    got = br.interleaved(graphs, 1, CPU, rounds=5, replays=1, until=0.0, timer=scripted_timer([1.0] * 10))
    assert {k: len(v) for k, v in got.items()} == {"a": 1, "b": 1}  # the first round always runs
    assert "deadline: 1 rounds" in capsys.readouterr().out


def test_turned_rounds_turns_each_round_and_stops_past_until(monkeypatch):
    """Three names over three rounds, each round turned one place; with ``until`` passed after the first round,
    that round only."""
    assert list(br.turned_rounds(["a", "b", "c"], 3)) == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    clock = iter([10.0])  # read before each round after the first
    monkeypatch.setattr(br.time, "time", lambda: next(clock))
    assert list(br.turned_rounds(["a", "b"], 3, until=5.0)) == ["a", "b"]


def test_interleaved_off_the_gpu_without_a_timer_is_one_nan_each():
    got = br.interleaved({"a": None, "b": None}, 3, CPU, rounds=5, replays=5)
    assert list(got) == ["a", "b"] and all(len(v) == 1 and v[0] != v[0] for v in got.values())


def test_settled_replays_each_predecessor_once_unmeasured_and_turns_the_order():
    trace: list = []
    pick, bf16 = FakeGraph("pick", trace), FakeGraph("bf16", trace)
    entries = {"pick": (pick, None), "pick@bf16": (pick, bf16), "bf16": (bf16, None)}
    marks: list = []

    def timer(run):  # the timed part of the trace, marked
        marks.append(len(trace))
        run()
        marks.append(len(trace))
        return 6.0

    got = br.settled(entries, calls=2, dev=CPU, rounds=3, replays=3, timer=timer)
    assert got == {k: [6e3 / 6] * 3 for k in entries}  # ms x 1e3 / (replays x calls)
    warm = {"pick": "pick", "pick@bf16": "bf16", "bf16": "bf16"}
    order = ["pick", "pick@bf16", "bf16", "pick@bf16", "bf16", "pick", "bf16", "pick", "pick@bf16"]
    expected = [g for name in order for g in [warm[name]] + [name.split("@")[0]] * 3]
    assert trace == expected
    timed = [trace[a:b] for a, b in zip(marks[::2], marks[1::2])]  # the warm replay is outside each timed span
    assert timed == [[name.split("@")[0]] * 3 for name in order]


def test_settled_in_a_given_order():
    trace: list = []
    a, b, c = (FakeGraph(n, trace) for n in "abc")
    entries = {"a": (a, None), "b": (b, None), "c": (c, None)}
    br.settled(entries, 1, CPU, rounds=2, replays=1, timer=lambda run: run() or 1.0,
               order=lambda r, names: ["c", *names[:2]] if r else names)
    assert trace == ["a", "a", "b", "b", "c", "c", "c", "c", "a", "a", "b", "b"]  # each warmed by itself, then timed
    assert br.turned(4, ["x", "y", "z"]) == ["y", "z", "x"]
    names = list("abcdef")
    orders = [br.shuffled(r, names) for r in range(5)]
    assert all(sorted(o) == names for o in orders) and orders == [br.shuffled(r, names) for r in range(5)]
    after = {tuple(o[o.index("b") - 1:o.index("b")]) for o in orders}  # what came right before b, round by round
    assert len(after) > 1


def test_settled_off_the_gpu_without_a_timer_is_one_nan_each():
    got = br.settled({"a": (None, None)}, 1, CPU, rounds=5, replays=5)
    assert list(got) == ["a"] and got["a"][0] != got["a"][0]


def test_wins_faster_rounds_and_versus_against_hand_counts():
    base = [100.0, 100.0, 100.0, 100.0, 100.0]
    samples = [97.05, 97.1, 90.0, 120.0, 96.0]
    assert br.wins(samples, base) == 2  # v <= 0.97 x 100: rounds 2, 4
    assert br.wins(base, samples) == 1  # the base <= 0.97 x samples: round 3 only
    assert br.faster_rounds(samples, base) == 3  # 100 / v >= 1.03: rounds 0 (1.0304), 2, 4; not 1 (1.0299)
    assert br.versus(samples, base) == "x1.030 (>=3% in 3/5)"  # median 100 / median 97.1
    assert br.medians({"a": [3.0, 1.0, 2.0], "b": [5.0]}) == {"a": 2.0, "b": 5.0}


def test_eager_us_times_host_then_wall_each_round(monkeypatch):
    events: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: events.append("sleep"))
    calls = {"a": [lambda: events.append("a0"), lambda: events.append("a1")], "b": [lambda: events.append("b0")]}
    got = br.eager_us(calls, rounds=2, n_calls=3)
    one_round = ["sync", "sleep", "a0", "a1", "a0", "sync", "a0", "a1", "a0", "sync",
                 "sync", "sleep", "b0", "b0", "b0", "sync", "b0", "b0", "b0", "sync"]
    assert events == one_round * 2
    assert set(got) == {"a", "b"} and all(host >= 0 and wall >= 0 for host, wall in got.values())


def test_run_log_checks_logs_and_prints_the_table(capsys):
    run = bench_run.RunLog("the title", stall_s=5.0)
    assert run.check("x M=1 pick", True, "rel 1e-3") and not run.check("x M=1 wide", False)
    run.log("hello")
    run.summary.append("row 1")
    run.print_table()
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["PASS  x M=1 pick  rel 1e-3", "FAIL  x M=1 wide  "]
    assert out[2].endswith("s] hello") and out[2].startswith("[")
    assert out[3:6] == ["", "the title", "row 1"] and out[6].startswith("FAILED: x M=1 wide; ")
    assert run.failed == ["x M=1 wide"] and run.last[1] == "hello"


def test_watchdog_prints_the_table_and_exits_when_nothing_is_logged():
    code = f"""
        import sys, time
        sys.path.insert(0, {str(BENCHMARKS)!r})
        import threading, bench_run
        run = bench_run.RunLog("stalled table", stall_s=0.2)
        run.summary.append("so far")
        run.log("last words")
        threading.Thread(target=run.watchdog, kwargs={{"poll_s": 0.05}}, daemon=True).start()
        time.sleep(30)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert "STALLED 0 s after: last words" in done.stdout and "stalled table\nso far\nFAILED: none" in done.stdout


@dataclasses.dataclass
class HeldGot:
    ci: int
    weights: str


def test_held_cells_holds_a_presets_weights_skips_past_the_deadline_and_writes_json(tmp_path, capsys):
    pytest.importorskip("triton")
    import held_run

    built, clock = [], [0.0]
    specs = [held_run.HeldCell(0, "a", 1.0, "a M=1", "a", "a"), held_run.HeldCell(1, "b", 1.0, "b M=1", "b", "b"),
             held_run.HeldCell(2, "a", 1.0, "a M=2", "a", "a"), held_run.HeldCell(3, "c", 50.0, "c M=1", "c", "c")]

    def run(ci, weights, status):
        clock[0] += 10.0
        return [HeldGot(ci, weights)]

    failed: list = []
    r = held_run.HeldRun(45.0, lambda: clock[0], failed, torch.device("cpu"), lambda p: built.append(p) or p.upper(),
                         run, str(tmp_path), "x.json", {"copy": 1.0}, "title", lambda c: [f"row {c.ci}"], None)
    assert held_run.held_cells(specs, {}, r) == 0
    assert built == ["a", "b", "a"]  # a preset's weights held while its cells run, built again after "b"'s
    got = json.loads((tmp_path / "x.json").read_text())
    assert got["cells"] == [{"ci": 0, "weights": "A"}, {"ci": 1, "weights": "B"}, {"ci": 2, "weights": "A"}]
    assert got["copy"] == 1.0 and got["failed"] == [] and got["seconds"] == 30.0
    out = capsys.readouterr().out  # "c" skipped: 30 s + its 50 past the 45 s deadline
    assert "skipped (deadline): c M=1" in out and "\ntitle\nrow 0\nrow 1\nrow 2\nFAILED: none (30.0 s)" in out


def test_write_json_and_its_header(tmp_path):
    pytest.importorskip("triton")
    path = tmp_path / "sub" / "x.json"
    bench_run.write_json(str(path), {**bench_run.run_info(), "cells": [1]})
    got = json.loads(path.read_text())
    assert list(got) == ["device", "torch", "triton", "cells"] and got["torch"] == torch.__version__


def test_rel_l2_against_a_float64_reference():
    out, ref = torch.tensor([1.0, 2.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])
    want = (((out.double() - ref.double()) ** 2).sum() / (ref.double() ** 2).sum()).sqrt().item()
    assert bench_run.rel_l2(out, ref) == pytest.approx(want, rel=1e-6)
    assert bench_run.rel_l2(torch.tensor([float("nan")]), ref[:1]) == float("inf")

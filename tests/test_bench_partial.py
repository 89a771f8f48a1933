"""``moekit bench`` keeps the cells timed so far on disk while it runs (``<results>.partial.json``, replaced after
each cell): a run killed by a time limit lost every cell (session 44: an H100 weight-only run stopped by `timeout`
after 53 of 84 cells, nothing written). A finished run leaves only its results file. Since session 53 ``--offload``
(its rows) and ``--cpu-experts`` (its batches) keep theirs too, and a Ctrl-C names the file."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

import pytest

from moekit.bench import cpu_measure, offload_measure, sweep
from moekit.bench.cells import Shape
from moekit.bench.offload_measure import OffloadRow
from moekit.bench.report import PARTIAL_SUFFIX, results_path
from moekit.cli import main
from moekit.experts import get_backend

TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)
ARGS = ["bench", "--device", "cpu", "--shapes", "mixtral-8x7b", "--batches", "1", "3", "5",
        "--backends", "grouped_mm", "--budget-s", "0.01", "--no-plot"]


def _killed_at(monkeypatch, m_killed: int):
    """grouped_mm as it is, but the first call at M = m_killed interrupts the run as a Ctrl-C or a kill would."""
    real = get_backend("grouped_mm")

    def run(x, *args, **kwargs):
        if x.shape[0] == m_killed:
            raise KeyboardInterrupt
        return real(x, *args, **kwargs)

    monkeypatch.setattr(sweep, "get_backend", lambda name: run)


def test_a_killed_run_keeps_the_cells_it_timed(tmp_path, monkeypatch, capsys):
    _killed_at(monkeypatch, 5)
    assert main([*ARGS, "--out", str(tmp_path)]) == 130  # the CLI's exit status for an interrupted command
    (partial,) = tmp_path.glob(f"*{PARTIAL_SUFFIX}")
    assert f"the cells timed before the interruption are in {partial}" in capsys.readouterr().err
    assert list(tmp_path.glob("*.json")) == [partial]  # no results file: the run did not finish
    doc = json.loads(partial.read_text())
    assert doc["partial"] is True and [c["M"] for c in doc["cells"]] == [1, 3] and doc["failed_cells"] == []
    assert all(c["us"] > 0 for c in doc["cells"]) and "copy_TBps" in doc["ceilings"]
    assert not list(tmp_path.glob("*.tmp"))

    monkeypatch.undo()  # the next run of the day takes the next name: the killed run's cells stay
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    assert json.loads(partial.read_text())["cells"] == doc["cells"]
    (done,) = [p for p in tmp_path.glob("*.json") if p != partial]
    assert done.stem.endswith("-2") and "partial" not in json.loads(done.read_text())
    assert [c["M"] for c in json.loads(done.read_text())["cells"]] == [1, 3, 5]


def test_a_finished_run_leaves_only_its_results(tmp_path):
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    assert not path.name.endswith(PARTIAL_SUFFIX) and not list(tmp_path.glob("*.tmp"))
    assert path == results_path(tmp_path, json.loads(path.read_text())).with_name(path.name)


def test_the_run_asks_git_once_and_every_partial_carries_the_runs_header(monkeypatch):
    """The commit (two git processes) is read once a run, not after every cell, and each partial document's header
    (device, date, commit, ceilings) is the final one's: a run past midnight keeps one date and one results name."""
    import torch

    import moekit.bench.run as run

    asked = []
    monkeypatch.setattr(run, "commit_id", lambda: asked.append(1) or f"c{len(asked)}")
    partials = []
    doc = run.run_bench(torch.device("cpu"), shapes=[TINY], batches=[1, 3, 5], backends=["grouped_mm"],
                        budget_s=0.01, on_partial=partials.append)
    assert len(asked) == 1 and len(partials) == 3 and [len(p["cells"]) for p in partials] == [1, 2, 3]
    head = ("device", "date", "commit", "ceilings", "shapes")
    assert all({k: p[k] for k in head} == {k: doc[k] for k in head} for p in partials)
    assert partials[-1]["cells"] == doc["cells"] and "partial" not in doc


def _offload_row(m: int) -> OffloadRow:
    """A row of ``bench --offload``'s table (every number 1.0 but M): what the CLI prints and keeps of it."""
    text = {"stream": "uniform", "policy": "lru", "prefetch": "none", "compute_misses_on": "gpu"}
    return OffloadRow(**{f.name: text.get(f.name, 1.0) for f in fields(OffloadRow)
                         if f.default is MISSING and f.name != "M"}, M=m)


def test_an_interrupted_offload_run_keeps_its_rows(tmp_path, monkeypatch, capsys):
    """``bench --offload`` (minutes on a GPU) lost every row to a Ctrl-C, saying "interrupted" (session 53)."""
    def measure_offload(*args, on_progress, **kwargs):
        on_progress(_offload_row(1))
        on_progress(_offload_row(8))
        raise KeyboardInterrupt

    monkeypatch.setattr(offload_measure, "measure_offload", measure_offload)
    argv = ["bench", "--offload", "--tiny", "--device", "cpu", "--out", str(tmp_path)]
    assert main(argv) == 130
    (partial,) = tmp_path.glob(f"*-offload-*{PARTIAL_SUFFIX}")
    assert f"moekit bench --offload: the rows measured before the interruption are in {partial}" in (
        capsys.readouterr().err)
    doc = json.loads(partial.read_text())
    assert doc["partial"] is True and [r["M"] for r in doc["rows"]] == [1, 8] and {"device", "commit"} <= set(doc)
    assert main(argv) == 130  # a second killed run keeps its own rows beside the first's
    assert len(list(tmp_path.glob(f"*-offload-*{PARTIAL_SUFFIX}"))) == 2


def test_an_interrupted_cpu_experts_run_keeps_its_batches(tmp_path, monkeypatch, capsys):
    real = cpu_measure.measure_batch

    def measure_batch(problem, *args, **kwargs):
        if problem.x.shape[0] == 3:
            raise KeyboardInterrupt
        return real(problem, *args, **kwargs)

    monkeypatch.setattr(cpu_measure, "measure_batch", measure_batch)
    argv = ["bench", "--cpu-experts", "--shape", "4,8,16,2", "--batches", "1,3", "--repeats", "1",
            "--backends", "moekit", "--out", str(tmp_path)]
    assert main(argv) == 130
    (partial,) = tmp_path.glob(f"*{PARTIAL_SUFFIX}")
    assert f"the batches measured before the interruption are in {partial}" in capsys.readouterr().err
    doc = json.loads(partial.read_text())
    assert doc["partial"] is True and [b["M"] for b in doc["batches"]] == [1]
    monkeypatch.undo()
    assert main(argv) == 0  # a finished run: its results file, the killed run's partial left as it was
    assert json.loads(partial.read_text()) == doc
    assert len(list(tmp_path.glob("*.json"))) == 2 and len(list(tmp_path.glob(f"*{PARTIAL_SUFFIX}"))) == 1


def test_an_interruption_before_any_result_says_nothing_was_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(offload_measure, "measure_offload", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["bench", "--offload", "--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 130
    assert "moekit bench --offload: nothing written (interrupted before its first result)" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_an_interrupted_hf_run_names_the_models_it_kept(tmp_path, monkeypatch, capsys):
    """``bench --hf`` writes a file per model as each finishes; a Ctrl-C said only "interrupted" (session 53)."""
    pytest.importorskip("transformers")
    from moekit.bench import hf_report, hf_run

    def run_hf_bench(device, opts, log):
        if opts.model == "mixtral":
            raise KeyboardInterrupt
        return {"device": "cpu", "date": "2026-12-07", "model": {"name": opts.model}}

    monkeypatch.setattr(hf_run, "run_hf_bench", run_hf_bench)
    monkeypatch.setattr(hf_report, "print_hf_report", lambda doc, console: None)
    assert main(["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "qwen3,mixtral",
                 "--out", str(tmp_path)]) == 130
    (kept,) = tmp_path.glob("*.json")
    assert json.loads(kept.read_text())["model"]["name"] == "qwen3"
    err = capsys.readouterr().err
    assert "mixtral was interrupted, its rows not kept" in err and f"finished before it are in {kept}" in err

"""``moekit train``: the data is the stdlib's bytes in a fixed order, the model learns, the command writes
its JSON (and PNG), and the two balanced runs end with a lower load imbalance than the unbalanced one.

The balance check runs a tiny model for 60 steps at seed 1 and asks for a margin of 0.3 (there: 2.81
unbalanced, 1.42 aux loss, 1.66 bias update; max/mean load over the last 12 steps). Not luck: seeds
0-9 all end with both balanced runs below the unbalanced one (unbalanced 1.82-2.81, aux loss
1.28-1.47, bias update 1.49-1.95; the smallest margin 0.15, seed 9)."""

from __future__ import annotations

import json
import sys
import sysconfig

import pytest
import torch

from moekit.cli import main
from moekit.train.curves import summary, tail_mean
from moekit.train.data import load_stdlib_bytes, stdlib_files
from moekit.train.loop import METHODS, TrainSettings, train_side_by_side

from _helpers import cli_error

TINY = dict(batch_size=16, seq_len=64, d_model=32, num_heads=2, num_layers=1, expert_size=32, aux_loss_coef=0.1,
            bias_rate=1e-2)


@pytest.fixture(scope="module")
def corpus():
    return load_stdlib_bytes(1 << 20)


def test_corpus_is_the_sorted_stdlib_sources(corpus):
    files = stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    want = b"".join(f.read_bytes() for f in files[: corpus.files])[: 1 << 20]
    assert corpus.root == sysconfig.get_paths()["stdlib"] and bytes(corpus.data.numpy()) == want
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x1, y1 = corpus.batch(4, 16, g1)
    x2, _ = corpus.batch(4, 16, g2)
    assert torch.equal(x1, x2) and torch.equal(x1[:, 1:], y1[:, :-1])  # targets: the next byte


@pytest.fixture
def one_thread():
    """Tiny GEMMs: a second thread only contends on CI's shared cores (measured here: 11 s vs 157 s with two
    threads, load 15)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_balanced_runs_end_less_imbalanced(corpus, one_thread):
    result = train_side_by_side(TrainSettings(steps=60, seed=1, **TINY), corpus)
    ends = {m: v["imbalance"] for m, v in summary(result).items()}
    assert list(result.curves) == list(METHODS)
    assert ends["aux"] < ends["none"] - 0.3 and ends["bias"] < ends["none"] - 0.3, ends
    for curve in result.curves.values():
        assert len(curve.loss) == 60 and tail_mean(curve.loss) < curve.loss[0] - 1.0  # it learns (5.7 -> ~2.7 nats)
        assert all(d == 0 for d in curve.dropped)  # dropless


def test_command_writes_curves_with_drops(tmp_path, capsys, one_thread):
    argv = ["train", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--layers", "1",
            "--expert-size", "8", "--capacity-factor", "0.5", "--log-every", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "step    3/3" in text and "drop" in text and "wrote" in text
    doc = json.loads((tmp_path / "train-curves.json").read_text())
    assert set(doc["runs"]) == set(METHODS) and doc["settings"]["capacity_factor"] == 0.5
    for run in doc["runs"].values():
        assert len(run["loss"]) == len(run["imbalance"]) == len(run["dropped"]) == 3
        assert all(d > 0 for d in run["dropped"])  # capacity 0.5 drops about half the assignments
    if pytest.importorskip("matplotlib"):
        assert (tmp_path / "train-curves.png").stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["--top-k", "9"], "top_k must be <= num_experts"),
    (["--d-model", "30"], "divisible by num_heads"),
])
def test_bad_settings_are_named(tmp_path, capsys, argv, message):
    """The one-line usage error names the flag the user typed (``--top-k``), not only the setting's field."""
    line = cli_error(capsys, ["train", "--steps", "1", "--out", str(tmp_path), *argv])
    assert message in line and argv[0] in line


def test_without_matplotlib_says_which_extra(tmp_path, capsys, one_thread, monkeypatch):
    """No PNG without matplotlib, and the line says so with the extra to install, brackets kept (rich reads
    ``[plot]`` as a style tag unless told not to: the line said ``pip install "moekit"``)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # how a missing package fails to import
    argv = ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--layers", "1",
            "--expert-size", "8", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert 'no plot: needs matplotlib, which is not installed: pip install "moekit[plot]"' in capsys.readouterr().out
    assert (tmp_path / "train-curves.json").exists() and not (tmp_path / "train-curves.png").exists()


def test_bench_train_rows_on_cpu(tmp_path, capsys, one_thread):
    """``moekit bench --train`` at a tiny CPU size: both implementations run, their gradients agree, and
    TFLOP/s is 3 x the forward's expert FLOPs over the step time."""
    pytest.importorskip("transformers")
    argv = ["bench", "--train", "--device", "cpu", "--shapes", "qwen3-30b-a3b", "--batches", "16", "--out",
            str(tmp_path)]
    assert main(argv) == 0
    assert "x transformers:grouped_mm" in capsys.readouterr().out
    (path,) = tmp_path.glob("*-train-*.json")
    doc = json.loads(path.read_text())
    rows = {r["impl"]: r for r in doc["rows"]}
    assert set(rows) == {"moekit:grouped_mm", "transformers:grouped_mm"}
    n, k, top_k = 768 // 16, 2048 // 16, 8  # Qwen3-30B-A3B's expert shape / CPU_SCALE
    for row in rows.values():
        assert row["error"] is None and row["ms"] > 0 and row["shape"] == "qwen3-30b-a3b/16" and row["tokens"] == 16
        assert row["tflops"] == pytest.approx(3 * 6 * n * k * 16 * top_k / (row["ms"] * 1e-3) / 1e12)
    assert rows["moekit:grouped_mm"]["rel_err_dx"] < 1e-5 and rows["moekit:grouped_mm"]["rel_err_dgate"] < 1e-5
    (speedup,) = doc["speedups"]
    ratio = rows["transformers:grouped_mm"]["ms"] / rows["moekit:grouped_mm"]["ms"]
    assert speedup["speedup_vs_transformers"] == pytest.approx(ratio)


@pytest.mark.parametrize("gpu", [True, False])
def test_device_defaults_to_cuda_when_a_gpu_is_present(gpu, monkeypatch, capsys):
    """As demo and bench: the default is resolved when the parser is built, and --help shows the one it took."""
    from moekit.cli import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    parser = build_parser()
    assert parser.parse_args(["train"]).device == ("cuda" if gpu else "cpu")
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"cuda (the Triton experts path) when a GPU is present, else cpu; as demo and bench (default: " \
           f"{'cuda' if gpu else 'cpu'})" in help_text


def test_the_first_line_names_the_device(tmp_path, capsys, one_thread):
    argv = ["train", "--steps", "1", "--batch-size", "2", "--seq-len", "16", "--d-model", "16", "--layers", "1",
            "--expert-size", "8", "--no-plot", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[0] == "moekit train on cpu: 1 steps x 3 runs"


def test_a_ctrl_c_says_nothing_was_written(tmp_path, capsys, one_thread, monkeypatch):
    """The curves are written after the three runs: a Ctrl-C said only "interrupted" (session 53)."""
    import moekit.train.loop as loop

    monkeypatch.setattr(loop, "train_side_by_side", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["train", "--steps", "7", "--no-plot", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert "moekit train: nothing written (train-curves.json and its plot are written after the three runs' 7 " in err
    assert "moekit train: interrupted" in err and not list(tmp_path.iterdir())

"""``moekit simulate`` and ``moekit serve`` through the real command-line entry point."""

import functools
import json

import pytest

from moekit.cli import build_parser, main
from moekit.cli import simulate as simulate_cli
from moekit.sim.exercises import exercise3

from _helpers import cli_error


def test_simulate_json_has_the_issue_fields(capsys):
    assert main(["simulate", "--json", "--experts", "16", "--gpus", "4"]) == 0
    d = json.loads(capsys.readouterr().out)
    for key in ("loads", "capacity", "dropped", "drop_rate", "imbalance", "experts_touched",
                "total_params", "active_params", "sparsity"):
        assert key in d
    assert sum(d["loads"]) == 128 * 2


def test_simulate_summary_histogram_and_plot(capsys, tmp_path):
    png = tmp_path / "run.png"
    assert main(["simulate", "--balance", "bias", "--bias-batches", "20", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "capacity 5" in out and "imbalance" in out and "balancing         bias, 20 steps" in out
    assert "#" in out  # the ASCII bars
    assert " µs  balanced " in out and " us " not in out  # one spelling of the unit (the EP lines said "us")
    assert png.stat().st_size > 10_000


def test_simulate_bad_value_exits_2_with_the_message(capsys):
    assert main(["simulate", "--skew", "1.5"]) == 2
    assert "skew must be in [0, 1]" in capsys.readouterr().err


def test_exercise_runs_and_plots(capsys, tmp_path, monkeypatch):
    # The CLI path (dispatch, answer text, plot) on a shorter sweep than the default; the exercise's
    # own numbers are tested in test_sim_exercises.py.
    monkeypatch.setitem(simulate_cli._EXERCISES, 3, functools.partial(exercise3, tokens=512, skews=[0.0, 0.4, 0.6]))
    png = tmp_path / "ex3.png"
    assert main(["simulate", "exercise", "3", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "loses 50% of the throughput" in out and "eplb" in out
    assert " µs  mean " in out and " us " not in out
    assert png.stat().st_size > 10_000


def test_a_run_shows_it_is_working_on_a_terminal_only(capsys, monkeypatch):
    """The exercises take 10-25 s on a 2-core CPU: a spinner on stderr says what runs (there was nothing);
    through a pipe stderr stays empty and stdout is the JSON alone."""
    monkeypatch.setitem(simulate_cli._EXERCISES, 3, functools.partial(exercise3, tokens=64, skews=[0.0]))
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE"):  # what makes rich take a pipe for a terminal
        monkeypatch.delenv(name, raising=False)
    assert main(["simulate", "exercise", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then draws as on a terminal
    assert main(["simulate", "exercise", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    assert "exercise 3 ..." in err and json.loads(out)
    assert main(["simulate", "--tokens", "16", "--experts", "8", "--json"]) == 0
    assert "simulating 16 tokens on E=8, top-2 ..." in capsys.readouterr().err


def test_serve_defaults_to_loopback():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"


@pytest.mark.parametrize(("argv", "line"), [
    (["--aux-steps", "5"], "moekit simulate: error: --aux-steps applies to --balance aux-loss, got --balance none"),
    (["--bias-batches", "3", "--balance", "aux-loss"],
     "moekit simulate: error: --bias-batches applies to --balance bias, got --balance aux-loss"),
])
def test_a_balance_methods_setting_with_another_method_is_refused(argv, line, capsys):
    """--aux-steps without --balance aux-loss (or --bias-batches without bias) ran, the setting dropped in silence."""
    assert cli_error(capsys, ["simulate", "--tokens", "16", *argv]) == line


@pytest.mark.parametrize("source", [["--experts", "4"], ["--config", "FLEX"]])
def test_a_model_of_fewer_experts_than_the_default_gpus_runs_on_as_many_gpus_as_it_has_experts(source, tmp_path,
                                                                                              capsys):
    """FlexOlmo's config.json (7 experts in transformers' default; 4 here) or --experts 4 without --gpus: the
    expert-parallel what-if spreads them over 4 GPUs (one expert each, no spare slot to fill: 4 x (4 - 1) = 12 >= 8
    spare slots), as `moekit serve` does; a --gpus the user gave above E is still refused, naming it."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "flex.json"
    transformers.FlexOlmoConfig(num_experts=4, num_experts_per_tok=2).to_json_file(str(path))
    argv = [str(path) if a == "FLEX" else a for a in source]
    assert main(["simulate", *argv, "--tokens", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["params"]["experts"], d["params"]["gpus"], d["params"]["spare_slots"]) == (4, 4, 8)
    assert "--gpus must be <= experts (4); got 8" in cli_error(capsys, ["simulate", *argv, "--gpus", "8"])


def test_a_model_whose_experts_the_simulator_cannot_take_names_the_file(tmp_path, capsys):
    """Hunyuan-MoE's config class defaults to num_experts=1: the error names the config and its key, not --experts
    (which the user did not give)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "hunyuan.json"
    transformers.HunYuanMoEV1Config().to_json_file(str(path))
    line = cli_error(capsys, ["simulate", "--config", str(path)])
    assert f"--config {path}: its E=1" in line and "must be in [2, 512]" in line and "--experts" not in line

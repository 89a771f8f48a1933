"""The ``moekit`` command never answers a user's mistake with a traceback: every subcommand, given a bad
argument, exits 2 with one line ``moekit <subcommand>: error: ...`` naming the argument (``cli_error``
in _helpers.py checks the three). A real bug keeps its traceback. Also: list options take both
``1 8 64`` and ``1,8,64``; ``--help``, ``--version``; the ``wrote PATH`` line.

Runs ``main()`` in-process (fast); two subprocesses check import-time behaviour with a package blocked
the way a missing one fails (``sys.modules[name] = None``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moekit.cli import build_parser, main
from moekit.cli import simulate as simulate_cli
from moekit.cli._args import ListOption, UsageError
from moekit.presets import hf_config_of_preset

from _helpers import cli_error

ROOT = Path(__file__).resolve().parents[1]
TINY = ["analyze", "--experts", "8", "--top-k", "2", "--hidden", "64", "--moe-intermediate", "32"]
NO_DIR = "/nonexistent-moekit-dir/out.png"
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    """Bad input files, by name."""
    mixtral = hf_config_of_preset("mixtral-8x7b")
    contents = {
        "list": [1, 2, 3],
        "partial": {"model_type": "mixtral"},
        "llama": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32},
        "no_layers": {k: v for k, v in mixtral.items() if k != "num_hidden_layers"},
        "nan": [float("nan")] + [1.0] * 7,
        "negative": [-1] + [1] * 7,
        "short": [1, 2, 3],
        "object": {"experts": 8},
        "zeros": [0] * 8,
    }
    paths = {name: tmp_path / f"{name}.json" for name in contents}
    for name, value in contents.items():
        paths[name].write_text(json.dumps(value))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "a_file").write_text("")
    paths |= {"bad": tmp_path / "bad.json", "a_file": tmp_path / "a_file", "dir": tmp_path}
    return {name: str(path) for name, path in paths.items()}


# (argv with {name} for a file of the fixture, text the error line must hold)
CASES = [
    (["analyze", "--preset", "nope"], "--preset"),
    (["analyze", "--config", "/nonexistent/config.json"], "--config: cannot read"),
    (["analyze", "--config", "{bad}"], "is not JSON"),
    (["analyze", "--config", "{list}"], "holds a JSON list"),
    (["analyze", "--config", "{partial}"], "config.json at {partial} has no 'hidden_size'"),
    (["analyze", "--config", "{llama}"], "model_type must be one of"),
    (["analyze", "--config", "{no_layers}"], "has no 'num_hidden_layers': give --layers"),
    ([*TINY, "--expert-load", "{nan}"], "--expert-load"),
    ([*TINY, "--expert-load", "{negative}"], "expert 0 has -1"),
    ([*TINY, "--expert-load", "{short}"], "list of 8"),
    ([*TINY, "--expert-load", "{object}"], "list of 8"),
    ([*TINY, "--expert-load", "{bad}"], "--expert-load"),
    ([*TINY, "--expert-load", "{zeros}"], "every count is zero"),
    ([*TINY, "--plot", NO_DIR], "--plot"),
    ([*TINY, "--plot", "{dir}"], "--plot"),
    ([*TINY, "--plot", "{a_file}/out.png"], "--plot"),
    ([*TINY, "--plot", "out.txt"], "--plot"),
    ([*TINY, "--batches", "1,x"], "--batches"),
    ([*TINY, "--batches", "-4"], "--batches"),
    ([*TINY, "--layers", "-1"], "--layers"),
    ([*TINY, "--memory-gib", "nan"], "--memory-gib"),
    ([*TINY, "--tflops", "inf"], "--tflops must be positive and finite"),
    ([*TINY, "--gpu", "v100"], "--gpu must be one of"),
    ([*TINY, "--cache-experts", "4", "--hit-rate", "0.9"], "--cache-experts, --hit-rate: settings of the offload"),
    (["simulate", "--experts", "-3"], "--experts"),
    (["simulate", "--top-k", "99"], "--top-k"),
    (["simulate", "--skew", "nan"], "--skew"),
    (["simulate", "--balance", "magic"], "--balance"),
    (["simulate", "--plot", NO_DIR], "--plot"),
    (["simulate", "exercise", "4"], "invalid choice"),
    (["simulate", "exercise", "1", "--plot", NO_DIR], "--plot"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "http"], "--port"),
    (["serve", "--host", "192.0.2.1", "--port", "0"], "--host"),  # TEST-NET-1: never this machine's
    (["demo", "--device", "tpu"], "--device"),
    (["demo", "--seed", "x"], "--seed"),
    (["demo", "--seed", str(2**80)], "--seed"),
    (["bench", "--device", "cuda:x"], "--device"),
    (["bench", "--device", "cpu", "--shapes", "nope"], "--shapes"),
    (["bench", "--device", "cpu", "--batches", "0"], "--batches"),
    (["bench", "--device", "cpu", "--backends", "nope"], "--backends: unknown"),
    (["bench", "--device", "cpu", "--out", "{a_file}/results"], "--out"),
    # a mode's own flag in a run of another mode: it was dropped in silence (--train --tiny ran full widths)
    (["bench", "--train", "--tiny"], "--tiny applies to --hf or --offload, which this run is not"),
    (["bench", "--train", "--hf-model", "qwen3"], "--hf-model applies to --hf"),
    (["bench", "--no-compile"], "--compile / --no-compile applies to --hf"),
    (["bench", "--offload-steps", "2"], "--offload-steps applies to --offload"),
    (["bench", "--hf", "--offload-dtype", "mxfp4"], "--offload-dtype applies to --offload"),
    (["bench", "--cpu-experts", "--layers", "2"], "--layers applies to --hf"),
    (["bench", "--train", "--repeats", "3"], "--repeats applies to --hf or --cpu-experts"),
    # the kernel cells' flags in a mode that does not read them: dropped in silence too (--hf --batches 8)
    (["bench", "--hf", "--batches", "8"], "--batches applies to the kernel cells, --offload, --train, --cpu-experts, "
                                          "not to --hf"),
    (["bench", "--offload", "--shapes", "mixtral-8x7b"], "--shapes applies to the kernel cells, --train, not to "
                                                          "--offload"),
    (["bench", "--hf", "--backends", "triton"], "--backends applies to the kernel cells, --train, --cpu-experts, not "
                                                "to --hf"),
    (["bench", "--train", "--no-plot"], "--no-plot applies to the kernel cells, not to --train"),
    (["tune"], "give --preset"),
    (["tune", "--preset", "nope"], "--preset"),
    (["tune", "--shape", "8,16"], "--shape"),
    (["tune", "--batches", "1,0"], "--batches"),
    (["tune", "--budget-s", "-5", "--preset", "qwen3-30b-a3b"], "--budget-s"),
    (["tune", "--out", "{a_file}/configs", "--preset", "qwen3-30b-a3b"], "--out"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_argument_is_one_line_naming_it(argv, expected, files, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a relative path that passed by mistake lands here, not in the tree
    line = cli_error(capsys, [a.format(**files) for a in argv])
    assert expected.format(**files) in line


@CPU_ONLY
@pytest.mark.parametrize("argv", [["demo", "--device", "cuda"], ["bench", "--device", "cuda"],
                                  ["tune", "--preset", "qwen3-30b-a3b"]])
def test_cuda_on_a_cpu_build(argv, capsys):
    assert "cuda" in cli_error(capsys, argv).lower()


def test_busy_port(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "already in use" in cli_error(capsys, ["serve", "--port", str(port)])


def test_unknown_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["nope"])
    assert exc.value.code == 2 and "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["analyze", "bench", "demo", "serve", "simulate", "train", "tune"])
def test_an_unknown_flag_is_the_subcommand_s_error(sub, capsys):
    """A flag the subcommand does not take (a typo, or another subcommand's: ``bench --config``) is reported by that
    subcommand, with its usage line, as every other mistake; argparse's top-level parser said ``moekit: error``
    under ``usage: moekit [-h] [--version] COMMAND ...``, which names neither the subcommand nor its options."""
    line = cli_error(capsys, [sub, "--no-such-flag=x"])
    assert line == f"moekit {sub}: error: unrecognized arguments: --no-such-flag=x"
    with pytest.raises(SystemExit):
        main([sub, "--no-such-flag"])
    assert capsys.readouterr().err.startswith(f"usage: moekit {sub} ")


def test_an_unknown_flag_after_a_nested_subcommand_is_that_subcommand_s_error(capsys):
    """``simulate cache --nope`` was reported by ``simulate``'s parser, under simulate's usage."""
    line = cli_error(capsys, ["simulate", "cache", "--nope"])
    assert line == "moekit simulate cache: error: unrecognized arguments: --nope"
    with pytest.raises(SystemExit):
        main(["simulate", "cache", "--nope"])
    assert capsys.readouterr().err.startswith("usage: moekit simulate cache ")
    assert cli_error(capsys, ["simulate", "--nope"]) == "moekit simulate: error: unrecognized arguments: --nope"


def test_plot_without_matplotlib(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # how a missing package fails to import
    for argv in ([*TINY, "--plot", "out.png"], ["simulate", "--plot", "out.png"]):
        assert 'pip install "moekit[plot]"' in cli_error(capsys, argv)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_entry_point_without_matplotlib(tmp_path):
    out = tmp_path / "out.png"
    argv = ["moekit", *TINY, "--plot", str(out)]
    done = _python(f"import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = {argv!r}; "
                   "runpy.run_module('moekit', run_name='__main__')")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("moekit analyze: error: argument --plot: needs matplotlib")
    assert not out.exists()


def test_import_hf_without_transformers():
    done = _python("import sys; sys.modules['transformers'] = None\n"
                   "try:\n    import moekit.hf\n"
                   "except ImportError as err:\n    print(type(err).__name__, err)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("MissingExtraError ") and 'pip install "moekit[hf]"' in done.stdout


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(params, config=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(simulate_cli, "simulate", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["simulate"])


def test_debug_shows_a_usage_error_with_its_traceback(monkeypatch):
    monkeypatch.setenv("MOEKIT_DEBUG", "1")
    with pytest.raises(UsageError, match="--top-k"):
        main(["simulate", "--top-k", "99"])


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_list_option_is_a_list_option():
    parser = build_parser()
    commands = _subparsers(parser)
    commands |= {f"simulate {k}": v for k, v in _subparsers(commands["simulate"]).items()}
    lists = [(name, a.dest) for name, p in commands.items() for a in p._actions
             if a.option_strings and (a.nargs in ("+", "*") or isinstance(a, argparse._AppendAction))
             and not isinstance(a, ListOption)]
    assert not lists, f"list options not using moekit.cli._args.ListOption: {lists}"


@pytest.mark.parametrize("argv, dest", [
    (["analyze", "--batches", "1,8", "64"], "batches"),
    (["bench", "--batches", "1", "8,64"], "batches"),
    (["tune", "--batches", "1,8,64"], "batches"),
])
def test_lists_take_spaces_and_commas(argv, dest):
    assert getattr(build_parser().parse_args(argv), dest) == [1, 8, 64]


def test_repeated_list_option_adds():
    args = build_parser().parse_args(["tune", "--preset", "qwen3-30b-a3b,deepseek-v3", "--preset", "mixtral-8x7b"])
    assert args.preset == ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("moekit ")


def test_simulate_help_has_defaults_and_lists_exercise_once():
    commands = _subparsers(build_parser())
    text = commands["simulate"].format_help()
    listing = text[text.index("positional arguments:"):text.index("options:")]
    assert sum(line.strip().startswith("exercise") for line in listing.splitlines()) == 1, text
    assert "(default: 64)" in text and "(default: 0.55)" in text and "(default: None)" not in text
    undocumented = [a.dest for a in commands["simulate"]._actions if a.help is None]
    assert not undocumented, undocumented


def test_every_subcommand_says_what_it_does_and_every_option_has_help():
    """``moekit demo --help`` and ``moekit serve --help`` said nothing beyond the usage line, and ``--top-k`` of
    analyze and ``--seed`` of simulate cache had no help: a new user's first look at each command."""
    commands = _subparsers(build_parser())
    commands |= {f"simulate {k}": v for k, v in _subparsers(commands["simulate"]).items()}
    assert not [name for name, p in commands.items() if not p.description]
    assert not [name for name, p in commands.items() if "``" in p.format_help()]  # rst markup is for docstrings
    undocumented = {name: [a.dest for a in p._actions if a.help is None] for name, p in commands.items()}
    assert not {name: dests for name, dests in undocumented.items() if dests}
    assert "E=16 experts, top-2" in commands["demo"].format_help()
    bench = " ".join(commands["bench"].format_help().split())  # where the files go, and which M, before a run
    assert "(default: benchmarks/results under the current directory;" in bench
    assert "(default: 1,8,32,64,128,256,512,1024,4096,16384 on the GPU, 1,8,32,128,512 on the CPU)" in bench
    tune = " ".join(commands["tune"].format_help().split())
    assert "(default: bfloat16)" in tune and "i.e. ~/.config/moekit/configs" in tune and "(default: no limit)" in tune


def test_every_option_with_a_default_says_it_in_its_help():
    """analyze's --utilization / --reserve-gib / --batches / --link-gbps and bench --offload's six options ran with
    defaults their help did not show (a user reads 0.92 of memory or three cache fractions nowhere but the code)."""
    commands = _subparsers(build_parser())
    commands |= {f"simulate {k}": v for k, v in _subparsers(commands["simulate"]).items()}
    hidden = {}
    for name, parser in commands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
                continue
            if "default" not in (formatter._get_help_string(action) or "").lower():
                hidden.setdefault(name, []).append(action.option_strings[-1])
    assert not hidden
    analyze = " ".join(commands["analyze"].format_help().split())
    assert "(default 0.92, vLLM's gpu_memory_utilization)" in analyze
    assert "(default 1,8,32,64,128,256,512,4096)" in analyze


def test_config_without_layer_count_takes_layers(files, capsys):
    assert main(["analyze", "--config", files["no_layers"], "--layers", "4", "--batches", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    row = json.loads(out)["rows"][0]
    assert row["step_time_floor_s"] == pytest.approx(4 * row["time_floor_s"])
    assert json.loads(out)["bills"] is None and "no 'num_hidden_layers': no parameter or memory bills" in err


def test_wrote_lines(tmp_path, capsys):
    png = tmp_path / "a.png"
    assert main([*TINY, "--batches", "1", "--plot", str(png)]) == 0
    assert capsys.readouterr().out.rstrip().endswith(f"wrote {png}")
    assert main([*TINY, "--batches", "1", "--plot", str(png), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"] and err.strip() == f"wrote {png}"  # stdout stays JSON
    assert main(["simulate", "--tokens", "16", "--plot", str(tmp_path / "s.png")]) == 0
    assert f"wrote {tmp_path / 's.png'}" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["train", "--steps", "1"], ["bench", "--device", "cpu", "--no-plot"]])
def test_an_output_directory_that_cannot_be_made_stops_the_run_before_its_work(argv, capsys, monkeypatch):
    """Run from /proc (no directory can be made there, root or not), the default ``--out`` fails at the start, in one
    line naming --out, before a step is trained or a ceiling measured: not at the end, the results lost."""
    import moekit.bench.ceilings
    import moekit.train.loop

    def never(*args, **kwargs):
        raise AssertionError("the run's work started")

    monkeypatch.setattr(moekit.train.loop, "train_side_by_side", never)
    monkeypatch.setattr(moekit.bench.ceilings, "measure_ceilings", never)
    monkeypatch.chdir("/proc")
    line = cli_error(capsys, argv)
    assert f"moekit {argv[0]}: error: --out: cannot write under " in line
    assert ("moekit-train" if argv[0] == "train" else "benchmarks/results") in line


def test_a_usage_error_after_the_output_directory_was_made_leaves_nothing(capsys, tmp_path):
    """``bench --hf --hf-model nope --out A/B``: the model is refused after --out's directories were made; they go
    again (a directory that was there stays, and so does one the run wrote into)."""
    out = tmp_path / "a" / "b"
    cli_error(capsys, ["bench", "--hf", "--hf-model", "nope", "--out", str(out)])
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    cli_error(capsys, ["bench", "--hf", "--hf-model", "nope", "--out", str(tmp_path / "kept")])
    assert (tmp_path / "kept").is_dir()


def test_a_reader_that_closes_the_pipe_gets_no_traceback():
    """Session 51: ``moekit demo --json | head`` ended in a ``BrokenPipeError`` traceback (and Python's "Exception
    ignored" line at exit) once head had read its lines. The reader here closes its end before moekit writes: the
    run stops quietly, exit 1 (what Python's docs do on EPIPE), nothing on stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "moekit", "demo", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before any write: the first one fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and err == "", err

"""``moekit tune`` keeps compiler output out of the console: Triton prints a kernel that fails to compile from C++
straight to file descriptor 2 (on Triton 3.6, ~220 lines of MLIR for one fp8 config); the tuner times that config as
failed, sends fd 2 to ``<file>.compile.log`` while it tunes, and says how many configs failed and where the output
is. No GPU: the search is stubbed, the writes are real fd-2 writes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import moekit.bench.tuning as tuning
from moekit.bench.cells import Shape
from moekit.bench.compiler_output import stderr_to
from moekit.experts.configs import GemmTile, KernelConfig, clear_config_cache

TINY = Shape("tiny", 4, 32, 64, 2)
CONFIG = KernelConfig(16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))


def test_stderr_to_takes_fd_2_and_gives_it_back(tmp_path, capfd):
    log = tmp_path / "sub" / "x.compile.log"
    with stderr_to(log):
        os.write(2, b"error: operand #0 does not dominate this use\n")  # as C++ writes it
        print("a python warning", file=sys.__stderr__, flush=True)  # the process's own stderr: fd 2 too
    os.write(2, b"after\n")
    assert log.read_text() == "error: operand #0 does not dominate this use\na python warning\n"
    assert capfd.readouterr().err == "after\n"
    with pytest.raises(RuntimeError), stderr_to(log):  # restored on an exception too, appended
        os.write(2, b"second\n")
        raise RuntimeError
    os.write(2, b"again\n")
    assert log.read_text().endswith("second\n") and capfd.readouterr().err == "again\n"


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path / "user"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    clear_config_cache()
    yield tmp_path / "user"
    clear_config_cache()


def test_a_failing_config_goes_to_the_log_and_the_note_counts_it(user_dir, monkeypatch, capfd):
    def search(shape, m, scheme, device, weights):
        os.write(2, b"gemm_fp8.py:285:82: error: operand #0 does not dominate this use\n")
        return tuning.TuneResult(CONFIG, 5.0, 9.0, failed=1, timed=7)

    monkeypatch.setattr(tuning, "tune_one", search)
    notes = []
    path = tuning.tune(TINY, [8], torch.bfloat16, device="cpu", out_dir=user_dir, note=notes.append)
    log = path.with_suffix(".compile.log")
    assert "does not dominate" in log.read_text()
    assert "does not dominate" not in capfd.readouterr().err  # not on the console
    assert notes == [f"M=8: 1 of 7 configs failed to compile or run (timed as failed, out of the running); their "
                     f"compiler output: {log}"]


def test_a_clean_search_leaves_no_log(user_dir, monkeypatch):
    monkeypatch.setattr(tuning, "tune_one", lambda shape, m, scheme, device, weights: tuning.TuneResult(
        CONFIG, 5.0, 9.0, failed=0, timed=7))
    notes = []
    path = tuning.tune(TINY, [8], torch.bfloat16, device="cpu", out_dir=user_dir, note=notes.append)
    assert path.is_file() and not path.with_suffix(".compile.log").exists() and notes == []


def test_tune_one_counts_the_configs_timed_as_failed(monkeypatch):
    # the search itself (coordinate descent over the scheme's heights and tiles) with a timer that fails every
    # config of a 32-wide up tile: the count is the configs timed inf, of all those timed
    def fake_timer(shape, num_tokens, scheme, device, weights):
        return lambda configs: [float("inf") if c.up.BLOCK_N == 32 else 10.0 + c.BLOCK_M for c in configs]

    monkeypatch.setattr(tuning, "_timer", fake_timer)
    result = tuning.tune_one(TINY, 8, tuning.scheme_for(torch.bfloat16), torch.device("cpu"), None)
    assert result.timed > result.failed > 0 and result.us < float("inf") and result.config.up.BLOCK_N != 32

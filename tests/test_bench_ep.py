"""The EP benchmark entry runs end to end on 2 gloo ranks with tiny fp32 shapes (a smoke test: the
numbers on CI's CPU mean nothing; the GPU run is ``torchrun --nproc-per-node 2 -m moekit.bench.ep``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from _parallel_harness import run_ranks


def _bench(rank: int, world_size: int) -> dict:
    from moekit.bench import ep

    args = argparse.Namespace(tiny=True, check=True, tokens=[0, 8], backend="auto", reps=2, out=None, dispatch="both",
                              profile=True, overlap=[1, 2])
    return ep.run(torch.device("cpu"), rank, world_size, args)


@pytest.fixture(scope="module")
def doc():
    return run_ranks(_bench, 2, timeout_s=120)[0]


def test_bench_entry_runs_on_two_ranks(doc):
    assert doc["world_size"] == 2 and doc["backend"] == "gloo"
    assert max(doc["check_rel_err"].values()) < 1e-5
    assert [(row["dispatch"], row["M"], row["overlap"]) for row in doc["rows"]] == [
        (d, m, c) for d in ("exact", "padded") for m in (0, 8) for c in (1, 2)]
    for row in doc["rows"]:
        for key in ("dispatch_us", "experts_us", "combine_us", "layer_us", "raw_dispatch_us", "single_gpu_us"):
            assert row[key] >= 0, key
        if row["overlap"] > 1:
            assert row["overlap_goal_us"] == 1.05 * max(row["experts_us"],
                                                        row["raw_dispatch_us"] + row["raw_combine_us"])


def test_profile_counts_the_exact_dispatchs_one_host_read_and_the_padded_none(doc):
    for row in (r for r in doc["rows"] if r["overlap"] == 1 and r["M"] == 8):
        profile = row["profile"]
        assert set(profile) == {"route", "dispatch", "experts", "experts_half", "combine", "layer", "layer_c2"}
        # The dispatch phase alone: the counts read (exact) or nothing (padded). The layer: that read,
        # or the padded path's eager error agreement, and nothing else beyond routing's own.
        assert profile["dispatch"]["host_syncs"] == (1 if row["dispatch"] == "exact" else 0), row["dispatch"]
        assert profile["layer"]["host_syncs"] == profile["route"]["host_syncs"] + 1, row["dispatch"]
        assert profile["combine"]["host_syncs"] == 0 and profile["combine"]["launches"] >= 1
        assert profile["layer"]["launches"] > profile["experts"]["launches"] + profile["route"]["launches"]


def test_run_without_torchrun_is_one_line_saying_how(capsys, monkeypatch):
    """``python -m moekit.bench.ep`` outside torchrun died in torch's env:// rendezvous with a traceback ("environment
    variable RANK expected, but not set"); its help showed no defaults and the docstring's rst markup."""
    from moekit.bench import ep

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        ep.main(["--tiny"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err == ("python -m moekit.bench.ep: error: run it under torchrun, which sets RANK "
                                           "and WORLD_SIZE: torchrun --standalone --nproc-per-node 2 -m "
                                           "moekit.bench.ep ...")
    text = " ".join(ep.build_parser().format_help().split())
    assert "``" not in text and "(default: both)" in text and "default 20)" in text and "default 120)" in text

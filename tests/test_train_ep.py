"""``moekit train --ep N``: the three runs with every MoE layer expert-parallel over N spawned gloo processes.

The curves of ``--ep 2`` equal ``--ep 1``'s (one process, no torch.distributed) on the same seed: the expert counts
behind the imbalance and the drops exactly (the same routing: the ranks' counts are integers summed), the loss within
1e-5 relative. Why 1e-5: the two differ only in float32 summation order (each rank's half of the batch, the
all-reduce, the averaged gradients) fed through 4 AdamW steps; measured 9e-8 at these sizes, about float32's epsilon
(6e-8), so 1e-5 leaves a factor of 100, while a training difference shows: each rank training on its own tokens' aux
loss instead of its part of the batch's moved the aux run's loss by 1.6e-4 after one step (measured by swapping it in).
Then the refusals, by flag.
"""

from __future__ import annotations

import json

import pytest
import torch

from _helpers import cli_error
from moekit.cli import main
from moekit.train.ep import check_ranks
from moekit.train.loop import METHODS, TrainSettings

ARGV = ["train", "--steps", "4", "--batch-size", "4", "--seq-len", "16", "--d-model", "32", "--layers", "2",
        "--experts", "4", "--expert-size", "32", "--aux-coef", "0.1", "--bias-rate", "0.01", "--log-every", "2",
        "--no-plot"]


def _train(tmp_path, capsys, ep: int) -> tuple[dict, list[str]]:
    out = tmp_path / f"ep{ep}"
    assert main([*ARGV, "--ep", str(ep), "--out", str(out)]) == 0
    return json.loads((out / "train-curves.json").read_text()), capsys.readouterr().out.splitlines()


def test_ep2_curves_equal_one_process_s(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs on shared cores (see test_train's one_thread)
    try:
        one, one_lines = _train(tmp_path, capsys, 1)
        two, two_lines = _train(tmp_path, capsys, 2)
    finally:
        torch.set_num_threads(threads)
    assert two_lines[0] == "moekit train on cpu: 4 steps x 3 runs, experts over 2 processes (gloo)"
    assert one_lines[0] == "moekit train on cpu: 4 steps x 3 runs"
    # the same progress and summary lines as the single process's (the step lines' seconds aside)
    steps = [[line.split("]")[1] for line in lines if line.startswith("step ")] for lines in (one_lines, two_lines)]
    assert len(steps[0]) == 2 and steps[0] == steps[1], steps
    assert [line for line in one_lines if ": loss" in line] == [line for line in two_lines if ": loss" in line]
    assert two["settings"] == {**one["settings"], "ep": 2} and list(two["runs"]) == list(METHODS)
    for method in METHODS:
        a, b = one["runs"][method], two["runs"][method]
        assert a["imbalance"] == b["imbalance"] and a["dropped"] == b["dropped"], method
        assert max(abs(x - y) / abs(x) for x, y in zip(a["loss"], b["loss"])) < 1e-5, (method, a["loss"], b["loss"])
        assert a["loss"][-1] < a["loss"][0]  # it trains


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3", "--batch-size", "4"], "--ep/--batch-size: ep=3 processes each take batch_size / ep sequences: "
     "batch_size (4) must be a multiple of it (e.g. 6)"),
    (["--ep", "4", "--batch-size", "4", "--experts", "2", "--top-k", "1"], "--ep/--experts: ep=4 processes each hold "
     "at least one expert: num_experts (2) must be >= it"),
    (["--ep", "9", "--batch-size", "18"], "--ep/--experts: ep=9 processes each hold at least one expert: num_experts "
     "(8) must be >= it"),  # the experts alone (the batch divides): the one condition that fails is named
])
def test_shares_that_do_not_divide_are_refused_by_flag(tmp_path, capsys, argv, message):
    line = cli_error(capsys, ["train", "--steps", "1", "--out", str(tmp_path), *argv])
    assert line.endswith(message), line


def test_on_cuda_one_gpu_per_rank(tmp_path, capsys, monkeypatch):
    """NCCL with rank r on GPU r: fewer GPUs than ranks, or a device index, refused naming --ep (here faked: two
    ranks, one GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    line = cli_error(capsys, ["train", "--device", "cuda", "--ep", "2", "--steps", "1", "--out", str(tmp_path)])
    assert "--ep: ep=2 runs one process per GPU: 1 GPU(s) visible" in line, line
    with pytest.raises(ValueError, match="give the device as cuda, got cuda:0"):
        check_ranks(TrainSettings(device="cuda:0", ep=2))
    check_ranks(TrainSettings(device="cuda", ep=1))  # one rank, one GPU: fine

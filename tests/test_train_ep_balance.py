"""``moekit train --ep N --spare-slots S --rebalance-every K``: EPLB replicas in the training loop.

On 2 gloo ranks in float64 (``torch.set_default_dtype`` in each rank, ``train_side_by_side`` with ``RankShare``), the
three runs with 2 spare slots rebalanced every 2 steps give the contiguous run's curves: the same loss within 1e-10
relative (float64 summation order: which rank computes a replica's rows), the same imbalance and drops exactly.
The rebalance does move experts (the test checks it happened), and the optimizer's state moves with them: run without
the state move, the curves leave the contiguous ones after the first rebalance (checked here: the test can fail).
Then the refusals, by flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from _helpers import cli_error
from _parallel_harness import run_ranks
from moekit.train import ep_balance
from moekit.train.data import ByteCorpus
from moekit.train.ep import RankShare
from moekit.train.loop import METHODS, TrainSettings, train_side_by_side

SETTINGS = dict(steps=4, batch_size=4, seq_len=8, d_model=16, num_layers=1, num_heads=2, num_experts=4, top_k=2,
                expert_size=8, aux_loss_coef=0.1, bias_rate=0.01, lr=1e-2, ep=2)


@dataclass(frozen=True)
class _Unmoved:
    weight: torch.Tensor  # move_experts' result, left where it was


def _curves(settings: TrainSettings, rank: int, move_state: bool) -> dict:
    corpus = ByteCorpus(torch.arange(4096, dtype=torch.int64).mul(37).remainder(251).to(torch.uint8), "test", 1)
    moved, real = [], ep_balance.move_experts

    def counted(value, *args, **kwargs):
        moved.append(1)
        return real(value, *args, **kwargs) if move_state else _Unmoved(value)

    ep_balance.move_experts = counted
    try:
        share = RankShare(rank, settings.ep, settings.spare_slots, settings.rebalance_every)
        result = train_side_by_side(settings, corpus, None, share)
    finally:
        ep_balance.move_experts = real
    return {"curves": {m: (c.loss, c.imbalance, c.dropped) for m, c in result.curves.items()}, "moved": len(moved)}


def _rank(rank: int, world_size: int) -> list[dict]:
    """Contiguous, then 2 spare slots rebalanced every 2 steps, then the same without moving the optimizer's state."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    contiguous = TrainSettings(**SETTINGS)
    balanced = TrainSettings(**SETTINGS, spare_slots=2, rebalance_every=2)
    return [_curves(contiguous, rank, True), _curves(balanced, rank, True), _curves(balanced, rank, False)]


def test_replicated_rebalanced_runs_follow_the_contiguous_curves():
    contiguous, balanced, stale = run_ranks(_rank, 2, timeout_s=200)[0]
    assert contiguous["moved"] == 0 and balanced["moved"] > 0  # experts moved (a new placement at least once)
    for method in METHODS:
        (loss_a, imb_a, drop_a), (loss_b, imb_b, drop_b) = contiguous["curves"][method], balanced["curves"][method]
        assert imb_a == imb_b and drop_a == drop_b, method
        assert max(abs(x - y) / abs(x) for x, y in zip(loss_a, loss_b)) < 1e-10, (method, loss_a, loss_b)
    worst = max(abs(x - y) / abs(x) for m in METHODS
                for x, y in zip(contiguous["curves"][m][0], stale["curves"][m][0]))
    assert worst > 1e-6, worst  # without the state move the runs differ: the test can fail


@pytest.mark.parametrize("argv, message", [
    (["--spare-slots", "2", "--rebalance-every", "2"], "need ep > 1"),
    (["--ep", "2", "--spare-slots", "2"], "set rebalance_every > 0"),
    (["--ep", "2", "--spare-slots", "1", "--rebalance-every", "2"], "must be a multiple of ep (2)"),
    (["--ep", "2", "--rebalance-every", "-1"], "rebalance_every must be an int >= 0"),
])
def test_balancer_settings_are_refused_by_flag(tmp_path, capsys, argv, message):
    line = cli_error(capsys, ["train", "--steps", "1", "--out", str(tmp_path), *argv])
    assert message in line and "--spare-slots/--rebalance-every" in line, line

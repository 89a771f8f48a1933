"""Balancing: aux-loss training and DeepSeek's bias update both flatten a skewed router."""

import pytest
import torch

from moekit.sim import SimParams, simulate
from moekit.sim.balance import expert_loads, train_aux_loss, update_bias
from moekit.sim.router import draw_tokens, make_router


@pytest.mark.parametrize("method", ["aux-loss", "bias"])
def test_balancing_lowers_imbalance_and_drops(method):
    r = simulate(SimParams(balance=method))
    b = r.balance
    assert b.method == method
    assert b.steps == (100 if method == "aux-loss" else 200)
    assert b.imbalance_after == r.imbalance
    assert b.imbalance_after < b.imbalance_before / 4  # 24.75x -> about 3x on the default batch
    assert b.drop_rate_after < b.drop_rate_before / 3


def test_balancing_off_reports_none():
    assert simulate(SimParams()).balance is None


def test_zero_steps_change_nothing():
    router = make_router(16, 2, 0.5, seed=1)
    assert torch.equal(train_aux_loss(router, 0, seed=1).router.weight, router.weight)
    assert torch.count_nonzero(update_bias(router, 0, seed=1).correction_bias) == 0


def test_aux_loss_trains_down_the_popularity_row():
    router = make_router(16, 2, 0.6, seed=2)
    trained = train_aux_loss(router, 50, seed=2).router
    before, after = router.weight[-1], trained.weight[-1]
    assert after.std() < before.std()  # the constant input's row, where the skew lives, flattens


def test_bias_cannot_split_identical_tokens():
    """At skew 1 every token scores the experts the same way, so a selection bias only moves the pile."""
    router = make_router(16, 2, 1.0, seed=3)
    outcome = update_bias(router, 50, seed=3)
    loads = expert_loads(router.route(draw_tokens(64, 16, torch.Generator().manual_seed(4)),
                                      outcome.correction_bias).topk_ids, 16)
    assert int((loads > 0).sum()) == 2

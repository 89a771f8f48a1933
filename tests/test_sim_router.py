"""The synthetic router: the skew knob's definition and determinism."""

import pytest
import torch

from moekit.sim.router import draw_tokens, make_router


def test_skew_zero_is_an_orthogonal_rotation_of_gaussian_tokens():
    router = make_router(16, 2, 0.0, seed=1)
    content, popularity_row = router.weight[:-1], router.weight[-1]  # [D, E], [E]
    torch.testing.assert_close(content.t() @ content, torch.eye(16), atol=1e-5, rtol=0)
    assert torch.count_nonzero(popularity_row) == 0


def test_skew_zero_selects_each_expert_with_probability_k_over_e():
    router = make_router(16, 2, 0.0, seed=2)
    ids = router.route(draw_tokens(20000, 16, torch.Generator().manual_seed(3))).topk_ids
    share = torch.bincount(ids.reshape(-1).long(), minlength=16).float() / ids.shape[0]  # per token
    assert torch.allclose(share, torch.full((16,), 2 / 16), atol=0.01)


def test_skew_one_collapses_every_token_onto_the_k_most_popular_experts():
    router = make_router(32, 3, 1.0, seed=4)
    ids = router.route(draw_tokens(64, 32, torch.Generator().manual_seed(5))).topk_ids
    favourites = torch.topk(router.popularity, 3).indices.sort().values.int()
    assert all(torch.equal(row.sort().values, favourites) for row in ids)


def test_popularity_is_minus_log_rank():
    router = make_router(8, 2, 0.5, seed=6)
    ranks = torch.exp(-router.popularity).round().long().sort().values
    assert torch.equal(ranks, torch.arange(1, 9))


def test_same_seed_same_router_and_skew_out_of_range_raises():
    assert torch.equal(make_router(8, 2, 0.3, 7).weight, make_router(8, 2, 0.3, 7).weight)
    assert not torch.equal(make_router(8, 2, 0.3, 7).weight, make_router(8, 2, 0.3, 8).weight)
    with pytest.raises(ValueError, match="skew must be in"):
        make_router(8, 2, 1.5, 7)

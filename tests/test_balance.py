"""moekit.balance: the bias update rule against a loop written here, the counts accumulator, the
all-reduce over a gloo group of 2 ranks, and that the update steers selection towards balance."""

from __future__ import annotations

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.balance import ExpertCounts, update_correction_bias_
from tests._parallel_harness import run_ranks

CFG = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=6, top_k=2, use_correction_bias=True)


def _rule_loop(bias, counts, rate, center):
    """b_i += rate * sign(mean - c_i), one expert at a time; then the deltas' mean off when centring."""
    mean = sum(counts) / len(counts)
    delta = [rate * ((mean > c) - (mean < c)) for c in counts]
    if center:
        m = sum(delta) / len(delta)
        delta = [d - m for d in delta]
    return [b + d for b, d in zip(bias, delta)]


@pytest.mark.parametrize("center", [True, False])
def test_update_follows_the_rule(center):
    moe = MoE(CFG)
    start = [0.1, -0.2, 0.0, 0.3, 0.05, -0.1]
    moe.e_score_correction_bias.copy_(torch.tensor(start))
    counts = torch.tensor([10, 2, 5, 5, 0, 8])  # mean 5: two experts exactly at the mean move by 0
    want = _rule_loop(start, counts.tolist(), 1e-3, center)
    delta = update_correction_bias_(moe, counts, rate=1e-3, center=center)
    torch.testing.assert_close(moe.e_score_correction_bias, torch.tensor(want), rtol=0, atol=1e-7)
    torch.testing.assert_close(delta, torch.tensor(want) - torch.tensor(start), rtol=0, atol=1e-7)
    if center:
        assert abs(float(delta.sum())) < 1e-7


def test_accumulator_sums_then_resets():
    acc = ExpertCounts(6)
    assert torch.equal(acc.take(), torch.zeros(6, dtype=torch.float64))
    acc.add(torch.tensor([1, 0, 2, 0, 0, 1]))
    acc.add(torch.tensor([0, 3, 0, 0, 1, 0]))
    assert acc.take().tolist() == [1, 3, 2, 0, 1, 1]
    assert acc.take().tolist() == [0] * 6


def test_bias_updates_balance_a_skewed_router():
    """Gate rows 0 and 1 favoured for every token: 100 updates of the bias (routing only, counts from
    the stats' rule) take max/mean load from above 2 to below 1.35 (seeds 0-5 end at 1.07-1.30)."""
    torch.manual_seed(0)
    moe = MoE(CFG)
    with torch.no_grad():
        moe.gate.weight[:2] += 0.1
    x = torch.randn(256, 8) + 1.0
    acc = ExpertCounts(6)

    @torch.no_grad()
    def imbalance():
        ids = moe.route_tokens(x).routing.topk_ids.long()
        counts = torch.bincount(ids.reshape(-1), minlength=6)
        acc.add(counts)
        return float(counts.max() / counts.double().mean())

    before = after = imbalance()
    for _ in range(100):
        update_correction_bias_(moe, acc.take(), rate=5e-3)
        after = imbalance()
    assert before > 2 and after < 1.35, (before, after)


@pytest.mark.parametrize("call, message", [
    (lambda: update_correction_bias_(MoE(CFG.replace(use_correction_bias=False)), torch.zeros(6)),
     "use_correction_bias"),
    (lambda: update_correction_bias_(MoE(CFG), torch.zeros(5)), "num_experts=6"),
    (lambda: update_correction_bias_(MoE(CFG), torch.zeros(6), rate=0), "rate"),
    (lambda: ExpertCounts(6).add(torch.zeros(2, 3)), "counts must be"),
])
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _update_on_rank(rank: int, world_size: int) -> list[float]:
    import torch.distributed as dist

    moe = MoE(CFG)
    counts = torch.tensor([[4, 0, 1, 3, 2, 2], [0, 5, 1, 1, 2, 3]][rank])  # summed: [4, 5, 2, 4, 4, 5]
    update_correction_bias_(moe, counts, rate=1e-3, group=dist.group.WORLD)
    return moe.e_score_correction_bias.tolist()


def test_counts_are_summed_over_the_group():
    got = run_ranks(_update_on_rank, 2)
    want = _rule_loop([0.0] * 6, [4, 5, 2, 4, 4, 5], 1e-3, center=True)
    for rank_bias in got:
        assert rank_bias == pytest.approx(want, abs=1e-7)
    alone = _rule_loop([0.0] * 6, [4, 0, 1, 3, 2, 2], 1e-3, center=True)
    assert got[0] != pytest.approx(alone, abs=1e-7)  # the local counts alone would move it elsewhere


# --- identity experts (LongCat-Flash): the bias spans E + Z, the stats count the identity slots apart -------------

LONGCAT = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=6, top_k=3, num_identity_experts=3,
                    renormalize=False, use_correction_bias=True)


def _budget_loop(bias, counts, rate, e, k, budget):
    """LongCat's budget rule by its sign: routed expert i moves by rate * sign(K_e / (k E) - c_i / sum(c)); the
    identity experts' entries never move."""
    total = sum(counts)
    out = []
    for i, (b, c) in enumerate(zip(bias, counts)):
        gap = budget / (k * e) - c / total
        out.append(b + (rate * ((gap > 0) - (gap < 0)) if i < e else 0.0))
    return out


@pytest.mark.parametrize("budget", [None, 1.5])
def test_identity_update_follows_the_budget_rule(budget):
    moe = MoE(LONGCAT)
    start = [0.1, -0.2, 0.0, 0.3, 0.05, -0.1, 0.2, -0.3, 0.4]
    moe.e_score_correction_bias.copy_(torch.tensor(start))
    counts = torch.tensor([10, 2, 5, 6, 0, 8, 4, 7, 3])  # sum 45 = k * 15 tokens; K_e = 2: share 2/18 = 5 slots
    want = _budget_loop(start, counts.tolist(), 1e-3, 6, 3, 2.0 if budget is None else budget)
    delta = update_correction_bias_(moe, counts, rate=1e-3, routed_per_token=budget)
    torch.testing.assert_close(moe.e_score_correction_bias, torch.tensor(want), rtol=0, atol=1e-7)
    assert delta[6:].abs().sum() == 0  # the identity experts' entries never move
    assert delta[2] == (0 if budget is None else -1e-3)  # expert 2's 5 slots of 45: K_e = 2's share exactly


def test_stats_count_identity_slots_apart():
    """MoEStats.counts [E] (experts run), identity_counts [Z] (the router's identity slots): a loop over route()."""
    torch.manual_seed(1)
    moe = MoE(LONGCAT)
    x = torch.randn(40, 8)
    stats = moe(x, return_stats=True).stats
    ids = torch.topk(torch.softmax(x.double() @ moe.gate.weight.detach().double().t(), -1), 3, dim=-1).indices
    want = [0] * 9
    for e in ids.reshape(-1).tolist():
        want[e] += 1
    assert stats.counts.tolist() == want[:6] and stats.identity_counts.tolist() == want[6:]
    assert stats.choice_counts.tolist() == want and sum(want) == 40 * 3
    assert stats.zero_compute_share == pytest.approx(sum(want[6:]) / 120)
    plain = MoE(CFG)(torch.randn(4, 8), return_stats=True).stats
    assert plain.identity_counts is None and plain.choice_counts is plain.counts and plain.zero_compute_share == 0


def test_identity_bias_updates_reach_the_budget():
    """Identity rows favoured: 60 updates from the stats' choice counts bring the routed slots a token runs from
    below 1 to within 0.25 of the budget K_e = k * E / (E + Z) = 2 (the routed experts' biases rise together)."""
    torch.manual_seed(0)
    moe = MoE(LONGCAT)
    with torch.no_grad():
        moe.gate.weight[6:] += 0.3
    x = torch.randn(256, 8) + 1.0
    acc = ExpertCounts(LONGCAT.choice_width)

    @torch.no_grad()
    def routed_per_token():
        stats = moe(x, return_stats=True).stats
        acc.add(stats.choice_counts)
        return 3 * (1 - stats.zero_compute_share)

    before = after = routed_per_token()
    for _ in range(60):
        update_correction_bias_(moe, acc.take(), rate=5e-3)
        after = routed_per_token()
    assert before < 1 and abs(after - 2) < 0.25, (before, after)


@pytest.mark.parametrize("call, message", [
    (lambda: update_correction_bias_(MoE(LONGCAT), torch.zeros(6)), "choice_counts"),
    (lambda: update_correction_bias_(MoE(LONGCAT), torch.ones(9), center=True), "center"),
    (lambda: update_correction_bias_(MoE(LONGCAT), torch.ones(9), routed_per_token=4), "routed_per_token"),
    (lambda: update_correction_bias_(MoE(CFG), torch.ones(6), routed_per_token=1), "routed_per_token"),
])
def test_identity_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()

"""``compute_misses_on="auto"``'s decision (``cost.split_misses``, ``plan.plan_misses``) against a
brute-force search over every split of the misses, with the step-time model written out here."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from moekit.offload import MissCosts, plan_misses, split_misses
from moekit.offload.cost import cpu_never_wins, margin_of

BYTES = 1000


def _step_s(on_cpu: set[int], tokens: dict[int, int], hits: int, c: MissCosts) -> float:
    """The forward's time with ``on_cpu`` computed on the CPU and the other misses fetched: the GPU
    computes its hits while the fetches travel, then the fetched experts; the CPU pays its fixed
    staging price and each of its experts one after another, all priced at the margin; the two sides
    run at once."""
    fetched = len(tokens) - len(on_cpu)
    read, link = BYTES / c.gpu_bytes_per_s, BYTES / c.link_bytes_per_s
    gpu = max(hits * read, fetched * link) + fetched * read
    cpu = 0.0
    if on_cpu:  # the CPU branch starts once the host has issued the fetches
        cpu = c.cpu_margin * (c.cpu_step_s + sum(c.cpu_expert_s + tokens[e] * c.cpu_token_s for e in on_cpu))
        cpu += fetched * c.issue_s
    return max(gpu, cpu)


def _cost_s(on_cpu: set[int], tokens: dict[int, int], hits: int, c: MissCosts) -> float:
    """The forward's time plus, per CPU expert (left uncached), one fetch times the chance it is needed
    again while a fetched copy would still be cached: this forward's hit rate."""
    h = hits / (hits + len(tokens))
    return _step_s(on_cpu, tokens, hits, c) + len(on_cpu) * h * BYTES / c.link_bytes_per_s


def _brute_force(tokens: dict[int, int], hits: int, c: MissCosts) -> float:
    experts = list(tokens)
    return min(_cost_s(set(s), tokens, hits, c)
               for r in range(len(experts) + 1) for s in itertools.combinations(experts, r))


def _random_case(gen: torch.Generator) -> tuple[dict[int, int], int, MissCosts]:
    def u(lo: float, hi: float) -> float:
        return float(torch.empty(1).uniform_(lo, hi, generator=gen))

    n = int(torch.randint(1, 8, (1,), generator=gen))
    experts = torch.randperm(40, generator=gen)[:n].tolist()
    tokens = {e: int(torch.randint(1, 30, (1,), generator=gen)) for e in experts}
    hits = int(torch.randint(0, 20, (1,), generator=gen))
    costs = MissCosts(link_bytes_per_s=BYTES / u(0.5, 2.0), cpu_expert_s=u(0.0, 3.0), cpu_token_s=u(0.0, 0.2),
                      cpu_step_s=u(0.0, 1.0), gpu_bytes_per_s=BYTES / u(0.0, 0.3) if u(0, 1) > 0.3 else math.inf,
                      cpu_margin=1.0 if u(0, 1) > 0.5 else u(1.0, 2.0), issue_s=u(0.0, 0.5) if u(0, 1) > 0.5 else 0.0)
    return tokens, hits, costs


def test_split_misses_finds_the_brute_force_optimum():
    gen = torch.Generator().manual_seed(0)
    mixed = 0
    for _ in range(300):
        tokens, hits, costs = _random_case(gen)
        split = split_misses(tokens, BYTES, costs, hits)
        assert sorted(split.fetch + split.cpu) == sorted(tokens)
        best = _brute_force(tokens, hits, costs)
        assert _cost_s(set(split.cpu), tokens, hits, costs) == pytest.approx(best, rel=1e-12, abs=1e-15)
        assert split.cost_s == pytest.approx(best, rel=1e-12, abs=1e-15)  # its own prediction is the model's
        assert split.step_s == pytest.approx(_step_s(set(split.cpu), tokens, hits, costs), rel=1e-12, abs=1e-15)
        assert best <= min(_cost_s(set(), tokens, hits, costs), _cost_s(set(tokens), tokens, hits, costs))
        mixed += bool(split.fetch) and bool(split.cpu)
    assert mixed > 30  # the cases exercise real splits, not only the pure choices


def test_a_warm_cache_charges_cpu_experts_their_refetch():
    # 4 misses at 1.6 ms a fetch, one CPU expert 5.0 ms: on the CPU it saves 1.4 ms of this forward ...
    costs = MissCosts(link_bytes_per_s=BYTES / 1.6e-3, cpu_expert_s=2.0e-3, cpu_token_s=0.0, cpu_step_s=3.0e-3)
    misses = {e: 1 for e in range(4)}
    assert split_misses(misses, BYTES, costs, hits=0).cpu == [0]
    # ... but with 36 hits (h = 0.9) it would cost 0.9 x 1.6 = 1.44 ms later: fetching wins
    split = split_misses(misses, BYTES, costs, hits=36)
    assert split.cpu == [] and split.refetch_s == 0.0 and split.cost_s == pytest.approx(4 * 1.6e-3)


def test_split_prefers_fetching_on_a_tie():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=BYTES, cpu_token_s=0.0)  # a CPU expert = one fetch
    split = split_misses({3: 1}, BYTES, costs)
    assert (split.fetch, split.cpu) == ([3], [])


def test_a_slow_cpu_path_sends_every_miss_over_the_link():
    # last session's H200 case: a cold CPU expert (3.5 ms with staging) against a 1.6 ms fetch at M=1
    costs = MissCosts(link_bytes_per_s=BYTES / 1.6e-3, cpu_expert_s=3.0e-3, cpu_token_s=30e-6, cpu_step_s=0.5e-3)
    split = split_misses({e: 1 for e in range(2)}, BYTES, costs, hits=6)
    assert split.cpu == [] and split.step_s == pytest.approx(2 * 1.6e-3)


def test_plan_admits_only_into_the_links_idle_time():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=2.5 * BYTES, cpu_token_s=0.0)  # CPU expert = 2.5 fetches
    tokens = {1: 5, 2: 1, 3: 9}
    cpu = plan_misses("cpu", tokens, 0, BYTES, costs)
    assert cpu.fetch == [] and cpu.cpu == [1, 2, 3]
    assert cpu.admit == [3, 1, 2][: int(3 * 2.5)]  # 7.5 fetches of idle link: all three, busiest first
    assert plan_misses("cpu", tokens, 0, BYTES, None).admit == [3]  # no costs: one per forward
    assert plan_misses("cpu", tokens, 0, BYTES, costs, admit_per_forward=0).admit == []
    auto = plan_misses("auto", tokens, 0, BYTES, costs)
    idle = 2.5 * BYTES * len(auto.cpu) - BYTES * len(auto.fetch)
    assert auto.cpu and auto.fetch and len(auto.admit) == max(int(idle / BYTES), 0)
    assert plan_misses("gpu", tokens, 0, BYTES, costs) == plan_misses("gpu", tokens, 0, BYTES, None)
    with pytest.raises(ValueError, match="compute_misses_on"):
        plan_misses("disk", tokens, 0, BYTES, costs)
    with pytest.raises(ValueError, match="costs"):
        plan_misses("auto", tokens, 0, BYTES, None)


def test_admissions_fit_the_modelled_cpu_time_not_the_margined_price():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=0.5 * BYTES, cpu_token_s=0.0, cpu_margin=2.0)
    plan = plan_misses("cpu", {1: 5, 2: 1, 3: 9}, 0, BYTES, costs)
    assert plan.cpu == [1, 2, 3] and plan.admit == [3]  # 1.5 fetches of CPU time: one admission, not three


def test_margin_is_the_worst_repeats_over_the_medians():
    assert margin_of([[1.0, 1.2, 1.1], [2.0, 2.0, 3.0]]) == pytest.approx((1.2 + 3.0) / (1.1 + 2.0))
    assert margin_of([[1.0, 1.0]]) == 1.0 and margin_of([]) == 1.0
    with pytest.raises(ValueError, match="cpu_margin"):
        MissCosts(1.0, 1.0, 0.0, cpu_margin=0.5)


def test_margin_sends_a_small_predicted_win_over_the_link():
    # one miss of 1 token: the CPU (1.5 ms) beats a 2 ms fetch by the model, not with 1.4x its price
    costs = MissCosts(link_bytes_per_s=BYTES / 2e-3, cpu_expert_s=1.2e-3, cpu_token_s=0.0, cpu_step_s=0.3e-3)
    assert split_misses({5: 1}, BYTES, costs).cpu == [5]
    pessimistic = costs.observed(measured_s=2.1e-3, predicted_s=1.5e-3)
    assert pessimistic.cpu_margin == pytest.approx(1.4)
    assert costs.observed(1.0e-3, 1.5e-3).cpu_margin == 1.0  # never below 1
    split = split_misses({5: 1}, BYTES, pessimistic)
    assert split.cpu == [] and split.step_s == pytest.approx(2e-3)


def test_measure_costs_times_the_layers_own_cpu_path():
    from moekit import MoE, MoEConfig
    from moekit.offload import OffloadedMoE

    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=16, top_k=2), backend="grouped_mm",
              router="torch")
    off = OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on="auto")
    costs = off.measure_costs(tokens=4)
    assert all(math.isfinite(v) and v >= 0 for v in (costs.cpu_expert_s, costs.cpu_token_s, costs.cpu_step_s))
    # at these tiny shapes timing noise may clamp the per-expert or per-token share to 0, never the whole branch
    assert costs.cpu_step_s + costs.cpu_expert_s + costs.cpu_token_s > 0
    assert costs.link_bytes_per_s > 0 and costs.gpu_bytes_per_s > 0
    x = torch.randn(5, 64)
    torch.testing.assert_close(off(x), moe(x))  # "auto" without costs measures them on first use
    assert off.costs is not None


def _fetch_all_s(hits: int, fetched: int, c: MissCosts) -> float:
    """Fetching every miss, written out (the cost module's docstring): hits read while the copies travel,
    then the fetched ones, a second call with both; or one call once the copies land where the hits' reads
    cost less than that call; at least the hits' reads and ``fetch_layer_s`` with any fetch."""
    read, link = BYTES / c.gpu_bytes_per_s, fetched * BYTES / c.link_bytes_per_s
    if hits * read < c.gpu_call_s:
        side = link + (hits + fetched) * read
    else:
        side = max(hits * read, link) + fetched * read + (c.gpu_call_s if hits and fetched else 0.0)
    return max(side, hits * read + c.fetch_layer_s)


@pytest.mark.parametrize("seed", range(4))
def test_cpu_never_wins_only_where_no_forward_of_that_size_puts_a_miss_on_the_cpu(seed):
    """Wherever ``cpu_never_wins(T, M)`` says so, every forward with at most T touched experts of at most M
    rows each (any hits, any misses, any rows) is priced all-fetch by "auto"'s own search; and on these
    random costs it says so often, and not always."""
    gen, said = torch.Generator().manual_seed(seed), []
    for _ in range(60):
        _, _, costs = _random_case(gen)
        table = tuple((r, float(torch.empty(1).uniform_(0.0, 3.0, generator=gen))) for r in (1, 2, 4, 8))
        costs = dataclasses.replace(costs, hysteresis=0.05, gpu_call_s=0.3, fetch_layer_s=0.5,
                                    cpu_rows_s=table if seed % 2 else ())
        touched, rows = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 10, (1,), generator=gen))
        never = cpu_never_wins(touched, rows, BYTES, costs)
        said.append(never)
        if not never:
            continue
        least_cpu = costs.cpu_margin * (costs.cpu_step_s + min(costs.cpu_time(r) for r in range(1, rows + 1)))
        for hits in range(touched):
            for fetched in range(1, touched - hits + 1):
                assert least_cpu > (1 - costs.hysteresis) * _fetch_all_s(hits, fetched, costs)
                for r in range(1, rows + 1):
                    tokens = {e: 1 + (r + e) % rows for e in range(fetched)}
                    assert split_misses(tokens, BYTES, costs, hits).cpu == []
    assert 2 < sum(said) < len(said)


def test_cpu_never_wins_at_decode_on_the_h200s_measured_costs():
    """The H200 run's costs (a5fb310, Qwen3 widths: 9.4 MB an expert, top-8 of 128): at M = 1 the CPU side's
    least price (1.14 x (1.87 + 0.46) ms) is above fetching all 8 experts (1.37 ms of link + a call); at
    M = 8 (64 experts, 11 ms of link) it is not."""
    costs = MissCosts(link_bytes_per_s=55.0e9, cpu_expert_s=483e-6, cpu_token_s=22e-6, cpu_step_s=1.868e-3,
                      gpu_bytes_per_s=3.76e12, cpu_margin=1.137, hysteresis=0.05, gpu_call_s=152e-6,
                      fetch_layer_s=256e-6, cpu_rows_s=((1, 505e-6), (2, 464e-6), (4, 522e-6), (8, 691e-6)))
    expert = 3 * 2048 * 768 * 2
    assert cpu_never_wins(8, 1, expert, costs)
    assert not cpu_never_wins(64, 8, expert, costs)


def test_the_cpu_tail_is_priced_by_auto_on_the_cpu_side_and_never_by_the_model():
    c = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6, cpu_step_s=3e-6)
    assert c.for_plan() is c  # no tail: the same costs
    tailed = dataclasses.replace(c, cpu_tail_s=5e-6)
    planned = tailed.for_plan()
    assert planned.cpu_step_s == 3e-6 + 5e-6 and planned.cpu_tail_s == 0.0 and tailed.for_plan() is planned
    assert tailed.cpu_side_s([1, 2]) == c.cpu_side_s([1, 2]) == 3e-6 + 2 * 1e-6 + 3 * 2e-6  # the floor's model


def test_auto_with_a_tail_dearer_than_any_gain_fetches_every_miss_and_keeps_the_output():
    from moekit import MoE, MoEConfig
    from moekit.offload import OffloadedMoE

    from _helpers import TOLERANCE, rel_l2
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2), backend="grouped_mm",
              router="torch")
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6)  # "auto" splits (the CPU is cheap)
    layers = {tail: OffloadedMoE.from_moe(moe, cache_experts=3, compute_misses_on="auto",
                                          costs=dataclasses.replace(costs, cpu_tail_s=tail)) for tail in (0.0, 1.0)}
    for seed in range(4):
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for layer in layers.values():
                assert rel_l2(layer(x), moe(x)) < TOLERANCE[torch.float32]
    assert layers[0.0].cache.stats.cpu_experts > 0  # without the tail some misses went to the CPU
    assert layers[1.0].cache.stats.cpu_experts == 0  # a 1 s tail: every miss fetched

""""auto" pricing a CPU-kept miss by its reuse (``ExpertCache.reuse``, ``cost.split_misses`` with
``refetch="reuse"``): the split against a brute force over every subset with the objective written out
here, the cache's reuse chance against a recomputation from the same history, and whole decode streams
whose modelled cost, later steps included, is counted by a loop here."""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics

import pytest
import torch

from moekit.offload import ExpertCache, MissCosts, OffloadStats, plan_misses, split_misses
from moekit.offload.cache import HORIZON_WEIGHT
from moekit.offload.plan import plan_forward
from moekit.sim.cache import decode_stream

BYTES = 1000


def _cost_s(on_cpu: set[int], tokens: dict[int, int], hits: int, c: MissCosts, chance: dict[int, float]) -> float:
    """The forward (GPU side: hits while the fetches travel, at the link's rate during CPU work when the
    CPU side runs, then the fetched; CPU side: its fixed price and its experts, at the margin, after the
    fetches' issue; both at once) plus, per CPU expert, one fetch times the mean chance
    of its class among the misses (chance >= 1/2, or below)."""
    fetched = len(tokens) - len(on_cpu)
    read, link = BYTES / c.gpu_bytes_per_s, BYTES / c.link_bytes_per_s
    busy = BYTES / c.link_cpu_bytes_per_s if on_cpu and c.link_cpu_bytes_per_s else link  # fetches beside CPU work
    gpu = max(hits * read, fetched * busy) + fetched * read
    cpu = c.cpu_margin * (c.cpu_step_s + sum(c.cpu_expert_s + tokens[e] * c.cpu_token_s
                                             for e in on_cpu)) if on_cpu else 0.0
    cpu += fetched * c.issue_s if on_cpu else 0.0  # the CPU branch starts once the fetches are issued
    refetch = 0.0
    for e in on_cpu:
        same = [chance[x] for x in tokens if (chance[x] >= 0.5) == (chance[e] >= 0.5)]
        refetch += link * sum(same) / len(same)
    return max(gpu, cpu) + refetch


def _random_case(gen: torch.Generator):
    def u(lo: float, hi: float) -> float:
        return float(torch.empty(1).uniform_(lo, hi, generator=gen))

    n = int(torch.randint(1, 9, (1,), generator=gen))
    experts = torch.randperm(40, generator=gen)[:n].tolist()
    tokens = {e: int(torch.randint(1, 6, (1,), generator=gen)) for e in experts}
    chance = {e: (math.inf if u(0, 1) < 0.05 else u(0, 1)) for e in experts}
    costs = MissCosts(link_bytes_per_s=BYTES / u(0.5, 2.0), cpu_expert_s=u(0.0, 2.0), cpu_token_s=u(0.0, 0.3),
                      cpu_step_s=u(0.0, 1.0), gpu_bytes_per_s=BYTES / u(0.0, 0.3) if u(0, 1) > 0.3 else math.inf,
                      cpu_margin=1.0 if u(0, 1) > 0.5 else u(1.0, 2.0),
                      link_cpu_bytes_per_s=BYTES / u(0.5, 3.0) if u(0, 1) > 0.5 else None,
                      issue_s=u(0.0, 0.6) if u(0, 1) > 0.5 else 0.0)
    return tokens, int(torch.randint(0, 20, (1,), generator=gen)), costs, chance


def test_split_with_reuse_classes_finds_the_brute_force_optimum():
    gen = torch.Generator().manual_seed(3)
    mixed = both_classes = 0
    for _ in range(400):
        tokens, hits, costs, chance = _random_case(gen)
        split = split_misses(tokens, BYTES, costs, hits, chance)
        assert sorted(split.fetch + split.cpu) == sorted(tokens)
        best = min(_cost_s(set(s), tokens, hits, costs, chance)
                   for r in range(len(tokens) + 1) for s in itertools.combinations(tokens, r))
        assert _cost_s(set(split.cpu), tokens, hits, costs, chance) == pytest.approx(best, rel=1e-12, abs=1e-15)
        assert split.cost_s == pytest.approx(best, rel=1e-12, abs=1e-15)
        mixed += bool(split.fetch) and bool(split.cpu)
        both_classes += len({chance[e] >= 0.5 for e in split.cpu}) == 2
        assert not any(math.isinf(chance[e]) for e in split.cpu)
    assert mixed > 40 and both_classes > 5  # real splits, some taking experts of both classes


def test_hit_rate_pricing_ignores_reuse_and_a_filling_cache_fetches_everything():
    # 8 misses of 1 token, a CPU expert at 1.2 fetches: in this forward alone the CPU takes some of them
    costs = MissCosts(link_bytes_per_s=BYTES / 1.6e-3, cpu_expert_s=1.4e-3, cpu_token_s=0.0, cpu_step_s=0.5e-3)
    misses = {e: 1 for e in range(8)}
    old = dataclasses.replace(costs, refetch="hit_rate")
    assert split_misses(misses, BYTES, old, 2, dict.fromkeys(misses, math.inf)) == split_misses(misses, BYTES, old, 2)
    assert split_misses(misses, BYTES, old, 2).cpu  # h = 0.2: the CPU is worth it
    assert split_misses(misses, BYTES, costs, 2, dict.fromkeys(misses, math.inf)).cpu == []
    cold = split_misses(misses, BYTES, costs, 2, {e: (0.05 if e % 2 else 0.9) for e in misses})
    assert cold.cpu and all(e % 2 for e in cold.cpu)  # the likely evicted ones go to the CPU first
    with pytest.raises(ValueError, match="refetch"):
        MissCosts(1.0, 1.0, 0.0, refetch="never")


def test_cache_reuse_is_the_poisson_chance_over_the_eviction_horizon():
    cache = ExpertCache(2, device="cpu", policy="lru")
    empty = torch.empty(6, 0, 0)
    layer = cache.register(empty, empty)
    history = [[0, 1], [0, 2], [0, 3], [0, 1], [4], [0, 5]]  # each forward's touched experts
    touches, idle, horizon, first = {}, [], math.inf, 1
    last_use, cached = {}, []
    for tick, touched in enumerate(history, start=1):
        stats = OffloadStats()
        cache.begin_forward()
        hits, misses = cache.lookup(layer, touched, stats)
        for e in touched:
            touches[e] = touches.get(e, 0) + 1
        got = cache.reuse(layer, misses)
        if math.isinf(horizon):
            assert got == dict.fromkeys(misses, math.inf)
        else:
            for e in misses:
                assert got[e] == pytest.approx(1 - math.exp(-horizon * touches[e] / (tick - first + 1)))
        for _ in cache.rounds(layer, hits, misses, stats):
            pass
        for e in misses:  # LRU by hand: evict the longest unused, recording its idle ticks
            if len(cached) == 2:
                victim = min((c for c in cached if c not in touched), key=lambda c: last_use[c])
                cached.remove(victim)
                idle.append(tick - last_use[victim])
                horizon = idle[0] if len(idle) == 1 else horizon + HORIZON_WEIGHT * (idle[-1] - horizon)
            cached.append(e)
        for e in touched:
            last_use[e] = tick
        assert sorted(cache.cached(layer)) == sorted(cached)
    assert len(idle) >= 3


def _window_floor(place: str, costs: MissCosts, trace, slots: int, policy: str, warm: int, timed: int) -> float:
    """Mean modelled step over steps warm+1 .. warm+timed of ``trace`` through a fresh cache: per layer the
    max of the GPU's reads, the fetches over the link and the CPU side, summed, and at least every
    expert the link moved (fetches and admissions); the plan and the cache decide as the layers do."""
    cache = ExpertCache(slots, device="cpu", policy=policy)
    empty = torch.empty(trace.num_experts, 0, 0)
    layers = [cache.register(empty, empty) for _ in range(trace.num_layers)]
    link, read = BYTES / costs.link_bytes_per_s, BYTES / costs.gpu_bytes_per_s
    steps = []
    for step in range(warm + 1 + timed):
        total = moved = 0.0
        for i, layer in enumerate(layers):
            counts, stats = trace.tokens[step][i], OffloadStats()
            cache.begin_forward()
            hits, misses = cache.lookup(layer, trace.touched[step][i], stats)
            plan = plan_forward(cache, layer, place, {m: counts[m] for m in misses}, len(hits), BYTES, costs)
            for _ in cache.rounds(layer, hits, plan.fetch, stats):
                pass
            cache.admit(layer, plan.admit, stats)
            cpu = (costs.cpu_step_s + sum(costs.cpu_time(counts[m]) for m in plan.cpu)) if plan.cpu else 0.0
            total += max((len(hits) + len(plan.fetch)) * read, len(plan.fetch) * link, cpu)
            moved += len(plan.fetch) + stats.admitted
        steps.append(max(total, moved * link))
    return statistics.fmean(steps[warm + 1:])


# the H200's measured rates (session 8, bf16 DeepSeek-V3-width experts) in units of one expert's bytes
H200 = MissCosts(link_bytes_per_s=BYTES / 1.590e-3, cpu_expert_s=1.346e-3, cpu_token_s=19.7e-6, cpu_step_s=1.738e-3,
                 gpu_bytes_per_s=BYTES / 22.7e-6, cpu_margin=1.09)


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_auto_is_no_slower_than_a_pure_mode_on_a_filling_skewed_cache(policy):
    # the bench's losing cell: skewed 75% M = 1 (48 warm steps, 12 timed): session 8's pricing keeps hot
    # experts on the CPU while the cache still fills, and pays for it in the timed steps
    trace = decode_stream(256, 8, 2, 61, 1, 0.3, 0.3, seed=3).trace
    cells = {name: _window_floor(place, c, trace, 384, policy, 48, 12) for name, place, c in (
        ("gpu", "gpu", H200), ("cpu", "cpu", H200), ("auto", "auto", H200),
        ("old", "auto", dataclasses.replace(H200, refetch="hit_rate")))}
    best = min(cells["gpu"], cells["cpu"])
    assert cells["old"] > 1.05 * best
    assert cells["auto"] <= best * (1 + 1e-9)


def test_auto_keeps_its_gain_where_the_cache_evicts():
    # uniform 50% at M = 1 and skewed 75% at M = 8: the cache evicts, cold misses go to the CPU
    for skew, m, slots, warm, timed in ((0.0, 1, 256, 48, 12), (0.3, 8, 384, 17, 3)):
        trace = decode_stream(256, 8, 2, warm + 1 + timed, m, skew, 0.3, seed=3).trace
        gpu, cpu, auto = (_window_floor(place, H200, trace, slots, "lru", warm, timed)
                          for place in ("gpu", "cpu", "auto"))
        assert auto < 0.9 * min(gpu, cpu)


def test_admissions_fit_the_cpu_time_at_the_links_rate_during_cpu_work():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=2.5 * BYTES, cpu_token_s=0.0)
    tokens = {1: 5, 2: 1, 3: 9}
    assert len(plan_misses("cpu", tokens, 0, BYTES, costs).admit) == 3  # 7.5 fetches of CPU time
    slower = dataclasses.replace(costs, link_cpu_bytes_per_s=0.5)  # the link at half its rate meanwhile
    assert plan_misses("cpu", tokens, 0, BYTES, slower).admit == [3, 1, 2][: int(7.5 / 2)]

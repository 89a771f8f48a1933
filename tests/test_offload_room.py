""""auto"'s room (``split.cpu_room``): every split of the misses that hysteresis lets "auto" take has a CPU
expert count inside it, checked against every subset priced by the model written out here (second call,
one call, fetch layer, issue, busy link, reuse classes); the search kept to it finds the brute-force
optimum; where it proves there is none, ``plan_forward`` fetches every miss without the reuse estimate."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from moekit.offload import ExpertCache, MissCosts, OffloadStats, split_misses
from moekit.offload.plan import plan_forward
from moekit.offload.split import cpu_room

BYTES = 1000
TABLE = ((1, 0.30), (2, 0.20), (4, 0.50))  # seconds per expert by rows: not monotone


def _table(rows: int) -> float:
    """TABLE read by hand for rows 1..6 (linear between its points, its last segment extended)."""
    return {1: 0.30, 2: 0.20, 3: 0.35, 4: 0.50, 5: 0.65, 6: 0.80}[rows]


def _cpu_time(c: MissCosts, rows: int) -> float:
    return _table(rows) if c.cpu_rows_s else c.cpu_expert_s + rows * c.cpu_token_s


def _gpu_s(fetched: int, hits: int, c: MissCosts, busy: bool, nbytes: int = BYTES) -> float:
    """Hits while the fetches travel (at the link's rate beside CPU work when measured), then the fetched in
    a second call, or one call after the fetches where the hits' reads cost less than that call; a
    forward with a fetch at least its hits' reads plus ``fetch_layer_s``."""
    read = nbytes / c.gpu_bytes_per_s
    link = nbytes / (c.link_cpu_bytes_per_s if busy and c.link_cpu_bytes_per_s else c.link_bytes_per_s)
    if hits * read < c.gpu_call_s:
        side = fetched * link + (hits + fetched) * read
    else:
        side = max(hits * read, fetched * link) + fetched * read + (c.gpu_call_s if hits and fetched else 0.0)
    return max(side, hits * read + c.fetch_layer_s) if fetched else side


def _cost_s(on_cpu: tuple, tokens: dict[int, int], hits: int, c: MissCosts, chance: dict[int, float]) -> float:
    """The forward (both sides at once; the CPU's after the fetches' issue, at the margin) plus, per CPU
    expert, one fetch times the mean chance of its reuse class (>= 1/2 or below) among the misses."""
    fetched = len(tokens) - len(on_cpu)
    gpu = _gpu_s(fetched, hits, c, bool(on_cpu))
    cpu = 0.0
    if on_cpu:
        cpu = c.cpu_margin * (c.cpu_step_s + sum(_cpu_time(c, tokens[e]) for e in on_cpu)) + fetched * c.issue_s
    refetch = 0.0
    for e in on_cpu:
        same = [chance[x] for x in tokens if (chance[x] >= 0.5) == (chance[e] >= 0.5)]
        refetch += BYTES / c.link_bytes_per_s * sum(same) / len(same)
    return max(gpu, cpu) + refetch


def _random_case(gen: torch.Generator):
    def u(lo: float, hi: float) -> float:
        return float(torch.empty(1).uniform_(lo, hi, generator=gen))

    n = int(torch.randint(1, 11, (1,), generator=gen))
    experts = torch.randperm(40, generator=gen)[:n].tolist()
    tokens = {e: int(torch.randint(1, 7, (1,), generator=gen)) for e in experts}
    chance = {e: (math.inf if u(0, 1) < 0.03 else u(0, 1)) for e in experts}
    costs = MissCosts(link_bytes_per_s=BYTES / u(0.1, 0.3), cpu_expert_s=u(0.0, 0.5), cpu_token_s=u(0.0, 0.05),
                      cpu_step_s=u(0.0, 1.5), gpu_bytes_per_s=BYTES / u(0.0, 0.05) if u(0, 1) > 0.3 else math.inf,
                      cpu_margin=1.0 if u(0, 1) > 0.5 else u(1.0, 1.5),
                      link_cpu_bytes_per_s=BYTES / u(0.1, 0.4) if u(0, 1) > 0.5 else None,
                      issue_s=u(0.0, 0.4) if u(0, 1) > 0.3 else 0.0, hysteresis=(0.0, 0.05, 0.2)[n % 3],
                      gpu_call_s=u(0.0, 0.2) if u(0, 1) > 0.5 else 0.0,
                      fetch_layer_s=u(0.0, 1.0) if u(0, 1) > 0.5 else 0.0,
                      cpu_rows_s=TABLE if u(0, 1) > 0.6 else ())
    return tokens, int(torch.randint(0, 20, (1,), generator=gen)), costs, chance


def _subsets(tokens):
    return (s for r in range(1, len(tokens) + 1) for s in itertools.combinations(tokens, r))


def test_the_room_holds_every_split_hysteresis_lets_auto_take():
    gen = torch.Generator().manual_seed(5)
    proved = narrowed = 0
    for _ in range(250):
        tokens, hits, costs, chance = _random_case(gen)
        limit = (1.0 - costs.hysteresis) * _gpu_s(len(tokens), hits, costs, False)
        room = cpu_room(tokens, hits, BYTES, costs, limit)
        for s in _subsets(tokens):
            if _cost_s(s, tokens, hits, costs, chance) <= limit:
                assert room is not None and room[0] <= len(s) <= room[1], (tokens, hits, costs, s, room)
        proved += room is None
        narrowed += room is not None and room != (1, len(tokens))
    assert proved > 20 and narrowed > 20  # both the proof and a narrower search occur


def test_the_search_kept_to_the_room_is_the_brute_force_choice():
    gen = torch.Generator().manual_seed(6)
    taken = 0
    for _ in range(250):
        tokens, hits, costs, chance = _random_case(gen)
        split = split_misses(tokens, BYTES, costs, hits, chance)
        fetch_all = _cost_s((), tokens, hits, costs, chance)
        best = min(_subsets(tokens), key=lambda s: (_cost_s(s, tokens, hits, costs, chance), len(s)))
        want = _cost_s(best, tokens, hits, costs, chance)
        want = want if want <= (1.0 - costs.hysteresis) * fetch_all else fetch_all
        assert split.cost_s == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert _cost_s(tuple(split.cpu), tokens, hits, costs, chance) == pytest.approx(want, rel=1e-12, abs=1e-15)
        taken += bool(split.cpu)
    assert 30 < taken < 220


def test_a_forward_without_room_fetches_every_miss_and_asks_no_reuse(monkeypatch):
    # the H200's measured costs at Qwen3 widths (session 15): a CPU call 1.54 ms + 0.26-0.31 ms an expert
    # against 0.17 ms a fetch; 20 hits, 1-2 rows an expert (M = 8)
    expert = 3 * 2048 * 768 * 2
    costs = MissCosts(link_bytes_per_s=55.3e9, cpu_expert_s=0.259e-3, cpu_token_s=8.7e-6, cpu_step_s=1.54e-3,
                      gpu_bytes_per_s=3.76e12, cpu_margin=1.15, hysteresis=0.05, gpu_call_s=0.146e-3,
                      fetch_layer_s=0.211e-3, issue_s=64.3e-6,
                      cpu_rows_s=((1, 0.259e-3), (2, 0.271e-3), (4, 0.262e-3), (8, 0.314e-3)))
    cache = ExpertCache(64, device="cpu", policy="lfu")
    layer = cache.register(torch.empty(128, 0, 0), torch.empty(128, 0, 0))
    asked = []
    monkeypatch.setattr(cache, "reuse", lambda layer, experts: asked.append(experts) or dict.fromkeys(experts, 0.0))
    for count, proved in ((4, True), (12, True), (40, False)):  # 40 misses: 6.8 ms of link, a CPU split can pay
        tokens = {e: 1 + e % 2 for e in range(count)}
        limit = 0.95 * _gpu_s(count, 20, costs, False, expert)
        assert (cpu_room(tokens, 20, expert, costs, limit) is None) == proved
        cache.begin_forward()
        hits, misses = cache.lookup(layer, sorted(tokens), OffloadStats())
        plan = plan_forward(cache, layer, "auto", {m: tokens[m] for m in misses}, 20, expert, costs)
        assert (asked[-1:] == [sorted(tokens)]) != proved
        if proved:
            assert plan.cpu == [] and plan.fetch == sorted(tokens)

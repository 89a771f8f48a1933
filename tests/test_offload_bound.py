""""auto"'s cheap all-fetch proof (``bound.fetches_all``, ``plan.plan_forward``): the least split cost it
bounds by is at most every subset's cost priced by the model written out in ``test_offload_room``; without a
charge it says "no room" exactly where a brute-force scan over s finds none; ``plan_forward`` returns the
search's own plan on random count vectors (the proof never changes a decision); on the H200's M = 8 costs
its fetch-all forwards run no room scan, no reuse estimate and no search. CPU only."""

from __future__ import annotations

import math

import pytest
import torch

from moekit.offload import ExpertCache, MissCosts, OffloadStats, split_misses
from moekit.offload import plan as plan_mod
from moekit.offload.bound import RowTimes, fetches_all, least_charge_s, least_split_s
from moekit.offload.plan import plan_forward

from _helpers import TOLERANCE, count_calls, rel_l2
from test_offload_room import BYTES, _cost_s, _cpu_time, _gpu_s, _random_case, _subsets

H200_EXPERT = 3 * 2048 * 768 * 2
H200 = MissCosts(link_bytes_per_s=52.95e9, cpu_expert_s=0.438e-3, cpu_token_s=10.3e-6, cpu_step_s=1.776e-3,
                 gpu_bytes_per_s=3.75e12, cpu_margin=1.219, hysteresis=0.05, gpu_call_s=0.125e-3,
                 fetch_layer_s=0.232e-3, issue_s=68.5e-6, link_cpu_bytes_per_s=51.1e9,
                 cpu_rows_s=((1, 448e-6), (2, 491e-6), (4, 468e-6), (8, 606e-6), (16, 572e-6), (32, 768e-6)))


def _scan_room(tokens, hits, c: MissCosts, limit: float) -> bool:
    """Some s = 1..n has both the GPU side with n - s fetches and the CPU side of the s least CPU times
    within ``limit``: the loop written out."""
    n, times = len(tokens), sorted(_cpu_time(c, t) for t in tokens.values())
    for s in range(1, n + 1):
        cpu = c.cpu_margin * (c.cpu_step_s + sum(times[:s])) + (n - s) * c.issue_s
        if max(cpu, _gpu_s(n - s, hits, c, True)) <= limit:
            return True
    return False


def _least_class_charge(tokens, chance, c: MissCosts) -> float:
    means = []
    for hot in (False, True):
        members = [chance[e] for e in tokens if (chance[e] >= 0.5) == hot]
        if members:
            means.append(sum(members) / len(members))
    return BYTES / c.link_bytes_per_s * min(means)


def test_the_least_split_cost_bounds_every_split_from_below():
    gen = torch.Generator().manual_seed(21)
    tight = 0
    for _ in range(200):
        tokens, hits, costs, chance = _random_case(gen)
        charge = least_charge_s(tokens, hits, BYTES, costs, chance)
        assert charge == pytest.approx(_least_class_charge(tokens, chance, costs), rel=1e-12) or math.isinf(charge)
        bound = least_split_s(RowTimes.of(tokens, costs), hits, BYTES, costs, charge)
        best = min(_cost_s(s, tokens, hits, costs, chance) for s in _subsets(tokens))
        assert bound <= best * (1 + 1e-12), (tokens, hits, costs)
        tight += bound == pytest.approx(best, rel=1e-9)
    assert tight > 40  # often the bound is the cost itself


def test_without_a_charge_it_says_no_room_where_a_scan_finds_none():
    gen = torch.Generator().manual_seed(22)
    proved = 0
    for _ in range(300):
        tokens, hits, costs, _ = _random_case(gen)
        limit = (1.0 - costs.hysteresis) * _gpu_s(len(tokens), hits, costs, False)
        says = fetches_all(RowTimes.of(tokens, costs), hits, BYTES, costs, limit)
        assert says == (not _scan_room(tokens, hits, costs, limit * (1 + 1e-9))), (tokens, hits, costs)
        proved += says
    assert 30 < proved < 270


def test_plan_forward_returns_the_search_plan_on_random_count_vectors():
    gen = torch.Generator().manual_seed(23)
    kinds = {"cpu": 0, "fetch": 0}
    for _ in range(300):
        tokens, hits, costs, chance = _random_case(gen)
        cache = ExpertCache(64, device="cpu", policy="lfu")
        layer = cache.register(torch.empty(40, 0, 0), torch.empty(40, 0, 0))
        cache.reuse = lambda _layer, experts, _chance=chance: {e: _chance[e] for e in experts}
        plan = plan_forward(cache, layer, "auto", tokens, hits, BYTES, costs)
        want = split_misses(tokens, BYTES, costs, hits, chance)
        assert (plan.fetch, plan.cpu) == (want.fetch, want.cpu)
        kinds["cpu" if want.cpu else "fetch"] += 1
    assert kinds["cpu"] > 30 and kinds["fetch"] > 30


def test_h200_fetch_all_forwards_run_no_scan_no_reuse_and_no_search(monkeypatch):
    """Session 16's M = 8 forwards at 50-75% caches (10-30 misses of 1-3 rows among ~55 touched experts):
    10-20 misses proved by one CPU expert's least price, 25-30 by the room without a refetch charge (no
    reuse asked); 35 by the least refetch charge (reuse asked, no search); a forward of 110 one-row misses
    beside no hits (M = 32, 25% cache) is searched."""
    seen = count_calls(monkeypatch, {"room": 0, "split": 0}, [(plan_mod, "room_of", "room"),
                                                                 (plan_mod, "split_misses", "split")])
    cache = ExpertCache(64, device="cpu", policy="lfu")
    layer = cache.register(torch.empty(128, 0, 0), torch.empty(128, 0, 0))
    asked = []
    monkeypatch.setattr(cache, "reuse", lambda _layer, experts: asked.append(experts) or dict.fromkeys(experts, 0.1))
    for misses, rooms in ((10, 0), (20, 0), (25, 1), (30, 2)):
        tokens = {e: 1 + e % 3 for e in range(misses)}
        plan = plan_forward(cache, layer, "auto", tokens, 55 - misses, H200_EXPERT, H200)
        assert plan.fetch == sorted(tokens) and plan.cpu == []
        assert seen == {"room": rooms, "split": 0} and asked == []
    plan = plan_forward(cache, layer, "auto", {e: 1 + e % 3 for e in range(35)}, 20, H200_EXPERT, H200)
    assert plan.cpu == [] and seen == {"room": 3, "split": 0} and len(asked) == 1
    plan = plan_forward(cache, layer, "auto", dict.fromkeys(range(110), 1), 0, H200_EXPERT, H200)
    assert plan.cpu and seen == {"room": 4, "split": 1} and len(asked) == 2


def test_the_o1_check_proves_only_what_the_row_proof_proves():
    """``cpu_too_dear`` (one CPU expert at the least time any row count takes) never says "fetch all" where
    ``fetches_all`` finds room; with H200's costs it proves the 75% cache's M = 8 forwards on its own."""
    from moekit.offload.bound import cpu_too_dear

    gen = torch.Generator().manual_seed(24)
    proved = 0
    for _ in range(300):
        tokens, hits, costs, _ = _random_case(gen)
        limit = (1.0 - costs.hysteresis) * _gpu_s(len(tokens), hits, costs, False)
        if cpu_too_dear(len(tokens), costs, limit):
            proved += 1
            assert not _scan_room(tokens, hits, costs, limit)
    assert proved > 20
    limit = 0.95 * _gpu_s(12, 40, H200, False, H200_EXPERT)
    assert cpu_too_dear(12, H200, limit)
    falling = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1.0, cpu_token_s=-0.1)
    assert not cpu_too_dear(3, falling, 1e-9)  # no least time over row counts: no proof


def test_an_auto_layer_decides_and_computes_the_same_with_the_proofs_off(monkeypatch):
    """Two stacks of "auto" layers on the same inputs, one with the bound's proofs answering "no proof"
    (every forward with misses priced by the room scan and the search): the same stats forward by forward
    (hits, fetches, CPU experts), the same outputs within rounding (where the search runs it issues its
    sure fetches early, so experts may land in other slots and sum in another order), and the proofs
    decided some forwards on the way."""
    from moekit import MoE, MoEConfig
    from moekit.offload import OffloadedMoE, link_layers

    e, k, n = 16, 32, 16
    cfg = MoEConfig(hidden_size=k, moe_intermediate_size=n, num_experts=e, top_k=4)
    fetch_s = 3 * n * k * 4 / 1e9
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1.2 * fetch_s, cpu_token_s=0.0, cpu_step_s=2 * fetch_s,
                      hysteresis=0.05)
    torch.manual_seed(0)
    moes = [MoE(cfg, backend="grouped_mm", router="torch") for _ in range(2)]

    def stack():
        cache = ExpertCache(12, device="cpu", policy="lfu")
        layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch=None, compute_misses_on="auto", costs=costs)
                  for m in moes]
        link_layers(layers)
        return layers

    def run(layers, proofs_on: bool, gen):
        outs, stats = [], []
        for _ in range(8):
            x = torch.randn(int(torch.randint(1, 6, (1,), generator=gen)), k, generator=gen)
            for layer in layers:
                with monkeypatch.context() as m:
                    if not proofs_on:
                        m.setattr(plan_mod, "cpu_too_dear", lambda *a: False)
                        m.setattr(plan_mod, "fetches_all", lambda *a: False)
                    with torch.no_grad():
                        x = layer(x)
                outs.append(x)
                stats.append(layer.last_stats)
        return outs, stats

    proved = count_calls(monkeypatch, {"dear": 0, "all": 0}, [(plan_mod, "cpu_too_dear", "dear"),
                                                              (plan_mod, "fetches_all", "all")])
    on = run(stack(), True, torch.Generator().manual_seed(4))
    off = run(stack(), False, torch.Generator().manual_seed(4))
    assert on[1] == off[1]
    for a, b in zip(on[0], off[0]):  # within rounding: the search's early fetches may take other slots
        assert rel_l2(a, b) < TOLERANCE[torch.float32]
    assert proved["dear"] + proved["all"] > 0 and sum(s.cpu_experts for s in on[1]) > 0


def test_the_least_split_cost_within_the_room_is_the_least_over_every_s():
    """``least_split_s`` kept to ``room_of``'s room, against every s = 1..n priced by the loop written out:
    the same least wherever that least is within the limit (outside the room none is)."""
    from moekit.offload.bound import room_of

    gen = torch.Generator().manual_seed(25)
    checked = 0
    for _ in range(300):
        tokens, hits, costs, chance = _random_case(gen)
        n, times = len(tokens), sorted(_cpu_time(costs, t) for t in tokens.values())
        charge = least_charge_s(tokens, hits, BYTES, costs, chance)
        if math.isinf(charge):
            continue
        limit = (1.0 - costs.hysteresis) * _gpu_s(n, hits, costs, False)
        every = min(max(costs.cpu_margin * (costs.cpu_step_s + sum(times[:s])) + (n - s) * costs.issue_s,
                        _gpu_s(n - s, hits, costs, True)) + s * charge for s in range(1, n + 1))
        rows = RowTimes.of(tokens, costs)
        room = room_of(rows, hits, BYTES, costs, limit)
        if room is None:
            continue
        got = least_split_s(rows, hits, BYTES, costs, charge, room)
        assert got >= every * (1 - 1e-12)
        if every <= limit:
            assert got == pytest.approx(every, rel=1e-9)
            checked += 1
    assert checked > 20


@pytest.mark.parametrize("skew, m", [(0.3, 8), (0.0, 8), (0.3, 32)])
def test_the_replay_counts_the_same_with_the_proofs_off(monkeypatch, skew, m):
    """The bench's streams (the simulator's, E = 128, top-8, 4 layers) through the what-if with the H200's
    costs, the CPU side cheapened as a group's recalibration did (x0.78): hits, fetches, CPU experts and
    admissions equal with the proofs on and off, at 25 / 50% caches where both fetch-all and split
    forwards occur."""
    from moekit.offload.whatif import replay
    from moekit.sim.cache import decode_stream

    data = decode_stream(128, 8, 4, 14, m, skew, 0.3, seed=3)
    costs = H200.scaled(0.78)
    for fraction in (0.25, 0.5):
        on = replay(data.trace, round(fraction * 512), "lfu", None, place="auto", costs=costs,
                    expert_bytes=H200_EXPERT, measure_from=6)
        with monkeypatch.context() as patched:
            patched.setattr(plan_mod, "cpu_too_dear", lambda *a: False)
            patched.setattr(plan_mod, "fetches_all", lambda *a: False)
            off = replay(data.trace, round(fraction * 512), "lfu", None, place="auto", costs=costs,
                         expert_bytes=H200_EXPERT, measure_from=6)
        assert on.as_dict() == off.as_dict()
        assert on.cpu_experts > 0 or fraction == 0.5

""""auto"'s early fetches: the misses every split its search can take fetches (``split.surely_fetched``) are
issued before the search (``plan.plan_forward``'s ``issue``, ``ExpertCache.ensure_early``) and computed in
the first fetched group (``ExpertCache.rounds``' ``issued``). The search's CPU experts never include them;
the layer's output stays the plain layer's, and the replay predicts its cache step for step. CPU only."""

from __future__ import annotations

import math

import torch

from moekit import MoE, MoEConfig
from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, OffloadStats, link_layers, split_misses
from moekit.offload.split import cpu_room, surely_fetched
from moekit.offload.whatif import RoutingTrace, replay

from _helpers import TOLERANCE, rel_l2

BYTES = 1000


def _random_case(gen: torch.Generator):
    def u(lo: float, hi: float) -> float:
        return float(torch.empty(1).uniform_(lo, hi, generator=gen))

    n = int(torch.randint(1, 15, (1,), generator=gen))
    tokens = {e: int(torch.randint(1, 5, (1,), generator=gen)) for e in torch.randperm(40, generator=gen)[:n].tolist()}
    reuse = {e: (math.inf if u(0, 1) < 0.03 else u(0, 1)) for e in tokens}
    costs = MissCosts(link_bytes_per_s=BYTES / u(0.1, 0.3), cpu_expert_s=u(0.0, 0.6), cpu_token_s=u(0.0, 0.05),
                      cpu_step_s=u(0.0, 1.5), gpu_bytes_per_s=BYTES / u(0.0, 0.05), cpu_margin=u(1.0, 1.3),
                      issue_s=u(0.0, 0.1), hysteresis=0.05, gpu_call_s=u(0.0, 0.2), fetch_layer_s=u(0.0, 0.5),
                      cpu_rows_s=((1, u(0.1, 0.5)), (2, u(0.1, 0.6)), (4, u(0.2, 0.8))) if u(0, 1) > 0.5 else ())
    return tokens, int(torch.randint(0, 20, (1,), generator=gen)), costs, reuse


def test_the_search_never_puts_a_surely_fetched_miss_on_the_cpu():
    gen = torch.Generator().manual_seed(11)
    early = split_with_early = 0
    for _ in range(400):
        tokens, hits, costs, reuse = _random_case(gen)
        sure = surely_fetched(tokens, hits, BYTES, costs, reuse)
        split = split_misses(tokens, BYTES, costs, hits, reuse)
        assert set(sure) <= set(split.fetch) and sure == sorted(sure)
        limit = (1.0 - costs.hysteresis) * split_misses(tokens, BYTES, costs.scaled(1e9), hits).cost_s
        if cpu_room(tokens, hits, BYTES, costs, limit) is None:
            assert sure == sorted(tokens)  # no room: every miss is sure
        elif sure:
            early += 1
            split_with_early += bool(split.cpu)
    assert early > 30 and split_with_early > 10  # early fetches beside real splits


def test_rounds_compute_early_fetches_in_the_first_fetched_group():
    cache = ExpertCache(4, device="cpu", policy="lru")
    layer = cache.register(torch.randn(8, 2, 3), torch.randn(8, 3, 1))
    stats = OffloadStats()
    cache.begin_forward()
    cache.lookup(layer, [0], stats)
    cache.ensure(layer, [0], stats)
    cache.release(layer, [0])
    cache.begin_forward()
    hits, _ = cache.lookup(layer, [0, 1, 2, 3, 4, 5], stats)
    assert hits == [0]
    assert cache.ensure_early(layer, [4, 5, 6, 7], stats) == [4, 5, 6]  # 3 slots beside the hit
    groups = [list(g) for g in cache.rounds(layer, hits, [1, 2, 3], stats, issued=[4, 5, 6])]
    assert groups == [[0], [4, 5, 6], [1, 2, 3]]  # the hit, the early ones (cache full), then a round of the rest
    assert stats.fetched == 1 + 3 + 3


def _moes(cfg: MoEConfig, count: int) -> list[MoE]:
    torch.manual_seed(0)
    return [MoE(cfg, backend="grouped_mm", router="torch") for _ in range(count)]


def test_auto_with_early_fetches_keeps_the_plain_output_and_the_replays_cache(monkeypatch):
    e, k, n = 16, 32, 16
    cfg = MoEConfig(hidden_size=k, moe_intermediate_size=n, num_experts=e, top_k=4)
    fetch_s = 3 * n * k * 4 / 1e9  # one expert over 1 GB/s
    # a CPU call costs two fetches, each CPU expert one more: a split keeps only a few misses on the CPU
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1.2 * fetch_s, cpu_token_s=0.0, cpu_step_s=2 * fetch_s,
                      hysteresis=0.05)
    moes = _moes(cfg, 2)
    cache = ExpertCache(12, device="cpu", policy="lfu")
    layers = [OffloadedMoE.from_moe(m, cache=cache, prefetch=None, compute_misses_on="auto", costs=costs) for m in moes]
    link_layers(layers)
    early = []
    real = ExpertCache.ensure_early
    monkeypatch.setattr(ExpertCache, "ensure_early", lambda self, *a: early.append(real(self, *a)) or early[-1])
    touched, tokens, gen = [], [], torch.Generator().manual_seed(2)
    for _ in range(8):
        x = torch.randn(4, k, generator=gen)
        step_t, step_n = [], []
        for moe, layer in zip(moes, layers):
            ids = moe.route_tokens(x).routing.topk_ids.flatten().tolist()
            step_t.append(sorted(set(ids)))
            step_n.append({i: ids.count(i) for i in set(ids)})
            with torch.no_grad():
                want, got = moe(x), layer(x)
            assert rel_l2(got, want) < TOLERANCE[torch.float32]
            x = got
        touched.append(step_t)
        tokens.append(step_n)
    assert any(early) and cache.stats.cpu_experts > 0  # early fetches, and the search still split some forwards
    early.clear()
    predicted = replay(RoutingTrace(e, touched, [[[]] * 2] * 8, tokens), 12, "lfu", None, place="auto", costs=costs,
                       expert_bytes=3 * n * k * 4)
    assert any(early)  # the replay issued them too
    assert predicted.as_dict() | {"bytes_transferred": 0} == cache.stats.as_dict() | {"bytes_transferred": 0}


def test_early_fetches_leave_the_cache_as_one_batch_would(monkeypatch):
    """The replay of "auto" with its early fetches against the same replay with them switched off (the plan's
    ``issue`` dropped): the same hits, fetches, CPU experts and admissions, step for step, at M = 8 on a
    skewed stream (LFU ties and the eviction horizon follow the order keys were cached in)."""
    from moekit.offload import whatif
    from moekit.sim.cache import decode_trace

    trace = decode_trace(32, 4, 3, 30, 8, 0.3, 0.3, seed=4)
    fetch_s = 1e-3
    costs = MissCosts(link_bytes_per_s=BYTES / fetch_s, cpu_expert_s=1.2 * fetch_s, cpu_token_s=0.0,
                      cpu_step_s=2 * fetch_s, hysteresis=0.05)
    early = []
    real = ExpertCache.ensure_early
    monkeypatch.setattr(ExpertCache, "ensure_early", lambda self, *a: early.append(real(self, *a)) or early[-1])
    for policy in ("lfu", "lru"):
        with_early = [replay(trace, 40, policy, None, place="auto", costs=costs, expert_bytes=BYTES, measure_from=s)
                      for s in range(0, 30, 5)]
        assert any(early)
        plan = whatif.plan_forward
        monkeypatch.setattr(whatif, "plan_forward", lambda *a: plan(*a[:8]))  # no issue: one batch
        without = [replay(trace, 40, policy, None, place="auto", costs=costs, expert_bytes=BYTES, measure_from=s)
                   for s in range(0, 30, 5)]
        monkeypatch.setattr(whatif, "plan_forward", plan)
        assert [s.as_dict() for s in with_early] == [s.as_dict() for s in without]
        assert without[-1].cpu_experts > 0 and without[-1].hits > 0

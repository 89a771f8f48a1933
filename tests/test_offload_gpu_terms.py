"""``OffloadedMoE.measure_costs`` sets every term ``cost`` prices by, through the same timing path the bench's
floor uses (``gpu_terms.measure_terms``), and the floor's prefetch term (``FixedCosts.prefetch_layer_s``).
Fake clocks with hand-chosen costs; CPU only."""

from __future__ import annotations

import math
import types

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.bench.offload_floor import timeline_s
from moekit.offload import ExpertCache, MissCosts, OffloadedMoE, OffloadStats, gpu_terms, split_misses
from moekit.offload.cost import gpu_side_s, one_call
from moekit.offload.cpu_path import CPU_GEMMS
from moekit.routing import route

BASE_S, FETCH_S, PREFETCH_S, CALL_S = 0.0007, 0.0004, 0.00025, 0.0003  # the fake clock's costs


def _moe(seed: int = 0, e: int = 8) -> MoE:
    torch.manual_seed(seed)
    return MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=e, top_k=2), backend="grouped_mm",
               router="torch")


def _fake_clock(monkeypatch) -> None:
    """gpu_terms' clock: a forward takes BASE_S plus FETCH_S a fetched expert, a prefetch PREFETCH_S an
    expert, one more experts call CALL_S; nothing else moves it."""
    clock = [0.0]
    monkeypatch.setattr(gpu_terms, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    run = OffloadedMoE.run_routed

    def timed(self, x, routing):
        out = run(self, x, routing)
        clock[0] += BASE_S + FETCH_S * self.last_stats.fetched
        return out

    def prefetch(self, layer, experts, stats, _real=ExpertCache.prefetch):
        _real(self, layer, experts, stats)
        clock[0] += PREFETCH_S * stats.prefetched

    def second_call(*args, **kwargs):
        clock[0] += CALL_S

    monkeypatch.setattr(OffloadedMoE, "run_routed", timed)
    monkeypatch.setattr(ExpertCache, "prefetch", prefetch)
    monkeypatch.setattr(gpu_terms, "call_backend", second_call)


def test_measure_costs_sets_every_term_and_decides_as_a_hand_built_cost_object(monkeypatch):
    _fake_clock(monkeypatch)
    layer = OffloadedMoE.from_moe(_moe(), cache_experts=3, prefetch=None)
    x = torch.randn(1, 32)
    layer(x)  # the layer's own cache and stats, which measuring must leave as they are
    cached, stats = layer.cache.cached(layer.layer_id), layer.cache.stats.as_dict()
    costs = layer.measure_costs(tokens=2, repeats=1, rows=(1, 2))
    assert layer.cache.cached(layer.layer_id) == cached and layer.cache.stats.as_dict() == stats
    assert costs.gpu_call_s == pytest.approx(CALL_S) and costs.fetch_layer_s == pytest.approx(FETCH_S)
    assert costs.link_bytes_per_s > 0 and 0 < costs.gpu_bytes_per_s < math.inf
    assert costs.cpu_rows_s and all(s > 0 for _, s in costs.cpu_rows_s) and costs.cpu_margin >= 1.0
    assert costs.cpu_threads >= 1 and costs.cpu_gemm in CPU_GEMMS and costs.hysteresis > 0
    hand = MissCosts(link_bytes_per_s=costs.link_bytes_per_s, cpu_expert_s=costs.cpu_expert_s,
                     cpu_token_s=costs.cpu_token_s, cpu_step_s=costs.cpu_step_s, gpu_bytes_per_s=costs.gpu_bytes_per_s,
                     cpu_margin=costs.cpu_margin, cpu_threads=costs.cpu_threads, cpu_gemm=costs.cpu_gemm,
                     link_cpu_bytes_per_s=costs.link_cpu_bytes_per_s, hysteresis=costs.hysteresis,
                     cpu_rows_s=costs.cpu_rows_s, gpu_call_s=CALL_S, fetch_layer_s=FETCH_S)
    nbytes = layer.cache.expert_bytes
    for hits in range(6):
        expect = hits * nbytes / costs.gpu_bytes_per_s < CALL_S  # the hits' reads against a second call
        assert one_call(hits, nbytes, costs) == one_call(hits, nbytes, hand) == expect
        for fetched in range(3):
            assert gpu_side_s(hits, fetched, nbytes, costs) == pytest.approx(gpu_side_s(hits, fetched, nbytes, hand))
            if fetched:  # a forward with a fetch takes at least its hits' reads and the measured term
                assert (gpu_side_s(hits, fetched, nbytes, costs)
                        >= hits * nbytes / costs.gpu_bytes_per_s + FETCH_S - 1e-12)
        for tokens in ({1: 1}, {1: 3, 5: 1}, {0: 1, 2: 2, 6: 1}):
            got, want = split_misses(tokens, nbytes, costs, hits), split_misses(tokens, nbytes, hand, hits)
            assert (got.fetch, got.cpu) == (want.fetch, want.cpu) and got.cost_s == pytest.approx(want.cost_s)


def test_measure_terms_times_the_bench_and_the_probe_alike(monkeypatch):
    """Two layers on one cache: every term is the fake clock's (the prefetch term per prefetching layer)."""
    _fake_clock(monkeypatch)
    cache = ExpertCache(16, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe(seed), cache=cache, prefetch=None) for seed in range(2)]
    x = torch.randn(2, 32)
    steps = [[route(layer.gate(x + s), layer.config) for layer in layers] for s in range(3)]
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=0.0, cpu_token_s=0.0, gpu_bytes_per_s=1e12)
    got = gpu_terms.measure_terms(layers, x, steps, costs, repeats=2, forced_repeats=2)
    read = cache.expert_bytes / costs.gpu_bytes_per_s
    hits = [sum(len(set(r.topk_ids.reshape(-1).tolist())) for r in per_layer) for per_layer in steps]
    assert got.layer_s == pytest.approx(BASE_S - sorted(hits)[1] * read / 2, rel=1e-6)  # median step, hits' reads out
    assert got.call_s == pytest.approx(CALL_S) and got.fetch_layer_s == pytest.approx(FETCH_S)
    assert got.prefetch_layer_s == pytest.approx(PREFETCH_S)
    assert (got.priced(costs).gpu_call_s, got.priced(costs).fetch_layer_s) == (got.call_s, got.fetch_layer_s)
    assert got.issue_s == 0.0 and got.priced(costs).issue_s == 0.0  # the fake clock's ensure costs nothing
    assert got.copy_call_s == 0.0  # nor does a forward after a copy


def test_measure_copy_call_is_a_forward_after_a_copy_over_one_after_none(monkeypatch):
    """``measure_copy_call``: per layer, a forward right after none of the cache's copies and one right after
    a touched expert evicted and fetched again (a fake clock: a forward BASE_S, COPY_S more when a copy into
    the slots came since the last forward); the cache holds the same experts after."""
    copy_s, clock, copied = 0.0003, [0.0], [False]
    monkeypatch.setattr(gpu_terms, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    run = OffloadedMoE.run_routed

    def timed(self, x, routing):
        out = run(self, x, routing)
        clock[0] += BASE_S + (copy_s if copied[0] else 0.0)
        copied[0] = False
        return out

    def ensure(self, layer, experts, stats, _real=ExpertCache.ensure):
        _real(self, layer, experts, stats)
        copied[0] = copied[0] or bool(experts)

    monkeypatch.setattr(OffloadedMoE, "run_routed", timed)
    monkeypatch.setattr(ExpertCache, "ensure", ensure)
    cache = ExpertCache(16, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe(seed), cache=cache, prefetch=None) for seed in range(2)]
    x = torch.randn(2, 32)
    per_layer = [route(layer.gate(x), layer.config) for layer in layers]
    for layer, routing in zip(layers, per_layer):
        layer.run_routed(x, routing)
    cached = [set(cache.cached(layer.layer_id)) for layer in layers]
    assert gpu_terms.measure_copy_call(layers, x, per_layer, repeats=3) == pytest.approx(copy_s)
    assert [set(cache.cached(layer.layer_id)) for layer in layers] == cached


def test_measure_issue_times_the_fetch_of_every_other_touched_expert_per_expert(monkeypatch):
    """``measure_issue``: every other touched expert (no two adjacent ids) evicted, the empty slots filled (of
    both layers of the cache, without copies), and fetched back by ``ensure``, which must evict as many, the host
    time per expert (a fake clock: ISSUE_S an expert ``ensure`` fetches); the cache holds the same experts after."""
    issue_s, clock, asked = 0.00004, [0.0], []
    monkeypatch.setattr(gpu_terms, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def ensure(self, layer, experts, stats, _real=ExpertCache.ensure):
        asked.append((list(experts), self.free_slots() - len(self.cached(0)) - len(self.cached(1))))  # empty slots
        _real(self, layer, experts, stats)
        clock[0] += issue_s * len(experts)

    monkeypatch.setattr(ExpertCache, "ensure", ensure)
    cache = ExpertCache(14, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe(seed, e=16), cache=cache, prefetch=None) for seed in range(2)]
    x = torch.randn(3, 32)
    routing = route(layers[0].gate(x), layers[0].config)
    layers[0].run_routed(x, routing)
    layers[1].run_routed(x, route(layers[1].gate(x), layers[1].config))
    cached, asked[:] = [cache.cached(layer.layer_id) for layer in layers], []
    assert gpu_terms.measure_issue(layers, routing, repeats=3) == pytest.approx(issue_s)
    touched = sorted(set(routing.topk_ids.reshape(-1).tolist()))
    assert [a for a, _ in asked[:3]] == [touched[::2]] * 3
    assert all(b - a >= 2 for a, b in zip(touched[::2], touched[2::2]))
    assert [empty for _, empty in asked[:3]] == [0] * 3  # a full cache: each timed ensure evicted
    assert [cache.cached(layer.layer_id).keys() for layer in layers] == [c.keys() for c in cached]


def test_forced_prefetch_fetches_k_of_each_later_layer_ahead_so_its_forward_hits():
    cache = ExpertCache(24, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe(seed), cache=cache, prefetch=None) for seed in range(3)]
    x = torch.randn(3, 32)
    steps = [[route(layer.gate(x), layer.config) for layer in layers]]
    for layer, routing in zip(layers, steps[0]):  # cached before: the untimed pass hits
        layer.run_routed(x, routing)
    fetched = cache.stats.fetched
    times = gpu_terms.measure_forced(layers, x, steps, counts=(0, 2), repeats=1, prefetch=True)
    assert sorted(times) == [0, 2] and all(len(v) == 1 for v in times.values())
    assert all(layer.last_stats.misses == 0 for layer in layers)  # k = 2 last: prefetched back before each forward
    assert [layer.last_stats.prefetch_used for layer in layers] == [0, 2, 2]
    assert cache.stats.fetched == fetched  # nothing fetched on demand


def test_timeline_puts_a_prefetching_layers_host_work_on_its_path():
    """Hand-worked: link 1 ms an expert, read 0.1 ms, fixed 3 ms, fetch layer 4 ms, prefetch work 2 ms."""
    costs = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.0, cpu_token_s=0.0, gpu_bytes_per_s=1e6,
                      fetch_layer_s=0.004)

    def floor(layers, pf):
        stats = [OffloadStats(touched=h + f, hits=h, fetched=f, prefetched=p) for h, f, p in layers]
        return timeline_s(stats, 100, costs, 0.003, prefetch_s=pf)

    # all hits, one prefetch: 3 + 5 x 0.1 + 2 (the link's prefetch lands at 3 + 1 = 4 ms, earlier)
    assert floor([(5, 0, 1)], 0.002) == pytest.approx(0.0055)
    assert floor([(5, 0, 0)], 0.002) == pytest.approx(0.0035)  # no prefetch: no term
    # a fetch and a prefetch: the fetch's 3 + 0.5 + 4, then the prefetch's 2 on the same host: 9.5 ms (7.5 without)
    assert floor([(5, 1, 1)], 0.002) == pytest.approx(0.0095) and floor([(5, 1, 1)], 0.0) == pytest.approx(0.0075)
    # two layers: the first's prefetch work delays the second's start: 3 + 0.3 + 2, then 3 + 0.6
    assert floor([(3, 0, 1), (6, 0, 0)], 0.002) == pytest.approx(0.0089)
    assert floor([(3, 0, 1), (6, 0, 0)], 0.0) == pytest.approx(0.0069)


def test_warm_rows_runs_the_cpu_experts_once_at_every_row_count_and_measure_costs_asks_for_it(monkeypatch):
    from moekit.offload import calibrate

    layer = OffloadedMoE.from_moe(_moe(), cache_experts=3, prefetch=None)
    seen, run = [], layer._cpu_experts

    def recorded(inputs, on_cpu, gemm):
        x, ids, weights = inputs
        seen.append((x.shape[0], ids.reshape(-1).tolist(), on_cpu, gemm, torch.get_num_threads()))
        out = run(inputs, on_cpu, gemm)
        assert out.shape == x.shape
        return out

    monkeypatch.setattr(layer, "_cpu_experts", recorded)
    calibrate.warm_rows(layer, 4, 1, "mm_loop")
    assert seen == [(r, [0] * r, [0], "mm_loop", 1) for r in range(1, 5)]
    asked = []
    monkeypatch.setattr(calibrate, "warm_rows", lambda lay, most, threads, gemm: asked.append(most))
    layer.measure_costs(tokens=2, repeats=1, rows=(1, 2), warm=7)
    layer.measure_costs(tokens=2, repeats=1, rows=(1, 3))
    assert asked == [7, 3]  # given, else the grid's largest row count


def test_measure_branch_layer_is_a_forward_with_a_cpu_expert_over_all_hits_less_the_branch(monkeypatch):
    """``measure_branch_layer``: each step all hits, then one touched expert of each layer evicted and computed
    on the CPU (a fake clock: a forward BASE_S; with a branch, its own BRANCH_S (set as its phases), ISSUE_S
    for each admission and EXTRA_S of host work beside it): the median per layer is EXTRA_S; the layers are
    back in the gpu mode with the same experts cached after."""
    from moekit.offload.cpu_path import CpuPhases

    branch_s, issue_s, extra_s, clock = 0.002, 0.00005, 0.00015, [0.0]
    monkeypatch.setattr(gpu_terms, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    run = OffloadedMoE.run_routed

    def timed(self, x, routing):
        out = run(self, x, routing)
        clock[0] += BASE_S
        if self.last_stats.cpu_experts:
            self._cpu.last = CpuPhases(0.0, 0.0, branch_s, 0.0, self.last_stats.cpu_experts, 1, 1)
            clock[0] += branch_s + extra_s + issue_s * self.last_stats.admitted
        return out

    monkeypatch.setattr(OffloadedMoE, "run_routed", timed)
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=1e-6)
    cache = ExpertCache(16, device="cpu")
    layers = [OffloadedMoE.from_moe(_moe(seed), cache=cache, prefetch=None, costs=costs) for seed in range(2)]
    x = torch.randn(2, 32)
    steps = [[route(layer.gate(x), layer.config) for layer in layers]]
    for layer, routing in zip(layers, steps[0]):
        layer.run_routed(x, routing)
    cached = [set(cache.cached(layer.layer_id)) for layer in layers]
    assert gpu_terms.measure_branch_layer(layers, x, steps, issue_s, repeats=3) == pytest.approx(extra_s)
    assert all(layer.compute_misses_on == "gpu" for layer in layers)
    assert [set(cache.cached(layer.layer_id)) for layer in layers] == cached
    assert cache.stats.cpu_experts == 3 * len(layers)  # one CPU expert a layer a repeat


def test_timeline_puts_a_branch_layers_host_work_before_its_cpu_branch():
    # fixed 3 ms, one CPU expert (a 2 ms call + 9 ms at 4 rows): 3 + 11 = 14 ms, with 0.5 ms beside the branch 14.5;
    # a layer without a CPU expert pays none of it
    from moekit.bench.offload_floor import timeline_s as floor

    table = ((1, 0.008), (4, 0.009))
    costs = MissCosts(link_bytes_per_s=1e6, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_step_s=0.002,
                      gpu_bytes_per_s=1e9, cpu_rows_s=table)
    cpu = OffloadStats(touched=1, cpu_experts=1, cpu_tokens=4, cpu_forwards=1, cpu_rows=(4,))
    assert floor([cpu], 1000, costs, 0.003) == pytest.approx(0.014)
    assert floor([cpu], 1000, costs, 0.003, branch_layer_s=0.0005) == pytest.approx(0.0145)
    hits = OffloadStats(touched=1, hits=1)
    assert floor([hits], 1000, costs, 0.003, branch_layer_s=0.0005) == floor([hits], 1000, costs, 0.003)

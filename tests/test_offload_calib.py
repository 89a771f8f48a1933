"""The offload bench's calibration: the floor (``bench.offload_floor``) against closed forms and a float64
event loop written here, the fixed per-layer cost, the per-group CPU recalibration, the online CPU rate,
the split's hysteresis and ``gpu_only``, and the balanced mode orders. CPU only."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.bench.offload_floor import sum_floor_s, timeline_s
from moekit.offload.gpu_terms import fixed_from, measure_fixed
from moekit.bench.offload_cells import balanced_orders
from moekit.offload import (CpuPhases, CpuRate, ExpertCache, MissCosts, OffloadedMoE, OffloadStats, gpu_only,
                            split_misses)
from moekit.offload import calibrate
from moekit.routing import Routing

BYTES = 1000
COSTS = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.004, cpu_token_s=0.0005, cpu_step_s=0.002,
                  gpu_bytes_per_s=1e6, link_cpu_bytes_per_s=8e4)  # link 10 ms, busy link 12.5 ms, read 1 ms


def _stats(hits=0, fetched=0, cpu_experts=0, cpu_tokens=0, admitted=0, prefetched=0) -> OffloadStats:
    return OffloadStats(touched=hits + fetched + cpu_experts, hits=hits, fetched=fetched, cpu_experts=cpu_experts,
                        cpu_tokens=cpu_tokens, admitted=admitted, prefetched=prefetched)


def _reference_timeline(layers: list[OffloadStats], fixed: float) -> float:
    """The floor written out as events in float64 (ms): each layer starts after the previous one ends and
    its fixed cost; its fetches (then admissions) go on the link after whatever is queued; its GPU reads
    the hits, then the fetched experts once landed; its CPU side (if any) runs from its start; the
    prefetch of the next layer waits for the CPU side and the link."""
    link, busy, read = 10.0, 12.5, 1.0
    now = link_free = 0.0
    for s in layers:
        begin = now + fixed
        per_copy = busy if s.cpu_experts else link
        landed = max(link_free, begin) + s.fetched * per_copy
        link_free = landed + s.admitted * per_copy
        gpu_done = max(begin + s.hits * read, landed) + s.fetched * read
        cpu = (2.0 + 4.0 * s.cpu_experts + 0.5 * s.cpu_tokens) if s.cpu_experts else 0.0
        done = max(gpu_done, begin + cpu, link_free) if s.cpu_experts else gpu_done
        link_free = max(link_free, begin + cpu) + s.prefetched * link
        now = done
    return max(now, link_free) / 1e3


def test_one_layer_floor_is_the_closed_form():
    # hits read while the fetches travel, then the fetched experts read: fixed + max(h r, F l) + F r
    s = _stats(hits=5, fetched=2)
    assert timeline_s([s], BYTES, COSTS, fixed_s=0.003) == pytest.approx(0.003 + max(5 * 0.001, 2 * 0.01) + 2 * 0.001)
    assert timeline_s([_stats(hits=30, fetched=1)], BYTES, COSTS) == pytest.approx(30 * 0.001 + 0.001)
    # a CPU-only layer: fixed + step + experts x expert + tokens x token
    assert timeline_s([_stats(cpu_experts=3, cpu_tokens=4)], BYTES, COSTS, 0.001) == pytest.approx(
        0.001 + 0.002 + 3 * 0.004 + 4 * 0.0005)


@pytest.mark.parametrize("seed", range(6))
def test_timeline_matches_the_float64_event_loop(seed):
    g = torch.Generator().manual_seed(seed)

    def count(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=g))

    layers = []
    for _ in range(1 + count(4)):
        cpu = count(4)
        layers.append(_stats(hits=count(9), fetched=count(4), cpu_experts=cpu, cpu_tokens=cpu + count(5),
                             admitted=count(3) if cpu else 0, prefetched=count(4)))
    fixed = count(5) * 1e-3
    assert timeline_s(layers, BYTES, COSTS, fixed) == pytest.approx(_reference_timeline(layers, fixed * 1e3), rel=1e-12)


def test_the_fixed_cost_adds_once_per_layer_on_a_chain_without_overlap():
    layers = [_stats(hits=3, fetched=1), _stats(hits=2, cpu_experts=2, cpu_tokens=2), _stats(fetched=2)]
    assert timeline_s(layers, BYTES, COSTS, 0.002) - timeline_s(layers, BYTES, COSTS) == pytest.approx(3 * 0.002)
    assert sum_floor_s(layers, BYTES, COSTS, 0.002) - sum_floor_s(layers, BYTES, COSTS) == pytest.approx(3 * 0.002)


def test_sum_floor_is_the_layers_maxima_or_the_links_total():
    layers = [_stats(hits=3, fetched=1), _stats(cpu_experts=2, cpu_tokens=3)]
    by_layer = max(4 * 0.001, 0.01) + (0.002 + 2 * 0.004 + 3 * 0.0005)
    assert sum_floor_s(layers, BYTES, COSTS) == pytest.approx(by_layer)
    moved = [_stats(hits=1, prefetched=5)]  # five copies on the link, 50 ms, outweigh the layer's 1 ms
    assert sum_floor_s(moved, BYTES, COSTS) == pytest.approx(0.05)


def test_fixed_from_recovers_the_per_layer_cost_of_all_hit_steps():
    layers, fixed, read = 4, 0.00037, BYTES / COSTS.gpu_bytes_per_s
    hits = [8, 20, 13, 31, 5]
    times = [layers * fixed + h * read for h in hits]
    assert fixed_from(times, hits, layers, BYTES, COSTS) == pytest.approx(fixed, rel=1e-9)
    assert fixed_from([0.0], [50], 1, BYTES, COSTS) == 0.0  # never negative
    with pytest.raises(ValueError, match="one hit count per step"):
        fixed_from([1.0, 2.0], [3], 2, BYTES, COSTS)


def _moe(e=8) -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=e, top_k=2), backend="grouped_mm",
               router="torch")


def _routing(ids: list[list[int]]) -> Routing:
    t = torch.tensor(ids, dtype=torch.int32)
    return Routing(t, torch.full(t.shape, 0.5))


def test_measure_fixed_times_all_hit_steps_and_a_second_call_and_refuses_a_small_cache(monkeypatch):
    """On a fake clock where each layer's forward takes 0.7 ms plus its distinct experts at the GPU read
    rate and one more experts call 0.3 ms, the fixed costs come out as 0.7 and 0.3 ms."""
    from moekit.offload import gpu_terms as offload_floor

    moe = _moe()
    steps = [[_routing([[0, 1], [2, 3]]), _routing([[1, 4], [4, 5]])],
             [_routing([[0, 2], [3, 1]]), _routing([[5, 1], [4, 1]])]]
    x = torch.randn(2, 32)
    cache = ExpertCache(4 + 3, device="cpu")  # layer 0 touches {0, 1, 2, 3}, layer 1 {1, 4, 5}
    layers = [OffloadedMoE.from_moe(moe, cache=cache, prefetch=None) for _ in range(2)]
    clock = [0.0]
    read = cache.expert_bytes / COSTS.gpu_bytes_per_s
    for layer in layers:
        def timed(x, routing, _run=layer.run_routed):
            out = _run(x, routing)
            clock[0] += 0.0007 + len(set(routing.topk_ids.flatten().tolist())) * read  # every expert a hit
            return out

        layer.run_routed = timed
    calls = []

    def second_call(fn, x, w13, w2, ids, weights, **kw):
        calls.append(kw["expert_map"])
        clock[0] += 0.0003

    monkeypatch.setattr(offload_floor.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(offload_floor, "call_backend", second_call)
    got = measure_fixed(layers, x, steps, COSTS, repeats=2)
    assert (got.layer_s, got.call_s) == pytest.approx((0.0007, 0.0003), rel=1e-9)
    assert len(calls) == 2 * 2 * 2  # repeats x steps x layers
    assert all((m >= 0).sum() == len(set(r.topk_ids.flatten().tolist())) for m, r in
               zip(calls, [r for _ in range(2) for step in steps for r in step]))  # each over its layer's touched set
    monkeypatch.undo()
    small = ExpertCache(3, device="cpu")
    layers = [OffloadedMoE.from_moe(moe, cache=small, prefetch=None) for _ in range(2)]
    with pytest.raises(ValueError, match="must hold every expert"):
        measure_fixed(layers, x, steps, COSTS, repeats=1)


def test_recalibrate_cpu_scales_the_cpu_model_by_the_median_round_and_keeps_the_rest(monkeypatch):
    base = MissCosts(link_bytes_per_s=5e10, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_step_s=0.001, cpu_margin=1.7,
                     cpu_threads=3, cpu_gemm="mm_loop", hysteresis=0.05, cpu_rows_s=((1, 0.002), (4, 0.003)))
    factors = iter([1.0, 1.3, 1.3, 0.9, 0.9, 1.6, 1.6])  # the warm-up call, then two calls a round
    calls = []

    def fake_branch(layer, group, experts, m, threads, gemm):
        calls.append((tuple(group), experts, m, threads, gemm))
        return next(factors) * (0.001 + experts * (0.002 + (m - 1) * 0.001 / 3))  # the model, scaled

    monkeypatch.setattr(calibrate, "branch", fake_branch)
    layer = OffloadedMoE.from_moe(_moe(e=64), cache_experts=1, prefetch=None)
    new, factor = calibrate.recalibrate_cpu(layer, base, start=2, rows=2, repeats=3)
    assert factor == pytest.approx(1.3, rel=1e-12)  # rounds 1.3, 0.9, 1.6: the median
    assert new.cpu_step_s == pytest.approx(0.0013) and [r for r, _ in new.cpu_rows_s] == [1, 4]
    assert [t for _, t in new.cpu_rows_s] == pytest.approx([0.0026, 0.0039])
    assert new.cpu_time(2) == pytest.approx(1.3 * (0.002 + 0.001 / 3))
    assert (new.link_bytes_per_s, new.cpu_margin, new.cpu_threads, new.cpu_gemm,
            new.hysteresis) == (5e10, 1.7, 3, "mm_loop", 0.05)
    assert all(c[3:] == (3, "mm_loop") for c in calls) and [c[1:3] for c in calls[1:3]] == [(2, 2), (8, 2)]
    groups = [c[0] for c in calls]
    assert groups[0] == (16, 17) and len({g[0] for g in groups}) == len(groups)  # cold: from group 2 (of 8) on


def test_cpu_rate_is_an_exponential_average_of_measured_over_modelled_branches():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=0.0, cpu_token_s=0.001, cpu_step_s=0.01,
                      cpu_rows_s=((1, 0.9e-3), (2, 1.1e-3)))
    rate = CpuRate(weight=0.3, clip=None)
    assert rate.apply(costs) is costs  # no sample yet
    branches = [(0.05, [1, 2, 2]), (0.08, [1] * 5), (0.02, [3, 1]), (0.002, [1])]  # (total s, rows per CPU expert)
    table = {1: 0.9e-3, 2: 1.1e-3, 3: 1.3e-3}  # the table, extended past its last point by its last slope
    want = None
    for total, rows in branches:
        rate.update(CpuPhases(0.0, 0.0, total, 0.0, len(rows), sum(rows), 1), costs, rows)
        sample = total / (0.01 + sum(table[r] for r in rows))
        want = 0.7 * (1.0 if want is None else want) + 0.3 * sample  # from the calibrated model's 1
        assert rate.scale == pytest.approx(want, rel=1e-12)
    scaled = rate.apply(costs)
    assert rate.apply(costs) is scaled  # asked again: the same answer, not built again
    assert rate.samples == 4 and scaled.cpu_step_s == pytest.approx(0.01 * want)
    assert scaled.cpu_time(2) == pytest.approx(1.1e-3 * want) and scaled.link_bytes_per_s == 1.0
    rate.update(CpuPhases(0.0, 0.0, 0.03, 0.0, 1, 1, 1), costs, [1])  # a new estimate: a new answer
    want = 0.7 * want + 0.3 * 0.03 / (0.01 + 0.9e-3)
    assert rate.apply(costs) is not scaled and rate.apply(costs).cpu_step_s == pytest.approx(0.01 * want)
    with pytest.raises(ValueError, match="weight"):
        CpuRate(weight=0.0)
    with pytest.raises(ValueError, match="rows"):
        rate.update(CpuPhases(0.0, 0.0, 1.0, 0.0, 1, 1, 1), costs, [])


def test_cpu_rate_clips_each_sample_to_a_factor_of_its_estimate():
    costs = MissCosts(link_bytes_per_s=1.0, cpu_expert_s=0.001, cpu_token_s=0.0, cpu_step_s=0.0)
    rate, want = CpuRate(weight=0.25), 1.0
    for ratio in (12.0, 1.1, 0.05, 3.0, 3.0, 3.0, 3.0):  # an outlier, a dip, then a lasting slowdown
        rate.update(CpuPhases(0.0, 0.0, ratio * 0.001, 0.0, 1, 1, 1), costs, [1])
        want += 0.25 * (min(max(ratio, want / 2.0), want * 2.0) - want)
        assert rate.scale == pytest.approx(want, rel=1e-12)
    assert 2.0 < rate.scale < 3.0  # the slowdown tracked, the outlier's 12x never taken whole
    with pytest.raises(ValueError, match="clip"):
        CpuRate(clip=0.5)


def test_a_layer_with_a_cpu_rate_updates_it_from_its_cpu_branch():
    moe, rate = _moe(), CpuRate()
    off = OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on="cpu", costs=COSTS, cpu_rate=rate)
    x = torch.randn(3, 32)
    with torch.no_grad():
        torch.testing.assert_close(off(x), moe(x))
    assert off.last_stats.cpu_experts == off.last_stats.touched > 0
    assert rate.samples >= 1 and rate.scale is not None and rate.scale >= 0
    counts = moe(x, return_stats=True).stats.counts  # [E]: the plain layer's tokens per expert
    assert sorted(off.last_stats.cpu_rows) == sorted(counts[counts > 0].tolist())
    with pytest.raises(TypeError, match="cpu_rate"):
        OffloadedMoE.from_moe(moe, cache_experts=2, cpu_rate=0.5)


def test_gpu_only_fetches_every_miss_as_the_closed_form():
    split = gpu_only({3: 1, 1: 2, 7: 1}, BYTES, COSTS, hits=4)
    assert (split.fetch, split.cpu, split.cpu_s, split.refetch_s) == ([1, 3, 7], [], 0.0, 0.0)
    assert split.gpu_s == pytest.approx(max(4 * 0.001, 3 * 0.01) + 3 * 0.001)
    assert split.link_s == pytest.approx(0.03)


def test_hysteresis_keeps_every_miss_on_the_link_unless_the_cpu_wins_by_that_much():
    # 4 one-token misses, nothing cached: fetching all costs 4 x (10 + 1) ms = 44 ms; three on the CPU
    # max(10 + 1, 2 + 3 x 4.5) = 15.5 ms, nothing to refetch (hit rate 0): a 65% gain
    tokens = {0: 1, 1: 1, 2: 1, 3: 1}
    costs = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.004, cpu_token_s=0.0005, cpu_step_s=0.002,
                      gpu_bytes_per_s=1e6, refetch="hit_rate")
    base = split_misses(tokens, BYTES, costs)
    fetch_all = gpu_only(tokens, BYTES, costs)
    gain = 1 - base.cost_s / fetch_all.cost_s
    assert fetch_all.cost_s == pytest.approx(0.044) and base.cost_s == pytest.approx(0.0155) and len(base.cpu) == 3
    below = split_misses(tokens, BYTES, dataclasses.replace(costs, hysteresis=gain * 0.99))
    above = split_misses(tokens, BYTES, dataclasses.replace(costs, hysteresis=min(gain * 1.01, 0.999)))
    assert below == base
    assert above.cpu == [] and above.fetch == sorted(tokens)
    with pytest.raises(ValueError, match="hysteresis"):
        dataclasses.replace(costs, hysteresis=1.0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_orders_make_every_run_follow_every_other_once_per_cycle(n):
    """Steps taken in turn through the orders, the cycle repeated: every ordered pair of distinct runs is
    adjacent exactly once per n - 1 steps, the last run of a step followed by the next step's first."""
    orders = balanced_orders(n)
    assert len(orders) == max(1, n - 1) and all(sorted(o) == list(range(n)) for o in orders)
    for cycles in (1, 3):
        runs = [j for _ in range(cycles) for o in orders for j in o]
        follows = {(a, b): 0 for a, b in itertools.permutations(range(n), 2)}
        for a, b in zip(runs, runs[1:] + runs[:1]):  # the repeated cycle's wrap too (n = 1: itself)
            if a != b:
                follows[(a, b)] += 1
        assert set(follows.values()) <= {cycles}
    with pytest.raises(ValueError, match="n must be"):
        balanced_orders(0)


def test_timed_steps_round_up_to_whole_cycles_of_the_groups_stacks():
    from moekit.bench.offload_measure import balanced_count

    assert [balanced_count(s, 4) for s in (1, 3, 4, 12)] == [3, 3, 6, 12]  # 3 modes and the reference
    assert [balanced_count(s, 5) for s in (3, 12)] == [4, 12] and balanced_count(3, 1) == 3


def test_a_group_is_recalibrated_only_when_a_run_computes_on_the_cpu(monkeypatch):
    from moekit.bench import offload_measure

    calls = []
    monkeypatch.setattr(offload_measure, "recalibrate_cpu",
                        lambda probe, costs, start, rows: calls.append((start, rows))
                        or (dataclasses.replace(costs, cpu_expert_s=9.0), 1.5))
    runs = [offload_measure._Run(0.5, 4, "lfu", False, place) for place in ("gpu", "cpu", "auto")]
    group, costs, scale = offload_measure._prepare(runs[:1], COSTS, None, 7, online=True)
    assert costs is COSTS and scale == 1.0 and calls == [] and not group[0].online
    group, costs, scale = offload_measure._prepare(runs, COSTS, None, 7, online=True, rows=2)
    assert costs.cpu_expert_s == 9.0 and scale == 1.5 and calls == [(7, 2)]
    assert [r.online for r in group] == [False, False, True]
    group, _, _ = offload_measure._prepare(runs, COSTS, None, 8, online=False)
    assert not any(r.online for r in group)


def test_after_ms_is_each_runs_mean_step_by_the_run_timed_before_it():
    from moekit.bench.offload_cells import _after

    times, before = [0.001, 0.003, 0.002, 0.006], [1, 2, 1, None]  # indexes into the names; None: nothing before
    assert _after(times, before, ["gpu", "cpu", "ref"]) == pytest.approx({"cpu": 1.5, "ref": 3.0, "-": 6.0})

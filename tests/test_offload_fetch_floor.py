"""The least a forward with a fetch takes (``MissCosts.fetch_layer_s`` / ``FixedCosts.fetch_layer_s``): in the
floor's timeline, in "auto"'s GPU side, and measured from forced-fetch timings; one experts call for hits and
fetches where a second call costs more than the hits' reads (``cost.one_call``), in the layer, the price and
the floor. Hand-worked numbers; CPU only."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.bench.offload_floor import timeline_s
from moekit.offload.gpu_terms import fetch_layer_from, overlap_from
from moekit.offload import MissCosts, OffloadedMoE, OffloadStats, gpu_only
from moekit.offload.cost import gpu_side_s, one_call

from _helpers import TOLERANCE, rel_l2

# link 10 ms an expert, GPU read 1 ms (1000-byte experts); second call 0.5 ms; a forward with a fetch >= 14 ms
COSTS = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.0, cpu_token_s=0.0, gpu_bytes_per_s=1e6, gpu_call_s=0.0005,
                  fetch_layer_s=0.014)


def _stats(hits=0, fetched=0, prefetched=0) -> OffloadStats:
    return OffloadStats(touched=hits + fetched, hits=hits, fetched=fetched, prefetched=prefetched)


def test_timeline_holds_a_layer_with_a_fetch_to_fetch_layer_s_past_its_start():
    fixed = 0.003
    # one fetch: the old model's 3 + max(5 x 1, 10) + 1 + 0.5 = 14.5 ms, the new term's 3 + 5 x 1 + 14 = 22 ms
    assert timeline_s([_stats(hits=5, fetched=1)], 1000, COSTS, fixed) == pytest.approx(0.022)
    # three fetches: 3 + max(5, 30) + 3 + 0.5 = 36.5 ms against 3 + 5 + 14 = 22 ms: the link's time stands
    assert timeline_s([_stats(hits=5, fetched=3)], 1000, COSTS, fixed) == pytest.approx(0.0365)
    # no fetch: untouched (3 + 5 ms); two layers add up, the second starting when the first ends
    assert timeline_s([_stats(hits=5)], 1000, COSTS, fixed) == pytest.approx(0.008)
    assert timeline_s([_stats(hits=5, fetched=1), _stats(hits=2, fetched=1)], 1000, COSTS, fixed) == pytest.approx(
        0.022 + (0.003 + 0.002 + 0.014))
    # a prefetch for layer 2 follows layer 1's fetch on the link (lands at 13 + 10 = 23 ms); layer 2 starts at
    # 22 + 3 = 25, its fetch lands at 35, + 1 + 0.5 = 36.5 ms, under 25 + 2 x 1 + 14 = 41: the new term rules
    two = timeline_s([_stats(hits=5, fetched=1, prefetched=1), _stats(hits=2, fetched=1)], 1000, COSTS, fixed)
    assert two == pytest.approx(0.041)


def test_gpu_side_prices_a_forward_with_a_fetch_at_fetch_layer_s_at_least():
    assert gpu_side_s(5, 1, 1000, COSTS) == pytest.approx(0.005 + 0.014)  # max(5 + 0, 10) + 1 + 0.5 = 16.5 < 19
    assert gpu_side_s(5, 3, 1000, COSTS) == pytest.approx(0.030 + 0.003 + 0.0005)
    assert gpu_side_s(5, 0, 1000, COSTS) == pytest.approx(0.005)  # no fetch: no such floor
    assert gpu_side_s(0, 1, 1000, COSTS) == pytest.approx(0.014)  # no hits: no second call, 10 + 1 < 14
    assert gpu_only({3: 1}, 1000, COSTS, hits=5).gpu_s == pytest.approx(0.019)
    with pytest.raises(ValueError, match="fetch_layer_s"):
        MissCosts(link_bytes_per_s=1.0, cpu_expert_s=0.0, cpu_token_s=0.0, fetch_layer_s=-1e-3)


def test_fetch_layer_from_is_the_median_paired_difference_per_layer():
    forced = {0: [0.010, 0.012, 0.011, 0.020], 1: [0.014, 0.020, 0.013, 0.021]}
    # per pair and layer (4 layers): 1.0, 2.0, 0.5, 0.25 ms -> median 0.75 ms
    assert fetch_layer_from(forced, 4) == pytest.approx(0.00075)
    assert fetch_layer_from({0: [0.02], 1: [0.01]}, 2) == 0.0  # never below 0
    with pytest.raises(ValueError, match="paired"):
        fetch_layer_from({0: [0.01, 0.02], 1: [0.01]}, 2)


def test_one_call_where_the_hits_reads_cannot_win_back_a_second_call():
    # read 1 ms an expert, second call 3.5 ms: up to 3 hits make one call with the fetched experts
    costs = dataclasses.replace(COSTS, gpu_call_s=0.0035, fetch_layer_s=0.0)
    assert [one_call(h, 1000, costs) for h in (0, 3, 4)] == [True, True, False]
    assert not one_call(3, 1000, dataclasses.replace(costs, gpu_call_s=0.0))  # unmeasured: two calls, as before
    # 3 hits, 2 fetches: one call, 20 + 5 x 1 = 25 ms against two, max(3, 20) + 2 + 3.5 = 25.5
    assert gpu_side_s(3, 2, 1000, costs) == pytest.approx(0.025)
    assert gpu_side_s(4, 2, 1000, costs) == pytest.approx(0.020 + 0.002 + 0.0035)  # two calls
    # the floor takes whichever ends first, whatever the rule: 4 hits, 2 fetches: 3 + min(25.5, 26) ms
    assert timeline_s([_stats(hits=4, fetched=2)], 1000, costs, 0.003) == pytest.approx(0.0285)
    assert timeline_s([_stats(hits=3, fetched=2)], 1000, costs, 0.003) == pytest.approx(0.028)


def test_a_layer_computes_hits_and_fetches_in_one_call_where_one_call_says_so():
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2), backend="grouped_mm",
              router="torch")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    for call_s, want_calls in ((1.0, 1), (0.0, 2)):  # a second call dearer than any read / unmeasured
        costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=0.0, cpu_token_s=0.0, gpu_bytes_per_s=1e9,
                          gpu_call_s=call_s)
        off = OffloadedMoE.from_moe(moe, cache_experts=8, costs=costs)
        off(x)
        touched = sorted(off.cache.cached(off.layer_id))
        off.cache.evict(off.layer_id, touched[:2])
        calls, real = [], off._experts_fn

        def record(*args, expert_map, **kwargs):
            calls.append(sorted(i for i, s in enumerate(expert_map.tolist()) if s >= 0))
            return real(*args, expert_map=expert_map, **kwargs)

        off._experts_fn = record
        assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
        assert len(calls) == want_calls and sorted(sum(calls, [])) == touched
        assert off.last_stats.fetched == 2 and off.last_stats.hits == len(touched) - 2


def test_the_reference_stack_is_all_hits_and_sets_the_groups_fixed_cost(monkeypatch):
    """``run_cells(reference=True)``: the all-hit stack's timed steps (every touched expert a hit) feed
    ``fixed_from``, and its answer is the rows' fixed cost; the quiet one stays beside it."""
    from moekit.bench import offload_cells
    from moekit.offload.gpu_terms import FixedCosts
    from moekit.bench.offload_hosts import host_shells
    from moekit.offload import CpuOptions
    from moekit.routing import Routing
    from moekit.sim.cache import decode_stream

    config = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2)
    shells = host_shells(config, torch.float32, torch.device("cpu"), layers=2)
    data = decode_stream(8, 2, 2, 5, 3, 0.3, 0.3, seed=3)
    routings = [[Routing(r.topk_ids, r.topk_weights) for r in s] for s in data.routings[1:]]
    seen = []

    def fake_fixed_from(times, hits, layers, expert_bytes, costs):
        seen.append((list(times), list(hits), layers))
        return 0.0123

    monkeypatch.setattr(offload_cells, "fixed_from", fake_fixed_from)
    runs = [offload_cells.Run(0.5, 8, "lfu", False, "gpu")]
    rows = offload_cells.run_cells(shells, config, routings, data.trace, runs, 1, COSTS, torch.device("cpu"),
                                   CpuOptions(), FixedCosts(0.004, 0.001, 0.002), reference=True)
    (times, hits, layers), = seen
    touched = [sum(len(set(r.topk_ids.reshape(-1).tolist())) for r in per_layer) for per_layer in routings[1:]]
    assert layers == 2 and len(times) == len(routings) - 1 and hits == touched  # every touched expert hit
    assert rows[0]["fixed_ms"] == pytest.approx(12.3) and rows[0]["fixed_quiet_ms"] == pytest.approx(4.0)
    assert rows[0]["call_ms"] == pytest.approx(1.0) and rows[0]["fetch_layer_ms"] == pytest.approx(2.0)


def test_copies_start_overlap_s_before_the_fixed_work_ends_never_before_the_layer():
    fixed = 0.003
    # 5 hits, 3 fetches, overlap 2 ms: copies from 3 - 2 = 1 ms, land at 31; two calls: 31 + 3 + 0.5 = 34.5 ms
    # (one call: 31 + 8 = 39); at least 3 + 5 + 14 = 22
    assert timeline_s([_stats(hits=5, fetched=3)], 1000, COSTS, fixed, 0.002) == pytest.approx(0.0345)
    # an overlap longer than the fixed work is cut to it: copies from 0, land at 30 -> 33.5 ms
    assert timeline_s([_stats(hits=5, fetched=3)], 1000, COSTS, fixed, 0.010) == pytest.approx(0.0335)
    # no fetch: nothing changes (3 + 5 ms)
    assert timeline_s([_stats(hits=5)], 1000, COSTS, fixed, 0.002) == pytest.approx(0.008)


def test_overlap_from_is_the_median_link_time_a_layer_hid():
    link = 0.001  # a fetch's link time
    none, every, fetched = [0.010, 0.011, 0.010], [0.016, 0.016, 0.030], [8, 8, 8]  # 2 layers
    # per pair and layer: (8 x 1 - 6) / 2 = 1 ms, (8 - 5) / 2 = 1.5, (8 - 20) / 2 = -6 -> median 1 ms
    assert overlap_from(none, every, fetched, 2, link, most=0.004) == pytest.approx(0.001)
    assert overlap_from(none, every, fetched, 2, link, most=0.0005) == pytest.approx(0.0005)  # at most the fixed work
    assert overlap_from([0.01], [0.05], [8], 2, link, most=1.0) == 0.0  # never below 0
    with pytest.raises(ValueError, match="paired"):
        overlap_from([0.01], [0.05, 0.06], [8], 2, link, most=1.0)


def test_the_host_scaled_floor_scales_the_terms_measured_before_the_group_by_the_references_speed():
    """``offload_cells._floors``' last entry: a layer with 5 hits and one fetch, its fixed cost 4 ms among the
    cells against 2 ms measured quietly (the host at half speed), so the second call 0.5 -> 1 ms and
    fetch_layer_s 2 -> 4 ms: 4 + max(5 + 4, 10 + 1 + 1) = 16 ms against the plain floor's 4 + max(5 + 2,
    10 + 1 + 0.5) = 15.5; with a fetch layer of 9 ms (18 scaled): 4 + 5 + 9 = 18 against 4 + 5 + 18 = 27 ms."""
    from moekit.bench.offload_cells import _floors
    from moekit.offload.gpu_terms import FixedCosts

    done = [[_stats(hits=5, fetched=1)]]
    costs = dataclasses.replace(COSTS, fetch_layer_s=0.002)
    floors = _floors(done, 1000, costs, FixedCosts(0.004), quiet=0.002)
    assert floors[0][0] == pytest.approx(0.0155) and floors[0][4] == pytest.approx(0.016)
    costs = dataclasses.replace(COSTS, fetch_layer_s=0.009)
    floors = _floors(done, 1000, costs, FixedCosts(0.004), quiet=0.002)
    assert floors[0][0] == pytest.approx(0.018) and floors[0][4] == pytest.approx(0.027)


def test_the_branch_rate_floor_prices_the_cpu_side_at_the_runs_time_weighted_median_branch():
    """``offload_cells._floors``' first entry with a branch rate: one layer computing 2 one-row experts on the CPU
    (a 1 ms call + 2 ms an expert: 5 ms), fixed 4 ms: 4 + 1.5 x 5 = 11.5 ms at a branch rate of 1.5, the probe
    floor (last entry; no probe: the model) 4 + 5 = 9 ms, as the first entry without a rate; the rate is the
    median of the branches' ratios weighted by their modelled time (a stall of 9x moves it no more than any
    branch above the middle)."""
    from moekit.bench.offload_cells import _floors, branch_rate
    from moekit.offload.gpu_terms import FixedCosts

    costs = dataclasses.replace(COSTS, cpu_step_s=0.001, cpu_expert_s=0.002)
    done = [[OffloadStats(touched=2, cpu_experts=2, cpu_tokens=2, cpu_forwards=1, cpu_rows=(1, 1))]]
    floors = _floors(done, 1000, costs, FixedCosts(0.004), quiet=0.004, rate=1.5)
    assert floors[0][0] == pytest.approx(0.0115) and floors[0][8] == pytest.approx(0.009)  # the probe's: none here
    assert _floors(done, 1000, costs, FixedCosts(0.004), quiet=0.004)[0][0] == pytest.approx(0.009)
    assert branch_rate([(0.9, 1.0), (9.0, 1.0), (1.1, 1.0)]) == pytest.approx(1.1)  # a 9x stall moves it no further
    # half the time at <= 1.0
    assert branch_rate([(0.8, 1.0), (1.0, 1.0), (1.2, 1.0), (1.4, 1.0)]) == pytest.approx(1.0)
    # by time: a 4 s branch at 0.5 outweighs a 1 s one at 1.0 and a 1 s one at 3.0 (half of 6 s is at 0.5)
    assert branch_rate([(1.0, 1.0), (2.0, 4.0), (3.0, 1.0)]) == pytest.approx(0.5)
    # 2 s at 0.8, then 3 of 6 s at <= 1.0
    assert branch_rate([(1.0, 1.0), (1.6, 2.0), (6.0, 3.0)]) == pytest.approx(1.0)
    assert branch_rate([]) is None


def test_the_paired_floor_takes_each_steps_fixed_cost_from_its_all_hit_twin_in_the_same_round():
    """``offload_cells._floors``' first entry with ``paired``: two all-hit steps of one layer (1 hit, 1 ms of
    reads), the group's fixed cost 4 ms (the reference's median) but the twins' own 3 and 7 ms that round:
    floors 3 + 1 = 4 and 7 + 1 = 8 ms (mean 6); entry 9 keeps the group's cost, 5 and 5; without ``paired``
    both take the group's."""
    from moekit.bench.offload_cells import _floors
    from moekit.offload.gpu_terms import FixedCosts

    done = [[_stats(hits=1)], [_stats(hits=1)]]  # 1000 bytes at 1e6 B/s: 1 ms
    floors = _floors(done, 1000, COSTS, FixedCosts(0.004), quiet=0.004, paired=[0.003, 0.007])
    assert [f[0] for f in floors] == pytest.approx([0.004, 0.008])
    assert [f[9] for f in floors] == pytest.approx([0.005, 0.005])
    plain = _floors(done, 1000, COSTS, FixedCosts(0.004), quiet=0.004)
    assert [f[0] for f in plain] == [f[9] for f in plain] == pytest.approx([0.005, 0.005])

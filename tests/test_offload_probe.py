"""The floor's CPU side among a group's steps: ``offload_probe.CpuProbe`` (its alternation of link states,
its ratio of sums, its shape) with the branch timer replaced by a script, and ``offload_floor``'s blend of
the busy and idle CPU rates while a layer's copies travel, against hand-worked timelines. CPU only."""

from __future__ import annotations

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.bench import offload_probe
from moekit.bench.offload_floor import cpu_branch_s, timeline_s
from moekit.bench.offload_probe import CpuProbe, probe_shape
from moekit.offload import MissCosts, OffloadedMoE, OffloadStats

COSTS = MissCosts(link_bytes_per_s=1e5, cpu_expert_s=0.004, cpu_token_s=0.0, cpu_step_s=0.002, gpu_bytes_per_s=1e6)


def _stats(hits=0, fetched=0, cpu_rows=(), admitted=0) -> OffloadStats:
    return OffloadStats(touched=hits + fetched + len(cpu_rows), hits=hits, fetched=fetched, cpu_experts=len(cpu_rows),
                        cpu_tokens=sum(cpu_rows), cpu_rows=tuple(cpu_rows), admitted=admitted)


def test_a_cpu_branch_runs_at_the_busy_rate_while_copies_travel_and_the_idle_rate_after():
    idle = COSTS.scaled(0.5)
    s = _stats(cpu_rows=(1, 1, 1))  # busy model: 2 + 3 x 4 = 14 ms; idle: 7 ms
    assert cpu_branch_s(s, COSTS, None, 0.005) == pytest.approx(0.014)
    assert cpu_branch_s(s, COSTS, idle, 0.0) == pytest.approx(0.007)
    assert cpu_branch_s(s, COSTS, idle, -0.003) == pytest.approx(0.007)  # the link went idle before it started
    assert cpu_branch_s(s, COSTS, idle, 0.020) == pytest.approx(0.014)  # busy throughout
    # 4 ms busy: 4/14 of its work done, the other 10/14 at the idle rate: 4 + 7 x 10 / 14 = 9 ms
    assert cpu_branch_s(s, COSTS, idle, 0.004) == pytest.approx(0.009)


def test_the_timeline_blends_by_the_layers_own_admissions_on_the_link():
    idle = COSTS.scaled(0.5)
    # fixed 3 ms; 2 admissions of 10 ms each queued before the CPU branch (no issue time): the link is
    # busy 20 ms from the layer's fixed work on; CPU busy model 2 + 3 x 4 = 14 ms < 20: busy throughout
    many = _stats(hits=1, cpu_rows=(1, 1, 1), admitted=2)
    assert timeline_s([many], 1000, COSTS, 0.003, idle=idle) == pytest.approx(0.003 + 0.020)  # the link ends last
    one = _stats(hits=1, cpu_rows=(1, 1, 1), admitted=1)  # 10 ms busy, then 4 ms of busy work at the idle rate
    want = 0.003 + 0.010 + 0.5 * (0.014 - 0.010)
    assert timeline_s([one], 1000, COSTS, 0.003, idle=idle) == pytest.approx(want)
    assert timeline_s([one], 1000, COSTS, 0.003) == pytest.approx(0.003 + 0.014)  # no idle model: busy throughout
    none = _stats(hits=1, cpu_rows=(1, 1, 1))
    assert timeline_s([none], 1000, COSTS, 0.003, idle=idle) == pytest.approx(0.003 + 0.007)


def _layer() -> OffloadedMoE:
    config = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=12, top_k=2)
    moe = MoE(config, dtype=torch.float32, device="cpu", fuse_shared=False)
    return OffloadedMoE.from_moe(moe, cache_experts=1, prefetch=None)


def test_the_probe_alternates_link_states_and_scales_by_a_ratio_of_sums(monkeypatch):
    calls, script = [], iter([0.010, 0.030, 0.020, 0.050])  # steps 1-4: busy, idle, busy, idle
    monkeypatch.setattr(offload_probe, "branch", lambda layer, group, experts, m, threads, gemm, busy, rows:
                        calls.append((tuple(group), experts, rows[0], busy)) or next(script))
    probe = CpuProbe(_layer(), COSTS, experts=3, rows=2, start=1)
    for step in range(1, 5):
        probe.run(step)
    model = COSTS.cpu_side_s([2, 2, 2])  # 14 ms a call
    assert [busy for *_, busy in calls] == [True, False, True, False]  # odd steps busy
    assert probe.scale("busy") == pytest.approx((0.010 + 0.020) / (2 * model))
    assert probe.scale("idle") == pytest.approx((0.030 + 0.050) / (2 * model))
    groups = [set(g) for g, *_ in calls]
    assert all(len(g) == 3 and n == 3 and m == 2 for g, (_, n, m, _b) in zip(groups, calls))  # max(3, k = 2) experts
    assert all(not (a & b) for a, b in zip(groups, groups[1:]))  # cold: consecutive calls share no expert
    busy, idle = probe.floor_costs()
    assert busy.cpu_step_s == pytest.approx(COSTS.cpu_step_s * probe.scale("busy"))
    assert idle.cpu_expert_s == pytest.approx(COSTS.cpu_expert_s * probe.scale("idle"))
    assert busy.link_bytes_per_s == COSTS.link_bytes_per_s  # only the CPU side moves
    assert probe.summary() == {"probe_busy": probe.scale("busy"), "probe_idle": probe.scale("idle"), "probes": 4,
                               "probe_shape": "3x2"}


def test_a_probe_with_one_state_prices_both_by_it_and_none_leaves_the_costs(monkeypatch):
    monkeypatch.setattr(offload_probe, "branch", lambda *a, **k: 0.028)
    probe = CpuProbe(_layer(), COSTS, experts=1, rows=1)
    assert probe.floor_costs() == (COSTS, None)
    probe.run(1)  # busy only: 28 ms against 6 ms
    busy, idle = probe.floor_costs()
    assert busy == idle == COSTS.scaled(0.028 / 0.006)
    probe.run(3, [2, 1, 5])  # the run's own branch: 28 ms against 2 + 3 x 4 = 14 ms
    assert probe.scale("busy") == pytest.approx(2 * 0.028 / (0.006 + 0.014))
    with pytest.raises(ValueError, match="experts >= 1"):
        CpuProbe(_layer(), COSTS, experts=0, rows=1)


def test_the_probe_shape_is_a_forwards_mean_cpu_work():
    assert probe_shape(cpu_experts=30, cpu_tokens=90, forwards=10) == (3, 3)  # 10 branches of 3 experts, 3 rows each
    assert probe_shape(cpu_experts=3, cpu_tokens=3, forwards=10) == (1, 1)  # at least one expert of one row
    assert probe_shape(cpu_experts=0, cpu_tokens=0, forwards=10) == (1, 1)


def test_each_cpu_computing_run_gets_a_probe_shaped_as_its_replayed_branches():
    from moekit.bench.offload_cells import Run
    from moekit.bench.offload_measure import _cpu_probes
    from moekit.offload.whatif import replay
    from moekit.sim.cache import decode_stream

    layer = _layer()
    trace = decode_stream(12, 2, 2, 9, 4, 0.3, 0.3, seed=1).trace
    cheap = MissCosts(link_bytes_per_s=1e3, cpu_expert_s=1e-9, cpu_token_s=0.0)  # "auto" sends misses to the CPU
    runs = [Run(0.25, 6, "lfu", False, place) for place in ("gpu", "cpu", "auto")]
    probes = _cpu_probes(layer, runs, cheap, trace, warm=3, start=0)
    assert sorted(probes) == [1, 2]  # the gpu run computes nothing on the CPU
    for j, probe in probes.items():
        done = replay(trace, 6, "lfu", None, place=runs[j].place, costs=cheap, expert_bytes=layer.cache.expert_bytes,
                      measure_from=4)
        assert done.cpu_forwards > 0
        assert (probe.experts, probe.rows) == (max(1, round(done.cpu_experts / done.cpu_forwards)),
                                               max(1, round(done.cpu_tokens / done.cpu_experts)))
        assert probe.costs is cheap


def test_a_branch_by_rows_routes_each_cpu_expert_its_own_rows():
    from moekit.offload.calibrate import branch

    layer = _layer()
    seconds = branch(layer, [4, 7, 9, 1], 3, 1, None, "mm_loop", busy=False, rows=[2, 1, 3])
    phases = layer.last_cpu
    assert seconds == phases.total_s > 0 and (phases.experts, phases.tokens) == (3, 6)
    with pytest.raises(ValueError, match="rows must hold 3"):
        branch(layer, [4, 7, 9, 1], 3, 1, None, "mm_loop", busy=False, rows=[2, 1])

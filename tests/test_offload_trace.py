"""A step's timeline (``moekit.offload.StepTrace``) on the CPU: the marks a forward records, in the order
its work runs, with the groups and copies it really made (read from the cache's counts, not the trace)."""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.offload.gpu_terms import measure_forced
from moekit.bench.offload_timeline import fit_steps, host_op_costs, layer_times, mean_times
from moekit.offload import ExpertCache, Mark, OffloadedMoE, OffloadStats, StepTrace
from moekit.offload.trace import spans
from moekit.routing import route

E, K, N = 8, 32, 16


def _layer(slots: int, place: str = "gpu") -> OffloadedMoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
              router="torch")
    return OffloadedMoE.from_moe(moe, cache_experts=slots, compute_misses_on=place, admit_per_forward=0)


def _names(marks: list[Mark]) -> list[str]:
    return [m.name for m in marks]


def test_a_forward_with_hits_and_fetches_marks_its_phases_in_order():
    off = _layer(slots=8)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    off(x)  # every touched expert cached now
    touched = sorted(off.cache.cached(off.layer_id))
    drop = touched[:2]
    off.cache.evict(off.layer_id, drop)  # two misses next time
    off.cache.trace = trace = StepTrace("cpu")
    off(x)
    marks = trace.read()
    assert off.last_stats.fetched == 2 and off.last_stats.hits == len(touched) - 2
    assert _names(marks) == ["start", "counted", "touched", "copy_start:fetch", "copy_end:fetch", "call_start:hits",
                             "call_end:hits", "call_start:fetched", "call_end:fetched", "end"]
    assert all(m.layer == off.layer_id and m.gpu_s is None for m in marks)
    hosts = [m.host_s for m in marks]
    assert hosts[0] == 0.0 and hosts == sorted(hosts)
    assert len(spans(marks, "call_start:hits", "call_end:hits", gpu=False)) == 1
    assert trace.read() == []  # read starts afresh
    off.cache.trace = None
    off(x)
    assert trace.read() == []  # untraced: nothing recorded


def test_cpu_misses_mark_the_cpu_branch_and_no_fetch():
    off = _layer(slots=8, place="cpu")
    off.cache.trace = trace = StepTrace("cpu")
    off(torch.randn(3, K, generator=torch.Generator().manual_seed(2)))
    names = _names(trace.read())
    assert off.last_stats.cpu_experts > 0 and off.last_stats.fetched == 0
    assert "cpu_start" in names and names.index("cpu_start") < names.index("cpu_end") < names.index("end")
    assert not any(n.startswith("copy_") for n in names)


def test_spans_pair_each_start_with_the_next_end_of_its_layer():
    marks = [Mark("a", 0, 0.0, 1.0), Mark("a", 1, 0.5, 2.0), Mark("b", 1, 1.0, 4.5), Mark("b", 0, 2.0, 3.0),
             Mark("b", 0, 3.0, 9.0), Mark("a", 0, 4.0, None)]
    assert spans(marks, "a", "b") == [2.5, 2.0]
    assert spans(marks, "a", "b", gpu=False) == [0.5, 2.0]


def test_evict_drops_only_unprotected_cached_experts():
    cache = ExpertCache(4, device="cpu")
    layer = cache.register(torch.randn(E, 2 * N, K), torch.randn(E, K, N))
    stats = OffloadStats()
    cache.ensure(layer, [1, 2, 3], stats)
    cache.release(layer, [1, 2])
    assert cache.evict(layer, [1, 3, 5]) == [1]  # 3 is in use by a forward, 5 is not cached
    assert sorted(cache.cached(layer)) == [2, 3]
    assert cache.free_slots() == 3  # 1's slot free again, 2 unprotected, 3 protected


def test_layer_times_reads_phases_from_marks_on_aligned_clocks():
    """Two layers, hand-placed marks: the host clock runs 10 s ahead of the GPU's at the "touched" marks."""
    def m(name, layer, host, gpu):
        return Mark(name, layer, host, gpu)

    marks = [m("start", 0, 0.0, 0.0), m("counted", 0, 1.0, 0.5), m("touched", 0, 12.0, 2.0),
             m("copy_start:fetch", 0, 13.0, 3.5), m("copy_end:fetch", 0, 13.5, 7.0),
             m("call_start:hits", 0, 14.0, 4.0), m("call_end:hits", 0, 14.2, 4.5),
             m("call_start:fetched", 0, 14.5, 7.25), m("call_end:fetched", 0, 15.0, 8.0), m("end", 0, 15.5, 8.1),
             m("start", 1, 16.0, 8.2), m("counted", 1, 16.5, 8.3), m("touched", 1, 19.0, 9.0),
             m("call_start:hits", 1, 19.5, 9.1), m("call_end:hits", 1, 19.7, 9.4), m("end", 1, 20.0, 9.5),
             m("step_end", -1, 21.0, 9.6)]
    first, second = layer_times(marks, {0: 2})
    assert (first.fetched, second.fetched) == (2, 0)
    assert first.period_s == 16.0 and second.period_s == 5.0
    assert first.d2h_wait_s == 11.0 and second.d2h_wait_s == 2.5
    assert first.host_busy_s == 5.0 and second.host_busy_s == 2.5
    assert first.wait_after_s == 2.5 and second.wait_after_s == 1.0  # the next layer's wait; the final sync
    assert first.host_before_copy_s == 1.0 and first.copy_issue_s == 0.5
    assert first.copy_lag_s == 3.5 + 10.0 - 13.0  # the median offset of (10, 10)
    assert first.copy_s == 3.5 and first.land_to_call_s == 0.25
    assert first.hits_call_s == 0.5 and first.fetched_call_s == 0.75 and first.host_tail_s == 0.5
    assert (math.isnan(second.copy_s) and second.hits_call_s == pytest.approx(0.3)
            and second.host_tail_s == pytest.approx(0.3))
    means = mean_times([first, second])
    assert means["layers"] == 2 and means["period_s"] == 10.5 and means["copy_s"] == 3.5


def test_fit_steps_recovers_terms_of_a_linear_model():
    fetches, layers_with = [0, 1, 2, 4, 6, 3], [0, 1, 1, 2, 4, 3]
    target = [4 * 0.25e-3 + f * 0.1e-3 + g * 0.3e-3 for f, g in zip(fetches, layers_with)]
    fit = fit_steps(target, {"per_layer": [4] * 6, "fetches": fetches, "fetch_layers": layers_with})
    assert fit.terms_s == pytest.approx((0.25e-3, 0.1e-3, 0.3e-3), rel=1e-9) and fit.rms_s < 1e-12
    assert all(math.isnan(t) for t in fit_steps([1.0], {"a": [1.0], "b": [2.0]}).terms_s)
    assert host_op_costs(torch.device("cpu")) == {}  # CUDA steps only


def test_measure_forced_fetches_exactly_k_in_every_layer():
    layers = []
    cache = ExpertCache(2 * E, device="cpu")
    for seed in range(2):
        torch.manual_seed(seed)
        moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
                  router="torch")
        layers.append(OffloadedMoE.from_moe(moe, cache=cache, prefetch=None))
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(3))
    steps = [[route(layer.gate(x), layer.config) for layer in layers] for _ in range(2)]
    before = cache.stats.fetched
    times = measure_forced(layers, x, steps, counts=(0, 1, 2), repeats=1)
    assert sorted(times) == [0, 1, 2] and all(len(v) == 2 and min(v) > 0 for v in times.values())
    touched = [len(set(r.topk_ids.reshape(-1).tolist())) for r in steps[0]]
    # the untimed pass fetches each layer's touched set once (both steps route alike: the second hits);
    # then every timed step fetches min(k, touched) in each layer, for k = 0, 1, 2
    forced = sum(2 * sum(min(k, t) for t in touched) for k in (0, 1, 2))
    assert cache.stats.fetched - before == sum(touched) + forced

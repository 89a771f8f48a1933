"""A step's timeline (``moekit.offload.StepTrace``) on the CPU: the marks a forward records, in the order
its work runs, with the groups and copies it really made (read from the cache's counts, not the trace)."""

from __future__ import annotations

import torch

from moekit import MoE, MoEConfig
from moekit.offload import ExpertCache, Mark, OffloadedMoE, OffloadStats, StepTrace
from moekit.offload.trace import spans

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

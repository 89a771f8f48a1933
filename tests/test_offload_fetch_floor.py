"""The least a forward with a fetch takes (``MissCosts.fetch_layer_s`` / ``FixedCosts.fetch_layer_s``): in the
floor's timeline, in "auto"'s GPU side, and measured from forced-fetch timings. Hand-worked numbers; CPU only."""

from __future__ import annotations

import pytest

from moekit.bench.offload_floor import fetch_layer_from, timeline_s
from moekit.offload import MissCosts, OffloadStats, gpu_only
from moekit.offload.cost import gpu_side_s

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

"""The expert-parallel what-if on moekit.parallel.placement, under the stated cost model."""

import pytest

from moekit.sim.ep import ep_what_if
from moekit.sim.shape import seconds_per_assignment


def test_two_x_imbalance_loses_half_the_throughput():
    loads = [3.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # contiguous GPU loads 3, 1, 1, 1: max/mean = 2
    report = ep_what_if(loads, gpus=4, spare_slots=0)
    contiguous = report.placements[0]
    assert contiguous.gpu_loads == [3.0, 1.0, 1.0, 1.0]
    assert contiguous.imbalance == pytest.approx(2.0)
    assert contiguous.throughput_lost == pytest.approx(0.5)
    assert contiguous.step_time_us == pytest.approx(3.0 * seconds_per_assignment() * 1e6)
    assert contiguous.balanced_time_us == pytest.approx(1.5 * seconds_per_assignment() * 1e6)


def test_replicating_the_hot_expert_recovers_throughput():
    loads = [30.0] + [2.0] * 15
    report = ep_what_if(loads, gpus=4, spare_slots=3)
    names = [p.name for p in report.placements]
    assert names == ["contiguous", "round-robin", "eplb"]
    eplb = report.placements[2]
    assert sum(len(s) for s in eplb.slots) == 16 + 3
    assert sum(eplb.gpu_loads) == pytest.approx(sum(loads))
    assert eplb.throughput_lost < report.placements[0].throughput_lost
    assert report.replication_gain == pytest.approx(report.placements[0].step_time_us / eplb.step_time_us)
    assert report.replication_gain > 1.5


def test_one_gpu_is_always_balanced():
    report = ep_what_if([5.0, 0.0, 1.0], gpus=1, spare_slots=0)
    assert all(p.throughput_lost == 0.0 for p in report.placements)

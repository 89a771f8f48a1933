"""The CPU branch of ``OffloadedMoE`` (``moekit.offload.cpu_path``): its options keep the plain layer's
output, its phases describe what it computed, its staging buffers are reused, and admissions queued
before or after the CPU compute leave the cache in the same state. CPU only: both "devices" are the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.experts import cpu_loop
from moekit.offload import CpuOptions, CpuPhases, MissCosts, OffloadedMoE
from moekit.offload import staging
from moekit.offload.calibrate import most_threads, thread_candidates
from moekit.offload.cpu_path import CPU_GEMMS, torch_threads

from _helpers import TOLERANCE, rel_l2

E, K, N = 8, 32, 16


def _moe() -> MoE:
    torch.manual_seed(0)
    return MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
               router="torch")


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("options", [CpuOptions(gemm="onednn_fused"), CpuOptions.baseline()])
def test_all_misses_on_the_cpu_equal_the_plain_layer_exactly(options, monkeypatch):
    # a cold cache: every expert runs in the CPU branch, one partial, the plain layer's own CPU loop
    # (grouped_mm's per-expert oneDNN loop; <= 3 rows per expert, so neither packs its weights). The plain
    # layer's auto would take BLAS for those experts on an Intel CPU (blas_plain_rows; phased_blas_rows where it times
    # its decode loops, cpu_split_choice): held to oneDNN here
    monkeypatch.setattr(cpu_loop, "blas_plain_rows", lambda dtype: False)
    monkeypatch.setattr(cpu_loop, "phased_blas_rows", lambda dtype: False)
    moe = _moe()
    off = OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on="cpu", cpu_options=options)
    x = _x(3, 0)
    with torch.no_grad():  # inference: the plain layer's CPU experts run the per-expert loop too
        assert torch.equal(off(x), moe(x))
    assert off.last_stats.hits == 0 and off.last_stats.cpu_experts == off.last_stats.touched


@pytest.mark.parametrize("options", [CpuOptions(threads=1), CpuOptions(gemm="mm_loop"), CpuOptions(gemm="onednn_fused"),
                                     CpuOptions.baseline(),
                                     CpuOptions(admit_early=False)])
@pytest.mark.parametrize("place", ["cpu", "auto"])
def test_cpu_options_keep_the_plain_layers_output(options, place):
    moe = _moe()
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6)  # "auto" mixes the two
    off = OffloadedMoE.from_moe(moe, cache_experts=3, compute_misses_on=place, costs=costs, cpu_options=options)
    for seed in range(3):  # warm caches: hits on the "GPU", misses on the CPU, partial sums
        x = _x(11, seed)
        assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert off.cache.stats.cpu_experts > 0 and off.cpu_options == options


def test_phases_describe_the_forwards_cpu_work():
    before = torch.get_num_threads()
    off = OffloadedMoE.from_moe(_moe(), cache_experts=2, compute_misses_on="cpu", cpu_options=CpuOptions(threads=1))
    off(_x(7, 0))
    phases, stats = off.last_cpu, off.last_stats
    assert isinstance(phases, CpuPhases) and phases.threads == 1
    assert (phases.experts, phases.tokens) == (stats.cpu_experts, stats.cpu_tokens) and stats.cpu_tokens > 0
    assert phases.compute_s > 0 and phases.total_s == pytest.approx(
        phases.stage_s + phases.wait_s + phases.compute_s + phases.back_s)
    assert torch.get_num_threads() == before  # the thread count is restored after the compute
    gpu = OffloadedMoE.from_moe(_moe(), cache_experts=8, compute_misses_on="gpu")
    gpu(_x(7, 0))
    assert gpu.last_cpu is None


def test_admissions_before_or_after_the_cpu_compute_leave_the_same_cache():
    layers = [OffloadedMoE.from_moe(_moe(), cache_experts=3, compute_misses_on="cpu", admit_per_forward=2,
                                    cpu_options=CpuOptions(admit_early=early)) for early in (True, False)]
    for seed in range(4):
        x = _x(9, seed)
        outs = [layer(x) for layer in layers]
        assert torch.equal(outs[0], outs[1])
        assert layers[0].last_stats == layers[1].last_stats
        assert layers[0].cache.cached(0) == layers[1].cache.cached(0)
    assert layers[0].cache.stats.admitted > 0


def test_staging_buffers_and_views_are_kept_and_grown():
    buffers = staging.Buffers(pin=False)
    x, ids = torch.randn(4, 6), torch.randint(0, 5, (4, 2), dtype=torch.int32)
    (a, b), _ = staging.to_host([x, ids], pin=False, buffers=buffers)
    (c, d), _ = staging.to_host([x * 2, ids + 1], pin=False, buffers=buffers)
    assert c is a and d is b  # the same views for the same shapes: no tensor made
    assert torch.equal(c, x * 2) and torch.equal(d, ids + 1)
    (e, f), _ = staging.to_host([x[:1], ids[:1]], pin=False, buffers=buffers)  # other shapes, same buffer
    assert e.data_ptr() == a.data_ptr() and torch.equal(e, x[:1]) and torch.equal(f, ids[:1])
    (g, _), _ = staging.to_host([torch.randn(64, 6), ids], pin=False, buffers=buffers)  # grown: new views
    assert g.data_ptr() != a.data_ptr()
    assert e.data_ptr() == a.data_ptr() and torch.equal(e, x[:1])  # the old views still read the old buffer
    y = torch.randn(3, 6).to(torch.bfloat16)
    assert buffers.result_view(y) is buffers.result_view(y) and buffers.result_view(y).dtype == torch.bfloat16


def test_options_and_thread_candidates():
    with pytest.raises(ValueError, match="threads"):
        CpuOptions(threads=0)
    with pytest.raises(ValueError, match="gemm"):
        CpuOptions(gemm="blas")
    with pytest.raises(TypeError, match="cpu_options"):
        OffloadedMoE.from_moe(_moe(), cache_experts=2, cpu_options={"threads": 2})
    assert thread_candidates(3) == [3]
    n = torch.get_num_threads()
    top = min(max(n, len(os.sched_getaffinity(0))), 2 * n)
    assert most_threads() == top and thread_candidates(None) == [max(1, top // 2)]  # half the CPUs left to the host
    with torch_threads(1) as used:
        assert used == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def test_measured_costs_carry_their_thread_count_and_a_margin():
    off = OffloadedMoE.from_moe(_moe(), cache_experts=2, compute_misses_on="auto")
    costs = off.measure_costs(tokens=4, repeats=2)
    assert costs.cpu_threads in thread_candidates(None) and costs.cpu_gemm in CPU_GEMMS and costs.cpu_margin >= 1.0
    assert costs.cpu_step_s >= 0 and costs.cpu_expert_s >= 0 and costs.cpu_token_s >= 0
    with pytest.raises(ValueError, match="tokens"):
        off.measure_costs(tokens=1)


def test_pick_setting_takes_the_fewest_threads_within_tolerance_of_the_best_mean():
    from moekit.offload.calibrate import pick_setting

    steady = [3.0, 3.1, 3.0, 3.2, 3.0, 3.1]  # 8 threads: no outlier
    spiky = [2.9, 2.9, 17.7, 2.9, 3.0, 2.9]  # 16: a lower median, one team stall
    assert pick_setting({(16, "g"): spiky, (8, "g"): steady}) == (8, "g")
    assert pick_setting({(16, "g"): [2.0] * 6, (8, "g"): [3.0] * 6}) == (16, "g")  # clearly faster: kept
    assert pick_setting({(16, "g"): [3.0] * 6, (8, "g"): [3.1] * 6}) == (8, "g")  # within 5%: fewer threads
    assert pick_setting({(8, "a"): [3.0] * 6, (8, "b"): [2.0] * 6}) == (8, "b")
    with pytest.raises(ValueError, match="timings"):
        pick_setting({})

"""The CPU branch's "direct" experts (``moekit.offload.cpu_direct``): the chosen experts' share of the experts
contract against a float64 loop written here, through an offloaded layer against the plain layer, and its
clear errors. CPU only: both "devices" are the CPU."""

from __future__ import annotations

import pytest
import torch

from moekit import MoE, MoEConfig
from moekit.offload import CpuOptions, MissCosts, OffloadedMoE
from moekit.offload.calibrate import cpu_gemms
from moekit.offload.cpu_direct import experts_direct
from moekit.offload.cpu_path import CpuPath, unmeasured_gemm

from _helpers import TOLERANCE, experts_loop, make_problem, rel_l2

E, K, N = 8, 32, 16


def _share_loop(x, w13, w2, ids, weights, experts, b13=None, b2=None) -> torch.Tensor:
    """float64 (``_helpers.experts_loop``): out[t] = sum_j w[t, j] (w2[e] @ (silu(g) * u) + b2[e]) over the slots
    routed to ``experts`` (a map keeping those ids, -1 for the others)."""
    share = torch.tensor([e if e in experts else -1 for e in range(w13.shape[0])], dtype=torch.int32)  # [E]
    return experts_loop(x, w13, w2, ids, weights, share, b13=b13, b2=b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 12])
@pytest.mark.parametrize("bias", [False, True])
def test_direct_share_equals_the_float64_loop(dtype, m, bias):
    p = make_problem(m, 3, E, K, N, dtype, seed=m, skips=True)  # -1 slots contribute nothing
    g = torch.Generator().manual_seed(7)
    b13 = torch.randn(E, 2 * N, generator=g).to(dtype) if bias else None
    b2 = torch.randn(E, K, generator=g).to(dtype) if bias else None
    experts = [1, 2, 5, 6]  # a subset: the other experts' slots are someone else's share
    got = experts_direct(p.x, p.w13, p.w2, p.ids, p.weights, experts, b13=b13, b2=b2)
    want = _share_loop(p.x, p.w13, p.w2, p.ids, p.weights, set(experts), b13, b2)
    assert got.dtype == dtype and got.shape == p.x.shape
    assert rel_l2(got, want) < TOLERANCE[dtype]


def test_an_expert_in_two_slots_of_a_token_adds_twice_and_no_experts_give_zeros():
    p = make_problem(2, 2, E, K, N)
    ids = torch.tensor([[3, 3], [3, 4]], dtype=torch.int32)
    got = experts_direct(p.x, p.w13, p.w2, ids, p.weights, [3])
    assert rel_l2(got, _share_loop(p.x, p.w13, p.w2, ids, p.weights, {3})) < TOLERANCE[torch.float32]
    assert torch.equal(experts_direct(p.x, p.w13, p.w2, ids, p.weights, []), torch.zeros_like(p.x))


def test_direct_rejects_bad_input():
    p = make_problem(2, 2, E, K, N)
    with pytest.raises(ValueError, match="experts must be in"):
        experts_direct(p.x, p.w13, p.w2, p.ids, p.weights, [E])
    with pytest.raises(ValueError, match="topk_weights"):
        experts_direct(p.x, p.w13, p.w2, p.ids, p.weights[:, :1], [0])
    with pytest.raises(TypeError, match="float weight tensors"):
        experts_direct(p.x, None, p.w2, p.ids, p.weights, [0])


def _moe(seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    return MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2), backend="grouped_mm",
               router="torch")


@pytest.mark.parametrize("place", ["cpu", "auto"])
def test_an_offloaded_layer_with_direct_cpu_experts_keeps_the_plain_output(place):
    moe = _moe()
    costs = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=1e-6, cpu_token_s=2e-6)  # "auto" mixes the two
    off = OffloadedMoE.from_moe(moe, cache_experts=3, compute_misses_on=place, costs=costs,
                                cpu_options=CpuOptions(gemm="direct"))
    for seed in range(4):  # warm caches: hits on the "GPU", misses on the CPU, partial sums
        x = torch.randn(5, K, generator=torch.Generator().manual_seed(seed))
        assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert off.cache.stats.cpu_experts > 0


def test_direct_is_for_float_host_weights_only():
    moe = _moe().quantize_("int8_w8a16")
    off = OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on="cpu", cpu_options=CpuOptions(gemm="direct"))
    with pytest.raises(ValueError, match="'direct' reads float host weights"):
        off(torch.randn(3, K))
    assert "direct" not in cpu_gemms(off)  # the calibration never tries it there
    plain = OffloadedMoE.from_moe(_moe(), cache_experts=2, compute_misses_on="cpu")
    assert cpu_gemms(plain)[-1] == "direct"


def test_direct_is_the_cpu_gemm_where_nothing_measured_one_for_float_weights():
    path = CpuPath(CpuOptions(), torch.device("cpu"))
    assert path.setting(None) == (None, "direct") and unmeasured_gemm(quantized=False) == "direct"
    assert path.setting(None, quantized=True) == (None, "onednn_fused")
    measured = MissCosts(link_bytes_per_s=1e9, cpu_expert_s=0.0, cpu_token_s=0.0, cpu_threads=3, cpu_gemm="mm_loop")
    assert path.setting(measured) == (3, "mm_loop")  # measured costs name theirs
    assert CpuPath(CpuOptions(gemm="onednn_fused"), torch.device("cpu")).setting(measured)[1] == "onednn_fused"
    moe = _moe()  # a cold cache of 2, no costs: every forward's misses take direct, the plain layer's output
    off = OffloadedMoE.from_moe(moe, cache_experts=2, compute_misses_on="cpu")
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert rel_l2(off(x), moe(x)) < TOLERANCE[torch.float32]
    assert off.last_stats.cpu_experts > 0
    quantized = OffloadedMoE.from_moe(_moe().quantize_("int8_w8a16"), cache_experts=2, compute_misses_on="cpu")
    assert quantized(x).shape == x.shape  # no costs: grouped_mm's loop, not direct's error

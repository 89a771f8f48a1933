"""The whole layer on seeded random configs (``_fuzz_cases``: every router option, shared / identity / input-weighted
experts, biases, activations, capacity, fused or separate shared MLP, the fused router, quantized experts, exact ties,
M = 0, 1 and odd, float32 / bfloat16 / float64 / float16) through ``reference``, ``grouped_mm`` (random ``cpu_gemm``,
layout, memory budget) and ``triton`` (interpreted: TRITON_INTERPRET=1) against the float64 loop of
``_fuzz_reference`` (``_fuzz_check``: output rel L2 per dtype of plain, stats, repeated 3-D, strided-x and autograd
calls, ids bit for bit, counts, drops; every refusal names its argument).

A failure prints the seed and the case; ``python3 benchmarks/fuzz_layer.py --seeds S:S+1`` reruns it alone. Longer
runs: ``benchmarks/fuzz_layer.py --seeds 0:5000``. The reference itself is held to closed forms here, and the checks
are shown to fail on a layer that is off by 0.1%.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from _fuzz_cases import draw_case
from _fuzz_check import check_case
from _fuzz_reference import LayerWeights, TokenRoute, capacity_keep, reference_moe, route_token
from _triton_helpers import router_and_experts_interpreted  # noqa: F401 (autouse: the kernels interpreted)
from moekit import MoE, MoEConfig

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

SEEDS = range(40)  # every option reached (the test below; range(35) misses a scheme); 50 took 25% longer


@pytest.mark.parametrize("seed", SEEDS)
def test_layer_matches_the_float64_loop(seed):
    case = draw_case(seed)
    outcome = check_case(case)
    assert not outcome.failures, f"{case.describe()}\n" + "\n".join(outcome.failures)


def test_the_seeds_reach_every_option():
    """The fixed seeds draw each option off its default, every dtype, scheme, layer option and backend path at least
    once, and meet refusals (each checked to name its field): else the test above tests less than it says."""
    cases = [draw_case(seed) for seed in SEEDS]
    changed = {name for c in cases for name, value in c.fields.items()
               if value != MoEConfig.__dataclass_fields__[name].default}
    for name in ("scoring", "renormalize", "routed_scaling_factor", "n_group", "use_correction_bias",
                 "correction_bias_on", "group_score", "dropped_group_fill", "router_logit_softcap",
                 "sparsemixer_jitter_eps", "shared_expert_intermediate_size", "shared_expert_gate",
                 "shared_expert_combine", "num_identity_experts", "expert_weight_on", "activation", "router_bias",
                 "expert_bias", "nonfinite", "router_dtype", "renorm_eps"):
        assert name in changed, name
    assert {c.dtype for c in cases} == {torch.float32, torch.bfloat16, torch.float64, torch.float16}
    assert {c.scheme for c in cases} >= {None, "fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4"}
    assert {c.m for c in cases} >= {0, 1, 7} and any(c.capacity_factor for c in cases)
    assert {c.router for c in cases} == {"torch", "fused"} and any(c.nan_gate_rows for c in cases)
    assert any(c.fuse_shared and c.config.num_shared_slots for c in cases)
    refusals = [r for c in cases for r in c.refusals]
    assert refusals and all(r.names_a_field() for r in refusals)


def test_the_seeds_reach_the_newest_options():
    """Sessions 45-49's options (``_fuzz_newest``), each where it computes something: sqrt(softplus) scoring (with the
    torch and the fused router), the renorm clamp on renormalised weights (both routers), the clamp after the
    activation, and a shared MLP's own activation on a separate MLP."""
    cases = [draw_case(seed) for seed in SEEDS]
    cfgs = [c.config for c in cases]
    assert {c.router for c, cfg in zip(cases, cfgs) if cfg.scoring == "sqrtsoftplus"} == {"torch", "fused"}
    assert {c.router for c, cfg in zip(cases, cfgs) if cfg.renorm_clamp and cfg.renormalize} == {"torch", "fused"}
    assert {cfg.renorm_clamp for cfg in cfgs} >= {0.9, 3.0}
    assert sum(not isinstance(cfg.activation, str) and cfg.activation.limit_after_act for cfg in cfgs) >= 3
    assert any(cfg.shared_activation is not None and cfg.shared_mlp_activation != cfg.activation for cfg in cfgs)


def test_the_checks_fail_on_a_layer_off_by_a_little(monkeypatch):
    """Every routed weight 0.1% too large: every float32 case routed through ``route``'s weights fails (the checks
    can fail; sparsemixer, Inkling and fp8 weight elsewhere or more loosely, capacity may leave a case out)."""
    route_module = importlib.import_module("moekit.routing.route")
    real = route_module._weights
    monkeypatch.setattr(route_module, "_weights", lambda *args: real(*args) * 1.001)
    cases = [c for c in map(draw_case, range(200)) if c.dtype == torch.float32 and c.router == "torch" and c.m
             and c.scheme != "fp8_block" and c.config.sparsemixer_jitter_eps is None  # weighted elsewhere
             and c.config.shared_expert_combine != "router" and c.capacity_factor is None]
    failing = [c.seed for c in cases if check_case(c, ("reference",)).failures]
    assert len(cases) >= 5 and len(failing) == len(cases), (len(cases), failing)


def test_reference_single_expert_is_the_dense_ffn():
    """E = 1, k = 1, softmax renormalised: the weight is 1 and the layer is w2 @ (silu(gate) * up), by hand."""
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=1, top_k=1)
    layer = MoE(cfg)
    x = torch.randn(3, 8, dtype=torch.float64)
    w13, w2 = layer.w13[0].detach().double(), layer.w2[0].detach().double()
    h = x @ w13.t()  # [M, 8]
    dense = (h[:, :4] * torch.sigmoid(h[:, :4]) * h[:, 4:]) @ w2.t()
    got = reference_moe(LayerWeights.of(layer), cfg, x)
    torch.testing.assert_close(got.out, dense, rtol=1e-12, atol=1e-12)
    assert got.counts == [3] and got.dropped == 0


def test_reference_routes_a_hand_example():
    """Grouped, biased sigmoid routing worked by hand: groups {0, 1}, {2, 3}; biased choice 3.0, 0.0 | 2.0, 1.5; the
    top-2 sums (a bias: "auto") 3.0 < 3.5 keep group 1 (a max would keep group 0); weights from the unbiased
    sigmoids of experts 2 and 3, renormalised, x 2.5."""
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=4, top_k=2, scoring="sigmoid", n_group=2,
                    topk_group=1, use_correction_bias=True, routed_scaling_factor=2.5)
    logits = [0.0, -1.0, 1.0, 0.5]
    sig = [1 / (1 + math.exp(-v)) for v in logits]
    bias = [c - s for c, s in zip([3.0, 0.0, 2.0, 1.5], sig)]
    r = route_token(logits, cfg, bias)
    assert r.ids == [2, 3] and not r.ambiguous
    assert r.weights == pytest.approx([2.5 * sig[2] / (sig[2] + sig[3]), 2.5 * sig[3] / (sig[2] + sig[3])], rel=1e-12)
    assert route_token(logits, cfg.replace(group_score="max"), bias).ids == [0, 1]


def test_reference_marks_a_capacity_drop_decided_by_a_near_tie():
    """Four tokens on expert 0 with room for three, "weight" policy: weights an ulp apart (float64 sums of ties a
    float32 router makes exact) decide which is dropped, so the case is ambiguous, whichever kept weight is the near
    one (fuzz seed 314: the heaviest); exact ties (position order on both sides) and clear gaps are not."""
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=2, top_k=1)
    sixth = 1.0 / 6.0
    for weights, ambiguous in (([math.nextafter(sixth, 1.0), sixth, sixth, sixth], True),
                               ([sixth, sixth, sixth, math.nextafter(sixth, 0.0)], True),
                               ([sixth] * 4, False), ([0.5, 0.4, 0.3, 0.2], False)):
        routes = [TokenRoute(ids=[0], weights=[w]) for w in weights]
        keep, marked = capacity_keep(routes, cfg, 1.5, "weight")  # C = ceil(1.5 * 4 tokens * k 1 / E 2) = 3
        assert sum(k[0] for k in keep) == 3 and marked == ambiguous, (weights, keep)
    assert not check_case(draw_case(314)).failures


def test_reference_marks_a_tie_that_float64_rounding_made():
    """Seed 854: copied gate rows gave logits an ulp apart (a float64 GEMM's columns) whose float64 softmax scores
    the reference rounds equal, so it took the lower id where the layer's softmax kept the ulp: ambiguous. Equal
    logits stay an exact tie (the lower id, on both sides)."""
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=6, top_k=2)
    row = [float.fromhex(v) for v in ("-0x1.69087d08a681ap+1", "0x1.bb55b7aca3230p-2", "0x1.a2f3a8857a9c2p+1",
                                      "0x1.a6dc12fd85055p+0", "0x1.a6dc12fd85056p+0", "-0x1.de93cc0a9eae8p-1")]
    route = route_token(row, cfg, None)
    assert route.ids == [2, 3] and route.ambiguous
    row[4] = row[3]
    route = route_token(row, cfg, None)
    assert route.ids == [2, 3] and not route.ambiguous


def test_reference_marks_near_ties():
    """Two logits 1e-7 apart at the top-k boundary: float32 may choose either, so the token is ambiguous."""
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=3, top_k=1)
    assert route_token([1.0, 1.0 + 1e-7, -1.0], cfg, None).ambiguous
    assert not route_token([1.0, 1.0, -1.0], cfg, None).ambiguous  # exact: the lower id, on both sides
    assert not route_token([1.0, 1.5, -1.0], cfg, None).ambiguous


def test_reference_marks_a_near_tie_behind_an_exact_tie():
    """k = 1 over logits 1.0, 1.0 (copied gate rows: an exact tie, the lower id on both sides) and 1.0 - 1e-7: the
    third is near both, so float32 may make it a three-way tie that it wins (the lowest id): ambiguous. Behind no
    exact tie, or far from it, the third is not looked at."""
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=4, top_k=1)
    assert route_token([1.0 - 1e-7, 1.0, 1.0, -1.0], cfg, None).ambiguous
    assert not route_token([0.5, 1.0, 1.0, -1.0], cfg, None).ambiguous
    assert not route_token([1.0 - 1e-7, 1.0, 1.5, -1.0], cfg, None).ambiguous

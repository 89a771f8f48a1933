"""The down GEMM's weights before its PDL wait (``KernelConfig.down_preload``) and the gate-up GEMM's early signal
(``up_signal_early``), issues 19 / 15, under Triton's interpreter, tiny shapes.

The preloaded steps and the loop after them must give the result of a float64 per-slot loop written here (fp8: the
recipe, float32: the plain expert), with N tails, a preload shorter than the steps over N (the loop finishes), one
longer (clamped), TMA descriptors and pointer loads, the tiny-batch shortcut (M = 1, 2: preloaded) and the aligned
layout (M = 7: the preload does not apply). The interpreter runs no PDL (the wait and the signal are no-ops there);
the GPU's order is checked in ``benchmarks/decode_pdl_device_check.py``.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import preload_steps  # noqa: E402

SHAPE, BLOCK = (16, 160, 288), (128, 128)  # E (M <= 2 takes the tiny-batch shortcut), K (a tail past 128), N = 288: three 128-steps, the last a tail
POISON_TMA = LaunchOptions(poison_workspace=True, weight_descriptors=True)
POISON_PTR = LaunchOptions(poison_workspace=True, weight_descriptors=False)


def _constexpr(launch, name: str):
    """A bound launch's constexpr (its trailing parameters, by name)."""
    return dict(zip(launch._named, launch.tail[-len(launch._named):]))[name]


def _f64_quant(v: torch.Tensor, group: int) -> torch.Tensor:
    """v [C] float64 through e4m3 per group of G columns: s = amax / 448 (1 for zeros), e4m3(v / s) * s."""
    out = torch.empty_like(v)
    for c0 in range(0, v.numel(), group):
        block = v[c0:c0 + group]
        s = block.abs().max() / 448 if block.abs().max() > 0 else 1.0
        out[c0:c0 + group] = (block / s).to(torch.float8_e4m3fn).double() * s
    return out


def _f64_recipe(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block):
    """Per token and slot in float64: x quantized per 128 columns, block-dequantized weights, silu-and-mul, h
    quantized per 128 columns, the routed weight, the slots summed."""
    (bn, bk), inter = block, w2_q.shape[2]

    def deq(q, s, e):
        r, c = torch.arange(q.shape[1])[:, None] // bn, torch.arange(q.shape[2])[None, :] // bk
        return q[e].double() * s[e].double()[r, c]

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = deq(w13_q, w13_s, e) @ _f64_quant(x[t].double(), bk)
            h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, j]) * (deq(w2_q, w2_s, e) @ _f64_quant(h, bk))
    return out


@pytest.mark.parametrize("m,options", [(1, POISON_TMA), (2, POISON_PTR), (7, POISON_PTR)])
@pytest.mark.parametrize("preload,swap", [(2, True), (8, False)])  # 2 of 3 steps, then the loop / clamped to 3
def test_fp8_preload_matches_float64_recipe(m, options, preload, swap):
    x, _, quantized, ids, weights = problem(m, 2, SHAPE, BLOCK, seed=m + preload)
    config = KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2), swap_ab=swap,
                          down_preload=preload, up_signal_early=True)
    with interpreted("moekit.experts", "moekit.experts.triton_fp8") as fp8:
        out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, config, options)
        plan = fp8.plan_for(x, *quantized, ids, weights, None, BLOCK, config, options)
        assert _constexpr(plan.down, "PRELOAD") == (min(preload, 3) if m <= 2 else 0)
        assert _constexpr(plan.down, "W_DESC") == (options.weight_descriptors and m > 2)  # preloading: pointers
        plain = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK,
                                             KernelConfig(16, config.up, config.down, swap_ab=swap), options)
    want = _f64_recipe(x, *quantized, ids, weights, BLOCK)
    # float32 sums against float64: equal up to a rare e4m3 rounding flip (~1e-4 here, see _fp8_cases.FLIP_TOL)
    assert rel_l2(out, want) < 1e-3
    assert torch.equal(out, plain)  # the same steps summed in the same order


@pytest.mark.parametrize("m,options", [(1, POISON_TMA), (1, POISON_PTR), (7, POISON_TMA), (1, LaunchOptions())])
@pytest.mark.parametrize("preload", [2, 4])  # N = 96 in 32-steps: 3 steps, 2 preloaded / clamped to 3
def test_preload_matches_float64_loop(m, options, preload):
    """Default options: the second call runs the recorded lean launches (the pair's w2 a tensor, not a descriptor)."""
    g = torch.Generator().manual_seed(m + preload)
    x, w13, w2 = torch.randn(m, 160, generator=g), torch.randn(8, 192, 160, generator=g), torch.randn(8, 160, 96, generator=g)
    b2 = torch.randn(8, 160, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(m)]).int()
    weights = torch.rand(m, 2, generator=g)
    config = KernelConfig(16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2), down_preload=preload,
                          up_signal_early=True)
    with interpreted("moekit.experts", "moekit.experts.triton") as tr:
        first = tr.fused_experts(x, w13, w2, ids, weights, config=config, options=options, b2=b2)
        out = tr.fused_experts(x, w13, w2, ids, weights, config=config, options=options, b2=b2)
    assert torch.equal(out, first)
    want = torch.zeros(m, 160, dtype=torch.float64)
    for t in range(m):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            h = torch.nn.functional.silu(gate_up[:96]) * gate_up[96:]
            want[t] += float(weights[t, j]) * (w2[e].double() @ h + b2[e].double())
    assert rel_l2(out, want) < 1e-5  # the float32 contract


def test_preload_steps_clamp_and_refuse():
    config = KernelConfig(16, GemmTile(64, 128), GemmTile(64, 128, num_warps=4), down_preload=6)
    assert preload_steps(config, True, 768, 1) == 6  # Qwen3 fp8: 6 x [64, 128] e4m3 = 96 registers a thread
    assert preload_steps(config, True, 300, 1) == 3  # clamped to the steps over N
    assert preload_steps(config, False, 768, 1) == 0  # the aligned layout: blocks unknown before the wait
    with pytest.raises(ValueError, match="registers a thread"):
        preload_steps(config, True, 768, 2)  # bf16: 192 registers


def test_preload_round_trips_through_a_config_entry():
    base = KernelConfig(16, GemmTile(64, 128), GemmTile(64, 128))
    assert base.to_dict() == {"BLOCK_M": 16, "up": vars(base.up), "down": vars(base.down)}  # files unchanged
    pdl = KernelConfig(16, base.up, base.down, down_preload=6, up_signal_early=True)
    assert pdl.to_dict()["down_preload"] == 6 and pdl.to_dict()["up_signal_early"] is True
    assert KernelConfig.from_dict(pdl.to_dict()) == pdl

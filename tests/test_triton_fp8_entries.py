"""The fp8 tuned files' optional per-entry switches (``triton_fp8_plan.read_entries``): "weight_tma" names
the weight loads an entry was measured with, "x_in_gate_up" where x is quantized (eager calls only); the plan
follows them where the caller does not choose, an entry without them keeps the rule (``TMA_MAX_BLOCK_M``; x in a
kernel of its own), and a value that is not a bool is refused. The result stays the torch twin's, and
the activation tiles loaded a K-step ahead (``gemm_fp8``'s AHEAD) give bit for bit the plain loads'
(Triton's interpreter, tiny shapes)."""

from __future__ import annotations


import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, POISON, SHAPES, fp8_tuned_file, problem  # noqa: E402, F401  (fixture)
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_plan import build_plan  # noqa: E402

SHAPE, BLOCK = SHAPES[0]  # E=4, K=160 (a K tail), N=96 (an N tail)
NARROW = KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(32, 128, 1, 4, 2))
TALL = KernelConfig(64, GemmTile(32, 128, 2, 4, 2), GemmTile(32, 128, 2, 4, 2))


def test_entry_switch_reaches_the_plan(fp8, fp8_tuned_file):
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = problem(9, 2, SHAPE, BLOCK, seed=70)
    # M=1: a 16-row entry without the switch (the rule: TMA); M=9: 64-row tiles asked to load by TMA
    fp8_tuned_file({"1": NARROW.to_dict(), "9": {**TALL.to_dict(), "weight_tma": True}})
    tall = build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON)
    assert tall.config == TALL and tall.descriptor_key is not None  # the rule alone would pick pointers
    forced = build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON, None, False)
    assert forced.descriptor_key is None  # the caller's choice wins
    plain = build_plan(x[:1], w13_q, w13_s, w2_q, w2_s, ids[:1], None, BLOCK, None, POISON)
    assert plain.config == NARROW and plain.descriptor_key is not None
    out = fp8.fused_experts_fp8(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=BLOCK, options=POISON)
    twin = fp8.fused_experts_fp8_torch(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=BLOCK)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("name", ["weight_tma", "x_in_gate_up"])
def test_entry_switch_must_be_a_bool(fp8_tuned_file, name):
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, _ = problem(9, 2, SHAPE, BLOCK)
    fp8_tuned_file({"9": {**TALL.to_dict(), name: "yes"}})
    with pytest.raises(ValueError, match=name):
        build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON)


def test_x_in_gate_up_switch_reaches_the_plan(fp8, fp8_tuned_file):
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = problem(9, 2, SHAPE, BLOCK, seed=71)
    fp8_tuned_file({"1": {**NARROW.to_dict(), "x_in_gate_up": True}, "9": TALL.to_dict()})
    assert build_plan(x[:1], w13_q, w13_s, w2_q, w2_s, ids[:1], None, BLOCK, None, POISON).quantize is None
    assert build_plan(x[:1], w13_q, w13_s, w2_q, w2_s, ids[:1], None, BLOCK, None, POISON, False).quantize is not None
    # a CUDA graph capture keeps the quantization kernel (faster on the GPU; the switch saves host time only)
    assert build_plan(x[:1], w13_q, w13_s, w2_q, w2_s, ids[:1], None, BLOCK, None, POISON,
                      capturing=True).quantize is not None
    assert build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON).quantize is not None
    out = fp8.fused_experts_fp8(x[:1], w13_q, w13_s, w2_q, w2_s, ids[:1], weights[:1], block_shape=BLOCK,
                                options=POISON)
    twin = fp8.fused_experts_fp8_torch(x[:1], w13_q, w13_s, w2_q, w2_s, ids[:1], weights[:1], block_shape=BLOCK)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("m,mapped", [(1, False), (5, False), (6, True)])
def test_ahead_loads_equal_the_plain_ones(fp8, m, mapped):
    """NARROW: the gate-up tile (32) below the group (128), so h goes float32 and the down GEMM quantizes it
    in its loop; x quantized inside gate-up; K = 160 and N = 96 end in partial steps; mapped: 7 global
    experts, the 4 local ones among them, ids with -1 (the aligned layout, not the shortcut)."""
    x, _, quantized, ids, weights = problem(m, 2, SHAPE, BLOCK, seed=72 + m, num_global=7 if mapped else None)
    expert_map = None
    if mapped:
        expert_map = torch.full((7,), -1, dtype=torch.int32)
        expert_map[torch.tensor([5, 0, 3, 6])] = torch.arange(4, dtype=torch.int32)
    args = (x, *quantized, ids, weights, expert_map, BLOCK, NARROW, POISON, True)
    ahead = fp8.fused_experts_fp8_launch(*args, ahead=True)
    assert torch.equal(ahead, fp8.fused_experts_fp8_launch(*args, ahead=False))
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, expert_map=expert_map, block_shape=BLOCK)
    assert rel_l2(ahead, twin) < FLIP_TOL

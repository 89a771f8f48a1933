"""The fp8 path's folded alignment (the gate-up GEMM derives its blocks from the ids and writes the
layout for the down GEMM, no alignment launch, up to ``LaunchOptions.align_fold_max`` assignments) and
its reused eager workspaces, under Triton's interpreter at tiny shapes: equal to the torch twin with
and without the fold, with an expert map with -1, and with a workspace reused across calls of two kinds."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, SHAPES, problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_plan import build_plan  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

SHAPE, BLOCK = SHAPES[0]  # E=4, K=160 (a K tail), N=96 (an N tail)
FOLDED = LaunchOptions(poison_workspace=True, align_fold_max=64)
UNFOLDED = LaunchOptions(poison_workspace=True, align_fold_max=0)
CONFIG = KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(32, 128, 1, 4, 2))


def test_plan_folds_up_to_the_limit():
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, _ = problem(9, 2, SHAPE, BLOCK)  # A = 18 > E: aligned, not naive
    assert build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, CONFIG, FOLDED).align.folded
    assert not build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, CONFIG, UNFOLDED).align.folded
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, _ = problem(40, 2, SHAPE, BLOCK)  # A = 80 > 64
    assert not build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, CONFIG, FOLDED).align.folded


@pytest.mark.parametrize("options", [FOLDED, UNFOLDED], ids=["folded", "launch"])
@pytest.mark.parametrize("config", [None, CONFIG, KernelConfig(64, GemmTile(128, 128, 2, 4, 2),
                                                                GemmTile(128, 128, 2, 4, 2))],
                         ids=["default", "n32", "bm64"])
def test_fold_matches_twin(fp8, options, config):
    x, _, quantized, ids, weights = problem(9, 2, SHAPE, BLOCK, seed=60)
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK, config, options)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=BLOCK)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("options", [FOLDED, UNFOLDED], ids=["folded", "launch"])
def test_fold_with_expert_map(fp8, options):
    expert_map = torch.tensor([2, -1, 0, -1, 3, 1, -1], dtype=torch.int32)  # 7 global experts, 4 local
    x, _, quantized, ids, weights = problem(11, 2, SHAPE, BLOCK, seed=61, num_global=7)
    out = fp8.fused_experts_fp8(x, *quantized, ids, weights, expert_map=expert_map, block_shape=BLOCK, options=options)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, expert_map=expert_map, block_shape=BLOCK)
    assert rel_l2(out, twin) < FLIP_TOL
    assert ((ids < 0) | (expert_map[ids.clamp(0).long()] < 0)).any()


def test_reused_workspace_across_call_kinds(fp8):
    # Eager calls take views of one reused buffer: a call of another kind in between (other M, other
    # regions) must not leave anything the next call reads.
    reuse = LaunchOptions(reuse_workspace=True)
    first = problem(9, 2, SHAPE, BLOCK, seed=62)
    other = problem(3, 2, SHAPE, BLOCK, seed=63)
    for x, _, quantized, ids, weights in (first, other, first):
        out = fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=BLOCK, options=reuse)
        twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=BLOCK)
        assert rel_l2(out, twin) < FLIP_TOL
    assert fp8._WORKSPACES.held()

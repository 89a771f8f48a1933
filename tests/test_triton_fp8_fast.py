"""The fp8 path's fast-path choices under Triton's interpreter, tiny shapes: weights through TMA
descriptors or pointer loads (``weight_tma``; the plan's default by tile height, and
``LaunchOptions.weight_descriptors`` forbidding them), and a K-step's weight scale as one scalar
(ONE_BLOCK) or one per column.
Each choice must give the torch twin's result (``test_triton_fp8`` holds the twin to a float64 emulation),
with K and N tails, M = 0 and 1, and an expert map with -1."""

from __future__ import annotations

import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, SHAPES, kernel_vs_twin, problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_plan import build_plan, fp8_descriptors_allowed  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

TMA = LaunchOptions(weight_descriptors=True, poison_workspace=True)
POINTERS = LaunchOptions(weight_descriptors=False, poison_workspace=True)
# E=4, K=160 (a K tail past 128), N=96 (an N tail: 96 rows of h, and the w13 rows 96.. are up rows).
SHAPE, BLOCK = SHAPES[0]
CONFIGS = [
    # gate-up 128 wide: under TMA tile 0 reads up rows 0..31 as gate columns 96..127, and h is re-quantized
    # in the epilogue: their zero weight scales must keep them out of the group's amax (the 256 tile too).
    KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(128, 128, 1, 4, 2)),
    # 32 wide: N = 3 tiles, every tile inside one scale block (ONE_BLOCK in both GEMMs)
    KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(32, 128, 1, 4, 2)),
    # 256 wide: two scale blocks per tile (a scale per column), 64-row blocks of the aligned layout
    KernelConfig(64, GemmTile(256, 128, 2, 4, 2), GemmTile(256, 128, 2, 4, 2)),
]


def _flags(launch) -> tuple:
    """(W_DESC, ONE_BLOCK) of a bound launch: its tail holds the arguments after the pointers, in order."""
    names = list(inspect.signature(launch.kernel.fn).parameters)
    first = len(names) - len(launch.tail)
    return tuple(launch.tail[names.index(n) - first] for n in ("W_DESC", "ONE_BLOCK"))


def _plan(fp8, m, config, options, weight_tma=None):
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, _ = problem(m, 2, SHAPE, BLOCK)
    return build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, config, options, None, weight_tma)


@pytest.mark.parametrize("weight_tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("config", CONFIGS, ids=["n128", "n32", "n256"])
@pytest.mark.parametrize("m", [1, 9])
def test_descriptors_and_scale_forms_match_twin(fp8, weight_tma, config, m):
    x, _, quantized, ids, weights = problem(m, 2, SHAPE, BLOCK, seed=20 + m)
    out, twin = kernel_vs_twin(fp8, x, quantized, ids, weights, BLOCK, config=config, weight_tma=weight_tma)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("x_in_gate_up", [False, True])
def test_one_block_fold_with_x_loaded_or_quantized(fp8, x_in_gate_up):
    # The one-FMA scale fold (ONE_BLOCK, a 128-wide tile) with x quantized in gate-up or by its own kernel.
    x, _, quantized, ids, weights = problem(9, 2, SHAPE, BLOCK, seed=31)
    out, twin = kernel_vs_twin(fp8, x, quantized, ids, weights, BLOCK, config=CONFIGS[0], x_in_gate_up=x_in_gate_up)
    assert rel_l2(out, twin) < FLIP_TOL


def test_plan_picks_descriptors_and_scale_form(fp8):
    tma = _plan(fp8, 9, CONFIGS[1], TMA)  # 16-row tiles: TMA by default (TMA_MAX_BLOCK_M)
    assert tma.descriptor_key == (False, 4, 192, 160, 32, 128, 32, 128)
    assert _flags(tma.gate_up) == (True, True) and _flags(tma.down) == (True, True)
    assert _plan(fp8, 9, CONFIGS[1], POINTERS).descriptor_key is None  # the option forbids them
    assert _plan(fp8, 9, CONFIGS[1], TMA, weight_tma=False).descriptor_key is None
    tall = _plan(fp8, 9, CONFIGS[2], TMA)  # 64-row tiles: pointer loads by default
    assert _flags(tall.gate_up) == (False, False) and _flags(tall.down) == (False, False)
    assert _flags(_plan(fp8, 9, CONFIGS[2], TMA, weight_tma=True).gate_up) == (True, False)
    assert _plan(fp8, 9, CONFIGS[2], POINTERS, weight_tma=True).descriptor_key is None
    # 64 wide over N = 96: the second tile would straddle the gate/up boundary's block -> a scale per column
    narrow = _plan(fp8, 9, KernelConfig(16, GemmTile(64, 128), GemmTile(64, 128)), TMA)
    assert _flags(narrow.gate_up) == (True, False) and _flags(narrow.down) == (True, True)


def test_descriptors_only_where_tma_can_copy():
    _, _, (w13_q, _, w2_q, _), _, _ = problem(1, 1, SHAPE, BLOCK)
    assert fp8_descriptors_allowed(w13_q, w2_q, TMA)
    assert not fp8_descriptors_allowed(w13_q, w2_q, POINTERS)
    assert not fp8_descriptors_allowed(w13_q[:, :, :150].contiguous(), w2_q, TMA)  # 150-byte rows
    transposed = w2_q.transpose(1, 2).contiguous().transpose(1, 2)  # [E, K, N] view of [E, N, K] storage
    assert not fp8_descriptors_allowed(w13_q, transposed, TMA)
    _, _, (w13_q, _, w2_q, _), _, _ = problem(1, 1, *SHAPES[1])  # K = 150: pointer loads
    assert not fp8_descriptors_allowed(w13_q, w2_q, TMA)


@pytest.mark.parametrize("options", [TMA, POINTERS], ids=["tma", "pointers"])
def test_empty_single_token_and_expert_map(fp8, options):
    x, _, quantized, ids, weights = problem(0, 2, SHAPE, BLOCK)
    assert fp8.fused_experts_fp8(x, *quantized, ids, weights, options=options).shape == (0, 160)
    x, _, quantized, ids, weights = problem(1, 1, SHAPE, BLOCK, seed=3)  # the tiny-batch shortcut
    out, twin = kernel_vs_twin(fp8, x, quantized, ids, weights, BLOCK, options=options)
    assert rel_l2(out, twin) < FLIP_TOL
    expert_map = torch.tensor([2, -1, 0, -1, 3, 1, -1], dtype=torch.int32)  # 7 global experts, 4 local
    x, _, quantized, ids, weights = problem(11, 2, SHAPE, BLOCK, seed=5, num_global=7)
    out, twin = kernel_vs_twin(fp8, x, quantized, ids, weights, BLOCK, expert_map, options=options)
    assert rel_l2(out, twin) < FLIP_TOL
    assert ((ids < 0) | (expert_map[ids.clamp(0).long()] < 0)).any()  # some slots are not local


def test_descriptors_follow_an_in_place_weight_update(fp8):
    # The descriptors are cached per weight tensor; an in-place update (a new _version) must be seen.
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = problem(9, 2, SHAPE, BLOCK, seed=6)
    before = fp8.fused_experts_fp8(x, w13_q, w13_s, w2_q, w2_s, ids, weights, options=TMA)
    w2_q.copy_((w2_q.float() * -1).to(torch.float8_e4m3fn))  # e4m3 negates exactly
    after = fp8.fused_experts_fp8(x, w13_q, w13_s, w2_q, w2_s, ids, weights, options=TMA)
    torch.testing.assert_close(after, -before)

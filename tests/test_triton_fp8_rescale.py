"""The fp8 GEMMs' RESCALE accumulation (``gemm_fp8``: the accumulator kept in units of the latest
K-step's scale, handed to the dot) under Triton's interpreter, tiny shapes: equal to the torch twin with
K and N tails, M = 1, an expert map with -1, both weight loads, x quantized by its kernel or in gate-up,
and weight blocks of scale 0 (leading and inside the reduction). Also which GEMMs the plan lets rescale."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, POISON, SHAPES, problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_plan import build_plan  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

SHAPE, BLOCK = SHAPES[0]  # E=4, K=160 (a K tail), N=96 (an N tail)
POINTERS = LaunchOptions(weight_descriptors=False, poison_workspace=True)
# 32 wide: every tile in one scale block in both GEMMs (both rescale); 128 wide: the gate-up tile passes
# N = 96, so gate-up folds and only the down GEMM rescales.
NARROW = KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(32, 128, 1, 4, 2))
WIDE = KernelConfig(64, GemmTile(128, 128, 2, 4, 2), GemmTile(128, 128, 2, 4, 2))


@pytest.fixture(scope="module")
def fp8():
    with interpreted("moekit.experts", "moekit.experts.triton_fp8") as module:
        yield module


def _run(fp8, x, quantized, ids, weights, config, options=POISON, expert_map=None, x_in_gate_up=None):
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, expert_map, BLOCK, config, options,
                                       x_in_gate_up, None, rescale=True)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, expert_map=expert_map, block_shape=BLOCK)
    return out, twin


@pytest.mark.parametrize("options", [POISON, POINTERS], ids=["tma", "pointers"])
@pytest.mark.parametrize("config", [NARROW, WIDE], ids=["n32", "n128"])
@pytest.mark.parametrize("m", [1, 9])
def test_rescale_matches_twin(fp8, options, config, m):
    x, _, quantized, ids, weights = problem(m, 2, SHAPE, BLOCK, seed=40 + m)
    out, twin = _run(fp8, x, quantized, ids, weights, config, options)
    assert rel_l2(out, twin) < FLIP_TOL


@pytest.mark.parametrize("x_in_gate_up", [False, True])
def test_rescale_with_expert_map(fp8, x_in_gate_up):
    expert_map = torch.tensor([2, -1, 0, -1, 3, 1, -1], dtype=torch.int32)  # 7 global experts, 4 local
    x, _, quantized, ids, weights = problem(11, 2, SHAPE, BLOCK, seed=45, num_global=7)
    out, twin = _run(fp8, x, quantized, ids, weights, NARROW, expert_map=expert_map, x_in_gate_up=x_in_gate_up)
    assert rel_l2(out, twin) < FLIP_TOL
    assert ((ids < 0) | (expert_map[ids.clamp(0).long()] < 0)).any()


@pytest.mark.parametrize("k_block", [0, 1], ids=["leading", "last"])
def test_rescale_with_zero_scale_blocks(fp8, k_block):
    # A weight block of scale 0 whose q is all zeros (what a quantizer writes for a zero block): its
    # K-step adds nothing, and the unit of the other steps stays right.
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = problem(9, 2, SHAPE, BLOCK, seed=50)
    w13_q, w13_s = w13_q.clone(), w13_s.clone()
    w13_s[1, :, k_block] = 0.0  # expert 1, every row block, one K block
    w13_q[1, :, k_block * 128:(k_block + 1) * 128] = 0.0
    w2_s[:, 0, 0] = 0.0
    w2_q[:, :128, :128] = 0.0
    out, twin = _run(fp8, x, (w13_q, w13_s, w2_q, w2_s), ids, weights, NARROW)
    assert twin.abs().sum() > 0
    assert rel_l2(out, twin) < FLIP_TOL


def _rescale_flag(launch) -> bool:
    names = list(inspect.signature(launch.kernel.fn).parameters)
    return launch.tail[names.index("RESCALE") - (len(names) - len(launch.tail))]


def test_plan_rescales_one_block_gemms_only(fp8):
    x, _, (w13_q, w13_s, w2_q, w2_s), ids, _ = problem(9, 2, SHAPE, BLOCK)

    def flags(config, rescale):
        plan = build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, config, POISON, None, None, rescale)
        return _rescale_flag(plan.gate_up), _rescale_flag(plan.down)

    assert flags(NARROW, True) == (True, True)
    assert flags(WIDE, True) == (False, True)  # the 128-wide gate-up tile straddles N = 96's block
    assert flags(NARROW, False) == (False, False)
    assert flags(NARROW, None) == (False, False)  # 16-row tiles: below RESCALE_MIN_BLOCK_M
    tall = KernelConfig(128, GemmTile(32, 128, 1, 4, 2), GemmTile(32, 128, 1, 4, 2))
    assert flags(tall, None) == (True, True)


def _entry(config: KernelConfig, **switches) -> dict:
    return {**config.to_dict(), **switches}


def test_tuned_entry_switches_reach_the_plan(fp8, tmp_path, monkeypatch):
    # A tuned file's entry may name weight_tma and rescale; the plan follows them where the caller does
    # not, and an entry without them leaves the rules (16-row tiles: TMA, no rescale).
    from moekit.experts.configs import clear_config_cache

    x, _, (w13_q, w13_s, w2_q, w2_s), ids, weights = problem(9, 2, SHAPE, BLOCK, seed=70)
    name = "E4_N96_K160_fp8_block_cpu.json"
    body = {"E": 4, "N": 96, "K": 160, "dtype": "fp8_block", "device": "cpu",
            "configs": {"1": _entry(NARROW), "9": _entry(NARROW, weight_tma=False, rescale=True)}}
    (tmp_path / name).write_text(json.dumps(body))
    monkeypatch.setenv("MOEKIT_CONFIG_DIR", str(tmp_path))
    clear_config_cache()
    try:
        plan = build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON)
        assert plan.descriptor_key is None and (_rescale_flag(plan.gate_up), _rescale_flag(plan.down)) == (True, True)
        forced = build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON, None, True, False)
        assert forced.descriptor_key is not None and not _rescale_flag(forced.gate_up)  # the caller's choice wins
        x1, ids1 = x[:1], ids[:1]
        plain = build_plan(x1, w13_q, w13_s, w2_q, w2_s, ids1, None, BLOCK, None, POISON)
        assert plain.descriptor_key is not None and not _rescale_flag(plain.down)
        out = fp8.fused_experts_fp8(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=BLOCK, options=POISON)
        twin = fp8.fused_experts_fp8_torch(x, w13_q, w13_s, w2_q, w2_s, ids, weights, block_shape=BLOCK)
        assert rel_l2(out, twin) < FLIP_TOL
        body["configs"]["9"]["rescale"] = "yes"
        (tmp_path / name).write_text(json.dumps(body))
        clear_config_cache()
        with pytest.raises(ValueError, match="rescale"):
            build_plan(x, w13_q, w13_s, w2_q, w2_s, ids, None, BLOCK, None, POISON)
    finally:
        clear_config_cache()

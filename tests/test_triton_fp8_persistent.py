"""The persistent fp8 GEMMs (``_kernels/gemm_fp8_persistent``, ``triton_fp8_persistent``) under the interpreter:
every tile walked by 2 programs a GEMM (the interpreter's "SM count"), each looping over several tiles; the output
bit-equal to the one-tile-a-program kernels (the same products in the same order) and within the twin's float32
flips of ``fused_experts_fp8_torch``; the float64 emulation of the recipe (``test_triton_fp8``) checks the twin."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, SHAPES, fp8_tuned_file, problem  # noqa: E402, F401  (fixture)
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_persistent import OFF, Persistent  # noqa: E402
from moekit.experts.triton_fp8_plan import build_plan  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

# no folded alignment (the persistent kernels read the aligned layout's launch), NaN-filled workspaces
UNFOLDED = LaunchOptions(poison_workspace=True, align_fold_max=0)
CONFIGS = [KernelConfig(16, GemmTile(128, 128, 2, 4, 2), GemmTile(64, 128, 2, 4, 2)),
           KernelConfig(16, GemmTile(128, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))]  # block (128, 128), (64, 32)


def _launch(fp8, case, config, persistent, expert_map=None, weight_tma=None):
    x, quantized, ids, weights, block_shape = case
    return fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, expert_map, block_shape, config, UNFOLDED,
                                        False, weight_tma, True, persistent)


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("persistent", [Persistent(1, 2), Persistent(1, 0), Persistent(0, 3)])
@pytest.mark.parametrize("weight_tma", [True, False])
def test_persistent_equals_one_tile_programs_and_twin(fp8, which, persistent, weight_tma):
    shape, block_shape = SHAPES[which]
    x, _, quantized, ids, weights = problem(13, 2, shape, block_shape, seed=3 + which)
    case = (x, quantized, ids, weights, block_shape)
    out = _launch(fp8, case, CONFIGS[which], persistent, weight_tma=weight_tma)
    base = _launch(fp8, case, CONFIGS[which], None, weight_tma=weight_tma)
    assert torch.equal(out, base)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=block_shape)
    assert rel_l2(out, twin) < FLIP_TOL


def test_persistent_with_expert_map(fp8):
    shape, block_shape = SHAPES[0]
    expert_map = torch.tensor([2, -1, 0, -1, 3, 1, -1], dtype=torch.int32)
    x, _, quantized, ids, weights = problem(11, 2, shape, block_shape, seed=5, num_global=7)
    out = _launch(fp8, (x, quantized, ids, weights, block_shape), CONFIGS[0], Persistent(), expert_map)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, expert_map=expert_map, block_shape=block_shape)
    assert rel_l2(out, twin) < FLIP_TOL
    assert ((ids < 0) | (expert_map[ids.clamp(0).long()] < 0)).any()  # some assignments are not local


def test_persistent_refuses_what_it_does_not_take(fp8):
    shape, block_shape = SHAPES[0]
    x, _, quantized, ids, weights = problem(9, 2, shape, block_shape, seed=1)
    case = (x, quantized, ids, weights, block_shape)
    narrow = KernelConfig(16, GemmTile(64, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2))  # h in float32
    with pytest.raises(ValueError, match="narrower than a scale group"):
        _launch(fp8, case, narrow, Persistent())
    with pytest.raises(ValueError, match="swap_ab"):
        _launch(fp8, case, replace(CONFIGS[0], swap_ab=True), Persistent())
    with pytest.raises(ValueError, match="folded"):
        fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, block_shape, CONFIGS[0],
                                     LaunchOptions(), None, None, True, Persistent())
    with pytest.raises(ValueError, match="programs per SM"):
        Persistent(-1, 2)
    with pytest.raises(ValueError, match="up_per_sm, down_per_sm"):
        Persistent.from_dict({"up": 1}, "file")


def test_tuned_entry_switch(fp8, fp8_tuned_file):
    # Entry 9 asks for a persistent down GEMM: the plan takes it at M = 13 (aligned, unfolded), not at M = 1 (the
    # tiny-batch shortcut; no error: an entry's switch applies where it can), and OFF overrides it.
    shape, block_shape = SHAPES[0]
    fp8_tuned_file({"9": {**CONFIGS[0].to_dict(), "persistent": {"up_per_sm": 0, "down_per_sm": 2}}})
    x, _, quantized, ids, weights = problem(13, 2, shape, block_shape, seed=9)
    plan = build_plan(x, *quantized, ids, None, block_shape, None, UNFOLDED)
    assert "persistent" in plan.down.kernel.fn.__name__ and "persistent" not in plan.gate_up.kernel.fn.__name__
    assert plan.down_sum is None  # the k-sum in its own launch
    off = build_plan(x, *quantized, ids, None, block_shape, None, UNFOLDED, persistent=OFF)
    assert "persistent" not in off.down.kernel.fn.__name__
    tiny = build_plan(x[:1], *quantized, ids[:1, :1], None, block_shape, None, UNFOLDED)
    assert "persistent" not in tiny.down.kernel.fn.__name__
    out = fp8.fused_experts_fp8(x, *quantized, ids, weights, block_shape=block_shape, options=UNFOLDED)
    base = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, block_shape, CONFIGS[0], UNFOLDED)
    assert torch.equal(out, base)
    fp8_tuned_file({"9": {**CONFIGS[0].to_dict(), "persistent": {"up_per_sm": True, "down_per_sm": 2}}})
    with pytest.raises(ValueError, match="up_per_sm must be an int"):
        build_plan(x, *quantized, ids, None, block_shape, None, UNFOLDED)


def test_packaged_fp8_entries_parse_with_their_switches():
    from moekit.experts.configs import PACKAGED_DIR
    from moekit.experts.triton_fp8_plan import read_entries

    found = {p.name: read_entries(p) for p in PACKAGED_DIR.glob("*_fp8_block_*.json")}
    assert found and all(found.values())
    assert any(e.persistent is not None and e.persistent.on for entries in found.values() for e in entries.values())

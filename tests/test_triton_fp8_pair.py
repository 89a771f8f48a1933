"""The gate-up GEMM's PAIR_DOT (``_kernels/gemm_fp8``: each K-step's gate and up tiles as one TMA tile through a
[2E, N, K] descriptor, one dot) under the interpreter: the one-tile-a-program and the persistent gate-up against the
same call with two dots a step (the same products and fold) and against the twin ``fused_experts_fp8_torch``; the
float64 emulation of the recipe (``test_triton_fp8``) checks the twin. Also the tuned entry's "pair_dot"."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, fp8_tuned_file, problem  # noqa: E402, F401  (fixture)
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import fp8  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_persistent import Persistent  # noqa: E402
from moekit.experts.triton_fp8_plan import build_plan  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

UNFOLDED = LaunchOptions(poison_workspace=True, align_fold_max=0)  # the aligned layout's launch (persistent needs it)
# (E, K, N), block shape, config: a 32-wide gate-up tile below a 128 group (h float32); K 176 with a tail of 16 past
# the 32-column groups (h re-quantized in gate-up's epilogue); a 128-wide tile, two 64-row chunks of gate and of up
CASES = [((4, 160, 96), (128, 128), KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2))),
         ((5, 176, 64), (64, 32), KernelConfig(16, GemmTile(32, 32, 2, 4, 2), GemmTile(32, 32, 1, 4, 2))),
         ((3, 160, 256), (128, 128), KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2)))]


def _launch(fp8, case, config, pair_dot, persistent=None, weight_tma=True):
    x, quantized, ids, weights, block_shape = case
    return fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, block_shape, config, UNFOLDED, False,
                                        weight_tma, True, persistent, pair_dot)


@pytest.mark.parametrize("which, persistent, swap_ab", [
    (0, None, False), (1, None, False), (1, Persistent(1, 0), False), (2, None, False), (2, Persistent(1, 2), False),
    (0, None, True), (2, None, True)])
def test_pair_dot_equals_two_dots_and_twin(fp8, which, persistent, swap_ab):
    shape, block_shape, config = CASES[which]
    config = replace(config, swap_ab=swap_ab)  # swapped: the [2BN, BK] weight tile as the MMA's M side
    x, _, quantized, ids, weights = problem(13, 2, shape, block_shape, seed=7 + which)
    case = (x, quantized, ids, weights, block_shape)
    out = _launch(fp8, case, config, True, persistent)
    two = _launch(fp8, case, config, False, persistent)
    assert rel_l2(out, two) < 1e-6  # the same products: float32 sums of exact e4m3 products, any order
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=block_shape)
    assert rel_l2(out, twin) < FLIP_TOL


def test_pair_dot_refuses_what_it_does_not_take(fp8):
    shape, block_shape, config = CASES[0]
    x, _, quantized, ids, weights = problem(9, 2, shape, block_shape, seed=1)
    case = (x, quantized, ids, weights, block_shape)
    with pytest.raises(ValueError, match="pointer weights"):
        _launch(fp8, case, config, True, weight_tma=False)
    across = replace(config, up=replace(config.up, BLOCK_N=64))  # N = 96: the second tile holds columns 64-127
    with pytest.raises(ValueError, match="across weight scale blocks"):
        _launch(fp8, case, across, True)
    assert _launch(fp8, case, config, None).shape == x.shape  # None: the entry's (none here), two dots


def test_tuned_entry_switch(fp8_tuned_file):
    # Entry 9 asks for pair_dot: taken with TMA weights, not with pointers (no error: an entry's switch applies
    # where it can); the descriptor key names the pair descriptor.
    shape, block_shape, config = CASES[0]
    entry = {**config.to_dict(), "weight_tma": True, "pair_dot": True}
    fp8_tuned_file({"9": entry})
    x, _, quantized, ids, weights = problem(13, 2, shape, block_shape, seed=9)
    plan = build_plan(x, *quantized, ids, None, block_shape, None, UNFOLDED)
    assert plan.descriptor_key[0] == "pair"
    pointers = build_plan(x, *quantized, ids, None, block_shape, None, UNFOLDED, weight_tma=False)
    assert pointers.descriptor_key is None
    fp8_tuned_file({"9": {**entry, "pair_dot": 1}})
    with pytest.raises(ValueError, match="pair_dot' must be true or false"):
        build_plan(x, *quantized, ids, None, block_shape, None, UNFOLDED)

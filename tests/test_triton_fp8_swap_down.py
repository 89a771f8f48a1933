"""The down GEMM swapped alone (``swap_down``: ``gemm_fp8``'s SWAP_AB on the down launch, the gate-up as the config
has it) under the interpreter: against the twin ``fused_experts_fp8_torch`` (another summation order than the
unswapped kernels: within the twin's float32 flips), with h in float32 (a gate-up tile below a scale group) and
re-quantized, the k-sum folded into the down GEMM or in its own launch; a persistent down GEMM refused by name."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, POISON, problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import interpreted  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_fp8_persistent import Persistent  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

SHAPE, BLOCK_SHAPE = (4, 160, 96), (128, 128)
H_FP32 = KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2))  # gate-up 32 wide: h float32
H_Q = KernelConfig(16, GemmTile(128, 128, 1, 4, 2), GemmTile(64, 128, 1, 4, 2))  # h re-quantized in gate-up


@pytest.fixture(scope="module")
def fp8():
    with interpreted("moekit.experts", "moekit.experts.triton_fp8") as module:
        yield module


@pytest.mark.parametrize("config", [H_FP32, H_Q])
@pytest.mark.parametrize("options", [POISON, LaunchOptions(poison_workspace=True, align_fold_max=0)])
@pytest.mark.parametrize("m, k", [(13, 2), (1, 1)])  # (1, 1): the tiny-batch shortcut (A * 4 <= E)
def test_swap_down_matches_twin(fp8, config, options, m, k):
    x, _, quantized, ids, weights = problem(m, k, SHAPE, BLOCK_SHAPE, seed=4)
    out = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK_SHAPE, config, options,
                                       swap_down=True)
    plain = fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK_SHAPE, config, options)
    twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=BLOCK_SHAPE)
    assert rel_l2(out, twin) < FLIP_TOL and rel_l2(plain, twin) < FLIP_TOL
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_swap_down_refuses_a_persistent_down(fp8):
    x, _, quantized, ids, weights = problem(13, 2, SHAPE, BLOCK_SHAPE, seed=4)
    with pytest.raises(ValueError, match="swap_ab"):
        fp8.fused_experts_fp8_launch(x, *quantized, ids, weights, None, BLOCK_SHAPE, H_Q,
                                     LaunchOptions(align_fold_max=0), persistent=Persistent(0, 2), swap_down=True)


def test_swap_down_swaps_the_down_launch_only(fp8):
    x, _, quantized, ids, weights = problem(13, 2, SHAPE, BLOCK_SHAPE, seed=4)
    plan = fp8.plan_for(x, *quantized, ids.contiguous(), weights, None, BLOCK_SHAPE, H_Q, POISON, swap_down=True)

    def swapped(launch):  # the named trailing arguments of the bound launch
        return launch.compile_arguments(())[1]["SWAP_AB"]

    assert swapped(plan.down) and not swapped(plan.gate_up)

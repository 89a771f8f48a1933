"""The tiny-batch down GEMM + k-sum over a token's slots (``_kernels/down_slots.py``, ``KernelConfig.down_slots``),
under Triton's interpreter: equal to a float64 per-(token, slot) loop and to the separate down + k-sum path, with
skipped slots (-1) adding nothing, column tails (K not a multiple of BLOCK_N), reduction tails (N not one of
BLOCK_K); taken only where it applies (the tiny-batch shortcut, no expert map, no b2), in one launch after gate-up."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import experts_loop, make_problem, partial_expert_map  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402

SMALL = KernelConfig(16, GemmTile(16, 32), GemmTile(16, 16))
HIDDEN, INTER = 40, 24  # K: 3 column tiles of 16 (the last 8 wide); N: 24 = 16 + 8 (a reduction tail)


def _slots(n=16, k=16) -> KernelConfig:
    return replace(SMALL, down_slots=GemmTile(n, k, num_warps=4, num_stages=2))


def _kernels(launch_log) -> list[str]:
    return [name for name, _ in launch_log.take()]


# (M, k, E): A*4 <= E (the tiny-batch shortcut), k in {1, 2, 6, 8}
@pytest.mark.parametrize("m,k,e", [(1, 8, 40), (1, 2, 9), (2, 1, 9), (1, 6, 32), (2, 2, 17)])
@pytest.mark.parametrize("tile_n,tile_k", [(16, 16), (32, 32)])
def test_down_slots_equals_float64_loop_and_separate_path(interpreter, launch_log, m, k, e, tile_n, tile_k):
    p = make_problem(m, k, e, HIDDEN, INTER, dtype=torch.bfloat16, seed=m * 31 + k * 7 + e, skips=True)
    out = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=_slots(tile_n, tile_k))
    assert _kernels(launch_log) == ["gate_up_kernel", "down_slots_kernel"]
    want = experts_loop(p.x, p.w13, p.w2, p.ids, p.weights)
    assert out.shape == p.x.shape and out.dtype == p.x.dtype
    assert torch.allclose(out.double(), want, rtol=2e-2, atol=2e-2)
    separate = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=SMALL)
    assert "down_slots_kernel" not in _kernels(launch_log)
    assert torch.equal(out, separate)  # the same products, the slots summed in the ordered k-sum's order


def test_all_slots_skipped_gives_zero(interpreter):
    p = make_problem(1, 4, 16, HIDDEN, INTER, dtype=torch.bfloat16, seed=3)
    out = interpreter.fused_experts(p.x, p.w13, p.w2, torch.full_like(p.ids, -1), p.weights, config=_slots())
    assert bool((out == 0).all())


def test_taken_only_where_it_applies(interpreter, launch_log):
    """Past the tiny-batch shortcut (4A > E), with an expert map or with b2, the config's down_slots is ignored."""
    p = make_problem(4, 4, 16, HIDDEN, INTER, dtype=torch.bfloat16, seed=5)  # A = 16, 4A > E
    out = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=_slots())
    assert "down_slots_kernel" not in _kernels(launch_log)
    assert torch.allclose(out.double(), experts_loop(p.x, p.w13, p.w2, p.ids, p.weights), rtol=2e-2, atol=2e-2)
    p = make_problem(1, 2, 19, HIDDEN, INTER, dtype=torch.bfloat16, seed=6)
    expert_map = partial_expert_map(19, 16, seed=6)
    out = interpreter.fused_experts(p.x, p.w13[:16], p.w2[:16], p.ids, p.weights, expert_map, config=_slots())
    assert "down_slots_kernel" not in _kernels(launch_log)
    want = experts_loop(p.x, p.w13[:16], p.w2[:16], p.ids, p.weights, expert_map)
    assert torch.allclose(out.double(), want, rtol=2e-2, atol=2e-2)
    b2 = torch.randn(16, HIDDEN).to(torch.bfloat16)
    interpreter.fused_experts(p.x, p.w13[:16], p.w2[:16], p.ids.clamp(max=15), p.weights, config=_slots(), b2=b2)
    assert "down_slots_kernel" not in _kernels(launch_log)


def test_config_round_trips_through_its_dict():
    config = _slots(32, 128)
    assert KernelConfig.from_dict(config.to_dict()) == config
    assert "down_slots" not in SMALL.to_dict() and KernelConfig.from_dict(SMALL.to_dict()) == SMALL


# fp8_block: block shape (128, 128) with K = 160 (a row tail) and N = 96 (one reduction step, a tail); (64, 32) with
# three reduction steps (TMA weights: e4m3 rows of a multiple of 16 bytes). down_slots.BLOCK_K is the group, its
# BLOCK_N divides the rows' block.
@pytest.mark.parametrize("shape,block_shape,tile_n", [((8, 160, 96), (128, 128), 16), ((9, 160, 96), (64, 32), 32)])
@pytest.mark.parametrize("up_n", [16, None])  # 16: h float32, quantized in the down kernel; None: h_q + h_s
@pytest.mark.parametrize("m,k", [(1, 2), (2, 1)])
def test_fp8_down_slots_equals_twin_and_separate_path(shape, block_shape, tile_n, up_n, m, k):
    from _fp8_cases import POISON, problem
    from _triton_helpers import interpreted

    x, _, quantized, ids, weights = problem(m, k, shape, block_shape, seed=m * 5 + k + shape[0])
    group = block_shape[1]
    config = KernelConfig(16, GemmTile(up_n or block_shape[0], group), GemmTile(16, group))
    with interpreted("moekit.experts", "moekit.experts.triton_fp8") as fp8:
        args = (x, *quantized, ids, weights, None, block_shape)
        slots = replace(config, down_slots=GemmTile(tile_n, group, num_warps=4, num_stages=2))
        with_slots = fp8.fused_experts_fp8_launch(*args, slots, POISON)
        separate = fp8.fused_experts_fp8_launch(*args, config, POISON)
        twin = fp8.fused_experts_fp8_torch(x, *quantized, ids, weights, block_shape=block_shape)
        plan = fp8.plan_for(x, *quantized, ids.contiguous(), weights, None, block_shape, slots, POISON)
    assert plan.down_slots is not None
    assert torch.allclose(with_slots, separate, rtol=1e-5, atol=1e-6)
    assert torch.allclose(with_slots, twin, rtol=1e-3, atol=1e-3)

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

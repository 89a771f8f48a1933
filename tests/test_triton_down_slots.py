"""The tiny-batch down GEMM + k-sum over a token's slots (``_kernels/down_slots.py``, ``triton_down_slots``), under
Triton's interpreter: equal to a float64 per-(token, slot) loop, to the separate down + k-sum path, with skipped
slots (-1) adding nothing, column tails (K not a multiple of BLOCK_N) and reduction tails (N not one of BLOCK_K)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import experts_loop, make_problem  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402

SMALL = KernelConfig(16, GemmTile(16, 32), GemmTile(16, 16))
HIDDEN, INTER = 40, 24  # K: 3 column tiles of 16 (the last 8 wide); N: 24 = 16 + 8 (a reduction tail)


@pytest.fixture
def slots(interpreter):
    from moekit.experts import triton_down_slots

    triton_down_slots._KEPT.clear()  # launches of kernels decorated outside the interpreter
    yield triton_down_slots
    triton_down_slots._KEPT.clear()


# (M, k, E): A*4 <= E (the tiny-batch shortcut), k in {1, 2, 6, 8}
@pytest.mark.parametrize("m,k,e", [(1, 8, 40), (1, 2, 9), (2, 1, 9), (1, 6, 32), (2, 2, 17)])
@pytest.mark.parametrize("tile_n,tile_k", [(16, 16), (32, 32)])
def test_down_slots_equals_float64_loop_and_separate_path(interpreter, slots, m, k, e, tile_n, tile_k):
    p = make_problem(m, k, e, HIDDEN, INTER, dtype=torch.bfloat16, seed=m * 31 + k * 7 + e, skips=True)
    tile = slots.SlotsTile(BLOCK_N=tile_n, BLOCK_K=tile_k, num_stages=2)
    out = slots.experts_down_slots(p.x, p.w13, p.w2, p.ids, p.weights, tile, config=SMALL)
    want = experts_loop(p.x, p.w13, p.w2, p.ids, p.weights)
    assert out.shape == p.x.shape and out.dtype == p.x.dtype
    assert torch.allclose(out.double(), want, rtol=2e-2, atol=2e-2)
    separate = interpreter.fused_experts(p.x, p.w13, p.w2, p.ids, p.weights, config=SMALL)
    assert torch.allclose(out.float(), separate.float(), rtol=1e-2, atol=1e-2)


def test_all_slots_skipped_gives_zero(interpreter, slots):
    p = make_problem(1, 4, 16, HIDDEN, INTER, dtype=torch.bfloat16, seed=3)
    ids = torch.full_like(p.ids, -1)
    out = slots.experts_down_slots(p.x, p.w13, p.w2, ids, p.weights, slots.SlotsTile(16, 16, 4, 2), config=SMALL)
    assert bool((out == 0).all())


def test_refuses_past_the_tiny_batch_shortcut(interpreter, slots):
    p = make_problem(4, 4, 16, HIDDEN, INTER, dtype=torch.bfloat16, seed=5)  # A = 16, 4A > E
    with pytest.raises(ValueError, match="A\\*4 <= E"):
        slots.experts_down_slots(p.x, p.w13, p.w2, p.ids, p.weights, config=SMALL)

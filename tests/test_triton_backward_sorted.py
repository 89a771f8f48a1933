"""grad_gate_up on dout and x permuted into the layout's rows (``triton_backward_sorted``, ``KernelTiles``
``contiguous`` on the grad tile) under Triton's interpreter, tiny shapes: every grad of the backward
against the float64 autograd of ``test_triton_backward``'s per-token loop. Fused (three accumulators) and
split (dg by its own GEMM), M-blocks smaller than the layout's, pointer and TMA loads.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, spy_desc  # noqa: E402, F401  (interpreter: fixture)
from _helpers import experts_loop, make_problem, rel_l2  # noqa: E402
from test_triton_backward import NAMES, TOL, grads_of  # noqa: E402


def _tiles(block_m: int, grad, weight_step: int = 16):
    from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles

    weight = KernelTiles(16, weight_step, 1, 1, rows=32, split=1, desc=grad.desc, contiguous=True, group=2)
    return BackwardTiles(block_m, grad=grad, dx=KernelTiles(16, 16, 1, 1), dw13=weight, dw2=weight)


def _grads(problem, tiles, dtype, spy=None) -> tuple[dict, dict]:
    """(the launch layer's grads with ``tiles``, the loop's in float64) of sum(out * dout)."""
    import moekit.experts.triton_backward_launch as bl

    dout = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(7))
    want = grads_of(experts_loop, problem, dout, torch.float64, torch.float64)
    x, w13, w2, ids, weights = problem
    g = bl.experts_backward(dout.to(dtype), x, w13, w2, ids, weights, None, None, "silu", (True,) * 4, tiles=tiles)
    return {"x": g.x, "w13": g.w13, "w2": g.w2, "topk_weights": g.topk_weights}, want


@pytest.mark.parametrize("k", [1, 6])  # empty experts at k = 1 (as at k = 2, dropped), none at 6
@pytest.mark.parametrize("dg_cols", [0, 32])
def test_sorted_grad_gate_up_odd_shapes(interpreter, k, dg_cols):
    """K=33, N=17 (every tail masked, two N tiles of 16, dg's one 32-wide tile), 16-row M-blocks in a
    32-row layout, E=8 with skipped slots and (k=6 over 45 tokens aside) empty experts; fused and split."""
    from moekit.experts.triton_backward_launch import KernelTiles

    grad = KernelTiles(16, 16, 1, 1, rows=16, contiguous=True, group=2, dg_cols=dg_cols)
    problem = make_problem(45, k, 8, 33, 17, seed=30 + k, skips=True)
    got, want = _grads(problem, _tiles(32, grad), torch.float32)
    for name in NAMES:
        assert got[name].dtype == torch.float32, name
        assert rel_l2(got[name], want[name]) < TOL[torch.float32], name


def test_sorted_grad_gate_up_empty_expert(interpreter):
    """An expert no token picks gets zero weight grads; the others match the loop."""
    from moekit.experts.triton_backward_launch import KernelTiles

    problem = make_problem(20, 2, 5, 33, 17, seed=41)
    problem.ids[problem.ids == 3] = 4  # expert 3 empty (tokens may now pick 4 twice: still a valid routing)
    grad = KernelTiles(16, 16, 1, 1, contiguous=True, dg_cols=16)
    got, want = _grads(problem, _tiles(16, grad), torch.float32)
    assert torch.equal(got["w13"][3], torch.zeros_like(got["w13"][3]))
    assert torch.equal(got["w2"][3], torch.zeros_like(got["w2"][3]))
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < TOL[torch.float32], name


@pytest.mark.parametrize("dg_cols", [0, 16])
def test_sorted_grad_gate_up_descriptors(interpreter, monkeypatch, dg_cols):
    """bf16 with 16-byte rows (K=48, N=24): dout, x and both weights through TMA descriptors (DESC seen by
    every launch of the sorted kernels; the last N tile of 16 reads past N into the up rows, never stored)."""
    import moekit.experts.triton_backward_sorted as bs
    from moekit.experts.triton_backward_launch import KernelTiles

    seen = spy_desc(monkeypatch, bs)
    grad = KernelTiles(16, 16, 1, 1, rows=16, desc=True, contiguous=True, group=2, dg_cols=dg_cols)
    problem = make_problem(21, 2, 4, 48, 24, dtype=torch.bfloat16, seed=22, skips=True)
    got, want = _grads(problem, _tiles(32, grad), torch.bfloat16)
    names = ["sorted_gemm_kernel"] * (dg_cols > 0) + ["grad_gate_up_sorted_kernel"]
    assert seen == [(name, True) for name in names]
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < TOL[torch.bfloat16], name


def test_sorted_grad_gate_up_equals_the_gathering_kernel(interpreter):
    """The same grads (float32, to rounding) as the gathering grad_gate_up with the same weight grads."""
    from moekit.experts.triton_backward_launch import KernelTiles

    problem = make_problem(33, 6, 8, 33, 17, seed=50, skips=True)
    sorted_grads, _ = _grads(problem, _tiles(32, KernelTiles(16, 16, 1, 1, contiguous=True, dg_cols=16)),
                             torch.float32)
    gathered, _ = _grads(problem, _tiles(32, KernelTiles(16, 16, 1, 1)), torch.float32)
    for name in NAMES:
        assert rel_l2(sorted_grads[name], gathered[name]) < 1e-6, name


def test_sorted_grad_gate_up_block_must_divide_the_layout(interpreter):
    from moekit.experts.triton_backward_launch import KernelTiles

    problem = make_problem(9, 2, 4, 33, 17, seed=3)
    with pytest.raises(ValueError, match="rows=24"):
        _grads(problem, _tiles(32, KernelTiles(16, 16, 1, 1, rows=24, contiguous=True)), torch.float32)


@pytest.mark.parametrize("k,desc", [(1, False), (2, True), (6, False)])
def test_sorted_dx(interpreter, k, desc):
    """dX from dh in the layout's rows (``dx_sorted``: ``contiguous`` dx tile), 16-row M-blocks in a 32-row
    layout, skipped slots; float32 pointer tiles (K=33, N=17) or bf16 through TMA (K=48, N=24); every grad
    against the loop."""
    import dataclasses

    from moekit.experts.triton_backward_launch import KernelTiles

    grad = KernelTiles(16, 16, 1, 1, rows=16, desc=desc, contiguous=True, group=2)
    tiles = dataclasses.replace(_tiles(32, grad), dx=KernelTiles(16, 16, 1, 1, rows=16, desc=desc, contiguous=True,
                                                                 group=2))
    dtype = torch.bfloat16 if desc else torch.float32
    problem = make_problem(37, k, 8, 48 if desc else 33, 24 if desc else 17, dtype=dtype, seed=80 + k, skips=True)
    got, want = _grads(problem, tiles, dtype)
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < TOL[dtype], name

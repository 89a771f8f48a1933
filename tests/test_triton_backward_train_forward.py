"""The training forward on x permuted into the layout's rows (``triton_train_forward.sorted_forward``,
``_kernels/gemm_train_forward.py``) under Triton's interpreter, tiny shapes, against the float64 per-token
loop (``_helpers.experts_loop``): the output alone (odd K/N, k in {1, 2, 6}, skipped slots, an empty
expert, pointer and TMA tiles), and ``experts_triton_train`` forward + backward when the tiles carry it
(the backward then reads the kept x_p instead of permuting x again).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter, spy_desc  # noqa: E402, F401  (interpreter: fixture)
from _helpers import experts_loop, make_problem, rel_l2  # noqa: E402
from test_triton_backward import NAMES, TOL, grads_of  # noqa: E402


def _tiles(block_m: int, desc: bool = False, rows: int = 16):
    from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles

    weight = KernelTiles(16, 16, 1, 1, rows=32, split=1, desc=desc, contiguous=True, group=2)
    fwd = KernelTiles(16, 16, 1, 1, rows=rows, desc=desc, contiguous=True, group=2)
    grad = KernelTiles(16, 16, 1, 1, rows=16, desc=desc, contiguous=True, group=2)
    return BackwardTiles(block_m, grad=grad, dx=KernelTiles(16, 16, 1, 1), dw13=weight, dw2=weight, fwd13=fwd,
                         fwd2=dataclasses.replace(fwd, cols=32))


@pytest.mark.parametrize("k", [1, 2, 6])
def test_sorted_forward_odd_shapes(interpreter, k):
    """K=33, N=17: every tail masked; 16-row M-blocks in a 32-row layout; E=8 with skipped slots; expert 5 empty."""
    from moekit.experts.triton_train_forward import layout_rows, sorted_forward

    problem = make_problem(45, k, 8, 33, 17, seed=60 + k, skips=True)
    problem.ids[problem.ids == 5] = -1
    x, w13, w2, ids, weights = problem
    kept = sorted_forward(x, w13, w2, ids, weights, None, "silu", _tiles(32))
    assert kept.out.dtype == torch.float32 and kept.x_p.shape == (layout_rows(ids.numel(), 8, 32), 33)
    assert kept.h_p is None
    assert rel_l2(kept.out, experts_loop(*problem)) < TOL[torch.float32]


def test_sorted_forward_descriptors(interpreter, monkeypatch):
    """bf16 with 16-byte rows (K=48, N=24): x_p, g_p and both weights through TMA (DESC seen by both launches)."""
    import moekit.experts.triton_train_forward as tf

    seen = spy_desc(monkeypatch, tf)
    problem = make_problem(21, 2, 4, 48, 24, dtype=torch.bfloat16, seed=22, skips=True)
    x, w13, w2, ids, weights = problem
    out = tf.sorted_forward(x, w13, w2, ids, weights, None, "silu", _tiles(32, desc=True)).out
    assert seen == [("gate_up_train_kernel", True), ("down_train_kernel", True)]
    assert rel_l2(out, experts_loop(*problem)) < TOL[torch.bfloat16]


def test_sorted_forward_block_must_divide_the_layout(interpreter):
    from moekit.experts.triton_train_forward import sorted_forward

    x, w13, w2, ids, weights = make_problem(9, 2, 4, 33, 17, seed=3)
    with pytest.raises(ValueError, match="rows=24"):
        sorted_forward(x, w13, w2, ids, weights, None, "silu", _tiles(32, rows=24))


@pytest.mark.parametrize("k", [1, 6])
def test_train_op_forward_and_backward_on_permuted_rows(interpreter, monkeypatch, k):
    """With forward tiles in the table, ``experts_triton_train`` runs the sorted forward, and its
    backward gets the kept x_p; out and every grad match the float64 loop's autograd."""
    import moekit.experts.triton_backward as tb
    import moekit.experts.triton_backward_launch as bl

    monkeypatch.setattr(tb, "backward_tiles", lambda *a: _tiles(32))
    real_backward, kept = bl.experts_backward, []
    monkeypatch.setattr(bl, "backward_tiles", lambda *a: _tiles(32))

    def spy(*args, **kw):
        kept.append(kw.get("x_p"))
        return real_backward(*args, **kw)

    monkeypatch.setattr(tb, "experts_backward", spy)
    problem = make_problem(37, k, 8, 33, 17, seed=70 + k, skips=True)
    dout = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(9))
    want = grads_of(experts_loop, problem, dout, torch.float64, torch.float64)
    got = grads_of(tb.experts_triton_train, problem, dout, torch.float32, torch.float32)
    assert len(kept) == 1 and kept[0] is not None and kept[0].shape[1] == 33
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < TOL[torch.float32], name


def test_opcheck_train_op_keeps_x_p(interpreter, monkeypatch):
    """With forward tiles, the train op's fake gives the kept x_p the real one's shape (torch.library.opcheck)."""
    import moekit.experts.triton_backward as tb
    import moekit.experts.triton_backward_launch as bl

    monkeypatch.setattr(tb, "backward_tiles", lambda *a: _tiles(32))
    monkeypatch.setattr(bl, "backward_tiles", lambda *a: _tiles(32))
    x, w13, w2, ids, weights = make_problem(6, 2, 8, 33, 17, seed=11)
    args = (x, w13, w2, ids, weights, None, "silu", False, 0)
    torch.library.opcheck(torch.ops.moekit.triton_experts_train.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    assert torch.ops.moekit.triton_experts_train(*args)[1].shape == (tb.layout_rows(12, 8, 32), 33)


@pytest.mark.parametrize("impl, recompute", [("moekit:triton_train", True), ("moekit:triton_kept", False)])
def test_bench_train_steps_run_the_train_op(interpreter, monkeypatch, impl, recompute):
    """``moekit bench --train``'s triton rows run ``experts_triton_train`` (spied) with the backward they are named
    for: ``moekit:triton_train`` recomputing the gate-up product, ``moekit:triton_kept`` keeping it (what
    ``backend="auto"`` trains plain layers with from 1024 tokens); their grads (x, the gate, w13, w2) equal the
    reference backend's step on the same problem."""
    import moekit.bench.train_measure as tm
    import moekit.experts.triton_backward as tb
    from moekit.bench.cells import Shape

    calls, real = [], tb.experts_triton_train

    def spy(*a, **kw):
        calls.append(kw.get("backward", tb.BackwardOptions()).recompute)
        return real(*a, **kw)

    monkeypatch.setattr(tb, "experts_triton_train", spy)
    problem = tm._problem(Shape("tiny", 4, 17, 33, 2), 9, torch.float32, torch.device("cpu"))
    grads = {}
    for name in (impl, "moekit:reference"):
        tm._clear_grads(problem)
        tm._moekit_step(problem, name.split(":", 1)[1])()
        grads[name] = [t.grad.clone() for t in problem.leaves]
    assert calls == [recompute]
    for got, want in zip(grads[impl], grads["moekit:reference"]):
        assert rel_l2(got, want) < TOL[torch.float32]
    assert impl not in tm.default_impls(torch.device("cpu"))


def test_bench_train_rows_beside_triton(monkeypatch):
    """Where the triton backend is available, both training rows follow its inference row, before transformers'."""
    import moekit.bench.train_measure as tm

    monkeypatch.setattr(tm, "available_backends", lambda device: ["triton", "grouped_mm", "reference"])
    assert tm.default_impls(torch.device("cpu")) == ["moekit:triton", "moekit:grouped_mm", "moekit:triton_train",
                                                     "moekit:triton_kept", "transformers:grouped_mm"]

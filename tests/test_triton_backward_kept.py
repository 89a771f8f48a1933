"""The kept path of ``experts_triton_train`` (``BackwardOptions(recompute=False)``): the forward on permuted rows keeps
the gate-up pre-activation h_p [P, 2N] (``gate_up_train_kernel`` with H_OUT) and the backward reads it
(``grad_gate_up_sorted_kernel`` with H_IN) instead of recomputing it. Under Triton's interpreter, tiny shapes: the
gradients of x, w13, w2 and topk_weights with and without the recompute against each other and the float64 autograd
of a per-token loop written here; h_p against its torch twin (x_p @ w13[e]^T in float64, row by layout row); what
ran (the kernels' constexprs); the op's fake. The variants (biases, other specs) keep the recomputing backward of
``triton_backward_recompute``, which refuses options (``tests/test_triton_backward_variants.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from _helpers import make_problem, rel_l2  # noqa: E402

NAMES = ("x", "w13", "w2", "topk_weights")


def loop64(x, w13, w2, ids, weights, expert_map=None):
    """out [M, K]: for each token and slot routed to a local expert e, w * w2[e] (silu(gate) * up), gate / up the
    halves of w13[e] x; float64, differentiable."""
    n = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e]) if 0 <= e < expert_map.numel() else -1
            if e < 0 or e >= w13.shape[0]:
                continue
            h = w13[e].double() @ x[t].double()
            y = y + weights[t, j].double() * (w2[e].double() @ (F.silu(h[:n]) * h[n:]))
        rows.append(y)
    return torch.stack(rows) if rows else out


def grads(fn, problem, dout, dtype=torch.float32) -> dict:
    x, w13, w2, ids, weights = problem
    leaves = {"x": x.to(dtype), "w13": w13.to(dtype), "w2": w2.to(dtype), "topk_weights": weights.float()}
    leaves = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], ids, leaves["topk_weights"])
    got = torch.autograd.grad(out, list(leaves.values()), dout.to(out.dtype))
    return dict(zip(NAMES, got))


def _train(recompute: bool, expert_map=None):
    from moekit.experts.triton_backward import BackwardOptions, experts_triton_train

    return lambda *a: experts_triton_train(*a, expert_map=expert_map, backward=BackwardOptions(recompute=recompute))


@pytest.mark.parametrize("m, k, e", [(1, 1, 4), (19, 2, 8), (33, 6, 8)])
def test_kept_and_recomputed_grads_equal_the_float64_loop(interpreter, m, k, e):
    """K=33, N=17 (every tail masked), skipped slots; float32: kept and recomputed agree to float32 rounding."""
    problem = make_problem(m, k, e, 33, 17, seed=100 + m, skips=m > 1)
    dout = torch.randn(m, 33, generator=torch.Generator().manual_seed(m))
    want = grads(loop64, problem, dout, torch.float64)
    kept, recomputed = grads(_train(False), problem, dout), grads(_train(True), problem, dout)
    for name in NAMES:
        assert want[name].abs().max() > 0, name
        assert rel_l2(kept[name], want[name]) < 1e-5, name
        assert rel_l2(recomputed[name], want[name]) < 1e-5, name
        assert rel_l2(kept[name], recomputed[name]) < 1e-6, name


def test_kept_with_an_expert_map_and_an_empty_expert(interpreter):
    """Expert parallelism's map (3 of 11 global experts elsewhere), ids out of range, expert 2 without rows: the
    unrouted slots' weight grads are exactly 0, an empty expert's weight grads exactly 0."""
    problem = make_problem(21, 3, 8, 33, 17, seed=7)
    g = torch.Generator().manual_seed(7)
    expert_map = torch.full((11,), -1, dtype=torch.int32)
    expert_map[torch.randperm(11, generator=g)[:8]] = torch.arange(8, dtype=torch.int32)
    ids = torch.randint(-1, 13, (21, 3), generator=g, dtype=torch.int32)
    ids[expert_map[ids.clamp(0, 10).long()] == 2] = -1  # local expert 2 gets nothing
    problem = problem._replace(ids=ids)
    dout = torch.randn(21, 33, generator=g)
    want = grads(lambda *a: loop64(*a, expert_map=expert_map), problem, dout, torch.float64)
    got = grads(_train(False, expert_map), problem, dout)
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < 1e-5, name
    unrouted = (ids < 0) | (ids >= 11) | (expert_map[ids.clamp(0, 10).long()] < 0)
    assert unrouted.any() and torch.equal(got["topk_weights"][unrouted], torch.zeros(int(unrouted.sum())))
    assert torch.equal(got["w13"][2], torch.zeros_like(got["w13"][2]))
    assert torch.equal(got["w2"][2], torch.zeros_like(got["w2"][2]))


def _seen_constexprs(monkeypatch, modules) -> list:
    """(kernel name, H_OUT / H_IN, DESC constexprs) of every launch through ``modules``' ``kernels``; they still run."""
    seen = []
    for module in modules:
        real = module.kernels

        class Spy:
            def __init__(self, kernels):
                self.kernels = kernels

            def __getattr__(self, name):
                kernel = getattr(self.kernels, name)
                return type("K", (), {"__getitem__": lambda _, grid: lambda *a, **kw: (
                    seen.append((name, kw.get("H_OUT", kw.get("H_IN")), kw.get("DESC"))), kernel[grid](*a, **kw))[1]})()

        monkeypatch.setattr(module, "kernels", lambda name, real=real: Spy(real(name)))
    return seen


@pytest.mark.parametrize("desc", [False, True])
def test_bf16_kept_path_stores_and_reads_h(interpreter, monkeypatch, desc):
    """bf16 with 16-byte rows (K=64, N=24): the forward's gate-up kernel stores h_p (H_OUT), the backward's grad
    kernel reads it (H_IN) and no kernel recomputes the gate-up product; through TMA where the shape's weight grads
    have it (``desc``: the interpreter's tiles with TMA weight grads, as ``TUNED``'s on sm_90), else pointer loads;
    the grads hold to the float64 loop within bf16's tolerance and to the recomputing path's."""
    import dataclasses

    import moekit.experts.triton_backward as tb
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_backward_sorted as bs
    import moekit.experts.triton_train_forward as tf

    real = bl.backward_tiles

    def tiles(*args):
        t = real(*args)
        return dataclasses.replace(t, dw13=dataclasses.replace(t.dw13, desc=desc))

    problem = make_problem(21, 2, 4, 64, 24, dtype=torch.bfloat16, seed=22, skips=True)
    dout = torch.randn(21, 64, generator=torch.Generator().manual_seed(3))
    want = grads(loop64, problem, dout, torch.float64)
    recomputed = grads(_train(True), problem, dout, torch.bfloat16)
    monkeypatch.setattr(tb, "backward_tiles", tiles)
    monkeypatch.setattr(bl, "backward_tiles", tiles)
    seen = _seen_constexprs(monkeypatch, (tf, bs))
    kept = grads(_train(False), problem, dout, torch.bfloat16)
    assert ("gate_up_train_kernel", True, desc) in seen and ("grad_gate_up_sorted_kernel", True, desc) in seen, seen
    assert not [s for s in seen if s[0] in ("gate_up_train_kernel", "grad_gate_up_sorted_kernel") and not s[1]], seen
    for name in NAMES:
        assert kept[name].dtype == (torch.float32 if name == "topk_weights" else torch.bfloat16), name
        assert rel_l2(kept[name], want[name]) < 1e-2, name
        assert rel_l2(kept[name], recomputed[name]) < 1e-2, name


def test_kept_h_p_is_the_gate_up_product_in_the_layout_rows(interpreter):
    """h_p's torch twin: row p of the layout holds w13[e] x_t of its assignment (t, e) in float64 within float32
    rounding, padding rows hold zeros; x_p the token's row; the shapes the module docstring states."""
    from moekit.experts.triton_backward_launch import align, backward_tiles
    from moekit.experts.triton_backward_sorted import kept_tiles
    from moekit.experts.triton_train_forward import layout_rows, sorted_forward

    x, w13, w2, ids, weights = make_problem(13, 2, 4, 33, 17, seed=31, skips=True)
    tiles = kept_tiles(backward_tiles(ids.numel(), 4, 17, x.dtype))
    kept = sorted_forward(x, w13, w2, ids, weights, None, "silu", tiles, keep_h=True)
    rows = layout_rows(ids.numel(), 4, tiles.block_m)
    assert kept.h_p.shape == (rows, 34) and kept.x_p.shape == (rows, 33)
    layout = align(ids.contiguous(), None, 4, tiles.block_m)
    used = int(layout.num_padded)
    flat = ids.flatten().long()
    for p in range(used):
        a = int(layout.sorted_ids[p])
        if a >= ids.numel():  # padding row
            assert torch.equal(kept.h_p[p], torch.zeros(34)) and torch.equal(kept.x_p[p], torch.zeros(33)), p
            continue
        e, t = int(layout.expert_ids[p // tiles.block_m]), a // 2
        assert e == int(flat[a]), p
        assert torch.equal(kept.x_p[p], x[t]), p
        twin = w13[e].double() @ x[t].double()
        assert (kept.h_p[p].double() - twin).abs().max() < 1e-5 * twin.abs().max(), p


def test_opcheck_train_op_keeps_h_p(interpreter):
    """The train op with save_h: the fake gives x_p and h_p the real ones' shapes and dtypes (opcheck)."""
    from moekit.experts.triton_backward import layout_rows

    x, w13, w2, ids, weights = make_problem(6, 2, 8, 33, 17, seed=11)
    args = (x, w13, w2, ids, weights, None, "silu", True, 0)
    torch.library.opcheck(torch.ops.moekit.triton_experts_train.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    out, x_p, h_p = torch.ops.moekit.triton_experts_train(*args)
    rows = layout_rows(12, 8, 16)
    assert out.shape == (6, 33) and x_p.shape == (rows, 33) and h_p.shape == (rows, 34)


def test_compile_traces_the_kept_path(interpreter):
    """torch.compile(fullgraph=True, aot_eager) through the kept path: the train op's fake gives x_p and h_p, the
    backward op takes them; one graph each way, the grads equal eager's."""
    problem = make_problem(6, 2, 8, 33, 17, seed=9)
    dout = torch.randn(6, 33, generator=torch.Generator().manual_seed(2))
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counts = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_train(False), fullgraph=True, backend=counts)
    eager, traced = grads(_train(False), problem, dout), grads(compiled, problem, dout)
    assert counts.frame_count == 1
    for name in NAMES:
        assert rel_l2(traced[name], eager[name]) < 1e-6, name


def test_the_kept_tensors_get_no_zero_grads(interpreter):
    """x_p and h_p are outputs of the train op marked non-differentiable: its backward is handed None for them, not
    zeros of [P, K] and [P, 2N] that autograd would allocate and fill at every step (materialized grads)."""
    import moekit.experts.triton_backward as tb

    handed = []

    def spy(ctx, dout, x_p_grad, h_p_grad):
        handed.append((x_p_grad, h_p_grad))
        return tb._backward_train(ctx, dout, x_p_grad, h_p_grad)

    tb._train_op.register_autograd(spy, setup_context=tb._setup_train)
    try:
        x, w13, w2, ids, weights = make_problem(6, 2, 8, 33, 17, seed=1)
        _train(False)(x.requires_grad_(), w13, w2, ids, weights).sum().backward()
    finally:
        tb._train_op.register_autograd(tb._backward_train, setup_context=tb._setup_train)
    assert handed == [(None, None)] and x.grad is not None

"""Gradients of the Triton experts path on the CPU, under Triton's interpreter (TRITON_INTERPRET=1), tiny
shapes: against the float64 autograd of a per-token loop written here.

Three ways in: ``experts_triton`` (the ``moekit::triton_experts`` op, autograd registered by
``triton_backward``), ``experts_triton_train`` with the gate-up product recomputed or saved, and a split
of the weight grads over M. What the interpreter cannot show (bf16 tl.dot, speed, memory) is
``benchmarks/backward_device_check.py``'s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from _helpers import experts_loop, make_problem, rel_l2  # noqa: E402
from moekit.experts.triton_backward import BackwardOptions, experts_triton_train, unsupported_variant  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NAMES = ("x", "w13", "w2", "topk_weights")


def grads_of(fn, problem, dout, dtype, weight_dtype, requires=NAMES) -> dict:
    """{name: grad} of sum(fn(...) * dout), the inputs cast to ``dtype`` (weights to ``weight_dtype``)."""
    x, w13, w2, ids, weights = problem
    leaves = {"x": x.to(dtype, copy=True), "w13": w13.to(dtype, copy=True), "w2": w2.to(dtype, copy=True),
              "topk_weights": weights.to(weight_dtype, copy=True)}
    for name in requires:
        leaves[name].requires_grad_()
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], ids, leaves["topk_weights"])
    (out * dout.to(out.dtype)).sum().backward()
    return {name: leaves[name].grad for name in NAMES}


def check_grads(fn, problem, dtype=torch.float32, expert_map=None, activation="silu", requires=NAMES) -> dict:
    """fn's grads against the loop's in float64 (inputs rounded to ``dtype`` first); returns fn's."""
    dout = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(7))
    rounded = type(problem)(*(t.to(dtype) if t.is_floating_point() else t for t in problem))
    got = grads_of(fn, rounded, dout, dtype, torch.float32, requires)
    want = grads_of(lambda *a: experts_loop(*a, expert_map=expert_map, spec=activation), rounded, dout,
                    torch.float64, torch.float64, requires)
    for name in NAMES:
        if name not in requires:
            assert got[name] is None, name
            continue
        assert got[name].shape == want[name].shape, name
        assert got[name].dtype == (torch.float32 if name == "topk_weights" else dtype), name
        if want[name].abs().max() == 0:
            assert torch.equal(got[name], torch.zeros_like(got[name])), name
        else:
            assert rel_l2(got[name], want[name]) < TOL[dtype], name
    return got


def _ways(tri, expert_map=None, activation="silu"):
    """The three differentiable entry points, as fn(x, w13, w2, ids, weights)."""
    kw = dict(expert_map=expert_map, activation=activation)
    return {
        "op": lambda *a: tri.experts_triton(*a, **kw),
        "recompute": lambda *a: experts_triton_train(*a, **kw, backward=BackwardOptions(recompute=True)),
        "saved": lambda *a: experts_triton_train(*a, **kw, backward=BackwardOptions(recompute=False, split_m=3)),
    }


# every M and every k at least once, both k extremes at one token (k = 1: the naive shortcut, 6: aligned) and at 33
@pytest.mark.parametrize("m, k", [(1, 1), (1, 6), (3, 2), (33, 1), (33, 6)])
def test_grads_odd_shapes(interpreter, m, k):
    # K = 33, N = 17: every tile tail is masked; E = 8 with k = 6 and skips leaves experts empty.
    check_grads(_ways(interpreter)["op"], make_problem(m, k, 8, 33, 17, seed=10 * m + k, skips=m > 1))


@pytest.mark.parametrize("m,k", [(1, 1), (33, 6)])
def test_recompute_and_saved_equal(interpreter, m, k):
    """Both ``BackwardOptions`` modes hold to the loop, and to each other (one reads the kept h_p, the
    other recomputes it: the same float32 values here, so they agree far below the tolerance)."""
    problem = make_problem(m, k, 8, 33, 17, seed=m + k, skips=m > 1)
    ways = _ways(interpreter)
    recomputed, saved = check_grads(ways["recompute"], problem), check_grads(ways["saved"], problem)
    for name in NAMES:
        assert rel_l2(saved[name], recomputed[name]) < 1e-6, name


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_grads_other_activations(interpreter, activation):
    check_grads(_ways(interpreter, activation=activation)["op"], make_problem(9, 2, 4, 33, 17, seed=3),
                activation=activation)


def test_grads_bf16(interpreter):
    # The interpreter upcasts bf16 operands; this checks the casts and the dtypes of the grads.
    check_grads(_ways(interpreter)["op"], make_problem(17, 2, 8, 33, 17, seed=4), dtype=torch.bfloat16)


def test_empty_experts_and_all_on_one(interpreter):
    problem = make_problem(33, 2, 8, 33, 17, seed=5)
    on_two = torch.stack([torch.full((33,), 5), torch.full((33,), 2)], 1).int()  # six experts stay empty
    got = check_grads(_ways(interpreter)["op"], problem._replace(ids=on_two))
    for name in ("w13", "w2"):  # an expert without rows gets exactly 0 (its tiles are written, not skipped)
        assert torch.equal(got[name][0], torch.zeros_like(got[name][0])), name
    all_on_one = torch.full((33, 2), 7, dtype=torch.int32)  # 66 rows: more than one block of 16
    check_grads(_ways(interpreter)["saved"], problem._replace(ids=all_on_one))


def test_expert_map_and_skipped_ids(interpreter):
    problem = make_problem(13, 6, 8, 33, 17, seed=6)
    g = torch.Generator().manual_seed(6)
    expert_map = torch.full((11,), -1, dtype=torch.int32)
    expert_map[torch.randperm(11, generator=g)[:8]] = torch.arange(8, dtype=torch.int32)  # 3 entries -1
    ids = torch.randint(-1, 13, (13, 6), generator=g, dtype=torch.int32)  # -1 and >= 11 too: skipped
    for way in ("op", "saved"):
        fn = _ways(interpreter, expert_map=expert_map)[way]
        got = check_grads(fn, problem._replace(ids=ids), expert_map=expert_map)
        unrouted = (ids < 0) | (ids >= 11) | (expert_map[ids.clamp(0, 10).long()] < 0)
        assert unrouted.any() and torch.equal(got["topk_weights"][unrouted], torch.zeros(int(unrouted.sum()))), way


def test_router_only_and_x_only(interpreter):
    # Frozen experts: the routed weights alone need a grad (the eager path must not skip the op).
    problem = make_problem(7, 2, 8, 33, 17, seed=8)
    check_grads(_ways(interpreter)["op"], problem, requires=("topk_weights",))
    check_grads(_ways(interpreter)["recompute"], problem, requires=("x",))


def test_compile_traces_forward_and_backward(interpreter):
    """torch.compile(fullgraph=True) through AOTAutograd: the forward and the backward are traced with
    the ops' fakes (one graph each, no break), then run; the grads equal eager's."""
    problem = make_problem(6, 2, 8, 33, 17, seed=9)
    fn = _ways(interpreter)["op"]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager = check_grads(fn, problem)
    traced = check_grads(compiled, problem)
    for name in NAMES:
        assert rel_l2(traced[name], eager[name]) < 1e-6, name


def test_opcheck_backward_op(interpreter):
    """The backward op's schema, fake and dispatch agree with its implementation (torch.library.opcheck)."""
    x, w13, w2, ids, weights = make_problem(4, 2, 8, 33, 17, seed=11)
    args = (torch.randn(4, 33), x, w13, w2, ids, weights, None, None, "silu", True, True, False, True, 0, None)
    torch.library.opcheck(torch.ops.moekit.triton_experts_backward.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_layer_trains_one_step(interpreter):
    """``MoE(backend="triton")`` trains: every parameter's grad (the router's gate included) equals the
    same layer's on the reference backend, and one SGD step lowers the loss."""
    from moekit import MoE, MoEConfig

    cfg = MoEConfig(hidden_size=33, moe_intermediate_size=17, num_experts=8, top_k=2)
    torch.manual_seed(0)
    layer = MoE(cfg, backend="triton")
    twin = MoE(cfg, backend="reference")
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(12, 33, generator=torch.Generator().manual_seed(1))
    target = torch.randn(12, 33, generator=torch.Generator().manual_seed(2))
    losses = []
    for moe in (layer, twin):
        loss = F.mse_loss(moe(x), target)
        loss.backward()
        losses.append(loss.item())
    for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert p.grad is not None and rel_l2(p.grad, q.grad) < 1e-5, name
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    with torch.no_grad():
        after = F.mse_loss(layer(x), target).item()
    assert after < losses[0]


def test_variants_the_fused_backward_lacks_are_named():
    """What sends a backward to recomputation (``test_triton_backward_variants`` checks those gradients)."""
    assert unsupported_variant({"activation": "silu", "b13": None, "gated": True}) is None
    assert "b13" in unsupported_variant({"activation": "silu", "b13": torch.zeros(2, 4)})
    assert "interleaved" in unsupported_variant({"activation": "silu", "interleaved": True})
    assert "relu2" in unsupported_variant({"activation": "relu2"})
    with pytest.raises(ValueError, match="split_m"):
        BackwardOptions(split_m=-1)


def test_transposed_weight_views(interpreter):
    """Weights stored transposed (transformers' is_transposed) arrive as views: the kernels read them
    through strides, and the grads reach the stored parameters."""
    x, w13, w2, ids, weights = make_problem(5, 2, 8, 33, 17, seed=12)
    stored13 = w13.transpose(1, 2).contiguous().requires_grad_()  # [E, K, 2N]
    stored2 = w2.transpose(1, 2).contiguous().requires_grad_()  # [E, N, K]
    dout = torch.randn(5, 33, generator=torch.Generator().manual_seed(13))
    out = interpreter.experts_triton(x, stored13.transpose(1, 2), stored2.transpose(1, 2), ids, weights)
    (out * dout).sum().backward()
    want = grads_of(experts_loop, make_problem(5, 2, 8, 33, 17, seed=12), dout, torch.float64, torch.float64)
    assert rel_l2(stored13.grad, want["w13"].transpose(1, 2)) < TOL[torch.float32]
    assert rel_l2(stored2.grad, want["w2"].transpose(1, 2)) < TOL[torch.float32]


def test_train_refuses_what_it_cannot_differentiate(interpreter):
    x, w13, w2, ids, weights = make_problem(3, 2, 8, 33, 17, seed=14)
    with pytest.raises(TypeError, match="activation"):
        experts_triton_train(x, w13, w2, ids, weights, activation=object())
    with pytest.raises(TypeError, match="BackwardOptions"):
        experts_triton_train(x, w13, w2, ids, weights, backward={"recompute": False})


def _launch_grads(problem, dout, tiles, saved: bool, split_m: int = 0) -> dict:
    """The launch layer's grads with explicit ``tiles`` (``saved``: x_p and h_p from the forward that keeps
    them, on ``kept_tiles(tiles)``, which the backward takes too)."""
    from moekit.experts.triton_backward_launch import experts_backward
    from moekit.experts.triton_backward_sorted import kept_tiles
    from moekit.experts.triton_train_forward import sorted_forward

    x, w13, w2, ids, weights = problem
    kept = sorted_forward(x, w13, w2, ids, weights, None, "silu", kept_tiles(tiles), keep_h=True) if saved \
        else None
    g = experts_backward(dout, x, w13, w2, ids, weights, None, kept.h_p if saved else None, "silu", (True,) * 4,
                         split_m, tiles=tiles, x_p=kept.x_p if saved else None)
    return {"x": g.x, "w13": g.w13, "w2": g.w2, "topk_weights": g.topk_weights}


def _check_against_loop(problem, tiles, dtype, saved=False, split_m=0) -> None:
    dout = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(7))
    want = grads_of(experts_loop, problem, dout, torch.float64, torch.float64)
    got = _launch_grads(problem, dout.to(dtype), tiles, saved, split_m)
    for name in NAMES:
        assert got[name].dtype == (torch.float32 if name == "topk_weights" else dtype), name
        assert rel_l2(got[name], want[name]) < TOL[dtype], name


@pytest.mark.parametrize("saved", [False, True])
def test_explicit_tiles_with_tails(interpreter, saved):
    """Non-default tiles, every tail masked (K=33, N=17): 32-row blocks; weight grads whose row step
    (64, 16) is not the layout's block, so a step reaches past an expert's rows into the next one's
    (masked); one split three ways, one not split."""
    from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles

    tiles = BackwardTiles(32, grad=KernelTiles(32, 16, 1, 1), dx=KernelTiles(16, 32, 1, 1),
                          dw13=KernelTiles(16, 64, 1, 1, rows=64, split=1),
                          dw2=KernelTiles(64, 16, 1, 1, rows=16, split=3))
    problem = make_problem(45, 3, 8, 33, 17, seed=21, skips=True)
    _check_against_loop(problem, tiles, torch.float32, saved=saved)


@pytest.mark.parametrize("split_m,saved", [(0, False), (2, True)])
def test_weight_descriptors(interpreter, split_m, saved):
    """bf16 weights with 16-byte rows (K=48, N=24) take the TMA descriptor path in grad_gate_up and
    gather_gemm, dX's (the last N tile of 16 reads past N into the up rows, never stored), and with
    ``saved`` x_p, w13 and the weights of the kept path's grad tile through TMA; the grads hold."""
    from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles, descriptor

    tiles = BackwardTiles(16, grad=KernelTiles(16, 16, 1, 1, desc=True), dx=KernelTiles(32, 16, 1, 1, desc=True),
                          dw13=KernelTiles(32, 16, 1, 1, rows=32), dw2=KernelTiles(32, 32, 1, 1, rows=16))
    problem = make_problem(21, 2, 4, 48, 24, dtype=torch.bfloat16, seed=22, skips=True)
    assert descriptor(problem.w13, [16, 16], 16) is not None and descriptor(problem.w2, [16, 16], 16) is not None
    _check_against_loop(problem, tiles, torch.bfloat16, saved=saved, split_m=split_m)


@pytest.mark.parametrize("saved,both", [(False, True), (True, True), (False, False)])
def test_contiguous_weight_grads(interpreter, saved, both):
    """Contiguous weight grads (``KernelTiles.contiguous``): with both, grad_gate_up writes dh and w*g in
    the layout's rows (padding rows 0) and dX reads dh there; with one, its operands are permuted. Steps
    of 16 in 32-row blocks, K=33 / N=17 tails, empty experts; the grads hold."""
    from moekit.experts.triton_backward_launch import BackwardTiles, KernelTiles

    contiguous = KernelTiles(16, 16, 1, 1, rows=32, contiguous=True, group=2)
    tiles = BackwardTiles(32, grad=KernelTiles(16, 16, 1, 1), dx=KernelTiles(16, 16, 1, 1), dw13=contiguous,
                          dw2=contiguous if both else KernelTiles(32, 16, 1, 1, rows=16, split=2))
    problem = make_problem(45, 3, 8, 33, 17, seed=23, skips=True)
    _check_against_loop(problem, tiles, torch.float32, saved=saved)


def test_descriptor_refusals():
    """The pointer loads stay where a TMA copy cannot serve: float32, a transposed view, rows of 66 bytes,
    and a reduction over rows whose step would cross into the next expert (48 rows, steps of 32)."""
    from moekit.experts.triton_backward_launch import descriptor

    w = torch.zeros(2, 48, 64, dtype=torch.bfloat16)
    assert descriptor(w, [16, 16], 16) is not None
    assert descriptor(w.float(), [16, 16]) is None
    assert descriptor(w.transpose(1, 2), [16, 16]) is None
    assert descriptor(torch.zeros(2, 48, 33, dtype=torch.bfloat16), [16, 16]) is None
    assert descriptor(w, [32, 16], 32) is None


def test_shape_classes_and_the_tuned_table(monkeypatch):
    """``shape_class`` buckets the presets' six cells apart; ``backward_tiles`` takes ``TUNED``'s entry for
    bf16 on an sm_90 device only (float32, another GPU, a class without an entry: the heuristic)."""
    import moekit.experts.triton_backward_launch as bl

    cells = {("qwen3", 4096): (4096 * 8, 128, 768), ("qwen3", 16384): (16384 * 8, 128, 768),
             ("dsv3", 4096): (4096 * 8, 256, 2048), ("dsv3", 16384): (16384 * 8, 256, 2048),
             ("mixtral", 4096): (4096 * 2, 8, 14336), ("mixtral", 16384): (16384 * 2, 8, 14336)}
    classes = {cell: bl.shape_class(*args) for cell, args in cells.items()}
    assert len(set(classes.values())) == 6
    assert classes[("qwen3", 4096)] == "narrow/few" and classes[("mixtral", 16384)] == "wide/many"
    tuned = bl.BackwardTiles(64, *(bl.KernelTiles(128, 32, 4, 4, rows=64 * (i > 1)) for i in range(4)))
    monkeypatch.setattr(bl, "interpreting", lambda: False)
    monkeypatch.setitem(bl.TUNED, "wide/many", tuned)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    cuda = torch.device("cuda")
    assert bl.backward_tiles(32768, 8, 14336, torch.bfloat16, cuda) == tuned
    assert bl.backward_tiles(32768, 8, 14336, torch.float32, cuda).block_m == 128  # the heuristic
    monkeypatch.delitem(bl.TUNED, "wide/some")
    assert not bl.backward_tiles(8192, 8, 14336, torch.bfloat16, cuda).grad.contiguous  # no entry: the heuristic
    capability[0] = (10, 0)
    assert bl.backward_tiles(32768, 8, 14336, torch.bfloat16, cuda) != tuned

"""torch.func transforms through every experts backend on the CPU (the Triton ones under Triton's interpreter):
grad and vjp against ``torch.autograd.grad`` on the same call and against the float64 autograd of the per-token
loop (``_helpers.experts_loop``), jacrev against the closed form d out[t] / d w[t, j] = y[t, j],
jvp against the loop's double-backward jvp (``torch.autograd.functional.jvp``), and the clear errors where a
backend lacks a derivative (``moekit.func_ops``): forward mode and second derivatives on the Triton ops, any
derivative on the fp8_block and weight-only kernels.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from _helpers import experts_loop, make_problem, rel_l2, routed_slots  # noqa: E402
from moekit.experts import get_backend  # noqa: E402
from moekit.experts.triton_backward import BackwardOptions, experts_triton_train  # noqa: E402
from moekit.quant.schemes import quantize  # noqa: E402

BACKENDS = ["reference", "grouped_mm", "triton", "triton_gluon"]
TRITON = {"triton", "triton_gluon"}  # no forward-mode derivative, no second derivative
ARGS = (0, 1, 2, 3)  # x, w13, w2, topk_weights
TOL = 1e-5  # relative L2 against float64 (tests/_helpers.TOLERANCE[float32])


@pytest.fixture(autouse=True)
def _quiet_batching():
    """vmap over a custom op takes torch's per-entry fallback, which warns of its speed on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        yield


def _problem(seed: int = 0):
    """M=5, k=2, E=4, K=16, N=8, some slots -1 (skipped); and the fixed dout [M, K] of the loss."""
    problem = make_problem(5, 2, 4, 16, 8, seed=seed, skips=True)
    dout = torch.randn(5, 16, generator=torch.Generator().manual_seed(seed + 1))
    return problem, dout


def _call(fn, ids):
    return lambda x, w13, w2, weights: fn(x, w13, w2, ids, weights)


def _autograd_grads(fn, problem, dout, dtype=torch.float32) -> tuple:
    """torch.autograd.grad of sum(fn(...) * dout) w.r.t. x, w13, w2, topk_weights, the inputs cast to ``dtype``."""
    leaves = [t.to(dtype).requires_grad_() for t in (problem.x, problem.w13, problem.w2, problem.weights)]
    out = _call(fn, problem.ids)(*leaves)
    return torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_and_vjp_match_autograd_and_the_float64_loop(backend):
    fn = get_backend(backend)
    problem, dout = _problem()
    call, primals = _call(fn, problem.ids), (problem.x, problem.w13, problem.w2, problem.weights)
    got = torch.func.grad(lambda *a: (call(*a) * dout).sum(), argnums=ARGS)(*primals)
    out, vjp_fn = torch.func.vjp(call, *primals)
    by_vjp = vjp_fn(dout)
    same_call = _autograd_grads(fn, problem, dout)
    want = _autograd_grads(experts_loop, problem, dout, torch.float64)
    for name, g, v, a, w in zip(("x", "w13", "w2", "topk_weights"), got, by_vjp, same_call, want):
        torch.testing.assert_close(g, a, msg=f"{name}: torch.func.grad vs torch.autograd.grad")
        torch.testing.assert_close(v, a, msg=f"{name}: torch.func.vjp vs torch.autograd.grad")
        assert rel_l2(g, w) < TOL, name
    assert rel_l2(out, experts_loop(*(t.double() if t.is_floating_point() else t for t in problem))) < TOL


def test_plain_autograd_keeps_the_custom_op():
    """Outside a transform a call that needs a gradient still runs the custom op and its registered autograd."""
    problem, _ = _problem()
    x = problem.x.clone().requires_grad_()
    out = get_backend("triton")(x, problem.w13, problem.w2, problem.ids, problem.weights)
    assert type(out.grad_fn).__name__.startswith("GeneratedBackwardFor_moekit_triton_experts_default")


@pytest.mark.parametrize("backend", BACKENDS)
def test_jacrev_of_the_routed_weights_is_each_slots_expert_output(backend):
    """out[t] = sum_j w[t, j] y[t, j]: d out[t] / d w[t', j] = y[t, j] where t' = t, else 0; 0 for a skipped slot."""
    fn = get_backend(backend)
    problem, _ = _problem(seed=2)
    jac = torch.func.jacrev(lambda w: fn(problem.x, problem.w13, problem.w2, problem.ids, w))(problem.weights)
    want = torch.zeros(*problem.x.shape, *problem.weights.shape, dtype=torch.float64)  # [M, K, M, k]
    n = problem.w2.shape[2]
    for t, j, e in routed_slots(problem.ids, problem.w13.shape[0]):
        h = problem.w13[e].double() @ problem.x[t].double()  # [2N]
        want[t, :, t, j] = problem.w2[e].double() @ (F.silu(h[:n]) * h[n:])
    assert rel_l2(jac, want) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_matches_the_loop_or_refuses(backend):
    fn = get_backend(backend)
    problem, _ = _problem(seed=3)
    g = torch.Generator().manual_seed(4)
    primals = (problem.x, problem.w13, problem.w2, problem.weights)
    tangents = tuple(torch.randn(t.shape, generator=g) for t in primals)
    call = _call(fn, problem.ids)
    if backend in TRITON:
        with pytest.raises(NotImplementedError, match="triton experts backend has no forward-mode derivative"):
            torch.func.jvp(call, primals, tangents)
        with pytest.raises(NotImplementedError, match="no forward-mode derivative"):
            torch.func.jacfwd(lambda w: call(problem.x, problem.w13, problem.w2, w))(problem.weights)
        return
    _, got = torch.func.jvp(call, primals, tangents)
    _, want = torch.autograd.functional.jvp(_call(experts_loop, problem.ids), tuple(t.double() for t in primals),
                                            tuple(t.double() for t in tangents))
    assert rel_l2(got, want) < TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_derivatives_match_the_loop_or_refuse(backend):
    """grad of grad: d/dx of sum(d loss / dw13 * c), against the loop's double backward in float64."""
    fn = get_backend(backend)
    problem, dout = _problem(seed=5)
    c = torch.randn(problem.w13.shape, generator=torch.Generator().manual_seed(6))

    def inner(fn, x, w13):
        return torch.func.grad(lambda w: (fn(x, w, problem.w2.to(x.dtype), problem.ids, problem.weights.to(x.dtype))
                                          * dout.to(x.dtype)).sum())(w13)

    outer = torch.func.grad(lambda x: (inner(fn, x, problem.w13) * c).sum())
    if backend in TRITON:
        with pytest.raises(NotImplementedError, match="triton experts backward has no derivative of its own"):
            outer(problem.x)
        return
    x64 = problem.x.double().requires_grad_()
    w64 = problem.w13.double().requires_grad_()
    out = experts_loop(x64, w64, problem.w2.double(), problem.ids, problem.weights.double())
    (dw,) = torch.autograd.grad((out * dout.double()).sum(), w64, create_graph=True)
    (want,) = torch.autograd.grad((dw * c.double()).sum(), x64)
    assert rel_l2(outer(problem.x), want) < TOL


def test_vmap_and_per_sample_grads_on_triton():
    """vmap comes free on the Triton ops (torch's per-entry fallback): a batch of inputs, and per-token w13 grads."""
    fn = get_backend("triton")
    problem, dout = _problem(seed=7)
    xs = torch.randn(3, *problem.x.shape, generator=torch.Generator().manual_seed(8))  # [B, M, K]
    batched = torch.func.vmap(lambda x: fn(x, problem.w13, problem.w2, problem.ids, problem.weights))(xs)
    for b in range(3):
        torch.testing.assert_close(batched[b], fn(xs[b], problem.w13, problem.w2, problem.ids, problem.weights))

    def token_loss(w13, x, ids, weights, d):  # one token: x [K], ids / weights [k], d [K]
        return (fn(x[None], w13, problem.w2, ids[None], weights[None])[0] * d).sum()

    per_token = torch.func.vmap(torch.func.grad(token_loss), in_dims=(None, 0, 0, 0, 0))(
        problem.w13, problem.x, problem.ids, problem.weights, dout)  # [M, E, 2N, K]
    for t in range(problem.x.shape[0]):
        w64 = problem.w13.double().requires_grad_()
        out = experts_loop(problem.x[t:t + 1].double(), w64, problem.w2.double(), problem.ids[t:t + 1],
                           problem.weights[t:t + 1].double())
        (want,) = torch.autograd.grad((out * dout[t:t + 1].double()).sum(), w64)
        assert rel_l2(per_token[t], want) < TOL, t  # a token whose slots are all skipped: both exactly 0


@pytest.mark.parametrize("recompute", [True, False])
def test_grad_through_experts_triton_train(recompute):
    problem, dout = _problem(seed=9)
    options = BackwardOptions(recompute=recompute)

    def train(x, w13, w2, ids, weights):
        return experts_triton_train(x, w13, w2, ids, weights, backward=options)

    call = _call(train, problem.ids)
    got = torch.func.grad(lambda *a: (call(*a) * dout).sum(), argnums=ARGS)(
        problem.x, problem.w13, problem.w2, problem.weights)
    for g, a, w in zip(got, _autograd_grads(train, problem, dout),
                       _autograd_grads(experts_loop, problem, dout, torch.float64)):
        torch.testing.assert_close(g, a)
        assert rel_l2(g, w) < TOL


@pytest.mark.parametrize("scheme, dtype, kernels", [("fp8_block", torch.float32, "fp8_block kernels"),
                                                    ("int8_w8a16", torch.bfloat16, "weight-only kernels")])
def test_quantized_triton_kernels_refuse_a_derivative_and_grouped_mm_gives_one(scheme, dtype, kernels):
    """The fused quantized kernels have no backward: grad and jvp name them (not functorch's setup_context message,
    not a zero tangent); vmap runs; grouped_mm's grad is its autograd's (weight-only: the dequantized loop's)."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 128, generator=g).to(dtype)
    w13, w2 = torch.randn(2, 256, 128, generator=g) * 0.1, torch.randn(2, 128, 128, generator=g) * 0.1
    ids, weights = torch.tensor([[0], [1]]), torch.rand(2, 1, generator=g)
    q13, q2 = quantize(w13, scheme), quantize(w2, scheme)
    tri = get_backend("triton")
    with pytest.raises(NotImplementedError, match=f"triton backend's {kernels} have no derivative"):
        torch.func.grad(lambda a: tri(a, q13, q2, ids, weights).float().sum())(x)
    with pytest.raises(NotImplementedError, match=f"triton backend's {kernels} have no derivative"):
        torch.func.jvp(lambda a: tri(a, q13, q2, ids, weights), (x,), (torch.ones_like(x),))
    batched = torch.func.vmap(lambda a: tri(a, q13, q2, ids, weights))(x[None])
    torch.testing.assert_close(batched[0], tri(x, q13, q2, ids, weights))
    gmm = get_backend("grouped_mm")
    got = torch.func.grad(lambda a: gmm(a, q13, q2, ids, weights).float().sum())(x)
    leaf = x.clone().requires_grad_()
    tol = TOL if dtype == torch.float32 else 1e-2  # bf16: the transform's per-expert loop rounds apart from autograd's
    assert rel_l2(got, torch.autograd.grad(gmm(leaf, q13, q2, ids, weights).float().sum(), leaf)[0]) < tol
    if scheme == "int8_w8a16":  # fp8_block quantizes x too (moekit.quant's recipe): no plain loop to hold it to
        x64 = x.double().requires_grad_()
        (want,) = torch.autograd.grad(experts_loop(x64, q13.dequantize().double(), q2.dequantize().double(), ids,
                                                   weights.double()).sum(), x64)
        assert rel_l2(got, want) < tol

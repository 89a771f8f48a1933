"""torch.func through the whole ``MoE`` layer on the CPU: ``functional_call`` + grad / vjp with respect to the
layer's parameters and x, against ``loss.backward()`` on the module and the float64 per-token loop of
``test_layer_backward``; jvp against that loop's double-backward jvp, or the Triton backend's clear error.
The routers: "torch", and "fused" under Triton's interpreter (a call that needs a gradient or runs under a
transform is routed by ``route``; the gate kernel and the one-launch route stand aside too).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from test_layer_backward import DEEPSEEK_LIKE, QWEN2_LIKE, _close, _loop_forward, _params64  # noqa: E402
from moekit import MoE  # noqa: E402

CASES = [(backend, router) for backend in ("reference", "grouped_mm", "triton") for router in ("torch", "fused")]
TOL = 2e-5  # relative L2 against float64, as test_layer_backward


@pytest.fixture(autouse=True)
def _quiet_batching():
    """jacrev's vmap takes torch's per-entry fallback over a custom op, which warns of its speed."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        yield


def _layer(config, backend: str, router: str, fuse_shared: bool = True) -> MoE:
    torch.manual_seed(1)
    moe = MoE(config, backend=backend, router=router, fuse_shared=fuse_shared)
    if moe.e_score_correction_bias is not None:
        with torch.no_grad():
            moe.e_score_correction_bias.copy_(torch.randn(config.num_experts) * 0.3)  # moves the selection
    return moe


def _inputs(moe: MoE, num_tokens: int = 7, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, moe.config.hidden_size, generator=g)
    r = torch.randn(num_tokens, moe.config.hidden_size, generator=g)  # the fixed tensor of the loss
    return x, r


def _loop_grads(moe: MoE, x, r) -> tuple[torch.Tensor, dict]:
    """(dL/dx, {name: dL/dparam}) of sum(loop(x) * r) in float64."""
    p64 = _params64(moe)
    x64 = x.double().requires_grad_(True)
    (_loop_forward(x64, p64, moe) * r.double()).sum().backward()
    return x64.grad, {name: p.grad for name, p in p64.items()}


@pytest.mark.parametrize("backend, router", CASES)
@pytest.mark.parametrize("config, fuse_shared", [(DEEPSEEK_LIKE, True), (QWEN2_LIKE, False)],
                         ids=["sigmoid_bias_fused_shared", "shared_gate_separate"])
def test_functional_call_grad_matches_backward_and_the_loop(backend, router, config, fuse_shared):
    moe = _layer(config, backend, router, fuse_shared)
    x, r = _inputs(moe)
    params = {name: p.detach() for name, p in moe.named_parameters()}

    def loss(params, x):
        return (torch.func.functional_call(moe, params, (x,)) * r).sum()

    got_p, got_x = torch.func.grad(loss, argnums=(0, 1))(params, x)
    x32 = x.clone().requires_grad_(True)
    (moe(x32) * r).sum().backward()
    want_x, want_p = _loop_grads(moe, x, r)
    torch.testing.assert_close(got_x, x32.grad, msg="x: torch.func.grad vs backward()")
    _close(got_x, want_x, TOL, "x")
    assert set(got_p) == set(params)
    for name, p in moe.named_parameters():
        torch.testing.assert_close(got_p[name], p.grad, msg=f"{name}: torch.func.grad vs backward()")
        _close(got_p[name], want_p[name], TOL, name)


@pytest.mark.parametrize("backend, router", CASES)
def test_vjp_and_jacrev_through_the_layer(backend, router):
    moe = _layer(DEEPSEEK_LIKE, backend, router)
    x, r = _inputs(moe, num_tokens=3, seed=4)
    params = {name: p.detach() for name, p in moe.named_parameters()}
    out, vjp_fn = torch.func.vjp(lambda p, x: torch.func.functional_call(moe, p, (x,)), params, x)
    got_p, got_x = vjp_fn(r)
    want_x, want_p = _loop_grads(moe, x, r)
    _close(got_x, want_x, TOL, "x")
    for name in params:
        _close(got_p[name], want_p[name], TOL, name)
    # jacrev of each token's output . r (its vmap over M cotangents, per entry over the custom op as over M * K):
    # [M, M, K], summed over the first M the same dL/dx as r contracted with the whole [M, K, M, K] Jacobian
    jac = torch.func.jacrev(lambda x: (torch.func.functional_call(moe, params, (x,)) * r).sum(1))(x)
    _close(jac.sum(0), want_x, TOL, "x by jacrev")


@pytest.mark.parametrize("backend, router", CASES)
def test_jvp_through_the_layer_matches_the_loop_or_refuses(backend, router):
    moe = _layer(DEEPSEEK_LIKE, backend, router)
    x, tangent = _inputs(moe, num_tokens=5, seed=6)
    params = {name: p.detach() for name, p in moe.named_parameters()}

    def layer(x):
        return torch.func.functional_call(moe, params, (x,))

    if backend == "triton":
        with pytest.raises(NotImplementedError, match="triton experts backend has no forward-mode derivative"):
            torch.func.jvp(layer, (x,), (tangent,))
        return
    _, got = torch.func.jvp(layer, (x,), (tangent,))
    p64 = {name: p.detach() for name, p in _params64(moe).items()}
    _, want = torch.autograd.functional.jvp(lambda x: _loop_forward(x, p64, moe), x.double(), tangent.double())
    _close(got, want, TOL, "jvp")


@pytest.mark.parametrize("backend, router", [("grouped_mm", "torch"), ("triton", "fused")])
def test_grad_of_the_task_and_aux_losses_matches_backward(backend, router):
    """A training step's loss under torch.func: the output's and the balance / z losses' (return_stats=True)."""
    config = DEEPSEEK_LIKE.replace(aux_loss_coef=0.01, z_loss_coef=0.001)
    moe = _layer(config, backend, router)
    x, r = _inputs(moe, num_tokens=6, seed=8)
    params = {name: p.detach() for name, p in moe.named_parameters()}

    def loss(params):
        res = torch.func.functional_call(moe, params, (x,), {"return_stats": True})
        return (res.out * r).sum() + res.aux_loss

    got = torch.func.grad(loss)(params)
    res = moe(x, return_stats=True)
    ((res.out * r).sum() + res.aux_loss).backward()
    for name, p in moe.named_parameters():
        torch.testing.assert_close(got[name], p.grad, msg=name)
    (aux_only,) = torch.autograd.grad(moe(x, return_stats=True).aux_loss, moe.gate.weight)
    assert aux_only.abs().max() > 0  # the aux losses reach the gate: the comparison above covers them


def _ep_under_grad(rank: int, world_size: int) -> str:
    from moekit.parallel import EPMoE

    torch.manual_seed(0)
    ep = EPMoE.from_moe(MoE(DEEPSEEK_LIKE, backend="grouped_mm"))
    params = {name: p.detach() for name, p in ep.named_parameters()}
    try:
        torch.func.grad(lambda p: torch.func.functional_call(ep, p, (torch.randn(3, 16),)).sum())(params)
    except NotImplementedError as e:
        return str(e)
    return "no error"


def test_ep_layer_refuses_a_transform_before_any_collective():
    """EPMoE's load counts add in place and its collectives need tensors with storage: a clear error on each rank
    (before: functorch's in-place refusal, masked by the error agreement's 'Cannot access data pointer')."""
    from _parallel_harness import run_ranks

    for message in run_ranks(_ep_under_grad, 2, timeout_s=120):
        assert message == "EPMoE does not run under torch.func transforms (grad, vjp, jvp, vmap)"

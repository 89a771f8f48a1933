"""Frozen experts, trainable router on the CPU: the experts need no gradient, but the router's does flow through
the routed weights, so the eager per-expert loop (no autograd) must not serve the call. The router weight's
gradient against a float64 computation written here: softmax router, renormalised top-k, (token, slot) loop."""

import pytest
import torch

from _helpers import experts_loop, rel_l2
from moekit import MoE, MoEConfig
from moekit.experts.grouped_mm import CPU_GEMMS, experts_grouped_mm

E, N, K, TOP_K, M = 6, 8, 16, 2, 40  # ~13 rows per expert: the loop packs the weights (>= 4 rows)


def router64(x, gate_weight, ids):
    """softmax over the experts, the given top-k taken and renormalised: [M, k] float64."""
    probs = torch.softmax(x.double() @ gate_weight.t(), dim=-1)
    picked = probs.gather(1, ids.long())
    return picked / picked.sum(-1, keepdim=True)


def problem(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w13 = torch.randn(E, 2 * N, K, generator=g) * K**-0.5
    w2 = torch.randn(E, K, N, generator=g) * N**-0.5
    gate = torch.randn(E, K, generator=g) * K**-0.5
    return x, w13, w2, gate, torch.randn(M, K, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("cpu_gemm", CPU_GEMMS)
def test_router_gradient_through_frozen_experts(cpu_gemm):
    """Every cpu_gemm (the fused loops were the ones that dropped it): x and the experts need no gradient,
    topk_weights do; d(loss)/d(gate weight) equals the float64 one."""
    x, w13, w2, gate, upstream = problem(1)
    gate = gate.requires_grad_(True)
    ids = (x @ gate.detach().t()).topk(TOP_K, dim=-1).indices.int()
    picked = torch.softmax(x @ gate.t(), dim=-1).gather(1, ids.long())
    weights = picked / picked.sum(-1, keepdim=True)
    out = experts_grouped_mm(x, w13, w2, ids, weights, cpu_gemm=cpu_gemm)
    (grad,) = torch.autograd.grad(out, [gate], upstream.float())
    gate64 = gate.detach().double().requires_grad_(True)
    want = experts_loop(x, w13, w2, ids, router64(x, gate64, ids))
    (want_grad,) = torch.autograd.grad(want, [gate64], upstream)
    assert rel_l2(out.detach(), want.detach()) < 1e-5
    assert rel_l2(grad, want_grad) < 1e-5


def test_layer_with_frozen_experts_trains_its_router():
    """MoE with requires_grad False on w13 and w2, an input that needs no gradient: the gate weight still gets
    the float64 gradient (it used to get none: the loop's output had no graph back to the routing)."""
    torch.manual_seed(2)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K))
    moe.w13.requires_grad_(False)
    moe.w2.requires_grad_(False)
    x, _, _, _, upstream = problem(3)
    out = moe(x)
    assert out.requires_grad
    (grad,) = torch.autograd.grad(out, [moe.gate.weight], upstream.float())
    gate64 = moe.gate.weight.detach().double().requires_grad_(True)
    ids = moe.route_tokens(x).routing.topk_ids
    want = experts_loop(x, moe.w13.detach(), moe.w2.detach(), ids, router64(x, gate64, ids))
    (want_grad,) = torch.autograd.grad(want, [gate64], upstream)
    assert rel_l2(grad, want_grad) < 1e-5


def test_graph_replay_is_never_offered_when_a_weight_needs_a_gradient(monkeypatch):
    """MoE(eager_graph_rows=...) replays CUDA graphs (no autograd) for calls that need no gradient; it used to
    ask only x, the gate weight and w13. With w13 frozen and w2 trainable the replay must not be offered, and
    w2's gradient equals the float64 one; under no_grad it is offered."""
    torch.manual_seed(4)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K), eager_graph_rows=64)
    offered = []
    monkeypatch.setattr(moe.eager_graphs, "run", lambda *args: offered.append(args) and None)  # None: runs eagerly
    moe.w13.requires_grad_(False)
    moe.gate.weight.requires_grad_(False)
    x, _, _, _, upstream = problem(5)
    out = moe(x)
    assert not offered
    (grad,) = torch.autograd.grad(out, [moe.w2], upstream.float())
    routing = moe.route_tokens(x).routing
    w2_64 = moe.w2.detach().double().requires_grad_(True)
    want = experts_loop(x, moe.w13.detach(), w2_64, routing.topk_ids, routing.topk_weights.double())
    (want_grad,) = torch.autograd.grad(want, [w2_64], upstream)
    assert rel_l2(grad, want_grad) < 1e-5
    with torch.no_grad():
        moe(x)
    assert len(offered) == 1

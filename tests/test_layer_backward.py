"""Backward through the whole ``MoE`` layer on the CPU backends: every gradient (x, the gate through the
routing weights, w13, w2, the shared expert and its gate) against float64 autograd through a per-token
loop written here from the models' formulas; ``torch.autograd.gradcheck`` on ``reference`` in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moekit import MoE, MoEConfig
from moekit.routing import route

BASE = MoEConfig(hidden_size=16, moe_intermediate_size=12, num_experts=8, top_k=2)
DEEPSEEK_LIKE = BASE.replace(scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5, use_correction_bias=True,
                             shared_expert_intermediate_size=24)
QWEN2_LIKE = BASE.replace(renormalize=False, shared_expert_intermediate_size=12, shared_expert_gate=True)


def _params64(moe: MoE) -> dict:
    """The layer's parameters as float64 leaves (the loop's own copies)."""
    return {name: p.detach().double().requires_grad_(True) for name, p in moe.named_parameters()}


def _glu(h, n):
    return F.silu(h[:n]) * h[n:]


def _loop_forward(x, p, moe: MoE):
    """float64, one token at a time: score, pick the top k (bias for selection only), weight, run each
    chosen expert, add the shared expert (routed slots E.. when fused, or the separate MLP, gated)."""
    c, bias = moe.config, moe.e_score_correction_bias
    e, n = c.num_experts, c.moe_intermediate_size
    rows = []
    for t in range(x.shape[0]):
        logits = p["gate.weight"] @ x[t]  # [E]
        scores = torch.softmax(logits, 0) if c.scoring == "softmax" else torch.sigmoid(logits)
        choice = scores.detach() + (0 if bias is None else bias.double())
        ids = torch.sort(choice, descending=True, stable=True).indices[: c.top_k]
        w = scores[ids]
        if c.renormalize:
            w = w / w.sum()
        w = w * c.routed_scaling_factor
        y = sum(w[j] * (p["w2"][ids[j]] @ _glu(p["w13"][ids[j]] @ x[t], n)) for j in range(c.top_k))
        if c.has_shared_expert:
            if moe.fuse_shared:
                shared = sum(p["w2"][s] @ _glu(p["w13"][s] @ x[t], n) for s in range(e, e + c.num_shared_slots))
            else:
                sn = c.shared_expert_intermediate_size
                shared = p["shared_w2"] @ _glu(p["shared_w13"] @ x[t], sn)
            if c.shared_expert_gate:
                shared = torch.sigmoid(p["shared_gate.weight"] @ x[t]) * shared
            y = y + shared
        rows.append(y)
    return torch.stack(rows)


def _check_grads(moe: MoE, num_tokens: int, seed: int, tol: float = 2e-5) -> torch.Tensor:
    """Layer (float32) vs loop (float64): out and every gradient of sum(out * r); returns the counts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, moe.config.hidden_size, generator=g)
    r = torch.randn(num_tokens, moe.config.hidden_size, generator=g)  # the fixed tensor of the loss
    p64 = _params64(moe)
    x64 = x.double().requires_grad_(True)
    want = _loop_forward(x64, p64, moe)
    (want * r.double()).sum().backward()

    x32 = x.clone().requires_grad_(True)
    res = moe(x32, return_stats=True)
    (res.out * r).sum().backward()
    _close(res.out, want, tol, "out")
    _close(x32.grad, x64.grad, tol, "x.grad")
    for name, p in moe.named_parameters():
        _close(p.grad, p64[name].grad, tol, f"{name}.grad")
    return res.stats.counts


def _close(got, want, tol, what):
    """Relative L2 error below tol; a gradient that is 0 in exact arithmetic (k=1 renormalised: the
    weight is always 1, the gate gets none) is held to an absolute 1e-10 instead."""
    diff, scale = (got.double() - want.detach()).norm(), want.detach().norm()
    assert diff <= tol * scale + 1e-10, f"{what}: L2 error {diff:.2e} against norm {scale:.2e} (tol {tol})"


@pytest.mark.parametrize("backend", ["reference", "grouped_mm"])
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_grads_match_the_float64_loop(backend, top_k):
    torch.manual_seed(top_k)
    moe = MoE(BASE.replace(top_k=top_k), backend=backend)
    counts = _check_grads(moe, num_tokens=5, seed=top_k)
    assert (counts == 0).any() or top_k == 6, "5 tokens with k <= 2 over 8 experts leave experts empty"


@pytest.mark.parametrize("backend", ["reference", "grouped_mm"])
@pytest.mark.parametrize("fuse_shared", [True, False])
def test_grads_with_shared_expert_bias_and_scaling(backend, fuse_shared):
    torch.manual_seed(1)
    moe = MoE(DEEPSEEK_LIKE, backend=backend, fuse_shared=fuse_shared)
    with torch.no_grad():
        moe.e_score_correction_bias.copy_(torch.randn(8) * 0.3)  # changes the selection, not the weights
    _check_grads(moe, num_tokens=7, seed=2)
    torch.manual_seed(2)
    _check_grads(MoE(QWEN2_LIKE, backend=backend, fuse_shared=fuse_shared), num_tokens=7, seed=3)


def test_one_token_on_one_expert_leaves_the_others_without_grad():
    """Every expert but the chosen ones is empty: their weight grads are exactly zero."""
    torch.manual_seed(0)
    moe = MoE(BASE.replace(top_k=1), backend="grouped_mm")
    counts = _check_grads(moe, num_tokens=1, seed=4)
    empty = counts == 0
    assert empty.sum() == 7
    assert torch.all(moe.w13.grad[empty] == 0) and torch.all(moe.w2.grad[empty] == 0)


def test_routing_weights_follow_float64_logits():
    logits = torch.randn(3, 8, dtype=torch.float64)
    assert route(logits, BASE).topk_weights.dtype == torch.float64
    assert route(logits.float(), BASE).topk_weights.dtype == torch.float32
    assert route(logits.bfloat16(), BASE).topk_weights.dtype == torch.float32


@pytest.mark.parametrize("cfg", [BASE, DEEPSEEK_LIKE, QWEN2_LIKE], ids=["softmax", "sigmoid_shared", "shared_gate"])
def test_gradcheck_reference_float64(cfg):
    torch.manual_seed(3)
    small = cfg.replace(hidden_size=6, moe_intermediate_size=4, num_experts=4,
                        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size and 4)
    moe = MoE(small, backend="reference", dtype=torch.float64)
    names = [name for name, _ in moe.named_parameters()]
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    params = tuple(p.detach().clone().requires_grad_(True) for p in moe.parameters())

    def fn(x, *ps):
        return torch.func.functional_call(moe, dict(zip(names, ps)), (x,))

    # fast_mode: finite differences along random directions against the same products of the analytic
    # Jacobian (the full Jacobian took 15-40 s per config on a loaded CI machine; this takes about 1 s)
    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("backend", ["reference", "grouped_mm"])
def test_fused_shared_slots_bias_rows_get_no_gradient(backend):
    """Expert biases with a fused shared expert: b13 / b2's rows E.. are the shared slots', zero because the shared
    MLP has no bias. Training must leave them zero (the un-fused layer, and OffloadedMoE's copy of the shared MLP, have
    no such bias): no gradient reaches them, and the routed rows' gradients are the separate layer's (the float64
    fuzzer's gradients found the shared rows' gradient, fuz44)."""
    cfg = BASE.replace(expert_bias=True, shared_expert_intermediate_size=24)  # S = 2 slots
    torch.manual_seed(5)
    fused = MoE(cfg, backend=backend, fuse_shared=True)
    separate = MoE(cfg, backend=backend, fuse_shared=False)
    with torch.no_grad():
        fused.b13[:8].normal_()
        fused.b2[:8].normal_()
        separate.gate.weight.copy_(fused.gate.weight)
        for name in ("w13", "w2", "b13", "b2"):
            getattr(separate, name).copy_(getattr(fused, name)[:8])
        gate, up = fused.w13[8:].split(12, dim=1)  # [S, N, K] each
        separate.shared_w13.copy_(torch.cat([gate.flatten(0, 1), up.flatten(0, 1)]))
        separate.shared_w2.copy_(torch.cat(list(fused.w2[8:]), dim=1))
    x, r = torch.randn(6, 16), torch.randn(6, 16)
    for moe in (fused, separate):
        (moe(x) * r).sum().backward()
    assert torch.equal(fused.b13.grad[8:], torch.zeros(2, 24)) and torch.equal(fused.b2.grad[8:], torch.zeros(2, 16))
    torch.testing.assert_close(fused.b13.grad[:8], separate.b13.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.b2.grad[:8], separate.b2.grad, rtol=1e-5, atol=1e-6)

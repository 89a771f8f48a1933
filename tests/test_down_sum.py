"""The down GEMM with the k-sum folded in (``_kernels/down_sum.py``, the naive path's second launch),
under Triton's interpreter, against a float64 per-token loop written here; and the naive path end to
end (gate-up, then down_sum) for the experts variants, against a float64 per-token loop of the contract."""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from moekit.activations import ActivationSpec
from moekit.experts.configs import GemmTile
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options


def _down_sum_loop(h, w2, b2, ids, weights, expert_map):
    """float64: out[t] = sum over routed slots j of weight * (w2[e] @ h[t*k + j] + b2[e])."""
    num_tokens, top_k = ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e]) if 0 <= e < expert_map.numel() else -1
            if not 0 <= e < w2.shape[0]:
                continue
            y = w2[e].double() @ h[t * top_k + j].double()
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(weights[t, j]) * y
    return out


def _launch(h, w2, b2, ids, weights, expert_map, tile, dot, num_tokens):
    from moekit.experts.triton_plan import down_sum_launch

    x = torch.empty(num_tokens, w2.shape[1], dtype=h.dtype)  # the plan reads only its shape and dtype
    options = resolve_launch_options(LaunchOptions(), x.device)
    launch = down_sum_launch(x, w2, b2, ids.shape[1], tile, False, expert_map, options, dot=dot)
    out = torch.full((num_tokens, w2.shape[1]), float("nan"), dtype=h.dtype)
    launch(h, w2, b2, weights.contiguous(), ids.contiguous(), expert_map if expert_map is not None else ids, out)
    return out


@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("top_k,with_map,with_bias", [(1, False, True), (2, True, False), (8, False, False),
                                                      (8, True, True)])
def test_down_sum_against_float64_loop(interpreter, dot, top_k, with_map, with_bias):
    g = torch.Generator().manual_seed(top_k + 10 * dot)
    num_tokens, num_experts, hidden, n = 3, 12, 37, 45  # odd K (output columns) and N (reduction)
    h = torch.randn(num_tokens * top_k, n, generator=g)
    h[1] = float("nan")  # slot 1's h row: unrouted below, so it must never be read
    w2 = torch.randn(num_experts, hidden, n, generator=g)
    b2 = torch.randn(num_experts, hidden, generator=g) if with_bias else None
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    ids.view(-1)[1] = -1
    if top_k > 2:
        ids[2, 0] = num_experts + 3  # past E (or past the map): not routed here
    weights = torch.rand(num_tokens, top_k, generator=g)
    expert_map = None
    if with_map:  # global ids 0..E-1 -> local; entry -1: not on this rank
        expert_map = torch.arange(num_experts, dtype=torch.int32).roll(1)
        expert_map[5] = -1
    for tile in (GemmTile(16, 16, 1, 4, 2), GemmTile(32, 64, 1, 4, 3)):  # several N steps, then one past N
        out = _launch(h, w2, b2, ids, weights, expert_map, tile, dot, num_tokens)
        ref = _down_sum_loop(h, w2, b2, ids, weights, expert_map)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


def test_down_sum_is_deterministic(interpreter):
    g = torch.Generator().manual_seed(7)
    h, w2 = torch.randn(16, 45, generator=g), torch.randn(6, 37, 45, generator=g)
    ids, weights = torch.randint(0, 6, (2, 8), generator=g), torch.rand(2, 8, generator=g)
    runs = [_launch(h, w2, None, ids, weights, None, GemmTile(16, 16, 1, 4, 2), True, 2) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


_ACT = {  # written here, not taken from moekit.activations
    "silu": lambda g, alpha: g * torch.sigmoid(alpha * g),
    "relu2": lambda g, alpha: torch.relu(g) ** 2,
    "gelu_tanh": lambda g, alpha: 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))),
}


def _contract_loop(x, w13, w2, ids, weights, spec: ActivationSpec, b13, b2):
    """float64 per token: sum_j weight * (w2[e] @ glu(w13[e] @ x + b13[e]) + b2[e]), spec's glu."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    n = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            u = w13[e].double() @ x[t].double() + (b13[e].double() if b13 is not None else 0)
            if not spec.gated:
                act = _ACT[spec.name](u, spec.alpha)
            else:
                gate, up = (u[0::2], u[1::2]) if spec.interleaved else (u[:n], u[n:])
                if spec.limit is not None:
                    gate, up = gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
                act = _ACT[spec.name](gate, spec.alpha) * (up + spec.up_shift)
            y = w2[e].double() @ act + (b2[e].double() if b2 is not None else 0)
            out[t] += float(weights[t, j]) * y
    return out


@pytest.mark.parametrize("spec,biases", [
    (ActivationSpec("silu"), False),
    (ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0), True),  # gpt-oss
    (ActivationSpec("relu2", gated=False), True),
    (ActivationSpec("gelu_tanh"), True),
])
def test_naive_path_runs_down_sum_for_every_variant(interpreter, spec, biases):
    g = torch.Generator().manual_seed(3)
    num_tokens, top_k, num_experts, hidden, n = 2, 3, 32, 33, 17  # A*4 = 24 <= E: the naive shortcut
    rows = 2 * n if spec.gated else n
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, rows, hidden, generator=g) * 0.3
    w2 = torch.randn(num_experts, hidden, n, generator=g) * 0.3
    b13 = torch.randn(num_experts, rows, generator=g) if biases else None
    b2 = torch.randn(num_experts, hidden, generator=g) if biases else None
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    ids[1, 2] = -1
    weights = torch.rand(num_tokens, top_k, generator=g)
    options = LaunchOptions(poison_workspace=True)
    from moekit.experts.triton_plan import plan_for

    plan = plan_for(x, w13, w2, ids, weights, None, spec, None, resolve_launch_options(options, x.device), b13, b2)
    assert plan.align is None and plan.down_sum is not None  # naive: two launches, no k-sum pass
    out = interpreter.experts_triton(x, w13, w2, ids, weights, activation=spec, b13=b13, b2=b2, options=options)
    ref = _contract_loop(x, w13, w2, ids, weights, spec, b13, b2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)

"""torch.compile(fullgraph=True, dynamic=True) of the CPU experts backends with gradients: M is a SymInt, so the
grouped_mm plan must not read it (it used to run choose_layout on it) and the reference must make no data-dependent
size. Outputs and gradients against a float64 (token, slot) loop (``_helpers.experts_loop``), at several M in one
compiled function, with the recompiles counted by torch._dynamo's counters."""

import pytest
import torch
from torch._dynamo.utils import counters

from _helpers import experts_loop, rel_l2
from moekit import MoE, MoEConfig
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.experts.grouped_mm_plan import contiguous_token_bytes, traced_plan
from moekit.experts.reference import experts_reference

E, N, K, TOP_K = 4, 8, 16, 2
BACKENDS = {"grouped_mm": experts_grouped_mm, "reference": experts_reference}


def problem(m, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(m)]).int()
    ids[0, 1] = -1  # a skipped slot
    ids[m - 1, 1] = ids[m - 1, 0]  # a token routed twice to one expert: both slots count
    return x, ids, torch.rand(m, TOP_K, generator=g)


def weights(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * N, K, generator=g) * K**-0.5, torch.randn(E, K, N, generator=g) * N**-0.5


def check_against_loop(fn, w13, w2, sizes, seed, backend="aot_eager", **kwargs):
    """Run the compiled ``fn`` at every M of ``sizes``; out and the gradients of x, w13, w2 and topk_weights
    against experts_loop's. Returns the graphs dynamo made."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda *a: fn(*a, **kwargs), fullgraph=True, dynamic=True, backend=backend)
    for i, m in enumerate(sizes):
        x, ids, topk_weights = problem(m, seed + i)
        leaves = [t.clone().requires_grad_(True) for t in (x, w13, w2, topk_weights)]
        out = compiled(leaves[0], leaves[1], leaves[2], ids, leaves[3])
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
        grads = torch.autograd.grad(out, leaves, upstream.float())
        leaves64 = [t.double().requires_grad_(True) for t in (x, w13, w2, topk_weights)]
        want = experts_loop(leaves64[0], leaves64[1], leaves64[2], ids, leaves64[3])
        wants = torch.autograd.grad(want, leaves64, upstream)
        assert out.shape == (m, K) and rel_l2(out.detach(), want.detach()) < 1e-5, m
        for name, got, ref in zip(("x", "w13", "w2", "topk_weights"), grads, wants):
            assert rel_l2(got, ref) < 1e-5, (m, name)
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", list(BACKENDS))
def test_dynamic_training_equals_float64_loop_with_one_graph(name):
    """M changes from call to call (3, 5, 12, 7): one graph serves them all (dynamo's trace, autograd through
    it; the layer test below compiles the backward too)."""
    w13, w2 = weights(1)
    assert check_against_loop(BACKENDS[name], w13, w2, (3, 5, 12, 7), seed=10, backend="eager") == 1


def test_dynamic_chunks_recompile_once_per_chunk_count():
    """A budget of 4 tokens' runs: M <= 4 in one run, longer batches in chunks of exactly 4 (the last one
    overlapping); one graph per chunk count, whatever the remainder (5, 8 and 6 share one)."""
    w13, w2 = weights(2)
    budget = 4 * contiguous_token_bytes(TOP_K, K, N, torch.float32)  # room for the runs of 4 tokens
    assert traced_plan(TOP_K, K, N, torch.float32, budget, "auto").chunk_tokens == 4
    graphs = check_against_loop(experts_grouped_mm, w13, w2, (3, 5, 8, 6), seed=20, backend="eager",
                                memory_budget_bytes=budget)
    assert graphs == 2


@pytest.mark.parametrize("name", list(BACKENDS))
def test_compiled_dynamic_layer_equals_eager(name):
    """torch.compile(MoE, fullgraph=True, dynamic=True), backward compiled too (aot_eager): outputs and the
    gradients of x, the router and the experts equal eager's at every M, from one graph."""
    torch.manual_seed(3)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K), backend=name)
    params = [moe.gate.weight, moe.w13, moe.w2]
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(moe, fullgraph=True, dynamic=True, backend="aot_eager")
    for m in (3, 6, 11):
        x = torch.randn(m, K, requires_grad=True)
        eager = moe(x)
        eager_grads = torch.autograd.grad(eager.square().sum(), [x, *params])
        got = compiled(x)
        grads = torch.autograd.grad(got.square().sum(), [x, *params])
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
        for g, want in zip(grads, eager_grads):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1

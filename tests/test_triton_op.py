"""The Triton experts ops (``moekit.experts.triton_op``), under Triton's interpreter: ``moekit::triton_experts_infer``,
the inference twin of ``moekit::triton_experts``, has the custom op's schema and fake but no Autograd kernel, passes
``torch.library.opcheck`` and gives the custom op's bits; both equal a float64 (token, slot) loop
(``_helpers.experts_loop``). ``experts_op`` sends a call that needs a gradient to the custom op (which trains: gradients
against the loop's) and every other call to the twin, eagerly and under torch.compile (fullgraph: decided at trace time,
no graph break; a compiled training step takes the custom op and runs its backward)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import count_op_calls, experts_loop, make_problem, rel_l2  # noqa: E402
from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from moekit.activations import ActivationSpec, spec_fields  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402

E, K, N = 8, 40, 24
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
TAIL = (*spec_fields(ActivationSpec()), *LaunchOptions(poison_workspace=True).as_op_args())  # silu, the options
GRAD_NAMES = ("x", "w13", "w2", "topk_weights")


def op_args(problem) -> tuple:
    x, w13, w2, ids, weights = problem
    return (x, w13, w2, ids, weights, None, None, None, *TAIL)


def test_twin_has_the_schema_and_fake_but_no_autograd_kernel():
    import moekit.experts.triton_op  # noqa: F401  (defines both ops)

    twin, custom = torch.ops.moekit.triton_experts_infer.default, torch.ops.moekit.triton_experts.default
    assert str(twin._schema).split("(", 1)[1] == str(custom._schema).split("(", 1)[1]
    for key in ("CompositeExplicitAutograd", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("moekit::triton_experts_infer", key), key
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("moekit::triton_experts_infer", "Autograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("moekit::triton_experts", "Autograd")
    assert torch.Tag.pt2_compliant_tag in twin.tags


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 9])  # M = 1: the naive shortcut (no alignment); 9: aligned
def test_twin_equals_the_custom_op_and_the_float64_loop(interpreter, dtype, m):
    problem = make_problem(m, 2, E, K, N, dtype, seed=m)
    with torch.no_grad():
        twin = torch.ops.moekit.triton_experts_infer(*op_args(problem))
        custom = torch.ops.moekit.triton_experts(*op_args(problem))
    assert twin.shape == problem.x.shape and twin.dtype == dtype
    assert torch.equal(twin, custom)
    assert rel_l2(twin, experts_loop(*problem)) < TOL[dtype]


def test_the_body_builds_its_options_once_per_set(interpreter):
    """Calls with the same option fields share one ``LaunchOptions`` (built and validated once), never reusing
    workspaces; other fields build another."""
    from moekit.experts.triton_op import _options_of

    problem = make_problem(3, 2, E, K, N, torch.float32, seed=8)
    _options_of.cache_clear()
    with torch.no_grad():
        for _ in range(3):
            torch.ops.moekit.triton_experts_infer(*op_args(problem))
    assert _options_of.cache_info().misses == 1 and _options_of.cache_info().hits == 2
    fields = LaunchOptions(poison_workspace=True).as_op_args()
    options = _options_of(*fields[:8], *fields[9:])  # without reuse_workspace (the op's 9th option field)
    assert options.reuse_workspace is False and options.poison_workspace is True
    assert options.as_op_args()[:8] == fields[:8] and options.as_op_args()[9:] == fields[9:]
    assert _options_of(*LaunchOptions().as_op_args()[:8], *LaunchOptions().as_op_args()[9:]) is not options


def test_twin_passes_opcheck(interpreter):
    torch.library.opcheck(torch.ops.moekit.triton_experts_infer.default,
                          op_args(make_problem(5, 2, E, K, N, torch.float32, seed=3)))


def test_a_call_needing_a_gradient_trains_through_the_custom_op(interpreter, monkeypatch):
    """experts_triton with inputs that need gradients: the custom op (counted), gradients of x, w13, w2 and the
    routed weights against the float64 loop's; the twin itself refuses such a call."""
    calls = count_op_calls(monkeypatch, ("triton_experts", "triton_experts_infer"))
    problem = make_problem(6, 2, E, K, N, torch.float32, seed=4)
    dout = torch.randn(problem.x.shape, generator=torch.Generator().manual_seed(5))
    got, want = ([t.clone().requires_grad_() for t in (problem.x, problem.w13, problem.w2, problem.weights)]
                 for _ in range(2))
    out = interpreter.experts_triton(got[0], got[1], got[2], problem.ids, got[3])
    (out * dout).sum().backward()
    (experts_loop(want[0], want[1], want[2], problem.ids, want[3]) * dout.double()).sum().backward()
    assert calls == ["triton_experts"]
    assert rel_l2(out, experts_loop(*problem)) < TOL[torch.float32]
    for name, g, w in zip(GRAD_NAMES, got, want):
        assert rel_l2(g.grad, w.grad) < TOL[torch.float32], name
    with pytest.raises(RuntimeError, match="has no backward"):
        torch.ops.moekit.triton_experts_infer.default(*op_args((got[0], *problem[1:])))


def _compiled_ops(fn, *args):
    """fn compiled fullgraph with aot_eager (the graph's moekit ops recorded), its output for args."""
    from torch._dynamo.backends.debugging import aot_eager

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if "moekit" in str(node.target))
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)(*args), seen


def test_compiled_inference_takes_the_twin_and_training_the_custom_op(interpreter):
    """The traced entry (``traced_triton_experts``: what moekit.hf runs under torch.compile) under no_grad traces
    the twin, and with weights that need a gradient the custom op, whose compiled backward gives the loop's
    gradients; both without a graph break (fullgraph) and equal to eager."""
    from moekit.experts.triton_op import traced_triton_experts

    problem = make_problem(5, 2, E, K, N, torch.float32, seed=6)
    w13, w2 = (torch.nn.Parameter(w.clone()) for w in (problem.w13, problem.w2))

    def fn(x, ids, weights):
        return traced_triton_experts(x, w13, w2, ids, weights, "silu")

    with torch.no_grad():
        out, seen = _compiled_ops(fn, problem.x, problem.ids, problem.weights)
        eager = interpreter.experts_triton(problem.x, w13, w2, problem.ids, problem.weights)
    assert seen == ["moekit.triton_experts_infer"] and torch.equal(out, eager)
    out, seen = _compiled_ops(fn, problem.x, problem.ids, problem.weights)
    assert seen == ["moekit.triton_experts"] and out.requires_grad and torch.equal(out.detach(), eager)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * dout).sum().backward()
    w13_64, w2_64 = (w.detach().clone().requires_grad_() for w in (w13, w2))
    (experts_loop(problem.x, w13_64, w2_64, problem.ids, problem.weights) * dout.double()).sum().backward()
    assert rel_l2(w13.grad, w13_64.grad) < TOL[torch.float32]
    assert rel_l2(w2.grad, w2_64.grad) < TOL[torch.float32]

"""The fused router's nonfinite="raise" under torch.compile (Triton interpreted on the CPU): where the kernel can assert
itself (a compiled GPU kernel) the traced graph holds the one op and no ``_assert_async``, and its flag output is empty
(nothing to fill); elsewhere (the interpreter, or ``FusedRouter(assert_in_kernel=False)``) the flag and
``torch._assert_async`` as before, and a non-finite logit raises, eager and compiled."""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoEConfig

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CFG = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=16, top_k=4)  # nonfinite="raise" by default


@pytest.fixture(scope="module")
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module:
        yield module


class _Traced(Exception):
    """Raised instead of running a traced graph: the test reads the graph, the kernel never runs."""


def _graph(fn, *args):
    """The FX graph dynamo traces for ``fn(*args)`` (fullgraph), not run."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)

        def refuse(*a):
            raise _Traced

        return refuse

    torch._dynamo.reset()
    with pytest.raises(_Traced):
        torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return graphs[0].graph


def _targets(graph) -> list[str]:
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


def test_a_kernel_that_asserts_itself_needs_no_flag_compiled(fused, monkeypatch):
    """With compiled kernels (PRECISE: what ``_launch_options`` says on a GPU) the op asserts in its kernel: the
    graph is the op alone, its flag output [0]; asked not to (``assert_in_kernel=False``), the flag and the assert."""
    options = dict(fused._launch_options(torch.device("cpu")), PRECISE=True)
    monkeypatch.setattr(fused, "_launch_options", lambda device: options)
    logits = torch.randn(3, 16)
    assert not fused._flagged(True, logits.device, True) and fused._flagged(True, logits.device, False)
    one = _targets(_graph(fused.FusedRouter(CFG), logits))
    assert one.count("moekit.route_fused") == 1 and not any("assert" in t for t in one), one
    two = _targets(_graph(fused.FusedRouter(CFG, assert_in_kernel=False), logits))
    assert "moekit.route_fused" in two and any("_assert_async" in t for t in two), two
    fake = fused._route_fake(logits, None, None, 4, 1, 1, False, True, 1.0, True, 0, 128, 0.0, False, "max", False,
                             1.0, False, 0.0, 0.0, True)  # ..., shared_weight, sqrt_softplus, renorm_eps, renorm_clamp,
    # assert_in_kernel
    assert fake[2].shape == (0,)
    assert fused._route_fake(logits, None, None, 4, 1, 1, False, True, 1.0, True, 0, 128, 0.0, False, "max", False,
                             1.0)[2].shape == (1,)


def test_interpreted_nonfinite_still_raises_eager_and_compiled(fused):
    """The interpreter has no device assert: the flag, a ValueError eager, ``_assert_async``'s error compiled; finite
    logits route the same compiled and eager."""
    router = fused.FusedRouter(CFG)
    logits = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    eager = router(logits)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: router(x), fullgraph=True, backend="aot_eager")
    got = compiled(logits)
    assert torch.equal(got.topk_ids, eager.topk_ids) and torch.equal(got.topk_weights, eager.topk_weights)
    bad = logits.clone()
    bad[2, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        router(bad)
    with pytest.raises(RuntimeError, match="NaN or infinite"):
        compiled(bad)
    assert torch.equal(compiled(logits).topk_ids, eager.topk_ids)  # the flag kept for the next call is clear again

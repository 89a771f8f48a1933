"""``MoE.forward``'s kept routing buffers (``moekit.routing.workspace``) on the CPU under Triton's
interpreter: a forward through them computes what the same layer computes with fresh buffers
(``route_tokens`` without a workspace), call after call, after in-place and replaced weights; nothing
returned aliases them; kinds of call (M, thread) get their own, at most MAX_ENTRIES."""

from __future__ import annotations

import threading

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

CFG = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, shared_expert_intermediate_size=8)


@pytest.fixture(scope="module", autouse=True)
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module:
        yield module


def fresh(layer, x):
    """The same layer's forward with freshly allocated routing buffers."""
    return layer._experts_and_shared(x, layer.route_tokens(x))


def test_forward_through_kept_buffers_matches_fresh():
    layer = MoE(CFG, backend="reference", router="fused")
    with torch.no_grad():
        x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
        out1 = layer(x1)
        kept = out1.clone()
        out2 = layer(x2)  # the same kind of call: the same buffers, rewritten
        assert len(layer._route_ws) == 1
        torch.testing.assert_close(out1, kept, rtol=0, atol=0)  # the output is not a kept buffer
        torch.testing.assert_close(out2, fresh(layer, x2), rtol=0, atol=0)
        torch.testing.assert_close(out1, fresh(layer, x1), rtol=0, atol=0)
        layer.gate.weight.mul_(-1.0)  # in place
        torch.testing.assert_close(layer(x1), fresh(layer, x1), rtol=0, atol=0)
        layer.w13 = torch.nn.Parameter(torch.randn_like(layer.w13))  # replaced
        torch.testing.assert_close(layer(x2), fresh(layer, x2), rtol=0, atol=0)
        layer(torch.randn(5, 16))  # another M: another entry
        assert len(layer._route_ws) == 2


def test_stats_and_route_tokens_never_alias_the_buffers():
    layer = MoE(CFG, backend="reference", router="fused")
    with torch.no_grad():
        x = torch.randn(4, 16)
        layer(x)
        stats = layer(x, return_stats=True)
        routed = layer.route_tokens(x)
        kept = [b for entry in layer._route_ws._buffers.values() for b in (entry.logits, entry.ids, entry.weights)]
        for t in (stats.router_logits, routed.router_logits, routed.routing.topk_ids, routed.routing.topk_weights):
            assert all(t.data_ptr() != b.data_ptr() for b in kept)


def test_kinds_of_call_threads_and_the_cap(monkeypatch):
    from moekit.routing import workspace

    monkeypatch.setattr(workspace, "MAX_ENTRIES", 2)
    layer = MoE(CFG, backend="reference", router="fused")
    x = torch.randn(2, 16)
    with torch.no_grad():
        layer(x)
    thread = threading.Thread(target=lambda: torch.no_grad()(layer)(x))  # another thread: buffers of its own
    thread.start()
    thread.join()
    ids = [entry.ids.data_ptr() for entry in layer._route_ws._buffers.values()]
    assert len(ids) == 2 and ids[0] != ids[1]
    with torch.no_grad():
        layer(torch.randn(3, 16))
    assert len(layer._route_ws) == 2  # the oldest went
    layer.to(torch.float64)  # a cast drops them all
    assert len(layer._route_ws) == 0


def test_a_subclass_that_places_experts_gets_fresh_buffers():
    """A subclass's run_routed may keep the routing past the call: no kept buffers for it."""
    kept = []

    class Keeping(MoE):
        def run_routed(self, x2d, routing):
            kept.append(routing.topk_ids)
            return super().run_routed(x2d, routing)

    layer = Keeping(CFG, backend="reference", router="fused")
    with torch.no_grad():
        layer(torch.randn(3, 16)), layer(torch.randn(3, 16))
    assert len(layer._route_ws) == 0 and kept[0].data_ptr() != kept[1].data_ptr()

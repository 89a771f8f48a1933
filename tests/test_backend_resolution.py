"""One backend resolver (``moekit.experts.backend_fn``): cached per (name, device type), used by MoE,
EPMoE and moekit.hf, and trace-friendly once resolved."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import moekit.experts
from moekit.config import MoEConfig
from moekit.experts import backend_fn, get_backend
from moekit.experts.reference import experts_reference
from moekit.layer import MoE

CONFIG = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2)


@pytest.fixture
def resolutions(monkeypatch) -> list:
    """An empty cache, and the (name, device) of every resolution from here on."""
    calls = []
    real = moekit.experts.resolve_backend
    monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
    monkeypatch.setattr(moekit.experts, "resolve_backend",
                        lambda name, device: calls.append((name, str(device))) or real(name, device))
    return calls


def test_resolved_once_per_name_and_device_type(resolutions):
    assert backend_fn("auto", "cpu") is get_backend("grouped_mm")  # auto on the CPU
    assert backend_fn("auto", torch.device("cpu")) is backend_fn("auto", "cpu")
    assert backend_fn("reference", "cpu") is experts_reference
    assert [name for name, _ in resolutions] == ["auto", "reference"]
    with pytest.raises(ValueError, match="backend must be one of"):
        backend_fn("cutlass", "cpu")
    assert ("cutlass", "cpu") not in moekit.experts._RESOLVED  # a failed resolution is not cached


def test_cached_lookup_traces_fullgraph(resolutions):
    """The lookup itself inside a fullgraph trace (what moekit.hf does per forward): no graph break,
    no second resolution. (The reference backend's own loop is data-dependent, so only the lookup.)"""

    def run(x):
        fn = backend_fn("reference", x.device)
        return x * 2 if fn is experts_reference else x

    x = torch.randn(3, 4)
    run(x)  # resolves outside the trace
    torch.testing.assert_close(torch.compile(run, fullgraph=True, backend="eager")(x), x * 2)
    assert len(resolutions) == 1


def test_moe_resolves_on_construction_and_device_moves_only(resolutions):
    layer = MoE(CONFIG, backend="reference")
    x = torch.randn(3, 16)
    with torch.no_grad():
        layer(x)
        layer.float()  # a move (_apply) looks up again: a cache hit
        layer(x)
    assert resolutions == [("reference", "cpu")]
    assert layer._experts_fn is experts_reference


def _init_one_rank_group():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def test_ep_moe_does_not_resolve_per_forward(resolutions):
    from moekit.parallel import EPMoE

    _init_one_rank_group()
    try:
        torch.manual_seed(0)
        moe = MoE(CONFIG, backend="reference")
        ep = EPMoE.from_moe(moe)
        count = len(resolutions)
        x = torch.randn(6, 16)
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(ep(x), moe(x), rtol=1e-5, atol=1e-6)
        assert len(resolutions) == count  # every forward met the resolved function
    finally:
        dist.destroy_process_group()


def test_ep_moe_from_moe_keeps_the_router_and_backend_options():
    """``EPMoE.from_moe`` carries every layer setting over, the router choice and backend options too."""
    from moekit.parallel import EPMoE

    _init_one_rank_group()
    try:
        moe = MoE(CONFIG, backend="grouped_mm", router="torch", backend_options={"memory_budget_bytes": 5_000})
        ep = EPMoE.from_moe(moe)
        assert (ep.router, ep.backend, ep.backend_options) == ("torch", "grouped_mm", {"memory_budget_bytes": 5_000})
        x = torch.randn(20, 16)
        with torch.no_grad():
            torch.testing.assert_close(ep(x), moe(x), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()

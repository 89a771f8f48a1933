"""The route's weight-only Gluon call (``triton_wo.run_experts_wo`` naming nothing, on ``WeightArgs``, in a measured
cell) against the same GEMM options named (``run_experts_wo_gluon`` on ``WoWeight``s, the lean launch) on the CPU:
the alignment, gather and combine interpreted, the GEMMs as their torch stand-ins. Both run one plan and one recorded
sequence on the pool, and on fresh regions (the branch a CUDA graph capture takes) the same launches: kernel, grid,
scalars and constexprs, options and every pointer argument's geometry; outputs equal bit for bit. (Session 31: the
pick read 5-14% above "swapfs" in the device checks' graph replay at DeepSeek-V3 4096 and Mixtral 1024 int8; the
device side: ``wopk31_device_check.py``, removed: ``git show 87f368f6:benchmarks/wopk31_device_check.py``.)"""

from __future__ import annotations

import pytest
import torch

from _gluon_fakes import fake_gemms  # noqa: F401  (fixture)
from _triton_helpers import interpreter  # noqa: F401  (module fixture: kernels under the interpreter)
from test_triton_gluon_wo import E, K, N, _call, _f64, _rel, _weights
from moekit.experts.triton_gluon_wo import GluonWoGemms, GluonWoOptions, run_experts_wo_gluon
from moekit.experts.triton_wo import run_experts_wo, weight_args

SWAPFS = GluonWoOptions(swap=True, fast=True, split=True)


@pytest.fixture
def routed(fake_gemms, monkeypatch):
    """This test's int8 shape a measured cell for M in [1, 1000) whose GEMMs are swapfs (GLUON_WO_CELLS /
    GLUON_WO_OPTIONS), the route's token floor off."""
    import moekit.experts.triton_gluon_wo as tgw
    import moekit.experts.triton_wo as tw

    key = ("int8_w8a16", E, N, K)
    monkeypatch.setattr(tw, "GLUON_MIN_TOKENS", 1)
    monkeypatch.setattr(tgw, "GLUON_WO_CELLS", {key: (1, 1000)})
    monkeypatch.setattr(tgw, "GLUON_WO_OPTIONS", {key: tgw.MeasuredGemms(1, 1000, GluonWoGemms(SWAPFS, SWAPFS))})
    return fake_gemms


@pytest.fixture
def bound_log(monkeypatch):
    """Every ``BoundLaunch`` call: (kernel, grid, scalars and constexprs, options, each pointer's geometry)."""
    from moekit.triton_bind import BoundLaunch

    log, real = [], BoundLaunch.__call__

    def call(self, *pointers):
        log.append((self.kernel.fn.__name__, self.grid, self.tail, sorted(self.options.items()),
                    tuple(_geometry(p) for p in pointers)))
        return real(self, *pointers)

    monkeypatch.setattr(BoundLaunch, "__call__", call)
    return log


def _geometry(v):
    """What a launch's pointer argument is, without its address: a descriptor's shape, strides, block and dtype; a
    tensor's dtype, shape and strides."""
    if hasattr(v, "block_shape"):
        return ("desc", tuple(v.shape), tuple(v.strides), tuple(v.block_shape), v.base.dtype)
    return ("tensor", v.dtype, tuple(v.shape), v.stride()) if isinstance(v, torch.Tensor) else v


def _both(m: int):
    """(the route's call, the named call) on one input set and weight pair: WeightArgs / WoWeights of one q."""
    w13, w2 = _weights("int8_w8a16")
    x, ids, weights = _call(m)
    args = tuple(weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    return (lambda: run_experts_wo(x, *args, ids, weights, None, "int8_w8a16"),
            lambda: run_experts_wo_gluon(x, w13, w2, ids, weights, None, "int8_w8a16", options=SWAPFS),
            lambda out: _rel(out, _f64(x, w13, w2, ids, weights)))


@pytest.mark.parametrize("m", [40, 300])
def test_route_and_named_options_share_one_plan_and_sequence(routed, launched, m):
    from moekit.experts import triton_gluon_wo_lean as lean

    route, named, err = _both(m)
    first = route()
    outs = [named(), route(), named()]
    assert err(first) < 2e-2 and all(torch.equal(o, first) for o in outs)
    plans = [p for p in lean._PLANS.values() if isinstance(p, lean.WoLeanPlan)]
    assert len(plans) == 1 and len([k for k in lean._SEQUENCES if k[0] is plans[0]]) == 1
    assert launched[0] == 3  # every call after the recording one: the kept sequence
    assert [(b["GATED"], b["FAST"], b["SPLIT"]) for _, b, _ in routed["wo_swap"].log[:2]] == [
        (True, True, True), (False, True, True)]


@pytest.mark.parametrize("m", [40, 300])
def test_on_fresh_regions_route_and_named_options_launch_the_same(routed, bound_log, monkeypatch, m):
    """Above the pool's size, as while a CUDA graph captures: the plan's bound launches on fresh regions."""
    from moekit.experts.triton_gluon_lean import _WORKSPACES

    monkeypatch.setattr(_WORKSPACES, "max_bytes", 1024)
    route, named, err = _both(m)
    out_route = route()
    logged_route = list(bound_log)
    bound_log.clear()
    out_named = named()
    assert torch.equal(out_route, out_named) and err(out_route) < 2e-2
    names = [entry[0] for entry in logged_route]
    assert "grouped_gemm_wo_swap_kernel" in names and len(names) >= 5  # alignment, gather, up, down, combine
    assert bound_log == logged_route

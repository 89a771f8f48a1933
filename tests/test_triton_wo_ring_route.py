"""Where a weight-only call takes the ring decode (``moekit.experts.triton_wo_ring_route.ring_route``): only the
measured shapes and batch sizes, int4 group 128, bf16, silu, no map, a call that leaves the choice open, Gluon."""

import pytest
import torch

from moekit.experts import triton_wo_ring_route as route
from moekit.experts.triton_wo_plan import weight_args
from moekit.experts.triton_wo_ring import RingPlan

E, N, K = 4, 128, 256
UP, DOWN = RingPlan(64, 8, 4, decode="raw"), RingPlan(32, 8, 4, decode="raw")


def args(group=128):
    w13 = weight_args(torch.zeros(E, 2 * N, K // 2, dtype=torch.uint8), torch.ones(E, 2 * N, K // group),
                      torch.zeros(E, 2 * N, K // group, dtype=torch.uint8), group)
    w2 = weight_args(torch.zeros(E, K, N // 2, dtype=torch.uint8), torch.ones(E, K, N // group),
                     torch.zeros(E, K, N // group, dtype=torch.uint8), group)
    return w13, w2


@pytest.fixture
def measured(monkeypatch):
    monkeypatch.setattr(route, "RING_MEASURED", {("int4_w4a16", E, N, K): (8, UP, DOWN)})
    monkeypatch.setattr(route, "gluon_supported", lambda device: True)


def call(m=1, dtype=torch.bfloat16, scheme="int4_w4a16", activation="silu", expert_map=None, config=None,
         split_k=None, decode=None, group=128):
    x = torch.zeros(m, K, dtype=dtype)
    w13, w2 = args(group)
    ids = torch.zeros(m, 2, dtype=torch.int32)
    return route.ring_route(x, w13, w2, ids, scheme, activation, expert_map, config, split_k, decode)


def test_measured_call_takes_the_ring(measured):
    assert call(1) == (UP, DOWN)
    assert call(8) == (UP, DOWN)


@pytest.mark.parametrize("kw", [dict(m=9), dict(dtype=torch.float16), dict(scheme="mxfp4"), dict(activation="gelu"),
                                dict(expert_map=torch.arange(E)), dict(config=object()), dict(split_k=2),
                                dict(decode="gemv"), dict(group=64)])
def test_other_calls_keep_the_fused_decodes(measured, kw):
    assert call(**kw) is None


def test_unmeasured_shape_or_no_gluon(monkeypatch):
    monkeypatch.setattr(route, "gluon_supported", lambda device: True)
    monkeypatch.setattr(route, "RING_MEASURED", {})
    assert call(1) is None
    monkeypatch.setattr(route, "RING_MEASURED", {("int4_w4a16", E, N, K): (8, UP, DOWN)})
    monkeypatch.setattr(route, "gluon_supported", lambda device: False)
    assert call(1) is None


def test_mxfp4_measured_call_takes_the_ring(monkeypatch):
    monkeypatch.setattr(route, "RING_MEASURED", {("mxfp4", E, N, K): (1, UP, DOWN)})
    monkeypatch.setattr(route, "gluon_supported", lambda device: True)
    x = torch.zeros(1, K, dtype=torch.bfloat16)
    w13 = weight_args(torch.zeros(E, 2 * N, K // 2, dtype=torch.uint8),
                      torch.zeros(E, 2 * N, K // 32, dtype=torch.uint8), None, 32)
    w2 = weight_args(torch.zeros(E, K, N // 2, dtype=torch.uint8), torch.zeros(E, K, N // 32, dtype=torch.uint8),
                     None, 32)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    assert route.ring_route(x, w13, w2, ids, "mxfp4", "silu", None, None, None, None) == (UP, DOWN)
    assert route.ring_route(x, w13, w2, ids, "int4_w4a16", "silu", None, None, None, None) is None

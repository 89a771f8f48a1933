"""The tensor-core gate's float32 tiles (``gate_mma.mma_tiles(..., fp32_block_e=)``, session 52) on the CPU under
Triton's interpreter: narrower expert blocks over the same split of K give today's logits, ids and weights bit for bit,
and the float64 gate-and-route loop's ids.

Why a model of the dot: on sm_90 the float32 ``ieee`` dot is Triton's FMA dot, which adds an output's products by one
fused multiply-add chain over K in K's order, starting from the accumulator it is given (its generic FMA vector
multiplier), whatever the tile's shape; the interpreter's dot is numpy's matmul plus the accumulator, whose order
depends on the tile's shape (other bits for other expert blocks). ``fma_chain_dot`` replaces it with that chain for
these tests: each step the float64 sum of the exact product and the float32 accumulator, rounded to float32 (a fused
multiply-add but for a double rounding where the two lie more than 20 bits apart, the same step for every tiling).
The device's own bits: ``benchmarks/gate52_device_check.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoEConfig
from test_routing_gate_route import loop

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module", autouse=True)
def mods():
    with interpreted("moekit.routing", "moekit.routing.fused") as fused:
        import moekit.routing.gate_mma as gate_mma
        from moekit.routing.workspace import RouteBuffers

        yield fused, gate_mma, RouteBuffers


@pytest.fixture
def fma_chain_dot(monkeypatch):
    """The interpreter's float32 dot as the GPU's FMA dot: acc = fma(a[:, k], b[k, :], acc) for k in order."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    numpy_dot = InterpreterBuilder.create_dot

    def chain(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32 or a.data.dtype != np.float32:
            return numpy_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        lhs, rhs = a.data.astype(np.float64), b.data.astype(np.float64)  # [BM, BK], [BK, BE]
        acc = d.data.copy()  # [BM, BE] float32
        for k in range(lhs.shape[1]):
            acc = (acc.astype(np.float64) + lhs[:, k:k + 1] * rhs[k:k + 1, :]).astype(np.float32)
        return TensorHandle(acc, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", chain)


SHAPES = {  # (E, K, gate weight dtype, scoring): Qwen3's, Mixtral's, DeepSeek-V3's E; K = 600: split K with a ragged
    # last 64-column step (and a split shorter than the others)
    "e8": (8, 600, BF16, "softmax"),
    "e60": (60, 600, BF16, "softmax"),
    "e128": (128, 600, BF16, "softmax"),
    "e256_v3": (256, 600, FP32, "sigmoid"),
}


def _config(name: str) -> MoEConfig:
    e, k, _, scoring = SHAPES[name]
    if scoring == "sigmoid":
        return MoEConfig(hidden_size=k, moe_intermediate_size=8, num_experts=e, top_k=8, scoring="sigmoid", n_group=8,
                         topk_group=4, use_correction_bias=True, routed_scaling_factor=2.5)
    return MoEConfig(hidden_size=k, moe_intermediate_size=8, num_experts=e, top_k=min(8, e // 2),
                     router_dtype="float32")


def _launch(mods, cfg, x, w, bias, linear_bias, tiles):
    """(logits [M, E] float32, ids, weights) of one gate + router launch on ``tiles``, x and W read as stored."""
    fused, gate_mma, route_buffers = mods
    m, e = x.shape[0], cfg.num_experts
    bound = gate_mma.BoundGateMma(fused.FusedRouter(cfg)._plans[0], x, w, linear_bias, bias, None, False, tiles,
                                  dtype=FP32)
    count, part = bound.scratch
    buffers = route_buffers(logits=torch.empty(m, e), ids=torch.empty(m, cfg.top_k, dtype=torch.int32),
                            weights=torch.empty(m, cfg.top_k), count=torch.zeros(max(count, 1), dtype=torch.int32),
                            part=torch.empty(max(part, 1)))
    bound(x, w, linear_bias, bias, None, buffers)
    assert int(buffers.count.abs().sum()) == 0  # every counter back at 0
    return buffers.logits, buffers.ids, buffers.weights


@pytest.mark.parametrize("name,m", [("e8", 37), ("e60", 20), ("e128", 100), ("e256_v3", 20)])
@pytest.mark.parametrize("block_e", [16, 32])
def test_narrow_expert_tiles_keep_the_bits(mods, fma_chain_dot, name, m, block_e):
    """M not a multiple of the row block (16 up to 64 rows, 32 above), E = 8 / 60 / 128 / 256, K = 600."""
    _, gate_mma, _ = mods
    cfg = _config(name)
    e, k, w_dtype, _ = SHAPES[name]
    g = torch.Generator().manual_seed(m + e)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(e, k, generator=g) * k ** -0.5).to(w_dtype)
    bias = torch.rand(e, generator=g) * 0.1 if cfg.use_correction_bias else None
    today = gate_mma.mma_tiles(m, e, k, FP32, fp32_block_e=None)
    tiles = gate_mma.mma_tiles(m, e, k, FP32, fp32_block_e=block_e)
    assert today.split_k > 1 and tiles.k_per_split(k) == today.k_per_split(k)
    assert tiles.block_e == min(today.block_e, block_e)
    logits, ids, weights = _launch(mods, cfg, x, w, bias, None, today)
    got = _launch(mods, cfg, x, w, bias, None, tiles)
    assert torch.equal(got[0], logits) and torch.equal(got[1], ids) and torch.equal(got[2], weights)
    want = x.double() @ w.double().t()  # [M, E]
    assert float((got[0].double() - want).abs().max()) <= 1e-6 * float(want.abs().max())
    want_ids, want_weights = loop(x, w, cfg, bias)
    assert torch.equal(got[1], want_ids)
    torch.testing.assert_close(got[2].double(), want_weights, rtol=1e-5, atol=1e-6)


def test_linear_bias_after_the_split_sum(mods, fma_chain_dot):
    """A router's Linear bias (float32 beside bf16 W) is added once to the summed splits: the same bits either way."""
    _, gate_mma, _ = mods
    cfg = _config("e60")
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(24, 600, generator=g).to(BF16), (torch.randn(60, 600, generator=g) / 25).to(BF16)
    linear_bias = torch.randn(60, generator=g)
    today, tiles = (gate_mma.mma_tiles(24, 60, 600, FP32, fp32_block_e=b) for b in (None, 16))
    logits, ids, weights = _launch(mods, cfg, x, w, None, linear_bias, today)
    got = _launch(mods, cfg, x, w, None, linear_bias, tiles)
    assert torch.equal(got[0], logits) and torch.equal(got[1], ids) and torch.equal(got[2], weights)
    want = x.double() @ w.double().t() + linear_bias.double()
    assert float((got[0].double() - want).abs().max()) <= 1e-6 * float(want.abs().max())


@pytest.mark.parametrize("e,k", [(128, 2048), (256, 7168), (8, 4096), (60, 2048), (128, 600)])
def test_tiles_keep_the_split(mods, e, k):
    """At 9..256 rows the float32 tiles split K as today's (the same columns a program: the bits), the expert
    blocks at most fp32_block_e, as many programs or more; bf16 tiles never change."""
    _, gate_mma, _ = mods
    for m in (9, 16, 37, 64, 65, 100, 256):
        today = gate_mma.mma_tiles(m, e, k, FP32, fp32_block_e=None)
        for block_e in (16, 32, 64):
            tiles = gate_mma.mma_tiles(m, e, k, FP32, fp32_block_e=block_e)
            assert (tiles.split_k, tiles.k_per_split(k), tiles.block_m, tiles.block_k) == (
                today.split_k, today.k_per_split(k), today.block_m, today.block_k)
            assert tiles.block_e == min(block_e, today.block_e) >= 16
            rows, experts, splits = tiles.grid(m, e)
            assert rows * experts * splits >= today.grid(m, e)[0] * today.grid(m, e)[1] * today.split_k
            assert rows * tiles.block_m >= m and experts * tiles.block_e >= e
            assert gate_mma.mma_tiles(m, e, k, BF16, fp32_block_e=block_e) == gate_mma.mma_tiles(m, e, k, BF16)


@pytest.mark.parametrize("m", [20, 100])
def test_layer_on_narrow_tiles(mods, fma_chain_dot, m, monkeypatch):
    """The layer (router_dtype float32, bf16 weights) with ``FP32_BLOCK_E`` set, its full forward and its decode fast
    path (the launch and its kept scratch): output, logits and ids bit for bit those of today's tiles."""
    import moekit.routing.gate_route as gate_route
    from moekit import MoE

    _, gate_mma, _ = mods
    cfg = _config("e60")
    x = torch.randn(m, cfg.hidden_size, generator=torch.Generator().manual_seed(m)).to(BF16)
    results = []
    for block_e in (None, 16):
        monkeypatch.setattr(gate_mma, "FP32_BLOCK_E", block_e)  # the switch, read where a launch is bound
        monkeypatch.setattr(gate_route, "_BOUND", {})
        torch.manual_seed(0)
        layer = MoE(cfg, backend="reference", router="fused", dtype=BF16).eval()
        with torch.no_grad():
            routed = layer.route_tokens(x, layer._route_ws)
            outs = [layer(x) for _ in range(3)]  # the first keeps, the others are served
        assert layer._decode._entries[m].bound.tiles == gate_mma.mma_tiles(m, 60, cfg.hidden_size, FP32, block_e)
        results.append((routed.router_logits, routed.routing.topk_ids, *outs))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert torch.equal(results[0][2], results[0][4])


def test_scratch_kept_before_the_switch_fits(mods, fma_chain_dot, monkeypatch):
    """Buffers kept under today's tiles, then ``FP32_BLOCK_E`` set and the launch bound again into them: the counters
    its narrower tiles need fit, are back at 0 after it, and the routing is the same bits."""
    import moekit.routing.gate_route as gate_route
    from moekit.routing.workspace import RouteWorkspace

    fused, gate_mma, _ = mods
    cfg = _config("e128")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(20, 600, generator=g).to(BF16), (torch.randn(128, 600, generator=g) / 25).to(BF16)
    buffers = RouteWorkspace().get(x, 128, cfg.top_k, FP32)
    router = fused.FusedRouter(cfg)
    results = []
    for block_e in (None, 16):
        monkeypatch.setattr(gate_mma, "FP32_BLOCK_E", block_e)
        monkeypatch.setattr(gate_route, "_BOUND", {})
        got = gate_route.gate_route(router, x, w, None, None, None, False, buffers)
        rows, experts, _ = next(iter(gate_route._BOUND.values())).tiles.grid(20, 128)
        assert experts == 128 // (block_e or 128) and rows * (experts + 1) <= buffers.count.numel()
        assert int(buffers.count.abs().sum()) == 0
        results.append((buffers.logits.clone(), got.topk_ids.clone(), got.topk_weights.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("bad", [8, 24, 0])
def test_a_block_below_16_or_not_a_power_of_2_is_refused(mods, bad):
    _, gate_mma, _ = mods
    with pytest.raises(ValueError, match="fp32_block_e"):
        gate_mma.mma_tiles(64, 128, 2048, FP32, fp32_block_e=bad)

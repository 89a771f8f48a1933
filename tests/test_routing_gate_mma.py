"""The tensor-core gate with the fused router in one launch above 8 rows (``moekit.routing.gate_mma``, taken by
``gate_route`` up to 256 rows) on the CPU under Triton's interpreter: the logits against a float64 ``x @ W^T``
written here, the routing against ``moekit.route`` on the kernel's own logits and against ``loop`` (the float64
per-token gate-and-route of ``test_routing_gate_route``); split-K tiles and several row blocks, the counters back at
0, ties, the NaN policy, shared slots, and the layer (eager with kept buffers == a call without them, as a CUDA graph
capture runs it). The GPU's memory ordering between programs and timing: ``benchmarks/layer3_device_check.py``."""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, route
from test_routing_gate_route import CONFIGS, check_nonfinite, loop, problem, run

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards


@pytest.fixture(scope="module", autouse=True)
def mods():
    with interpreted("moekit.routing", "moekit.routing.fused") as fused:
        import moekit.routing.gate_mma as gate_mma
        import moekit.routing.gate_route as gate_route
        from moekit.routing.workspace import RouteWorkspace

        yield fused, gate_mma, gate_route, RouteWorkspace


def tiles_of(gate_mma, block_m, block_e, block_k, split_k):
    """mma_tiles replaced for one test: the launch and the workspace's scratch both read it."""
    return lambda *args: gate_mma.MmaTiles(block_m, block_e, block_k, split_k)


# (M, tiles): the default tiles; 16-row blocks of 16 experts with K split in 3 (K = 40: steps of 16) over 2 row
# blocks; 32-row blocks with a ragged last one
TILINGS = [(9, None), (20, (16, 16, 16, 3)), (37, (32, 16, 16, 2))]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m,tiling", TILINGS)
def test_logits_and_routing(mods, name, m, tiling, monkeypatch):
    _, gate_mma, gate_route, _ = mods
    monkeypatch.setattr(gate_route, "_BOUND", {})
    if tiling is not None:
        monkeypatch.setattr(gate_mma, "mma_tiles", tiles_of(gate_mma, *tiling))
    cfg = CONFIGS[name]
    x, w, bias = problem(cfg, m, seed=m)
    for _ in range(2):  # the second call finds every counter back at 0
        got, buffers = run(mods, cfg, x, w, bias)
        bound = next(iter(gate_route._BOUND.values()))
        assert isinstance(bound, gate_mma.BoundGateMma)
        assert int(buffers.count.abs().sum()) == 0 and buffers.count.numel() == bound.scratch[0]
        torch.testing.assert_close(buffers.logits.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
        ref = route(buffers.logits, cfg, bias)
        assert torch.equal(got.topk_ids, ref.topk_ids)
        torch.testing.assert_close(got.topk_weights, ref.topk_weights.float(), rtol=2e-6, atol=1e-7)
        ids, weights = loop(x, w, cfg, bias)
        assert torch.equal(got.topk_ids, ids)
        torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-6)


def test_bf16_logits_round_once(mods):
    """bf16 x and W: fp32 accumulation, one rounding to bf16 at the end: within one bf16 ulp (2^-7 relative) of the
    float64 product (the interpreter truncates fp32 -> bf16, the GPU rounds to nearest: half that)."""
    cfg = CONFIGS["no_renorm_scaled"]
    x, w, _ = problem(cfg, 24, torch.bfloat16, seed=4)
    got, buffers = run(mods, cfg, x, w)
    exact = x.double() @ w.double().t()
    assert float(((buffers.logits.double() - exact).abs() / exact.abs().clamp_min(1e-3)).max()) <= 2 ** -7
    assert torch.equal(got.topk_ids, route(buffers.logits, cfg).topk_ids)


def test_ties_lower_id_wins(mods):
    cfg = CONFIGS["softmax"]
    x, w, _ = problem(cfg, 12, seed=3)
    w[5], w[9], w[2] = w[1], w[1], w[7]  # experts 1, 5, 9 tie; 2 and 7 tie
    got, buffers = run(mods, cfg, x, w)
    ids, weights = loop(x, w, cfg)
    assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_ids, route(buffers.logits, cfg).topk_ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-6)


def test_shared_slots_and_linear_bias(mods, monkeypatch):
    _, gate_mma, _, _ = mods
    monkeypatch.setattr(gate_mma, "mma_tiles", tiles_of(gate_mma, 16, 16, 16, 2))  # E = 16: one expert block
    cfg = CONFIGS["grouped_sigmoid"].replace(shared_expert_intermediate_size=16)  # S = 2, ungated
    x, w, bias = problem(cfg, 10, seed=5)
    linear_bias = torch.randn(cfg.num_experts)
    got, buffers = run(mods, cfg, x, w, bias, linear_bias, append_shared=True)
    want = x.double() @ w.double().t() + linear_bias.double()
    torch.testing.assert_close(buffers.logits.double(), want, rtol=1e-5, atol=1e-5)
    ref = route(buffers.logits, cfg, bias)
    shared = torch.tensor([[16, 17]] * 10, dtype=torch.int32)
    assert torch.equal(got.topk_ids, torch.cat([ref.topk_ids, shared], dim=1))
    torch.testing.assert_close(got.topk_weights[:, :4], ref.topk_weights.float(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got.topk_weights[:, 4:], torch.ones(10, 2))


def test_nonfinite_raise_and_mask(mods):
    check_nonfinite(mods, 12, 10)


@pytest.mark.parametrize("name", ["softmax", "grouped_sigmoid"])
def test_layer_eager_equals_a_call_without_buffers(mods, name, monkeypatch):
    """MoE.forward at 9..256 rows takes the one launch from its kept buffers; ``route_tokens`` without buffers (stats,
    a CUDA graph capture) takes it too, into fresh ones, for every plan (``wants_fresh``: the two launches would gate
    on torch.mm), so both compute the same bits; the output against the layer's experts on ``route``'s routing."""
    _, _, gate_route, _ = mods
    cfg = CONFIGS[name].replace(shared_expert_intermediate_size=16)
    with torch.no_grad():
        layer = MoE(cfg, backend="reference", router="fused")
        if cfg.use_correction_bias:
            layer.e_score_correction_bias = torch.randn(cfg.num_experts) * 0.1
        taken = []
        monkeypatch.setattr(layer, "_gate_route", lambda *a: taken.append(1) or gate_route.gate_route(*a))
        x = torch.randn(18, cfg.hidden_size)
        out, kept = layer(x), layer.route_tokens(x, layer._route_ws)
        kept_tensors = (kept.routing.topk_ids, kept.routing.topk_weights, kept.router_logits)
        ids, weights, logits = (t.clone() for t in kept_tensors)
        fresh = layer.route_tokens(x)
        assert taken == [1, 1, 1] and 18 in layer._decode._entries and layer._decode._entries[18].bound is not None
        again = layer(x)  # the decode fast path: the entry's bound launch
        assert len(taken) == 3 and torch.equal(again, out)
        assert torch.equal(fresh.router_logits, logits) and torch.equal(fresh.routing.topk_ids, ids)
        assert torch.equal(fresh.routing.topk_weights, weights)
        ref = route(logits, cfg, layer.e_score_correction_bias)
        assert torch.equal(ids[:, :cfg.top_k], ref.topk_ids)
        want = layer._experts_and_shared(x, layer.route_tokens(x))
    assert torch.equal(out, want)

"""The gate kernels reading x and the gate weights in their stored dtypes under a float32 router (session 51:
``router_dtype="float32"`` over bf16 / fp16, DeepSeek-V3's float32 gate weight in a bf16 model), on the CPU under
Triton's interpreter: the row-loop gate (<= 8 rows), the one gate + router launch and the tensor-core one (9-256 rows)
bit for bit what they compute on the inputs cast to float32 first (session 50's path, cast here in the test), the
logits within float32 rounding of a float64 loop and the ids its top-k; the layer's full forward and decode fast path
with no cast at all, bit for bit the cast path (``gate.READ_STORED`` off). The GPU's reduction order (the reason the
kernel lays every float32-logits load out as float32's): ``benchmarks/rtr51_device_check.py``."""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig
from test_routing_gate_route import CONFIGS, loop

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (x, W, Linear bias or None) as stored under a float32 router: Kolibri / Lara-Mini (bf16 all), the privacy filter
# (its bf16 router bias), DeepSeek-V3 (a float32 W), an fp16 model, a float32 bias beside a bf16 W
STORED = {"bf16": (BF16, BF16, None), "bf16_bias": (BF16, BF16, BF16), "v3_fp32_w": (BF16, FP32, None),
          "fp16": (FP16, FP16, FP16), "fp32_bias": (BF16, BF16, FP32)}


@pytest.fixture(scope="module", autouse=True)
def mods():
    with interpreted("moekit.routing", "moekit.routing.fused") as fused:
        import moekit.routing.gate as gate
        import moekit.routing.gate_mma as gate_mma
        import moekit.routing.gate_route as gate_route
        from moekit.routing.workspace import RouteWorkspace

        yield fused, gate, gate_route, gate_mma, RouteWorkspace


def _tensors(kind: str, m: int, k: int, e: int, seed: int):
    """x [m, k], W [e, k], b [e] | None in ``kind``'s stored dtypes."""
    x_dtype, w_dtype, b_dtype = STORED[kind]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(x_dtype)
    w = torch.randn(e, k, generator=g).to(w_dtype)
    b = None if b_dtype is None else (torch.randn(e, generator=g) * 0.5).to(b_dtype)
    return x, w, b


def _cast(*tensors):
    """The float32 inputs of session 50's path (an exact upcast of each)."""
    return tuple(None if t is None else t.float() for t in tensors)


def _logits64(x, w, b) -> torch.Tensor:
    """x @ W^T + b in float64, a loop over tokens and experts."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        for e in range(w.shape[0]):
            dot = sum(float(a) * float(c) for a, c in zip(x[t].double(), w[e].double()))
            out[t, e] = dot + (0.0 if b is None else float(b[e]))
    return out


@pytest.mark.parametrize("kind", list(STORED))
@pytest.mark.parametrize("m", [1, 5])
def test_row_loop_gate_reads_stored_into_float32_logits(mods, kind, m):
    _, gate, _, _, _ = mods
    x, w, b = _tensors(kind, m, 40, 12, seed=m)
    got = gate.gate_logits(x, w, b, dtype=FP32)
    assert got is not None and got.dtype == FP32
    assert torch.equal(got, gate.gate_logits(*_cast(x, w, b)))  # the cast-then-launch, bit for bit
    want = _logits64(x, w, b)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()  # one float32 rounding of a K = 40 sum
    out = torch.full((m, 12), float("nan"))
    assert gate.gate_logits(x, w, b, out) is out and torch.equal(out, got)  # into a kept float32 buffer


def test_what_the_gate_does_not_read_as_stored(mods):
    """A downcast (float32 x under a bf16 router), float64, or logits in x's bf16 with a float32 W: None, the caller
    casts (``router_inputs``) and runs F.linear."""
    _, gate, _, _, _ = mods
    x, w, _ = _tensors("bf16", 2, 40, 12, seed=0)
    assert gate.reads_as(x, w, None, FP32) and gate.reads_as(x, w.float(), w[:, 0].half(), FP32)
    assert not gate.reads_as(x.float(), w, None, BF16) and not gate.reads_as(x, w.half(), None, BF16)
    assert not gate.reads_as(x, w, None, torch.float64) and not gate.reads_as(x.double(), w.float(), None, FP32)
    assert gate.gate_logits(x, w.float()) is None  # logits in x's dtype: W would be rounded
    assert gate.gate_logits(x.float(), w, dtype=BF16) is None
    assert gate.gate_logits(x, w, out=torch.empty(2, 12, dtype=FP16)) is None  # bf16 into fp16 is not exact


def _route(mods, cfg, x, w, linear_bias, bias, dtype=FP32):
    """(routing, buffers) of one gate_route call into fresh kept buffers of ``dtype``."""
    fused, _, gate_route, _, workspace = mods
    buffers = workspace().get(x, cfg.num_experts, cfg.top_k, dtype)
    return gate_route.gate_route(fused.FusedRouter(cfg), x, w, linear_bias, bias, None, False, buffers), buffers


@pytest.mark.parametrize("kind", ["bf16_bias", "v3_fp32_w", "fp16"])
@pytest.mark.parametrize("m", [1, 8, 12, 20])  # the row-loop gate's one launch; the tensor-core one's (20: 2 blocks)
@pytest.mark.parametrize("name", ["softmax", "grouped_sigmoid"])
def test_one_launch_reads_stored(mods, kind, m, name, monkeypatch):
    _, _, gate_route, gate_mma, _ = mods
    monkeypatch.setattr(gate_route, "_BOUND", {})
    if m == 20:  # split K in 3 over 2 row blocks of 16 (K = 40: steps of 16)
        monkeypatch.setattr(gate_mma, "mma_tiles", lambda *args: gate_mma.MmaTiles(16, 16, 16, 3))
    cfg = CONFIGS[name]
    x, w, b = _tensors(kind, m, cfg.hidden_size, cfg.num_experts, seed=m)
    bias = torch.randn(cfg.num_experts) * 0.1 if cfg.use_correction_bias else None
    got, buffers = _route(mods, cfg, x, w, b, bias)
    assert got is not None and len(gate_route._BOUND) == 1
    bound = next(iter(gate_route._BOUND.values()))
    assert isinstance(bound, gate_mma.BoundGateMma) == (m > 8)
    if m > 8:
        assert bound.tiles == gate_mma.MmaTiles(16, 16, 16, 3) or bound.tiles.block_k == 64  # float32's tiles
    logits, ids, weights = buffers.logits.clone(), got.topk_ids.clone(), got.topk_weights.clone()
    old, old_buffers = _route(mods, cfg, *_cast(x, w, b), bias)  # session 50's path: cast, then the same launch
    assert torch.equal(logits, old_buffers.logits) and torch.equal(ids, old.topk_ids)
    assert torch.equal(weights, old.topk_weights)
    want = _logits64(x, w, b)
    assert (logits.double() - want).abs().max() <= 1e-6 * want.abs().max()
    if b is None:  # loop: the float64 gate (no Linear bias) and route, one token at a time
        want_ids, want_weights = loop(x, w, cfg, bias)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights.double(), want_weights, rtol=1e-5, atol=1e-6)


K, E = 40, 8
LAYERS = {  # name -> (config, layer dtype, gate weight dtype)
    "router_fp32": (MoEConfig(hidden_size=K, moe_intermediate_size=16, num_experts=E, top_k=2,
                              router_dtype="float32"), BF16, BF16),
    "router_fp32_bias": (MoEConfig(hidden_size=K, moe_intermediate_size=16, num_experts=E, top_k=2,
                                   router_dtype="float32", router_bias=True), BF16, BF16),
    "fp32_gate_weight": (MoEConfig(hidden_size=K, moe_intermediate_size=16, num_experts=E, top_k=2, scoring="sigmoid",
                                   use_correction_bias=True), BF16, FP32),
    "fp16_router_fp32": (MoEConfig(hidden_size=K, moe_intermediate_size=16, num_experts=E, top_k=2,
                                   router_dtype="float32"), FP16, FP16),
}


def _layer(name: str) -> MoE:
    cfg, dtype, gate_dtype = LAYERS[name]
    torch.manual_seed(0)
    layer = MoE(cfg, backend="reference", router="fused", dtype=dtype).eval()
    layer.gate.to(gate_dtype)
    with torch.no_grad():
        if cfg.router_bias:
            layer.gate.bias.copy_(torch.randn(E) * 0.5)
        if cfg.use_correction_bias:
            layer.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    return layer


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("m", [1, 12])
def test_layer_casts_nothing_and_equals_the_cast_path(mods, name, m, monkeypatch):
    """The full forward, then the decode fast path: no cast of x or the gate weights (``router_inputs`` never runs,
    the kept entry holds no ``RouterCasts``), the output and router logits bit for bit those of the cast path
    (``gate.READ_STORED`` off: session 50's copies)."""
    _, gate, _, _, _ = mods
    layer = _layer(name)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(LAYERS[name][1])
    casts = []
    real = gate.router_inputs
    monkeypatch.setattr(gate, "router_inputs", lambda *a: casts.append(1) or real(*a))
    with torch.no_grad():
        full = layer.route_tokens(x, layer._route_ws)
        logits, ids = full.router_logits.clone(), full.routing.topk_ids.clone()
        outs = [layer(x) for _ in range(3)]  # the first keeps, the others are served
        assert casts == [] and layer._decode._entries[m].casts is None and logits.dtype == FP32
        monkeypatch.setattr(gate, "READ_STORED", False)
        old = layer.route_tokens(x, layer._route_ws)
        assert casts and torch.equal(old.router_logits, logits) and torch.equal(old.routing.topk_ids, ids)
        layer._decode.clear()
        old_outs = [layer(x) for _ in range(3)]
        assert layer._decode._entries[m].casts is not None  # the A/B's old path: kept cast buffers
    assert all(torch.equal(a, outs[0]) for a in outs + old_outs)

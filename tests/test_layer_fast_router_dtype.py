"""The decode fast path (``moekit.layer_fast``) with the router in another dtype than x's, under Triton's interpreter:
``router_dtype="float32"`` over bf16 activations and a bf16 gate weight (Kolibri, Lara-Mini, the privacy filter with
its router bias, LongCat-Flash) and a float32 gate weight in a bf16 layer (DeepSeek-V3 as transformers loads it). It
serves the repeated calls (the gate + router launch reading them as stored, session 51; ``RouterCasts``' kept float32
copies with ``gate.READ_STORED`` off, session 50), bit for bit the full forward's output, on logits that are the
float64 GEMM's rounded once to float32 and a choice that is the float64 logits' top-k; an update of the gate weight in
place or through ``.data`` (no version moves) is read, never a stale copy."""

from __future__ import annotations

import pytest
import torch

from _helpers import TOLERANCE as TOL, count_served, rel_l2
from _triton_helpers import interpreted
from moekit import MoE, MoEConfig, layer_fast
from moekit.experts.reference import experts_reference

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

K, N, E = 40, 24, 8
BASE = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
KINDS = {  # name -> (config, the gate weight's dtype)
    "router_fp32": (BASE.replace(router_dtype="float32"), torch.bfloat16),
    "router_fp32_bias": (BASE.replace(router_dtype="float32", router_bias=True), torch.bfloat16),
    "fp32_gate_weight": (BASE.replace(scoring="sigmoid", use_correction_bias=True), torch.float32),
}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with interpreted("moekit.routing", "moekit.routing.fused"), interpreted("moekit.experts", "moekit.experts.triton"):
        yield


class _Never(layer_fast.DecodeFast):
    """Keeps nothing: the full forward every time."""

    def keep(self, layer, x2d) -> None:
        pass


def _pair(name: str):
    """(layer, full): bf16 layers with the same weights, the gate weight in its kind's dtype; ``full`` never takes
    the fast path."""
    cfg, gate_dtype = KINDS[name]
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = MoE(cfg, backend="triton", router="fused", dtype=torch.bfloat16).eval()
        layer.gate.to(gate_dtype)
        if cfg.router_bias:
            with torch.no_grad():
                layer.gate.bias.copy_(torch.randn(E) * 0.5)
        if cfg.use_correction_bias:
            layer.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
        layers.append(layer)
    layers[1]._decode = _Never()
    return layers[0], layers[1]


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _logits64(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The gate in float64, a loop over tokens and experts: x and W as the layer holds them, upcast exactly."""
    w = layer.gate.weight.double()
    b = layer.gate.bias
    out = torch.empty(x.shape[0], E, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e in range(E):
            out[t, e] = sum(float(x[t, i]) * float(w[e, i]) for i in range(K)) + (0.0 if b is None else float(b[e]))
    return out


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("m", [1, 12])  # the one gate + router launch; torch.mm and the router's launch
def test_served_bit_equal_to_the_full_forward_and_the_float64_gate(monkeypatch, name, m):
    hits = count_served(monkeypatch, layer_fast.DecodeFast, "__call__")  # forwards the fast path served
    layer, full = _pair(name)
    with torch.no_grad():
        xs = [_x(m, seed) for seed in range(3)]
        outs = [layer(x) for x in xs]  # the first call keeps, the others are served
        assert hits[0] == 2 and all(torch.equal(out, full(x)) for out, x in zip(outs, xs))
        x, got = xs[-1], outs[-1]
        ws = layer._decode._entries[m].buffers
        assert ws.logits.dtype == torch.float32
        want = _logits64(layer, x)
        # one float32 rounding of a K = 40 sum: a few ulps of the largest term, never bf16's 4e-3
        assert (ws.logits.double() - want).abs().max() <= 1e-5 * want.abs().max()
        bias = layer.e_score_correction_bias
        scores = want.softmax(-1) if layer.config.scoring == "softmax" else want.sigmoid()
        choice = scores if bias is None else scores + bias.double()
        top = choice.topk(layer.config.top_k, dim=-1)
        assert (top.values[:, -1] - choice.sort(-1, descending=True).values[:, 2]).min() > 1e-4  # no near-tie
        assert torch.equal(ws.ids.long().sort(-1).values, top.indices.sort(-1).values)
        routing = layer.route_tokens(x).routing
        ref = experts_reference(x.double(), layer.w13.double(), layer.w2.double(), routing.topk_ids.long(),
                                routing.topk_weights.double())
        assert rel_l2(got, ref) < TOL[torch.bfloat16]


def _in_place(layer, full):
    layer.gate.weight.mul_(-1), full.gate.weight.mul_(-1)


def _through_data(layer, full):  # the same tensor and address, no version moved
    w = torch.randn_like(layer.gate.weight)
    layer.gate.weight.data.copy_(w), full.gate.weight.data.copy_(w)


@pytest.mark.parametrize("change", [_in_place, _through_data])
@pytest.mark.parametrize("name", ["router_fp32", "router_fp32_bias"])
def test_an_updated_gate_weight_is_read_not_a_stale_cast(monkeypatch, name, change):
    hits = count_served(monkeypatch, layer_fast.DecodeFast, "__call__")
    layer, full = _pair(name)
    with torch.no_grad():
        layer(_x(2, 0)), layer(_x(2, 1))
        before = hits[0]
        version = layer.gate.weight._version
        change(layer, full)
        x = _x(2, 2)
        assert torch.equal(layer(x), full(x)) and hits[0] == before + 1  # served, on the new weight
        assert (layer.gate.weight._version == version) is (change is _through_data)


@pytest.mark.parametrize("read_stored", [True, False])
def test_two_sizes_share_one_weight_copy_and_stay_exact(monkeypatch, read_stored):
    """Kinds of M = 1 and 12 kept by one layer on one thread, calls in turn across an in-place update of the weight
    between them, stay equal to the full forward: reading x, W and b as stored (no buffers at all), or with
    ``gate.READ_STORED`` off (session 50's casts) sharing the float32 W and b buffers (one copy a layer, not one per
    kept M), each filling the shared W before its launch, and each its own x buffer."""
    from moekit.routing import gate

    monkeypatch.setattr(gate, "READ_STORED", read_stored)
    hits = count_served(monkeypatch, layer_fast.DecodeFast, "__call__")
    layer, full = _pair("router_fp32_bias")
    with torch.no_grad():
        for seed in range(3):
            if seed == 2:
                layer.gate.weight.mul_(-1), full.gate.weight.mul_(-1)
            for m in (1, 12):
                x = _x(m, seed)
                assert torch.equal(layer(x), full(x))
    assert hits[0] == 4
    one, twelve = (layer._decode._entries[m].casts for m in (1, 12))
    if read_stored:
        assert one is None and twelve is None
    else:
        assert one.weight is twelve.weight and one.linear_bias is twelve.linear_bias and one.x is not twelve.x

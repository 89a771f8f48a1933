"""The decode fast path (``moekit.layer_fast``) with a separate shared MLP under Triton's interpreter: a bf16 layer
with ``fuse_shared=False``, the same with Qwen2-MoE's sigmoid-gated shared expert, and quantized layers
(``MoE.quantize_`` un-fuses the shared expert: int4 and fp8); a repeated forward is served and equals the full
forward bit for bit (the fast path off), and the float64 reference; a shared weight replaced, its ``.data`` swapped,
or updated in place is read as the full forward reads it (nothing of the shared MLP is kept)."""

from __future__ import annotations

import pytest
import torch

from _helpers import TOLERANCE as TOL, rel_l2
from moekit import MoE, MoEConfig
from moekit.activations import apply_glu
from moekit.experts.reference import experts_reference
from test_layer_fast import _Never, hits, interpreter  # noqa: F401  (fixtures: the interpreter, served calls)

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

K, N = 64, 32  # int4's groups of 32 along K and N
CONFIG = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=8, top_k=2, scoring="sigmoid",
                   use_correction_bias=True, routed_scaling_factor=2.5, shared_expert_intermediate_size=N)
SCHEMES = {"int4_w4a16": dict(group_size=32), "fp8_block": dict(block_shape=(32, 32))}


def _pair(gated: bool = False, scheme: str | None = None):
    """(layer, full): the same weights, a separate shared MLP; ``full`` never takes the fast path."""
    cfg = CONFIG.replace(shared_expert_gate=gated)
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = MoE(cfg, backend="triton", router="fused", dtype=torch.bfloat16, fuse_shared=False).eval()
        layer.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.1)
        layers.append(layer if scheme is None else layer.quantize_(scheme, **SCHEMES[scheme]))
    layers[1]._decode = _Never()
    assert layers[0].shared_w13 is not None and not layers[0].fuse_shared
    return layers[0], layers[1]


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _shared_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The shared MLP in float64, written out: silu(x W_g) * (x W_u) W_2, times sigmoid(x w_gate) where gated."""
    xd = x.double()
    h = apply_glu(xd @ layer.shared_w13.double().t(), "silu")  # [M, SN]
    y = h @ layer.shared_w2.double().t()  # [M, K]
    if layer.shared_gate is not None:
        y = torch.sigmoid(xd @ layer.shared_gate.weight.double().t()) * y
    return y


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """float64 routed experts over the layer's own routing of x, plus the shared MLP's reference."""
    routing = layer.route_tokens(x).routing
    routed = experts_reference(x.double(), layer.w13.double(), layer.w2.double(), routing.topk_ids.long(),
                               routing.topk_weights.double())
    return routed + _shared_reference(layer, x)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 8])
def test_served_equal_to_full_forward(hits, gated, m):
    layer, full = _pair(gated)
    xs = [_x(m, seed) for seed in range(3)]
    with torch.no_grad():
        pairs = [(layer(x), full(x)) for x in xs]  # the first call keeps, the others are served
        assert hits[0] == 2 and all(torch.equal(got, want) for got, want in pairs)
        assert rel_l2(pairs[-1][0], _reference(layer, xs[-1])) < TOL[torch.bfloat16]  # a served call's output


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_quantized_layer_served_equal_to_full_forward(hits, scheme):
    """``quantize_`` un-fuses the shared expert: the experts on the backend's quantized fast path, then the MLP."""
    layer, full = _pair(scheme=scheme)
    with torch.no_grad():
        for seed in range(3):
            x = _x(2, seed)
            assert torch.equal(layer(x), full(x))
    assert hits[0] == 2


def _new_w13(layer, full):
    w = torch.randn_like(layer.shared_w13)
    layer.shared_w13, full.shared_w13 = torch.nn.Parameter(w), torch.nn.Parameter(w.clone())


def _w2_data(layer, full):
    w = torch.randn_like(layer.shared_w2)
    layer.shared_w2.data, full.shared_w2.data = w, w.clone()


def _w13_in_place(layer, full):
    layer.shared_w13.mul_(-1), full.shared_w13.mul_(-1)


def _gate_in_place(layer, full):
    layer.shared_gate.weight.mul_(-2), full.shared_gate.weight.mul_(-2)


def _new_gate(layer, full):
    w = torch.randn_like(layer.shared_gate.weight)
    layer.shared_gate.weight, full.shared_gate.weight = torch.nn.Parameter(w), torch.nn.Parameter(w.clone())


@pytest.mark.parametrize("change", [_new_w13, _w2_data, _w13_in_place, _gate_in_place, _new_gate])
def test_a_changed_shared_weight_is_read_as_the_full_forward_reads_it(hits, change):
    layer, full = _pair(gated=True)
    with torch.no_grad():
        layer(_x(2, 0)), layer(_x(2, 1))
        before = full(_x(2, 2))
        change(layer, full)
        x = _x(2, 2)
        want = full(x)
        assert not torch.equal(want, before)  # the change matters
        assert torch.equal(layer(x), want)
    assert hits[0] == 2



class _JointStandIn:
    """Stands in for ``triton_fast.JointCall`` (which batches only on a GPU): the one C call's output, the routed
    experts alone (the layer's experts call), after the gate + router launch the stand-in runs first."""

    def __init__(self, entry, layer):
        self.entry, self.layer = entry, layer

    def __call__(self, x, w13, w2, ids, weights, b13=None, b2=None):
        entry, layer = self.entry, self.layer
        entry.bound(x, layer.gate.weight, None, layer.e_score_correction_bias, None, entry.buffers)
        return routed_experts(layer, x, ids, weights)


def routed_experts(layer, x, ids, weights):
    return layer._experts_call(layer._experts_fn, x, layer.w13, layer.w2, ids, weights,
                               activation=layer.config.activation)


@pytest.mark.parametrize("gated", [False, True])
def test_a_joined_call_adds_the_shared_mlp(hits, gated):
    """Where the gate + router launch joins the experts' one C call (``JOINED``, a GPU's batched launches) the served
    output is still the full forward's: the separate shared MLP added after it (session 48 returned the joined call's
    routed experts alone)."""
    layer, full = _pair(gated)
    x = _x(2, 0)
    with torch.no_grad():
        layer(x)
        entry = layer._decode._entries[2]
        assert entry.kept is not None and entry.bound is not None
        entry.joint = _JointStandIn(entry, layer)
        got, want = layer(x), full(x)
        routed = routed_experts(layer, x, entry.buffers.ids, entry.buffers.weights)
    assert hits[0] == 1
    assert not torch.equal(routed, want)  # the shared MLP matters here
    assert torch.equal(got, want)

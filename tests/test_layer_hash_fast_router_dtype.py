"""``HashMoE``'s decode fast path (``moekit.layer_hash_fast``) with the router in another dtype than x's, under
Triton's interpreter: a float32 gate weight in a bf16 layer (DeepSeek-V4 as transformers loads its gate) and
``router_dtype="float32"`` over a bf16 gate weight. The repeated calls are served (session 51, fix51), the gate kernel
reading x and the gate weight as stored (the same tensors, no cast copy) for float32 logits, as the full forward
does; the served output equals the full forward's bit for bit and ``_hash_loop``'s float64 layer within bf16's
rounding. With ``gate.READ_STORED`` off (the full forward casts the gate's inputs) nothing is served."""

from __future__ import annotations

import pytest
import torch

from _hash_loop import hash_layer_loop
from _triton_helpers import interpreted
from test_layer_hash_fast import _Never
from moekit import HashMoE, MoEConfig
from moekit.layer_hash_fast import HashDecodeFast
from moekit.routing import gate as routing_gate

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

V, K = 50, 16
BASE = MoEConfig(hidden_size=K, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sqrtsoftplus",
                 routed_scaling_factor=1.5, hash_table_size=V, shared_expert_intermediate_size=8)
KINDS = {  # name -> (config, the gate weight's dtype)
    "fp32_gate_weight": (BASE, torch.float32),
    "router_fp32": (BASE.replace(router_dtype="float32"), torch.bfloat16),
}


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with interpreted("moekit.routing", "moekit.routing.hash_fused"), \
            interpreted("moekit.experts", "moekit.experts.triton"):
        yield


def _pair(name: str, fuse_shared: bool):
    """(layer, full): bf16 layers with the same weights and table, the gate weight in its kind's dtype; ``full``
    never takes the fast path."""
    cfg, gate_dtype = KINDS[name]
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = HashMoE(cfg, backend="triton", router="fused", fuse_shared=fuse_shared, dtype=torch.bfloat16).eval()
        layer.gate.to(gate_dtype)
        layers.append(layer)
    layers[1]._hash_decode = _Never()
    return layers[0], layers[1]


def _served(monkeypatch) -> list:
    """The outputs the fast path served (None: it missed), in call order."""
    seen, real = [], HashDecodeFast.__call__

    def counted(self, layer, x2d, token_ids):
        out = real(self, layer, x2d, token_ids)
        seen.append(out)
        return out

    monkeypatch.setattr(HashDecodeFast, "__call__", counted)
    return seen


def _gate_weights(monkeypatch) -> list:
    """The gate weight tensor of every gate kernel launch."""
    seen, real = [], routing_gate._BoundGate.__call__

    def spied(self, x, weight, bias, out):
        seen.append(weight)
        return real(self, x, weight, bias, out)

    monkeypatch.setattr(routing_gate._BoundGate, "__call__", spied)
    return seen


@pytest.mark.parametrize("name", list(KINDS))
@pytest.mark.parametrize("m, fuse_shared", [(1, True), (8, False), (9, True)])  # the gate kernel to 8 rows, F.linear
def test_served_bit_equal_to_the_full_forward(monkeypatch, name, m, fuse_shared):
    served, launched = _served(monkeypatch), _gate_weights(monkeypatch)
    layer, full = _pair(name, fuse_shared)
    with torch.no_grad():
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            x, ids = torch.randn(m, K, generator=g).bfloat16(), torch.randint(0, V, (m,), generator=g)
            before = len(launched)
            got = layer(x, token_ids=ids)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, full(x, token_ids=ids))
            if m <= 8:  # the served call's gate launch reads the layer's weight as stored
                assert launched[before] is layer.gate.weight
    assert [out is not None for out in served] == [False, True, True]  # the first call keeps, the others are served
    ref = hash_layer_loop(layer, x, ids)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-2  # bf16 activations and experts


def test_nothing_served_where_the_gate_reads_casts(monkeypatch):
    """``gate.READ_STORED`` off: the full forward gives the gate kernel float32 casts, which the fast path does not
    keep, so every call runs the full forward (its output the same)."""
    monkeypatch.setattr(routing_gate, "READ_STORED", False)
    served = _served(monkeypatch)
    layer, full = _pair("fp32_gate_weight", True)
    x, ids = torch.randn(2, K).bfloat16(), torch.randint(0, V, (2,))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(layer(x, token_ids=ids), full(x, token_ids=ids))
    assert served == [None] * 3

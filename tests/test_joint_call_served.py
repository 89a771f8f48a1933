"""The real joined one-C-call path of a served decode call on the CPU: ``layer_fast``'s ``triton_fast.JointCall``
(the gate + router launch, then the experts' kept launches) run by ``batch_launch``'s C module, its launches executed
by the interpreter through ``_interpreted_raw``'s driver. A bf16 top-k layer with a separate shared MLP (plain and
Qwen2-MoE's sigmoid-gated one) is served through the joint and equals the full forward bit for bit (run before, under
the plain interpreter) and a float64 loop written here; session 48's joined path returned the routed experts alone.
DeepSeek-V4's hash layer (``layer_hash_fast``: the gate kernel, the hash router reading the call's token ids, then
the experts), shared expert fused or separate, likewise against ``_hash_loop``'s float64 layer."""

from __future__ import annotations

import pytest
import torch

from _helpers import TOLERANCE as TOL, rel_l2
from _interpreted_raw import interpreted_raw
from _hash_loop import hash_layer_loop
from moekit import HashMoE, MoE, MoEConfig, layer_fast
from moekit.routing import hash_fused
from test_batch_launch import mod  # noqa: F401  (the fixture: the C module)
from test_layer_fast import hits  # noqa: F401  (the fixture: served calls)
from test_layer_hash_fast import interpreter  # noqa: F401  (the routers, the hash one too, and experts interpreted)

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

K, N, E, TOP_K = 64, 32, 8, 2
# nonfinite="mask": the router keeps no flag under the interpreter (as a GPU's asserting kernel keeps none), which
# is what lets ``DecodeFast.keep`` join the one launch to the kept call
CONFIG = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=TOP_K, scoring="sigmoid",
                   use_correction_bias=True, routed_scaling_factor=2.5, shared_expert_intermediate_size=N,
                   nonfinite="mask")


def _layer(gated: bool) -> MoE:
    torch.manual_seed(0)
    layer = MoE(CONFIG.replace(shared_expert_gate=gated), backend="triton", router="fused", dtype=torch.bfloat16,
                fuse_shared=False).eval()
    layer.e_score_correction_bias.copy_(torch.randn(E) * 0.1)
    assert layer.shared_w13 is not None and not layer.fuse_shared
    return layer


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _float64_loop(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's formula per token in float64: sigmoid scores, the top-k by score + correction bias, the chosen
    scores renormalised and scaled, SiLU-and-mul experts, plus the shared MLP (times sigmoid of its gate)."""
    xd, bias = x.double(), layer.e_score_correction_bias.double()
    w13, w2 = layer.w13.double(), layer.w2.double()
    out = torch.zeros_like(xd)
    for t in range(xd.shape[0]):
        scores = torch.sigmoid(xd[t] @ layer.gate.weight.double().t())  # [E]
        chosen = sorted(range(E), key=lambda e: -(scores[e] + bias[e]).item())[:TOP_K]
        total = sum(scores[e] for e in chosen)
        for e in chosen:
            h = w13[e] @ xd[t]  # [2N]
            act = torch.nn.functional.silu(h[:N]) * h[N:]
            out[t] += CONFIG.routed_scaling_factor * scores[e] / total * (w2[e] @ act)
        shared = layer.shared_w13.double() @ xd[t]
        y = layer.shared_w2.double() @ (torch.nn.functional.silu(shared[:N]) * shared[N:])
        if layer.shared_gate is not None:
            y = y * torch.sigmoid(layer.shared_gate.weight.double() @ xd[t])
        out[t] += y
    return out


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 4])
def test_a_joined_served_call_equals_the_full_forward_and_float64(mod, hits, gated, m):  # noqa: F811
    layer = _layer(gated)
    xs = [_x(m, seed) for seed in range(4)]
    layer._decode.clear()
    with torch.no_grad():
        saved, layer_fast.ENABLED = layer_fast.ENABLED, False
        try:
            want = [layer(x) for x in xs]  # the full forward, the plain interpreter's launches
        finally:
            layer_fast.ENABLED = saved
        with interpreted_raw(mod) as driver:
            got = [layer(x) for x in xs]  # compiled (raw from then on), kept, then served
            entry = layer._decode._entries[m]
            assert entry.joint is not None and entry.joint.batch is not None, "the served calls were not joined"
            driver.launches.clear()
            again = layer(xs[-1])
    assert driver.error is None, driver.error
    assert driver.launches[0] == "gate_route_kernel" and len(driver.launches) > 1  # the lead, then the experts'
    assert hits[0] >= 2
    for g, w in zip(got + [again], want + [want[-1]]):
        assert torch.equal(g, w)
    assert rel_l2(again, _float64_loop(layer, xs[-1])) < TOL[torch.bfloat16]


def _hash_layer(fuse_shared: bool) -> HashMoE:
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sqrtsoftplus",
                    routed_scaling_factor=1.5, hash_table_size=50, shared_expert_intermediate_size=8)
    layer = HashMoE(cfg, backend="triton", router="fused", fuse_shared=fuse_shared).eval()
    # a table whose rows differ (the default repeats 4 rows: two tokens' ids swapped could route alike)
    layer.tid2eid.copy_(torch.stack([torch.randperm(16)[:4] for _ in range(50)]).to(layer.tid2eid.dtype))
    return layer


@pytest.mark.parametrize("fuse_shared", [True, False])
def test_a_joined_served_hash_call_equals_the_full_forward_and_float64(mod, fuse_shared, monkeypatch):  # noqa: F811
    """The interpreted hash router keeps flags (a GPU's asserts in its kernel): they are set aside (``ok`` None, as
    compiled) so that ``HashDecodeFast.keep`` joins; a served call's launches are then the driver's only ones."""
    layer = _hash_layer(fuse_shared)
    g = torch.Generator().manual_seed(1)
    calls = [(torch.randn(2, 16, generator=g), torch.randint(0, 50, (2,), generator=g)) for _ in range(4)]
    with torch.no_grad():
        saved, layer_fast.ENABLED = layer_fast.ENABLED, False
        try:
            want = [layer(x, token_ids=ids) for x, ids in calls]  # the full forward, the plain interpreter's launches
        finally:
            layer_fast.ENABLED = saved
        with interpreted_raw(mod) as driver:
            layer(calls[0][0], token_ids=calls[0][1])  # compiled: raw from then on
            for bound in hash_fused._BOUND.values():
                monkeypatch.setattr(bound, "ok", None)
            layer._hash_decode.clear()
            got = [layer(x, token_ids=ids) for x, ids in calls]  # kept, then served
            entry = layer._hash_decode._entries[2]
            assert entry.joint is not None and entry.joint.batch is not None, "the served calls were not joined"
            driver.launches.clear()
            again = layer(calls[-1][0], token_ids=calls[-1][1])
            gate_name = entry.gate.launch.kernel.fn.__name__
    assert driver.error is None, driver.error
    assert driver.launches[:2] == [gate_name, "hash_route_kernel"] and len(driver.launches) > 2
    for g_out, w_out in zip(got + [again], want + [want[-1]]):
        assert torch.equal(g_out, w_out)
    assert rel_l2(again, hash_layer_loop(layer, *calls[-1])) < TOL[torch.float32]

"""Hash routing in one Triton launch (``moekit.routing.hash_fused``, ``HashMoE(router="fused")``) on the CPU under
Triton's interpreter (TRITON_INTERPRET=1).

Chain: the kernel against a float64 per-token loop written here (the table's experts, their scores: sqrt(softplus),
sigmoid or softmax, soft-capped or not, / (their sum + 1e-20) or not, x the scale; shared slots last) and against
``hash_route`` (its torch twin: ids equal, weights within fp32 rounding); its errors as the twin's; the layer with
``router="fused"`` against the torch-routed layer and ``_hash_loop``'s float64 layer; the compiled launch's own
device-side asserts (interpreted with the debug option a GPU compile gets). GPU figures:
``benchmarks/v4r48_device_check.py``.

Shapes: M tokens, E experts 16, k = top_k 4, V table rows 50.
"""

from __future__ import annotations

import math

import pytest
import torch

from _hash_loop import hash_layer_loop
from _triton_helpers import interpreted
from moekit import HashMoE, MoEConfig
from moekit.routing import append_shared_slots
from moekit.routing.hash_route import hash_route

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

V = 50
BASE = dict(hidden_size=16, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sqrtsoftplus",
            routed_scaling_factor=1.5, hash_table_size=V)
CASES = {
    "v4": {},
    "v4_shared": dict(shared_expert_intermediate_size=16),  # two fused shared slots
    "sigmoid_not_renormalised": dict(scoring="sigmoid", renormalize=False),
    "softmax_capped": dict(scoring="softmax", router_logit_softcap=2.0, routed_scaling_factor=1.0),
}


@pytest.fixture(scope="module", autouse=True)
def hash_fused():
    with interpreted("moekit.routing", "moekit.routing.hash_fused") as module, \
            interpreted("moekit.experts", "moekit.experts.triton"):
        yield module


def _score(row: list[float], e: int, cfg: MoEConfig) -> float:
    cap = cfg.router_logit_softcap
    row = [cap * math.tanh(v / cap) for v in row] if cap else row
    x = row[e]
    if cfg.scoring == "softmax":
        top = max(row)
        return math.exp(x - top) / sum(math.exp(v - top) for v in row)
    if cfg.scoring == "sigmoid":
        return 1.0 / (1.0 + math.exp(-x))
    return math.sqrt(x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x)))


def loop(logits, token_ids, table, cfg, num_shared=0):
    """float64 per token: ids [M, k+S], weights [M, k+S]."""
    all_ids, all_w = [], []
    for row, t in zip(logits.double().tolist(), token_ids.tolist()):
        ids = table[t].tolist()
        s = [_score(row, e, cfg) for e in ids]
        total = sum(s) + 1e-20 if cfg.renormalize else 1.0
        all_ids.append(ids + list(range(cfg.num_experts, cfg.num_experts + num_shared)))
        all_w.append([v / total * cfg.routed_scaling_factor for v in s] + [cfg.shared_weight] * num_shared)
    return torch.tensor(all_ids, dtype=torch.int32), torch.tensor(all_w, dtype=torch.float64)


def _problem(cfg, m, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, cfg.num_experts, generator=g) * 4
    table = torch.randint(0, cfg.num_experts, (V, cfg.top_k), generator=g)
    return logits, torch.randint(0, V, (m,), generator=g), table


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("m, per_program", [(1, 128), (9, 128), (9, 8192)])  # 8192: many rows a program
def test_matches_a_float64_loop_and_hash_route(hash_fused, name, m, per_program):
    cfg = MoEConfig(**dict(BASE, **CASES[name]))
    shared = cfg.num_shared_slots > 0
    logits, token_ids, table = _problem(cfg, m, seed=m)
    got = hash_fused.FusedHashRouter(cfg, per_program)(logits, token_ids, table, append_shared=shared)
    ids, weights = loop(logits, token_ids, table, cfg, cfg.num_shared_slots)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-12)
    want = hash_route(logits, token_ids, table, cfg)
    want = append_shared_slots(want, cfg) if shared else want
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-12)


def test_errors_as_hash_routes_then_a_good_call(hash_fused):
    cfg = MoEConfig(**BASE)
    logits, token_ids, table = _problem(cfg, 5, seed=5)
    router = hash_fused.FusedHashRouter(cfg)
    bad = logits.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"router_logits contains NaN or infinite values \(first bad token rows: \[3"):
        router(bad, token_ids, table)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, hash_table_size=50\).*got \[50\] at tokens \[1\]"):
        router(logits, torch.tensor([0, V, 2, 3, 4]), table)
    with pytest.raises(TypeError, match="token_ids must be an integer torch.Tensor"):
        router(logits, token_ids.float(), table)
    with pytest.raises(ValueError, match=r"token_ids must have shape \[M=5\]"):
        router(logits, token_ids[:4], table)
    got = router(logits, token_ids, table)  # the flags set back after each error
    assert torch.equal(got.topk_ids, hash_route(logits, token_ids, table, cfg).topk_ids)
    with pytest.raises(ValueError, match="the fused hash router needs hash_table_size"):
        hash_fused.FusedHashRouter(MoEConfig(**dict(BASE, hash_table_size=None)))


@pytest.mark.parametrize("fuse_shared", [True, False])
def test_the_layer_with_the_fused_hash_router(hash_fused, fuse_shared):
    """``HashMoE(router="fused")`` equals the torch-routed layer (same weights) and the float64 loop layer."""
    cfg = MoEConfig(**BASE, shared_expert_intermediate_size=8)
    layers = []
    for router in ("fused", "torch"):
        torch.manual_seed(0)
        layers.append(HashMoE(cfg, backend="triton", router=router, fuse_shared=fuse_shared).eval())
    fused, plain = layers
    assert fused._hash_router is not None and plain._hash_router is None
    g = torch.Generator().manual_seed(1)
    x, ids = torch.randn(2, 3, 16, generator=g), torch.randint(0, V, (2, 3), generator=g)
    with torch.no_grad():
        got, want = fused(x, token_ids=ids), plain(x, token_ids=ids)
    assert (got - want).norm() / want.norm() < 1e-6
    ref = hash_layer_loop(fused, x, ids)
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-5
    torch.manual_seed(0)
    auto = HashMoE(cfg, backend="triton", router="auto", fuse_shared=fuse_shared).eval()
    with torch.no_grad():
        assert torch.equal(auto(x, token_ids=ids), want)  # "auto" off CUDA: the torch twin, as MoE's router


@pytest.fixture
def device_asserts(monkeypatch):
    """The interpreter compiling ``tl.device_assert`` as a GPU compile with ``debug=True`` does (its builder's
    options say debug=False: the asserts would be dropped)."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    monkeypatch.setattr(builder, "options", dataclasses.replace(builder.options, debug=True))


def test_the_kernels_own_asserts(hash_fused, device_asserts):
    """ASSERT_IN_KERNEL (the compiled GPU launch's): a token id outside [0, V) and a NaN logit each fail the kernel's
    device-side assert with hash_route's message; good inputs route as the flagged launch does, bit for bit."""
    cfg = MoEConfig(**BASE)
    logits, token_ids, table = _problem(cfg, 5, seed=7)
    plan = hash_fused.FusedHashRouter(cfg)._plans[0]
    kernel = hash_fused.kernels("hash_route_kernel").hash_route_kernel

    def launch(lg, tid, in_kernel: bool):
        ids, weights = torch.empty(5, 4, dtype=torch.int32), torch.empty(5, 4)
        ok = torch.ones(2, dtype=torch.int32)
        kernel[(5,)](lg, tid, table, ids, weights, ok, 5, V, lg.stride(0), 1, table.stride(0), 1.5, **plan.constexprs,
                     BLOCK_M=1, PRECISE=False, ASSERT_IN_KERNEL=in_kernel)
        return ids, weights, ok

    ids, weights, ok = launch(logits, token_ids, True)
    flagged = launch(logits, token_ids, False)
    assert torch.equal(ids, flagged[0]) and torch.equal(weights, flagged[1]) and flagged[2].tolist() == [1, 1]
    assert ok.tolist() == [1, 1]  # asserting, the kernel writes no flag
    bad_ids = token_ids.clone()
    bad_ids[4] = V
    with pytest.raises(Exception, match=r"token_ids outside \[0, hash_table_size\)"):
        launch(logits, bad_ids, True)
    assert launch(logits, bad_ids, False)[2].tolist() == [1, 0]  # the flag the launcher asserts instead
    bad_logits = logits.clone()
    bad_logits[2, 9] = float("nan")
    with pytest.raises(Exception, match="router_logits contains NaN or infinite values"):
        launch(bad_logits, token_ids, True)


def test_compiled_launches_assert_in_the_kernel(hash_fused, monkeypatch):
    """Where the kernel is compiled (PRECISE: a GPU), the bound launch asks for its asserts (debug=True) and keeps no
    flags; ``assert_in_kernel=False`` keeps the flags; interpreted, always the flags."""
    cfg = MoEConfig(**BASE)
    logits, token_ids, table = _problem(cfg, 3, seed=3)
    plan = hash_fused.FusedHashRouter(cfg)._plans[0]
    interpreted_bound = hash_fused._Bound(plan, logits, token_ids, table, True)
    assert interpreted_bound.ok is not None and "debug" not in interpreted_bound.launch.options
    assert interpreted_bound.launch.tail[-1] is False  # ASSERT_IN_KERNEL, the kernel's last parameter
    compiled = dict(hash_fused._launch_options(logits.device), PRECISE=True)
    monkeypatch.setattr(hash_fused, "_launch_options", lambda device: compiled)
    bound = hash_fused._Bound(plan, logits, token_ids, table, True)
    assert bound.ok is None and bound.launch.options["debug"] is True
    assert bound.launch.options["sanitize_overflow"] is False and bound.launch.tail[-1] is True
    flagged = hash_fused._Bound(plan, logits, token_ids, table, False)
    assert flagged.ok.tolist() == [1, 1] and "debug" not in flagged.launch.options
    assert not hash_fused.FusedHashRouter(cfg, assert_in_kernel=False).assert_in_kernel

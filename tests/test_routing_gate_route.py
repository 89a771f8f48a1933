"""The gate GEMM and the fused router in one launch (``moekit.routing.gate_route``) on the CPU under Triton's
interpreter: against the two launches it replaces (bit-equal logits, ids and weights), against ``moekit.route``
on its own logits, and against ``loop``, a float64 per-token gate-and-route written here; ties, the NaN policy
(the flag's ValueError, mask), shared slots, the cases it hands back, and the layer. The GPU's memory ordering
between programs, the in-kernel assert and timing: ``benchmarks/gate_route_device_check.py``."""

from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig, route

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards


@pytest.fixture(scope="module", autouse=True)
def mods():
    with interpreted("moekit.routing", "moekit.routing.fused") as fused:
        import moekit.routing.gate as gate
        import moekit.routing.gate_route as gate_route
        from moekit.routing.workspace import RouteWorkspace

        yield fused, gate, gate_route, RouteWorkspace


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(hidden_size=40, moe_intermediate_size=8, **kw)


CONFIGS = {  # K = 40: one ragged K step; E = 12 / 20: ragged expert tiles over several programs
    "softmax": _cfg(num_experts=12, top_k=3),
    "no_renorm_scaled": _cfg(num_experts=20, top_k=4, renormalize=False, routed_scaling_factor=2.0),
    "grouped_sigmoid": _cfg(num_experts=16, top_k=4, scoring="sigmoid", n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, use_correction_bias=True),
}


def loop(x, w, cfg, bias=None, num_shared=0):
    """float64, one token at a time: logits = x @ w^T, then score, (grouped) top-k with the lower id winning
    ties, weights from the unbiased scores, renormalised, scaled; S shared slots of weight 1 last."""
    size = cfg.num_experts // cfg.n_group
    ids, weights = [], []
    for t in range(x.shape[0]):
        row = [sum(float(a) * float(b) for a, b in zip(x[t].double(), w[e].double())) for e in range(w.shape[0])]
        if cfg.scoring == "softmax":
            exps = [math.exp(v - max(row)) for v in row]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        groups = list(range(cfg.n_group))
        if cfg.n_group > 1:
            top_n = 2 if bias is not None else 1
            score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:top_n]) for g in groups]
            groups = sorted(groups, key=lambda g: (-score[g], g))[: cfg.topk_group]
        chosen = sorted((e for e in range(cfg.num_experts) if e // size in groups), key=lambda e: (-choice[e], e))
        chosen = chosen[: cfg.top_k]
        picked = [scores[e] for e in chosen]
        if cfg.renormalize:
            picked = [p / sum(picked) for p in picked]
        ids.append(chosen + list(range(cfg.num_experts, cfg.num_experts + num_shared)))
        weights.append([p * cfg.routed_scaling_factor for p in picked] + [1.0] * num_shared)
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


def run(mods, cfg, x, w, bias=None, linear_bias=None, append_shared=False, gate_logits=None):
    """(routing or None, buffers) of one gate_route call with fresh kept buffers."""
    fused, _, gate_route, workspace = mods
    router = fused.FusedRouter(cfg)
    slots = cfg.top_k + (cfg.num_shared_slots if append_shared else 0)
    buffers = workspace().get(x, cfg.num_experts, slots, x.dtype)
    return gate_route.gate_route(router, x, w, linear_bias, bias, gate_logits, append_shared, buffers), buffers


def two_launches(mods, cfg, x, w, bias=None, linear_bias=None, append_shared=False, gate_logits=None):
    fused, gate, _, _ = mods
    logits = gate.gate_logits(x, w, linear_bias)
    return logits, fused.FusedRouter(cfg)(logits, bias, gate_logits, append_shared)


def problem(cfg, m, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, cfg.hidden_size, generator=g).to(dtype)
    w = torch.randn(cfg.num_experts, cfg.hidden_size, generator=g).to(dtype)
    bias = torch.randn(cfg.num_experts, generator=g) * 0.1 if cfg.use_correction_bias else None
    return x, w, bias


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m,dtype", [(1, torch.float32), (3, torch.bfloat16), (4, torch.float32), (6, torch.bfloat16),
                                     (8, torch.float32)])
def test_equals_two_launches_route_and_loop(mods, name, m, dtype, monkeypatch):
    """The kernel at every row count up to MAX_TOKENS, sigmoid plans included (interpreted: on the H200 a sigmoid
    plan's weights differ in the last bits from the two launches' at 5-8 rows, see ``wants_fresh``)."""
    _, _, gate_route, _ = mods
    monkeypatch.setattr(gate_route, "_BOUND", {})
    cfg = CONFIGS[name]
    x, w, bias = problem(cfg, m, dtype, seed=m)
    got, buffers = run(mods, cfg, x, w, bias)
    logits, twin = two_launches(mods, cfg, x, w, bias)
    assert got.topk_ids.data_ptr() == buffers.ids.data_ptr() and int(buffers.count) == 0
    assert torch.equal(buffers.logits, logits)
    assert torch.equal(got.topk_ids, twin.topk_ids) and torch.equal(got.topk_weights, twin.topk_weights)
    ref = route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, ref.topk_ids)
    torch.testing.assert_close(got.topk_weights, ref.topk_weights.float(), rtol=2e-6, atol=1e-7)
    if dtype == torch.float32:  # bf16 logits round: the float64 loop may choose otherwise on near-ties
        ids, weights = loop(x, w, cfg, bias)
        assert torch.equal(got.topk_ids, ids)
        torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["softmax", "grouped_sigmoid"])
def test_many_programs_last_one_routes(mods, name):
    """K = 2100: tiles of 2 experts x 2048 columns, so 6 (E = 12) or 8 (E = 16) programs of 2 K steps each; the
    last to finish routes every row and sets the counter back to 0, so a second call routes again."""
    cfg = CONFIGS[name].replace(hidden_size=2100)
    fused, _, gate_route, workspace = mods
    router, ws = fused.FusedRouter(cfg), workspace()
    for seed in (1, 2):
        x, w, bias = problem(cfg, 3, seed=seed)
        buffers = ws.get(x, cfg.num_experts, cfg.top_k, x.dtype)
        got = gate_route.gate_route(router, x, w, None, bias, None, False, buffers)
        key = next(k for k in gate_route._BOUND if k[1] == x.shape and k[6] == w.shape)
        assert gate_route._BOUND[key].launch.grid[0] == cfg.num_experts // 2 and int(buffers.count) == 0
        logits, twin = two_launches(mods, cfg, x, w, bias)
        assert torch.equal(buffers.logits, logits) and torch.equal(got.topk_ids, twin.topk_ids)
        ids, weights = loop(x, w, cfg, bias)
        assert torch.equal(got.topk_ids, ids)
        torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-6)


def test_ties_lower_id_wins(mods):
    """Equal rows of W give equal logits: the lower expert id wins, as route and the loop say."""
    cfg = CONFIGS["softmax"]
    x, w, _ = problem(cfg, 2, seed=3)
    w[5], w[9], w[2] = w[1], w[1], w[7]  # experts 1, 5, 9 tie; 2 and 7 tie
    got, _ = run(mods, cfg, x, w)
    ids, weights = loop(x, w, cfg)
    assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_ids, route(x @ w.t(), cfg).topk_ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-6)


def test_shared_slots_and_linear_bias(mods):
    cfg = CONFIGS["grouped_sigmoid"].replace(shared_expert_intermediate_size=16)  # S = 2, ungated
    x, w, bias = problem(cfg, 3, seed=5)
    linear_bias = torch.randn(cfg.num_experts)
    got, buffers = run(mods, cfg, x, w, bias, linear_bias, append_shared=True)
    logits, twin = two_launches(mods, cfg, x, w, bias, linear_bias, append_shared=True)
    assert torch.equal(buffers.logits, logits) and torch.equal(got.topk_ids, twin.topk_ids)
    assert torch.equal(got.topk_weights, twin.topk_weights)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().t() + linear_bias.double(), rtol=1e-5,
                               atol=1e-5)
    ref = route(logits, cfg, bias)
    shared = torch.tensor([[16, 17]] * 3, dtype=torch.int32)
    assert torch.equal(got.topk_ids, torch.cat([ref.topk_ids, shared], dim=1))
    torch.testing.assert_close(got.topk_weights[:, 4:], torch.ones(3, 2))


def check_nonfinite(mods, m: int, bad: int):
    """Row ``bad`` of an m-row x NaN (softmax plan): the default policy raises naming the row; "mask" routes it with
    zero weights and counts it, as ``route`` does on the same logits. Returns (routing, route's, the masked cfg, x, w)
    of the masked call (also ``test_routing_gate_mma``'s, at the MMA gate's row counts)."""
    cfg = CONFIGS["softmax"]
    x, w, _ = problem(cfg, m, seed=6)
    x[bad, 4] = float("nan")
    with pytest.raises(ValueError, match=f"NaN or infinite.*\\[{bad}\\]"):
        run(mods, cfg, x, w)
    masked = cfg.replace(nonfinite="mask")
    got, buffers = run(mods, masked, x, w)
    ref = route(buffers.logits, masked)
    assert torch.equal(got.topk_ids, ref.topk_ids) and float(got.topk_weights[bad].abs().max()) == 0.0
    assert int(got.masked_tokens) == 1 == int(ref.masked_tokens)
    return got, ref, masked, x, w


def test_nonfinite_raise_and_mask(mods):
    got, ref, masked, x, w = check_nonfinite(mods, 3, 1)
    torch.testing.assert_close(got.topk_weights, ref.topk_weights, rtol=2e-6, atol=1e-7)
    _, twin = two_launches(mods, masked, x, w)
    assert torch.equal(got.topk_ids, twin.topk_ids) and torch.equal(got.topk_weights, twin.topk_weights)


def test_hands_back(mods):
    """None (the caller runs two launches) above ROWS (256) rows, under autograd, for mixed dtypes, for an
    empty batch, and for buffers in another dtype."""
    fused, _, gate_route, workspace = mods
    cfg = CONFIGS["softmax"]
    router = fused.FusedRouter(cfg)
    x, w, _ = problem(cfg, gate_route.ROWS + 1)
    ws = workspace()
    assert gate_route.gate_route(router, x, w, None, None, None, False, ws.get(x, 12, 3, x.dtype)) is None
    x4 = x[:4]
    assert gate_route.gate_route(router, x4, w.requires_grad_(), None, None, None, False,
                                 ws.get(x4, 12, 3, x.dtype)) is None
    w = w.detach()
    assert gate_route.gate_route(router, x4, w.double(), None, None, None, False, ws.get(x4, 12, 3, x.dtype)) is None
    assert gate_route.gate_route(router, x4, w, None, None, None, False, ws.get(x4, 12, 3, torch.bfloat16)) is None
    x0 = x[:0]
    assert gate_route.gate_route(router, x0, w, None, None, None, False, ws.get(x0, 12, 3, x.dtype)) is None


@pytest.mark.parametrize("preset_like", ["qwen3", "deepseek"])
def test_layer_runs_one_launch_and_matches_two(mods, preset_like, monkeypatch):
    """MoE.forward at M <= 4 takes the one launch, and its output equals the layer's with two launches."""
    _, _, gate_route, _ = mods
    cfg = (CONFIGS["softmax"] if preset_like == "qwen3" else
           CONFIGS["grouped_sigmoid"].replace(shared_expert_intermediate_size=16))
    with torch.no_grad():
        layer = MoE(cfg, backend="reference", router="fused")
        layer.e_score_correction_bias = torch.randn(cfg.num_experts) * 0.1 if cfg.use_correction_bias else None
        calls = []
        monkeypatch.setattr(layer, "_gate_route", lambda *a: calls.append(1) or gate_route.gate_route(*a))
        x = torch.randn(2, 2, cfg.hidden_size)  # M = 4
        one = layer(x)
        assert calls == [1]
        layer._gate_route = None
        two = layer(x)
    assert torch.equal(one, two)


@pytest.mark.parametrize("name", ["softmax", "grouped_sigmoid"])
def test_layer_at_eight_rows(mods, name, monkeypatch):
    """MoE.forward at MAX_TOKENS = 8 rows takes the one launch from its kept buffers, softmax and sigmoid/grouped plans
    alike; ``route_tokens`` without buffers (stats, a CUDA graph capture) takes it too, into fresh buffers, for a
    sigmoid/grouped plan (on the H200 its two launches' weights differ in the last bits at 5-8 rows) and the two
    launches for a renormalised softmax plan (measured bit-equal). Either way the output equals the layer with two
    launches (the gate kernel, then the router) bit for bit here (interpreted)."""
    _, _, gate_route, _ = mods
    cfg = CONFIGS[name].replace(shared_expert_intermediate_size=16)
    with torch.no_grad():
        layer = MoE(cfg, backend="reference", router="fused")
        if cfg.use_correction_bias:
            layer.e_score_correction_bias = torch.randn(cfg.num_experts) * 0.1
        taken = []
        monkeypatch.setattr(layer, "_gate_route", lambda *a: taken.append(gate_route.gate_route(*a) is not None)
                            or (gate_route.gate_route(*a) if taken[-1] else None))
        x = torch.randn(gate_route.MAX_TOKENS, cfg.hidden_size)
        one, routed_one = layer(x), layer.route_tokens(x, layer._route_ws)
        ids_one = routed_one.routing.topk_ids.clone()
        assert taken == [True, True]
        stats = layer.route_tokens(x)
        assert taken == [True, True] + [True] * (name == "grouped_sigmoid")
        assert torch.equal(stats.routing.topk_weights, routed_one.routing.topk_weights)
        layer._gate_route = None
        two, routed_two = layer(x), layer.route_tokens(x)
    assert gate_route.MAX_TOKENS == 8
    assert torch.equal(ids_one, routed_two.routing.topk_ids) and torch.equal(one, two)


def test_selected_ids_leave_out_the_shared_slots(mods):
    """With the shared slots appended in the kernel, RoutedTokens.selected_ids (what the losses read) is the
    router's k routed columns, sliced on access."""
    cfg = CONFIGS["grouped_sigmoid"].replace(shared_expert_intermediate_size=16, aux_loss_coef=0.01)
    layer = MoE(cfg, backend="reference", router="fused")
    with torch.no_grad():
        routed = layer.route_tokens(torch.randn(3, cfg.hidden_size))
        assert routed.routing.topk_ids.shape == (3, 6) and routed.selected_ids.shape == (3, 4)
        assert torch.equal(routed.selected_ids, routed.routing.topk_ids[:, :4])
        assert layer(torch.randn(3, cfg.hidden_size), return_stats=True).aux_loss is not None

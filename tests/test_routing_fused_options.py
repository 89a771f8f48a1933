"""The fused router with session 34's router options (``moekit.routing.router_math``: Laguna's logit soft-cap,
Kolibri's correction bias on the logits, the group score rule, A.X-K2's / Mistral-4's dropped groups filled with 0,
Cohere2-MoE's averaged shared expert) on the CPU under Triton's interpreter (TRITON_INTERPRET=1).

Chain: kernel vs ``route`` (its torch twin: ids exactly on inputs without ties, weights within fp32 rounding) and
kernel vs ``loop_route``, a float64 per-token loop written here with every option; each option changes the routing
of these inputs (else the comparison would not test it); the layer on the fused path (the one gate + router launch,
the decode fast path) against the float64 experts over ``route``'s routing. GPU numbers (libdevice tanhf, timing):
``benchmarks/rfast34_device_check.py``; the default configs' machine code unchanged:
``benchmarks/route_sass_diff_cpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig, route
from moekit.routing import append_shared_slots

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards


@pytest.fixture(scope="module", autouse=True)
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module, \
            interpreted("moekit.experts", "moekit.experts.triton"):
        yield module


BASE = dict(hidden_size=16, moe_intermediate_size=8, num_experts=16, top_k=4)
SIGMOID_BIAS = dict(scoring="sigmoid", use_correction_bias=True)
GROUPS = dict(n_group=4, topk_group=2)
# name -> (the option's config fields, the same option off): what each family's reader sets
OPTIONS = {
    "softcap_sigmoid": (dict(SIGMOID_BIAS, router_logit_softcap=2.0), dict(router_logit_softcap=0.0)),
    "softcap_softmax_no_renorm": (dict(router_logit_softcap=1.5, renormalize=False), dict(router_logit_softcap=0.0)),
    "bias_on_logits": (dict(SIGMOID_BIAS, renormalize=False, correction_bias_on="logits"),
                       dict(correction_bias_on="scores")),
    "bias_on_logits_grouped": (dict(SIGMOID_BIAS, **GROUPS, correction_bias_on="logits"),
                               dict(correction_bias_on="scores")),
    "group_max_with_bias": (dict(SIGMOID_BIAS, **GROUPS, group_score="max"), dict(group_score="auto")),
    "group_top2_without_bias": (dict(GROUPS, group_score="top2_sum"), dict(group_score="auto")),
    "fill_zero": (dict(SIGMOID_BIAS, **GROUPS, group_score="top2_sum", dropped_group_fill="zero",
                       routed_scaling_factor=2.5), dict(dropped_group_fill="-inf")),
    "average": (dict(shared_expert_intermediate_size=16, shared_expert_combine="average", routed_scaling_factor=2.5),
                dict(shared_expert_combine="sum")),
    "average_gated": (dict(shared_expert_intermediate_size=8, shared_expert_gate=True, shared_expert_combine="average",
                           renormalize=False), dict(shared_expert_combine="sum")),
}


def _cfg(name: str, nonfinite: str = "raise", off: bool = False) -> MoEConfig:
    on, option_off = OPTIONS[name]
    return MoEConfig(**BASE, **on, nonfinite=nonfinite).replace(**(option_off if off else {}))


def _scores(row, finite, cfg):
    if cfg.scoring == "softmax":
        top = max([v for v, f in zip(row, finite) if f], default=0.0)
        exps = [math.exp(v - top) if f else 0.0 for v, f in zip(row, finite)]
        return [e / sum(exps) if f else None for e, f in zip(exps, finite)]
    return [1.0 / (1.0 + math.exp(-v)) if f else None for v, f in zip(row, finite)]


def _kept_groups(choice, cfg, biased):
    size, groups = cfg.num_experts // cfg.n_group, range(cfg.n_group)
    top2 = size >= 2 and (cfg.group_score == "top2_sum" or (cfg.group_score == "auto" and biased))
    group_score = []
    for g in groups:
        members = sorted((c for c in choice[g * size:(g + 1) * size] if c is not None), reverse=True)
        group_score.append(sum(members[:2 if top2 else 1]) if members else -math.inf)
    return set(sorted(groups, key=lambda g: (-group_score[g], g))[: cfg.topk_group])


def loop_route(logits, cfg, bias=None, shared_gate=None, num_shared=0):
    """float64, one token at a time, with the options: the logits capped (c tanh(l / c)) before all else; the bias
    on the scores or the logits for the choice; a group's score its max or top-2 sum; a dropped group's finite
    experts at 0 for the choice (fill "zero") or out; masked (non-finite) experts last, lower id first, weight 0;
    weights from the capped logits' scores x routed_scaling_factor x shared_weight; shared slots shared_weight."""
    size, cap, all_ids, all_weights = cfg.num_experts // cfg.n_group, cfg.router_logit_softcap, [], []
    for t, raw in enumerate(logits.double().tolist()):
        finite = [math.isfinite(v) for v in raw]
        row = [cap * math.tanh(v / cap) if cap and f else v for v, f in zip(raw, finite)]
        scores = _scores(row, finite, cfg)
        shifted = scores if cfg.correction_bias_on == "scores" else [v if f else None for v, f in zip(row, finite)]
        choice = [None if s is None else s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(shifted)]
        kept = _kept_groups(choice, cfg, bias is not None) if cfg.n_group > 1 else {0}
        in_kept = [e // size in kept for e in range(cfg.num_experts)]
        if cfg.dropped_group_fill == "zero":
            choice = [c if k or c is None else 0.0 for c, k in zip(choice, in_kept)]
            in_kept = [True] * cfg.num_experts
        best = sorted((e for e in range(cfg.num_experts) if in_kept[e] and finite[e]), key=lambda e: (-choice[e], e))
        chosen = (best + [e for e in range(cfg.num_experts) if in_kept[e] and not finite[e]])[: cfg.top_k]
        taken = [e for e in chosen if finite[e]]
        if cfg.renormalize:
            logs = {e: row[e] if cfg.scoring == "softmax" else -math.log1p(math.exp(-row[e])) for e in taken}
            top = max(logs.values(), default=0.0)
            total = sum(math.exp(v - top) for v in logs.values())
            w = {e: math.exp(logs[e] - top) / total for e in taken}
        else:
            w = {e: scores[e] for e in taken}
        all_ids.append(chosen + list(range(cfg.num_experts, cfg.num_experts + num_shared)))
        gate = 1.0 if shared_gate is None else 1.0 / (1.0 + math.exp(-float(shared_gate[t, 0])))
        all_weights.append([w.get(e, 0.0) * cfg.routed_scaling_factor * cfg.shared_weight for e in chosen]
                           + [gate * cfg.shared_weight] * num_shared)
    slots = cfg.top_k + num_shared
    return (torch.tensor(all_ids, dtype=torch.int32).view(-1, slots),
            torch.tensor(all_weights, dtype=torch.float64).view(-1, slots))


def _problem(cfg, m, seed=0):
    """logits [M, E] (x 3: the cap and the groups matter), a bias around -0.8 (a dropped group's 0 can win), a shared
    gate [M, 1]; with nonfinite="mask" a NaN, a row of infinities in two groups and a wholly infinite row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, cfg.num_experts, generator=g) * 3
    bias = torch.randn(cfg.num_experts, generator=g) * 0.3 - 0.8 if cfg.use_correction_bias else None
    gate = torch.randn(m, 1, generator=g) if cfg.shared_expert_gate else None
    if cfg.nonfinite == "mask" and m >= 4:
        logits[1, 3], logits[2, :7], logits[3] = float("nan"), float("inf"), float("-inf")
    return logits, bias, gate


def _both(fused, cfg, logits, bias, gate, **options):
    """(the fused router's Routing, route's), each with the shared slots where the config has them."""
    shared = cfg.num_shared_slots > 0
    got = fused.FusedRouter(cfg, **options)(logits, bias, gate, append_shared=shared)
    want = route(logits, cfg, bias)
    return got, append_shared_slots(want, cfg, gate) if shared else want


@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("nonfinite, m", [("raise", 1), ("raise", 9), ("mask", 9)])
def test_matches_route_and_loop(fused, name, nonfinite, m):
    cfg = _cfg(name, nonfinite)
    assert fused.computes(cfg) and cfg.changed_router_options()
    logits, bias, gate = _problem(cfg, m, seed=m)
    got, want = _both(fused, cfg, logits, bias, gate)
    ids, weights = loop_route(logits, cfg, bias, gate, cfg.num_shared_slots)
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=1e-5, atol=1e-7)  # interpreted tanh: ~ulps
    if nonfinite == "mask":
        assert int(got.masked_tokens) == int(want.masked_tokens) == 1


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_changes_the_routing(fused, name):
    """The inputs above tell the option from its default: ids or weights differ from the option-off config's."""
    cfg, off = _cfg(name), _cfg(name, off=True)
    logits, bias, gate = _problem(cfg, 9, seed=9)
    got, _ = _both(fused, cfg, logits, bias, gate)
    other, _ = _both(fused, off, logits, bias, gate)
    assert not torch.equal(got.topk_ids, other.topk_ids) or not torch.allclose(got.topk_weights, other.topk_weights)


@pytest.mark.parametrize("name", ["softcap_sigmoid", "fill_zero", "average_gated"])
def test_many_rows_per_program(fused, name):
    cfg = _cfg(name, "mask")
    logits, bias, gate = _problem(cfg, 40, seed=40)
    got, want = _both(fused, cfg, logits, bias, gate, elements_per_program=8192)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-7)


def test_opcheck_and_compile_with_every_option(fused):
    cfg = MoEConfig(**BASE, **SIGMOID_BIAS, **GROUPS, router_logit_softcap=2.0, correction_bias_on="logits",
                    group_score="max", dropped_group_fill="zero", shared_expert_intermediate_size=8,
                    shared_expert_combine="average")
    logits, bias, _ = _problem(cfg, 5, seed=5)
    torch.library.opcheck(torch.ops.moekit.route_fused, (logits, bias, None, 4, 4, 2, True, True, 1.0, True, 1, 128,
                                                         2.0, True, "max", True, 0.5))
    router = fused.FusedRouter(cfg)
    compiled = torch.compile(lambda x, b: router(x, b, append_shared=True), fullgraph=True, backend="aot_eager")
    got, want = compiled(logits, bias), append_shared_slots(route(logits, cfg, bias), cfg)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["softcap_sigmoid", "bias_on_logits_grouped", "fill_zero", "average"])
def test_layer_fused_path_and_decode_fast_path(fused, name):
    """``router="fused"`` with the option: the one gate + router launch and a kept decode entry at M = 1; the output
    (first call and the fast path's) against float64 experts over ``route``'s routing of the layer's own logits."""
    from _helpers import rel_l2
    from moekit.experts.reference import experts_reference

    on = dict(OPTIONS[name][0], hidden_size=40, moe_intermediate_size=24)  # 16-byte bf16 rows, as test_layer_fast
    if "shared_expert_intermediate_size" in on:
        on["shared_expert_intermediate_size"] = 24
    cfg = MoEConfig(**dict(BASE, **on))
    torch.manual_seed(0)
    layer = MoE(cfg, backend="triton", router="fused", dtype=torch.bfloat16).eval()
    if cfg.use_correction_bias:
        layer.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.3 - 0.8)
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        first, served = layer(x), layer(x)
        logits = layer._router_logits(x).double()
        bias = layer.e_score_correction_bias
        routing = route(logits, cfg, None if bias is None else bias.double())
        if layer.fuse_shared:
            routing = append_shared_slots(routing, cfg)
        want = experts_reference(x.double(), layer.w13.double(), layer.w2.double(), routing.topk_ids.long(),
                                 routing.topk_weights.double())
    assert layer._gate_route is not None and layer._decode._entries[1].bound is not None  # the one launch, kept
    assert torch.equal(first, served)
    assert rel_l2(served.double(), want) < 1e-2

"""The fused router (one Triton kernel) on the CPU under Triton's interpreter (TRITON_INTERPRET=1).

Chain: kernel vs ``route`` (its torch twin: ids exactly on inputs without ties, weights within fp32
rounding) and kernel vs ``loop_route``, a float64 per-token loop written here for the whole semantics:
exact ties, grouped selection, ``nonfinite="mask"`` as issue 13 defines it, shared slots.

What the interpreter cannot show and ``benchmarks/routing_device_check.py`` covers on the GPU: bit-equal
ids against route's CUDA softmax / sigmoid (libdevice expf, div.rn; the interpreter uses numpy's exp),
programmatic dependent launch, the device-side assert, CUDA graphs, timing.
"""

from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoEConfig, route
from moekit.routing import append_shared_slots

# conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
triton = pytest.importorskip("triton")
# numpy, running the kernel, warns on the NaN and inf of branches that tl.where then discards.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module", autouse=True)
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module:
        yield module


# elements per program for many rows per program: the interpreter runs programs one after another (~0.1 s each at E=128)
WIDE = 8192


def _cfg(**kw) -> MoEConfig:
    return MoEConfig(hidden_size=8, moe_intermediate_size=8, **kw)


MIXTRAL = _cfg(num_experts=8, top_k=2)
QWEN3 = _cfg(num_experts=128, top_k=8)
DEEPSEEK_V3 = _cfg(num_experts=256, top_k=8, scoring="sigmoid", n_group=8, topk_group=4, routed_scaling_factor=2.5,
                   use_correction_bias=True)
QWEN3_NEXT = _cfg(num_experts=512, top_k=10)
QWEN2_NO_RENORM = _cfg(num_experts=60, top_k=4, renormalize=False)  # E not a power of two
DEEPSEEK_V2 = _cfg(num_experts=64, top_k=6, n_group=8, topk_group=3, renormalize=False, routed_scaling_factor=16.0)
SMALL_GROUPED = _cfg(num_experts=16, top_k=4, scoring="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     use_correction_bias=True)
CONFIGS = {"mixtral": MIXTRAL, "qwen3": QWEN3, "deepseek_v3": DEEPSEEK_V3, "qwen3_next": QWEN3_NEXT,
           "qwen2_no_renorm": QWEN2_NO_RENORM, "deepseek_v2": DEEPSEEK_V2}


def loop_route(logits, cfg, bias=None, shared_gate=None, num_shared=0):
    """float64, one token at a time. An expert with a non-finite logit is masked: it scores lowest for
    selection, its group's score counts only finite experts, it fills a slot only when the allowed
    groups hold fewer than k finite experts, and then with weight 0; renormalisation covers the finite
    chosen experts only. Equal scores: the lower expert id (group id) wins."""
    num_experts, size = cfg.num_experts, cfg.num_experts // cfg.n_group
    all_ids, all_weights = [], []
    for t, row in enumerate(logits.double().tolist()):
        finite = [math.isfinite(v) for v in row]
        if cfg.scoring == "softmax":
            top = max([v for v, f in zip(row, finite) if f], default=0.0)
            exps = [math.exp(v - top) if f else 0.0 for v, f in zip(row, finite)]
            scores = [e / sum(exps) if f else None for e, f in zip(exps, finite)]
        else:
            scores = [1.0 / (1.0 + math.exp(-v)) if f else None for v, f in zip(row, finite)]
        choice = [None if s is None else s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        groups = range(cfg.n_group)
        if cfg.n_group > 1:
            group_score = []
            for g in groups:
                members = sorted((c for c in choice[g * size:(g + 1) * size] if c is not None), reverse=True)
                top_n = 2 if bias is not None and size >= 2 else 1
                group_score.append(sum(members[:top_n]) if members else -math.inf)
            groups = sorted(groups, key=lambda g: (-group_score[g], g))[: cfg.topk_group]
        allowed = [e for e in range(num_experts) if e // size in groups]
        best = sorted((e for e in allowed if finite[e]), key=lambda e: (-choice[e], e))
        chosen = (best + [e for e in allowed if not finite[e]])[: cfg.top_k]
        taken = [e for e in chosen if finite[e]]
        if cfg.renormalize:
            logs = {e: row[e] if cfg.scoring == "softmax" else -math.log1p(math.exp(-row[e])) if row[e] > -30
                    else row[e]
                    for e in taken}
            top = max(logs.values(), default=0.0)
            total = sum(math.exp(v - top) for v in logs.values())
            w = {e: math.exp(logs[e] - top) / total for e in taken}
        else:
            w = {e: scores[e] for e in taken}
        weights = [w.get(e, 0.0) * cfg.routed_scaling_factor for e in chosen]
        shared_w = 1.0 if shared_gate is None else 1.0 / (1.0 + math.exp(-float(shared_gate[t, 0])))
        all_ids.append(chosen + list(range(num_experts, num_experts + num_shared)))
        all_weights.append(weights + [shared_w] * num_shared)
    slots = cfg.top_k + num_shared
    return (torch.tensor(all_ids, dtype=torch.int32).view(-1, slots),
            torch.tensor(all_weights, dtype=torch.float64).view(-1, slots))


def _problem(cfg, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, cfg.num_experts, generator=g) * 2
    bias = torch.randn(cfg.num_experts, generator=g) * 0.1 if cfg.use_correction_bias else None
    return logits, bias


def _check(fused, logits, cfg, bias=None, against_route=True, elements_per_program=None):
    options = {} if elements_per_program is None else dict(elements_per_program=elements_per_program)
    got = fused.route_fused(logits, cfg, bias, **options)
    assert got.topk_ids.dtype == torch.int32 and got.topk_weights.dtype == torch.float32
    ids, weights = loop_route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=2e-6, atol=1e-7)
    if against_route:
        ref = route(logits, cfg, bias)
        assert torch.equal(got.topk_ids, ref.topk_ids)
        # route: float64 from float64
        torch.testing.assert_close(got.topk_weights, ref.topk_weights.float(), rtol=2e-6, atol=1e-7)
    return got


# --- against route and the loop, inputs without ties --------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m", [0, 1, 7])
def test_matches_route_and_loop(fused, name, m):
    cfg = CONFIGS[name]
    logits, bias = _problem(cfg, m, seed=m)
    got = _check(fused, logits, cfg, bias)
    assert got.topk_ids.shape == (m, cfg.top_k)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_route_and_loop_many_rows_per_program(fused, name):
    cfg = CONFIGS[name]
    logits, bias = _problem(cfg, 64, seed=64)
    _check(fused, logits, cfg, bias, elements_per_program=WIDE)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("use_bias", [True, False])
def test_grouped_sigmoid_variants(fused, renormalize, use_bias):
    cfg = SMALL_GROUPED.replace(renormalize=renormalize)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(16, generator=g) * 0.5 if use_bias else None
    _check(fused, torch.randn(9, 16, generator=g) * 2, cfg, bias)


def test_low_precision_and_strided_logits(fused):
    logits, _ = _problem(QWEN3, 5, seed=3)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        _check(fused, logits.to(dtype), QWEN3, elements_per_program=WIDE)
    wide = torch.randn(2 * QWEN3.num_experts, 5).t()  # [5, E] with stride (1, 5)
    _check(fused, wide[:, ::2], QWEN3, elements_per_program=WIDE)


def test_sigmoid_underflow_stays_finite(fused):
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(16, generator=g) * 10
    got = _check(fused, -100.0 + torch.randn(4, 16, generator=g), SMALL_GROUPED, bias)
    torch.testing.assert_close(got.topk_weights.sum(1), torch.full((4,), 2.5))
    deep = fused.route_fused(torch.full((2, 16), -200.0), SMALL_GROUPED, bias)  # sigmoid is exactly 0 here
    torch.testing.assert_close(deep.topk_weights.sum(1), torch.full((2,), 2.5))


# --- exact ties: the lower expert id, the lower group id -----------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exact_ties_lower_id_wins(fused, name):
    cfg = CONFIGS[name]
    g = torch.Generator().manual_seed(11)
    logits = torch.randint(0, 3, (6, cfg.num_experts), generator=g).float()  # three values: ties everywhere
    logits[0] = 0.0  # one row all equal
    bias = torch.zeros(cfg.num_experts) if cfg.use_correction_bias else None
    got = _check(fused, logits, cfg, bias)  # route promises the same tie rule: ids equal to it too
    assert got.topk_ids[0].tolist() == list(range(cfg.top_k))


def test_group_ties_lower_group_wins(fused):
    cfg = SMALL_GROUPED
    logits = torch.zeros(2, 16)
    logits[1, [4, 5, 12, 13]] = 1.0  # groups 1 and 3 tie on their top two; group 1 first
    got = _check(fused, logits, cfg, torch.zeros(16))
    assert got.topk_ids[0].tolist() == [0, 1, 2, 3]  # groups 0 and 1 (experts 0-7) win the all-equal tie
    assert got.topk_ids[1].tolist() == [4, 5, 12, 13]


# --- nonfinite="mask" ---------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


def test_mask_ungrouped(fused):
    """Ungrouped, these agree with route's mask path as it is now, and after the fix."""
    cfg = QWEN3.replace(nonfinite="mask", num_experts=12, top_k=3)
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(4))
    logits[0, 5] = NAN
    logits[1, [0, 3]] = torch.tensor([INF, -INF])
    logits[2, 2:] = NAN  # two finite experts for three slots: a masked one fills the last, weight 0
    logits[3] = NAN  # none finite: ids 0, 1, 2 and all-zero weights
    got = _check(fused, logits, cfg)
    assert got.topk_ids[2].tolist()[:2] == sorted(got.topk_ids[2].tolist()[:2], key=lambda e: -logits[2, e].item())
    assert got.topk_ids[2, 2].item() == 2 and got.topk_weights[2, 2].item() == 0.0
    assert got.topk_ids[3].tolist() == [0, 1, 2] and got.topk_weights[3].tolist() == [0.0] * 3
    torch.testing.assert_close(got.topk_weights[:3].sum(1), torch.ones(3))  # renormalised over the finite


def test_mask_grouped(fused):
    """Grouped with a bias, against the float64 loop and route (both follow route's docstring)."""
    cfg = SMALL_GROUPED.replace(nonfinite="mask")
    logits = torch.full((4, 16), -3.0)
    logits[0, 0:4] = torch.tensor([NAN, 2.0, NAN, NAN])  # group 0: one finite expert scores it alone
    logits[0, 4:8] = torch.tensor([-2.0, -2.5, -2.0, -2.9])  # group 1: its top two sum below 2.0's score
    logits[1, 4:16] = NAN  # one group with finite experts: the -inf groups fill up, the lowest id first
    logits[2, 8:12] = NAN  # a masked group between finite ones
    logits[2, 12:16] = torch.tensor([1.0, NAN, NAN, NAN])
    logits[3] = NAN
    logits[3, 9] = 0.5  # a single finite expert: group 2, then group 0 (-inf, lowest id) fills up
    got = fused.route_fused(logits, cfg, torch.zeros(16))
    ids, weights = loop_route(logits, cfg, torch.zeros(16))
    assert torch.equal(got.topk_ids, ids)
    assert torch.equal(got.topk_ids, route(logits, cfg, torch.zeros(16)).topk_ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=2e-6, atol=1e-7)
    assert 1 in got.topk_ids[0].tolist()  # group 0 kept on its one finite expert
    assert got.topk_ids[1].tolist() == [0, 1, 2, 3]
    assert got.topk_ids[2].tolist() == [12, 0, 1, 2]  # group 3 scores its one finite expert alone
    assert got.topk_ids[3].tolist() == [9, 0, 1, 2]  # then the masked experts of the kept groups, lowest id first
    torch.testing.assert_close(got.topk_weights[3], torch.tensor([2.5, 0.0, 0.0, 0.0]))


def test_masked_tokens_counted_and_bad_bias_refused(fused):
    """The fused router counts tokens with no finite logit as route does, and checks the bias as route
    does: once per bias version, so a NaN written into the same buffer later is still caught."""
    from moekit.layer import MoE

    cfg = SMALL_GROUPED.replace(hidden_size=12, nonfinite="mask")
    logits = torch.randn(3, 16)
    logits[1] = NAN
    assert int(fused.route_fused(logits, cfg, torch.zeros(16)).masked_tokens) == 1
    layer = MoE(cfg, router="fused")
    assert layer(torch.randn(4, 12), return_stats=True).stats.masked_tokens == 0
    layer.e_score_correction_bias[3] = NAN  # in place: the buffer's version moves
    with pytest.raises(ValueError, match="correction_bias contains NaN"):
        layer(torch.randn(4, 12))


def test_raise_is_a_value_error_on_the_cpu(fused):
    logits = torch.randn(4, 12)
    logits[2, 5] = NAN
    logits[3, 1] = INF
    with pytest.raises(ValueError, match="NaN or infinite.*\\[2, 3\\]"):
        fused.route_fused(logits, QWEN3.replace(num_experts=12, top_k=3))


def test_raise_asserted_in_the_kernel(fused, monkeypatch):
    """assert_in_kernel: the launch the GPU's eager calls get (no flag, debug=True), run by the interpreter
    with its device asserts switched on: finite logits route as route does; a NaN or inf row asserts."""
    from triton.runtime import interpreter
    from triton.runtime.errors import InterpreterError  # the interpreter's wrapping of the assert

    monkeypatch.setattr(interpreter.interpreter_builder, "options", interpreter.InterpreterOptions(debug=True))
    cfg = QWEN3.replace(num_experts=12, top_k=3)
    plan = fused._plan_of(cfg, 0, WIDE)

    def launch(logits):
        grid, scalars, constexprs = fused._scalars_and_constexprs(plan, logits, None, None, True)
        assert constexprs["ASSERT_FINITE"] and not constexprs["CHECK_FINITE"] and constexprs["debug"]
        ids, weights = torch.empty(4, 3, dtype=torch.int32), torch.empty(4, 3)
        fused.kernels("route_kernel").route_kernel[grid](logits, logits, logits, ids, weights, ids, *scalars,
                                                         **constexprs)
        return ids, weights

    logits = torch.randn(4, 12)
    ids, weights = launch(logits)
    twin = route(logits, cfg)
    assert torch.equal(ids, twin.topk_ids) and torch.allclose(weights, twin.topk_weights, atol=1e-6)
    for bad in (NAN, INF, -INF):
        logits[2, 5] = bad
        with pytest.raises(InterpreterError, match="router_logits contains NaN or infinite values"):
            launch(logits)


def test_assert_in_kernel_only_where_compiled(fused):
    """Interpreted (here), a router with assert_in_kernel keeps the flag, so the CPU still raises ValueError."""
    router = fused.FusedRouter(QWEN3.replace(num_experts=12, top_k=3), assert_in_kernel=True)
    logits = torch.randn(4, 12)
    logits[1, 0] = NAN
    with pytest.raises(ValueError, match="NaN or infinite.*\\[1\\]"):
        router(logits)


# --- shared slots, contract, custom op, the layer ------------------------------------------------------


@pytest.mark.parametrize("gated", [False, True])
def test_shared_slots_appended_in_the_kernel(fused, gated):
    cfg = SMALL_GROUPED.replace(shared_expert_intermediate_size=16, shared_expert_gate=gated)  # S = 2
    logits, _ = _problem(cfg, 5, seed=8)
    bias, gate = torch.randn(16) * 0.1, torch.randn(5, 1)
    got = fused.FusedRouter(cfg)(logits, bias, gate, append_shared=True)
    ref = append_shared_slots(route(logits, cfg, bias), cfg, gate)
    assert torch.equal(got.topk_ids, ref.topk_ids) and got.topk_ids.shape == (5, 6)
    torch.testing.assert_close(got.topk_weights, ref.topk_weights, rtol=2e-6, atol=1e-7)
    ids, weights = loop_route(logits, cfg, bias, gate if gated else None, num_shared=2)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=2e-6, atol=1e-7)
    if gated:
        with pytest.raises(ValueError, match="shared_gate_logits must have shape"):
            fused.FusedRouter(cfg)(logits, bias, None, append_shared=True)


def test_empty_batch(fused):
    got = fused.route_fused(torch.zeros(0, 16), SMALL_GROUPED, torch.zeros(16))
    assert got.topk_ids.shape == (0, 4) and got.topk_weights.shape == (0, 4)
    shared = SMALL_GROUPED.replace(shared_expert_intermediate_size=8)
    got = fused.FusedRouter(shared)(torch.zeros(0, 16), torch.zeros(16), append_shared=True)
    assert got.topk_ids.shape == (0, 5) and got.topk_weights.shape == (0, 5)


def test_bad_inputs_name_the_argument(fused):
    with pytest.raises(ValueError, match="router_logits must have shape"):
        fused.route_fused(torch.randn(4, 11), MIXTRAL)
    with pytest.raises(TypeError, match="floating-point"):
        fused.route_fused(torch.ones(4, 8, dtype=torch.int64), MIXTRAL)
    with pytest.raises(ValueError, match="correction_bias must have shape"):
        fused.route_fused(torch.randn(4, 16), SMALL_GROUPED, torch.zeros(15))
    with pytest.raises(ValueError, match="fused router supports"):
        fused.FusedRouter(_cfg(num_experts=2048, top_k=2))


def test_logits_that_need_a_gradient_go_through_route(fused):
    logits = torch.randn(3, 8, requires_grad=True)
    got = fused.route_fused(logits, MIXTRAL)
    assert got.topk_weights.grad_fn is not None  # route's differentiable weights
    with torch.no_grad():
        assert fused.route_fused(logits, MIXTRAL).topk_weights.grad_fn is None
    # a gated shared slot's gate logits (or the bias) needing one: route too, never the op (which would refuse it)
    cfg = SMALL_GROUPED.replace(shared_expert_intermediate_size=16, shared_expert_gate=True)
    logits, _ = _problem(cfg, 3, seed=4)
    bias, gate = (torch.randn(16) * 0.1).requires_grad_(), torch.randn(3, 1, requires_grad=True)
    got = fused.FusedRouter(cfg)(logits, bias, gate, append_shared=True)
    ref = append_shared_slots(route(logits, cfg, bias), cfg, gate)
    assert torch.equal(got.topk_ids, ref.topk_ids) and torch.equal(got.topk_weights, ref.topk_weights)
    assert got.topk_weights.grad_fn is not None


def test_router_choice(fused, monkeypatch):
    assert fused.fused_router(QWEN3, "cpu") is None  # auto never picks the interpreter
    assert fused.fused_router(QWEN3, "cpu", "torch") is None
    assert isinstance(fused.fused_router(QWEN3, "cpu", "fused"), fused.FusedRouter)
    assert fused.fused_router(_cfg(num_experts=2048, top_k=2), "cuda") is None  # too wide: route
    with pytest.raises(ValueError, match="router must be"):
        fused.fused_router(QWEN3, "cpu", "fast")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        fused.fused_router(QWEN3, "cpu", "fused")


def test_opcheck(fused):
    logits, bias = _problem(SMALL_GROUPED, 3)
    op = torch.ops.moekit.route_fused
    torch.library.opcheck(op, (logits[:, :8], None, torch.randn(3, 1), 2, 1, 1, False, False, 1.0, True, 1, 128, 0.0,
                               False, "auto", False, 1.0))


def test_compiles_fullgraph(fused):
    router = fused.FusedRouter(SMALL_GROUPED)  # nonfinite="raise": a device-side assert under compile
    logits, _ = _problem(SMALL_GROUPED, 5, seed=2)
    bias = torch.randn(16) * 0.1
    compiled = torch.compile(lambda x, b: router(x, b), fullgraph=True, backend="aot_eager")(logits, bias)
    eager = router(logits, bias)
    assert torch.equal(compiled.topk_ids, eager.topk_ids)
    torch.testing.assert_close(compiled.topk_weights, eager.topk_weights)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_moe_with_the_fused_router(fused, capacity_factor):
    from moekit.layer import MoE

    cfg = SMALL_GROUPED.replace(hidden_size=12, shared_expert_intermediate_size=16, shared_expert_gate=True)
    torch.manual_seed(0)
    layer = MoE(cfg, router="fused", capacity_factor=capacity_factor)
    layer.e_score_correction_bias.normal_(std=0.1)
    x = torch.randn(6, 12)
    with torch.no_grad():
        fused_routed = layer.route_tokens(x)
        fused_out = layer(x)
        layer.router = "torch"
        torch_routed = layer.route_tokens(x)
        torch_out = layer(x)
    assert layer._fused_router is None and "router=torch" in repr(layer)
    assert torch.equal(fused_routed.routing.topk_ids, torch_routed.routing.topk_ids)
    torch.testing.assert_close(fused_routed.routing.topk_weights, torch_routed.routing.topk_weights)
    torch.testing.assert_close(fused_out, torch_out)
    assert MoE(cfg)._fused_router is None  # auto on the CPU: route

"""moekit's other GPU ops without custom_op's autograd layer (session 36), under Triton's interpreter, tiny shapes:
``moekit::triton_experts_fp8``, ``triton_experts_wo``, ``route_fused`` and ``align_block_triton``, registered through
``op_library.define_inference_op``. Each keeps main's schema string (written here), tag and fake (opcheck), has no
Autograd kernel, gives its body's bits (the body called directly) and its independent reference's result (a float64
loop, the torch twin of the router or the alignment); a compiled (fullgraph) call with no input needing a gradient
holds it, never the fp8 / wo ``*_autograd`` custom op; a call with an input that needs one does what main did: the
fp8 / wo custom op without a backward (the forward's bits; a backward, eager or in a compiled graph, raises torch's
"no autograd formula" error), ``route`` for the router; the inference op itself refuses it. The bodies build their
options (and the router's / alignment's plans) once per set of values."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from _fp8_cases import FLIP_TOL, emulation_f64, problem as fp8_problem  # noqa: E402
from _helpers import rel_l2  # noqa: E402
from _triton_helpers import interpreted, interpreter  # noqa: E402, F401  (fixture)
from test_triton_op import _compiled_ops  # noqa: E402  (fn compiled fullgraph, aot_eager: its output, its ops)
from test_triton_wo import loop64, problem as wo_problem, wo  # noqa: E402, F401  (fixture)
from moekit import MoEConfig, route  # noqa: E402
from moekit.experts.op_library import needs_grad  # noqa: E402
from moekit.layouts.block_aligned import align_block  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy under the interpreter: discarded NaN lanes

# main's (024707d) schemas, the part after the op's name, string for string; route_fused's with blk36's trailing
# ``bool assert_in_kernel=False`` (a defaulted argument: main's 17-argument calls unchanged), triton_experts_wo's with
# gpt39's trailing biases and activation fields (defaulted: main's 16-argument calls unchanged), triton_experts_fp8's
# with fpb40's (defaulted: main's 13-argument calls unchanged); session 48: the two experts ops' trailing
# ``bool limit_after_act=False`` (act48) and route_fused's ``bool sqrt_softplus=False`` before ``assert_in_kernel``
# (v4r48), each defaulted; session 49: route_fused's ``float renorm_eps=0.`` after it (edge49, defaulted) and
# ``float renorm_clamp=0.`` after that (ern49, defaulted)
MAIN_SCHEMAS = {
    "triton_experts_fp8": "(Tensor x, Tensor w13_q, Tensor w13_scale, Tensor w2_q, Tensor w2_scale, Tensor topk_ids, "
                          "Tensor topk_weights, Tensor? expert_map, SymInt block_n, SymInt block_k, "
                          "bool weight_descriptors, bool dependent_launch, bool poison_workspace, Tensor? b13=None, "
                          "Tensor? b2=None, str activation=\"silu\", bool gated=True, bool interleaved=False, "
                          "float alpha=1., float? limit=None, float up_shift=0., bool limit_after_act=False) -> Tensor",
    "triton_experts_wo": "(Tensor x, Tensor q13, Tensor s13, Tensor? z13, SymInt g13, Tensor q2, Tensor s2, "
                         "Tensor? z2, SymInt g2, Tensor topk_ids, Tensor topk_weights, Tensor? expert_map, str scheme, "
                         "str activation, bool dependent_launch, str decode=\"\", Tensor? b13=None, Tensor? b2=None, "
                         "bool gated=True, bool interleaved=False, float alpha=1., float? limit=None, "
                         "float up_shift=0., bool limit_after_act=False) -> Tensor",
    "route_fused": "(Tensor logits, Tensor? bias, Tensor? gate_logits, SymInt top_k, SymInt n_group, "
                   "SymInt topk_group, bool sigmoid, bool renormalize, float scaling, bool check_finite, "
                   "SymInt num_shared, SymInt elements_per_program, float softcap, bool bias_on_logits, "
                   "str group_score, bool fill_zero, float shared_weight, bool sqrt_softplus=False, "
                   "float renorm_eps=0., float renorm_clamp=0., bool assert_in_kernel=False) "
                   "-> (Tensor, Tensor, Tensor)",
    "align_block_triton": "(Tensor topk_ids, SymInt num_experts, SymInt block_size, Tensor? expert_map, "
                          "bool allow_naive, bool dependent_launch, SymInt align_small_max, "
                          "SymInt align_small_max_bins, SymInt align_one_launch_max=2048, "
                          "SymInt align_two_launch_max=4096) -> (Tensor, Tensor, Tensor, Tensor)",
}
FP8_SHAPE, FP8_BLOCK = (4, 160, 96), (128, 128)  # E, K, N
ROUTER = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sigmoid", n_group=4,
                   topk_group=2, routed_scaling_factor=2.5, use_correction_bias=True)


@pytest.fixture(scope="module")
def ops(wo):
    """The four ops' modules, their kernels interpreted (the router's too); caches dropped before and after."""
    with interpreted("moekit.routing", "moekit.routing.fused") as fused:
        from moekit.experts import triton_align, triton_fp8

        triton_fp8.clear_launch_caches()
        yield {"fp8": triton_fp8, "wo": wo, "fused": fused, "align": triton_align}
        triton_fp8.clear_launch_caches()


def fp8_args(m: int, seed: int) -> tuple:
    x, _, quantized, ids, weights = fp8_problem(m, 2, FP8_SHAPE, FP8_BLOCK, seed=seed)
    return (x, *quantized, ids, weights, None, *FP8_BLOCK, True, False, True)


def wo_args(wo, m: int, seed: int) -> tuple:
    x, w13, w2, ids, weights = wo_problem(wo, "int4_w4a16", 32, m=m, k=2, seed=seed)
    return (x, w13.q, w13.scale, w13.zero, 32, w2.q, w2.scale, w2.zero, 32, ids, weights, None, "int4_w4a16", "silu",
            False, "")


def route_args(m: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    logits, bias = torch.randn(m, 16, generator=g), torch.randn(16, generator=g) * 0.1
    return (logits, bias, None, 4, 4, 2, True, True, 2.5, False, 0, 128, 0.0, False, "auto", False, 1.0)


def align_args(m: int, seed: int) -> tuple:
    ids = torch.randint(0, 8, (m, 2), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    return (ids, 8, 16, None, True, True, 0, 64, 2048, 4096)


@pytest.mark.parametrize("name", list(MAIN_SCHEMAS))
def test_each_op_has_mains_schema_and_tag_and_no_autograd_kernel(ops, name):
    op = getattr(torch.ops.moekit, name).default
    assert str(op._schema) == f"moekit::{name}{MAIN_SCHEMAS[name]}"
    assert op.tags == [torch.Tag.pt2_compliant_tag]
    for key in ("CompositeExplicitAutograd", "Meta"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moekit::{name}", key), key
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"moekit::{name}", "Autograd")


@pytest.mark.parametrize("name", ["triton_experts_fp8", "triton_experts_wo"])
def test_the_autograd_forms_keep_mains_custom_op(ops, name):
    """What takes a call that needs a gradient: main's registration (a custom op, its Autograd kernel, no backward)
    of the same schema under the name + ``_autograd``."""
    op = getattr(torch.ops.moekit, name + "_autograd").default
    assert str(op._schema) == f"moekit::{name}_autograd{MAIN_SCHEMAS[name]}"
    assert op.tags == [torch.Tag.pt2_compliant_tag]
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moekit::{name}_autograd", "Autograd")


@pytest.mark.parametrize("m", [1, 5])  # 1: the tiny-batch shortcut; 5: aligned blocks
def test_fp8_op_gives_its_bodys_bits_and_the_float64_recipe(ops, m):
    fp8, args = ops["fp8"], fp8_args(m, seed=m)
    with torch.no_grad():
        got = torch.ops.moekit.triton_experts_fp8(*args)
        body = fp8._fp8_kernel(*args)
        main_form = torch.ops.moekit.triton_experts_fp8_autograd(*args)
    assert torch.equal(got, body) and torch.equal(got, main_form)
    want = emulation_f64(*args[:7], FP8_BLOCK)
    assert rel_l2(got, want) < FLIP_TOL
    torch.library.opcheck(torch.ops.moekit.triton_experts_fp8.default, args,  # no test_schema: it multiplies e4m3
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("m", [1, 5])
def test_wo_op_gives_its_bodys_bits_and_the_float64_loop(ops, m):
    wo, args = ops["wo"], wo_args(ops["wo"], m, seed=m)
    with torch.no_grad():
        got = torch.ops.moekit.triton_experts_wo(*args)
        body = wo._wo_kernel(*args)
        main_form = torch.ops.moekit.triton_experts_wo_autograd(*args)
        defaulted = torch.ops.moekit.triton_experts_wo(*args[:-1])  # decode's default ""
    assert torch.equal(got, body) and torch.equal(got, main_form) and torch.equal(got, defaulted)
    x, _, _, _, _, _, _, _, _, ids, weights = args[:11]
    w13, w2 = (wo.WoWeight("int4_w4a16", *args[i:i + 3], 32) for i in (1, 5))
    assert rel_l2(got, loop64(x, w13, w2, ids, weights)) < 2e-3  # fp16 output
    torch.library.opcheck(torch.ops.moekit.triton_experts_wo.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_route_op_gives_its_bodys_bits_and_routes_as_route(ops):
    args = route_args(6, seed=2)
    got = torch.ops.moekit.route_fused(*args)
    body = ops["fused"]._route_kernel(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, body))
    want = route(args[0], ROUTER, args[1])
    assert torch.equal(got[0], want.topk_ids.int())
    torch.testing.assert_close(got[1], want.topk_weights, rtol=1e-6, atol=1e-6)
    torch.library.opcheck(torch.ops.moekit.route_fused.default, args)


@pytest.mark.parametrize("m", [1, 40])  # 1: the naive shortcut; 40: aligned
def test_align_op_gives_its_bodys_bits_and_align_blocks(ops, m):
    args = align_args(m, seed=m)
    got = torch.ops.moekit.align_block_triton(*args)
    body = ops["align"]._align_kernel(*args)
    defaulted = torch.ops.moekit.align_block_triton(*args[:8])  # the two defaults filled by the dispatcher
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(got, body, defaulted))
    want = align_block(args[0], 8, 16)
    used = int(got[2])
    assert used == int(want.num_padded)
    assert torch.equal(got[0][:used], want.sorted_ids[:used]) and torch.equal(got[3], want.counts)
    torch.library.opcheck(torch.ops.moekit.align_block_triton.default, args)


def test_compiled_calls_without_a_gradient_hold_the_inference_ops(ops):
    """Grad mode on, no input needing a gradient (a model's forward without no_grad): the inference op in the graph,
    equal to the eager call."""
    fp8, wo, fused, align = ops["fp8"], ops["wo"], ops["fused"], ops["align"]
    f8, w4 = fp8_args(3, seed=7), wo_args(wo, 3, seed=7)
    w13, w2 = (wo.WoWeight("int4_w4a16", *w4[i:i + 3], 32) for i in (1, 5))
    router = fused.FusedRouter(ROUTER.replace(nonfinite="mask"))
    ids = align_args(9, seed=3)[0]
    cases = {
        "triton_experts_fp8": (lambda x, i, w: fp8.fused_experts_fp8(x, *f8[1:5], i, w), (f8[0], f8[5], f8[6])),
        "triton_experts_wo": (lambda x, i, w: wo.fused_experts_wo(x, w13, w2, i, w), (w4[0], w4[9], w4[10])),
        "route_fused": (lambda logits, bias: router(logits, bias).topk_weights, route_args(4, seed=5)[:2]),
        "align_block_triton": (lambda i: align.align_block_triton(i, 8, 16).sorted_ids, (ids,)),
    }
    with torch.enable_grad():
        for name, (fn, args) in cases.items():
            out, seen = _compiled_ops(fn, *args)
            assert seen == [f"moekit.{name}"], name
            assert torch.equal(out, fn(*args)), name


@pytest.mark.filterwarnings("ignore:Error detected in")  # autograd anomaly mode, naming the failing backward
@pytest.mark.parametrize("kind", ["fp8", "wo"])
def test_a_call_needing_a_gradient_runs_mains_form(ops, kind):
    """x needs a gradient: the ``_autograd`` custom op runs the forward (the same bits), and a backward through it
    raises torch's error, eagerly and when compiled (main's behaviour for every call); the inference op refuses the
    call itself, naming itself."""
    if kind == "fp8":
        fp8, args = ops["fp8"], fp8_args(2, seed=4)
        run = lambda x: fp8.fused_experts_fp8(x, *args[1:7])  # noqa: E731
        name = "triton_experts_fp8"
    else:
        wo, args = ops["wo"], wo_args(ops["wo"], 2, seed=4)
        w13, w2 = (wo.WoWeight("int4_w4a16", *args[i:i + 3], 32) for i in (1, 5))
        run = lambda x: wo.fused_experts_wo(x, w13, w2, args[9], args[10])  # noqa: E731
        name = "triton_experts_wo"
    x = args[0].clone().requires_grad_()
    out = run(x)
    with torch.no_grad():
        assert torch.equal(out.detach(), run(args[0]))
    assert f"{name}_autograd" in type(out.grad_fn).__name__
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        out.float().sum().backward()
    with pytest.raises(Exception, match="no autograd formula was registered"):
        _compiled_ops(run, x)
    with pytest.raises(RuntimeError, match=f"moekit::{name} has no backward"):
        getattr(torch.ops.moekit, name)(x, *args[1:])


def test_route_op_refuses_logits_that_need_a_gradient(ops):
    """Its one caller, FusedRouter, routes such a call with ``route`` (``test_routing_fused``); the op says so."""
    args = route_args(3, seed=1)
    with pytest.raises(RuntimeError, match="moekit::route_fused has no backward"):
        torch.ops.moekit.route_fused(args[0].clone().requires_grad_(), *args[1:])
    with torch.no_grad():
        torch.ops.moekit.route_fused(args[0].clone().requires_grad_(), *args[1:])  # no gradient recorded: runs


def test_bodies_build_options_and_plans_once_per_set_of_values(ops):
    fp8, wo, fused, align = ops["fp8"], ops["wo"], ops["fused"], ops["align"]
    calls = {fp8._fp8_options: (torch.ops.moekit.triton_experts_fp8, fp8_args(1, seed=1)),
             wo._wo_options: (torch.ops.moekit.triton_experts_wo, wo_args(wo, 1, seed=1)),
             fused._op_plan: (torch.ops.moekit.route_fused, route_args(2, seed=1)),
             align._op_plan: (torch.ops.moekit.align_block_triton, align_args(5, seed=1))}
    with torch.no_grad():
        for cache, (op, args) in calls.items():
            cache.cache_clear()
            for _ in range(3):
                op(*args)
            assert (cache.cache_info().misses, cache.cache_info().hits) == (1, 2), cache.__name__
    options = fp8._fp8_options(True, False, True)
    assert (options.weight_descriptors, options.dependent_launch, options.poison_workspace) == (True, False, True)
    assert wo._wo_options(True).dependent_launch and not wo._wo_options(True).reuse_workspace


def test_needs_grad():
    t, leaf = torch.ones(2), torch.ones(2, requires_grad=True)
    assert not needs_grad(t, None) and needs_grad(None, t, leaf)
    with torch.no_grad():
        assert not needs_grad(leaf)

"""The Triton experts kernels on every experts variant (issue 14), under Triton's interpreter, small shapes.

Each variant (biases, interleaved gate/up, ungated, clamped SwiGLU with alpha/limit/up_shift, transposed storage) is
held to a float64 per-token loop (``_helpers.experts_loop``) with the activations spelled out (``_helpers.glu64``), not
to moekit's own torch code. Workspaces are poisoned with NaN, so a read of an unwritten row fails.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate (odd: every tile has a masked tail).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from _helpers import TOLERANCE as TOL, count_op_calls, experts_loop, make_problem, rel_l2  # noqa: E402
from _triton_helpers import interpreter, launch_log  # noqa: E402, F401  (fixtures)
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_plan import descriptors_allowed, plan_key  # noqa: E402

POISON = LaunchOptions(poison_workspace=True)
E, K, N = 8, 33, 17
# limit 0.5 and alpha 1.702: at these scales (pre-activations ~ N(0, 1)) the clamp cuts most values, so a
# kernel that skipped it fails (test_the_variant_parameters_matter); the device check runs gpt-oss's 7.0.
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.5, up_shift=1.0)
VARIANTS = {
    "silu": ActivationSpec("silu"),
    "gpt_oss": GPT_OSS,
    "clamp_concatenated": ActivationSpec("silu", limit=0.5, up_shift=1.0),
    "gelu_tanh_interleaved": ActivationSpec("gelu_tanh", interleaved=True),
    "relu2_ungated": ActivationSpec("relu2", gated=False),
    "gelu_ungated": ActivationSpec("gelu", gated=False),
    "silu_alpha_ungated": ActivationSpec("silu", gated=False, alpha=1.702),
}


def _problem(m, k, spec, dtype=torch.float32, hidden=K, inter=N, seed=0, biases=True, skips=True):
    """x, w13 ([E, 2N or N, K]), w2, ids (some -1), weights, b13, b2 (random, non-zero) in ``dtype``."""
    x, w13, w2, ids, weights = make_problem(m, k, E, hidden, inter, dtype, seed=seed, skips=skips)
    if not spec.gated:
        w13 = w13[:, :inter].contiguous()  # [E, N, K]
    g = torch.Generator().manual_seed(seed + 100)
    b13 = (torch.randn(E, w13.shape[1], generator=g) * 0.5).to(dtype) if biases else None
    b2 = (torch.randn(E, hidden, generator=g) * 0.5).to(dtype) if biases else None
    return x, w13, w2, ids, weights, b13, b2


def _run(tri, x, w13, w2, ids, weights, b13, b2, spec, expert_map=None, options=POISON):
    return tri.experts_triton(x, w13, w2, ids, weights, activation=spec, expert_map=expert_map, b13=b13, b2=b2,
                              options=options)


def _check(tri, x, w13, w2, ids, weights, b13, b2, spec, expert_map=None, options=POISON):
    out = _run(tri, x, w13, w2, ids, weights, b13, b2, spec, expert_map, options)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.shape[0]:
        loop_spec = ActivationSpec(spec) if isinstance(spec, str) else spec  # a str means its plain spec
        want = experts_loop(x, w13, w2, ids, weights, expert_map, b13=b13, b2=b2, spec=loop_spec)
        assert rel_l2(out, want) < TOL[x.dtype]
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("m", [0, 1, 5])
def test_variant_matches_the_loop(interpreter, variant, m, k):
    # M=1, k=1 (A*4 <= E) takes the naive path, the rest the aligned layout; some slots are -1.
    spec = VARIANTS[variant]
    _check(interpreter, *_problem(m, k, spec, seed=m * 10 + k), spec)


@pytest.mark.parametrize("variant", ["gpt_oss", "relu2_ungated"])
def test_variant_without_biases_and_in_bf16(interpreter, variant):
    spec = VARIANTS[variant]
    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, spec, torch.bfloat16, seed=3)
    _check(interpreter, x, w13, w2, ids, weights, b13, b2, spec)
    _check(interpreter, x, w13, w2, ids, weights, None, None, spec)
    _check(interpreter, x, w13, w2, ids, weights, b13, None, spec)  # one bias alone
    _check(interpreter, x, w13, w2, ids, weights, None, b2, spec)


@pytest.mark.parametrize("variant", ["gpt_oss", "relu2_ungated", "silu"])
def test_expert_map_with_minus_one(interpreter, variant):
    spec = VARIANTS[variant]
    x, w13, w2, _, weights, b13, b2 = _problem(5, 2, spec, seed=4)
    ids = torch.tensor([[0, 3], [11, -1], [4, 5], [1, 9], [8, 13]], dtype=torch.int32)  # global ids; 13 >= 12
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5, -1, 6, 7, -1], dtype=torch.int32)  # [12] global -> local
    out = _check(interpreter, x, w13, w2, ids, weights, b13, b2, spec, expert_map)
    for t in (1, 4):  # every slot skipped (map entry -1, id -1, id past the map): exact zeros, no bias either
        assert torch.equal(out[t], torch.zeros(K))


@pytest.mark.parametrize("variant", ["gpt_oss", "relu2_ungated", "clamp_concatenated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transposed_storage_is_read_through_strides(interpreter, launch_log, variant, dtype):
    """transformers' ``is_transposed`` weights ([E, K, 2N] / [E, N, K] storage) passed as transposed views
    and biases as strided views: the pointer path with their real strides (no TMA: K is not the
    contiguous dim), no copy, the loop's answer."""
    spec = VARIANTS[variant]
    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, spec, dtype, hidden=40, inter=24, seed=5)
    w13_t, w2_t = w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)
    b13_s, b2_s = torch.cat([b13, b13], 1)[:, ::2], torch.cat([b2, b2], 1)[:, ::2]  # column stride 2
    b13_s.copy_(b13)
    b2_s.copy_(b2)
    assert w13_t.stride(1) == 1 and not descriptors_allowed(w13_t, w2_t, POISON)
    _check(interpreter, x, w13_t, w2_t, ids, weights, b13_s, b2_s, spec)
    (_, up), (_, down) = [(n, kw) for n, kw in launch_log.take() if n in ("gate_up_kernel", "down_kernel")]
    assert not up["W_DESC"] and up["w13_ptr"].data_ptr() == w13_t.data_ptr()  # the view itself: no copy
    assert up["stride_wk"] == w13_t.stride(2) and up["stride_bn"] == 2 and down["stride_b2k"] == 2


@pytest.mark.parametrize("variant", ["gpt_oss", "relu2_ungated", "clamp_concatenated"])
def test_weight_descriptors_with_variants(interpreter, launch_log, variant):
    """16-bit contiguous weights with 16-byte rows take the TMA path: interleaved w13 through two strided
    descriptors (gate rows, up rows), concatenated and ungated through one; tails masked as in the plain
    path. Equal to the pointer path's answer within bf16 tolerance of the loop."""
    spec = VARIANTS[variant]
    x, w13, w2, ids, weights, b13, b2 = _problem(33, 2, spec, torch.bfloat16, hidden=40, inter=24, seed=6)
    cfg = KernelConfig(16, GemmTile(16, 32, 2, 4, 2), GemmTile(16, 32, 1, 4, 2))  # N=24: a masked last N tile
    ref = experts_loop(x, w13, w2, ids, weights, b13=b13, b2=b2, spec=spec)
    for descriptors in (True, False):
        options = LaunchOptions(weight_descriptors=descriptors, poison_workspace=True)
        out = interpreter.fused_experts(x, w13, w2, ids, weights, None, spec, cfg, options, b13=b13, b2=b2)
        assert rel_l2(out, ref) < TOL[torch.bfloat16]
        up = next(kw for name, kw in launch_log.take() if name == "gate_up_kernel")
        assert up["W_DESC"] == descriptors
        assert (up["w13_up_ptr"] is not None) == (descriptors and spec.interleaved)


def test_the_variant_parameters_matter(interpreter):
    """The test problems are sensitive: dropping the clamp, alpha, up_shift or the interleaving from the
    gpt-oss spec changes the loop's answer by far more than the tolerance, and the kernel follows each."""
    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, GPT_OSS, seed=7)
    ref = experts_loop(x, w13, w2, ids, weights, b13=b13, b2=b2, spec=GPT_OSS)
    for change in (dict(limit=None), dict(alpha=1.0), dict(up_shift=0.0), dict(interleaved=False)):
        other = dataclasses.replace(GPT_OSS, **change)
        other_ref = experts_loop(x, w13, w2, ids, weights, b13=b13, b2=b2, spec=other)
        assert rel_l2(other_ref, ref) > 0.05, change
        _check(interpreter, x, w13, w2, ids, weights, b13, b2, other)
    assert rel_l2(experts_loop(x, w13, w2, ids, weights, b13=None, b2=b2, spec=GPT_OSS), ref) > 0.05  # b13 matters
    assert rel_l2(experts_loop(x, w13, w2, ids, weights, b13=b13, b2=None, spec=GPT_OSS), ref) > 0.05  # b2 matters


def test_plans_are_kept_per_variant(interpreter, launch_log):
    """A silu plan is never reused for a clamped SwiGLU (nor a plan without biases for one with): same
    shapes, different variants, each its own key and plan, each launch with its own constexprs, each
    right; calling them again adds no plan."""
    from moekit.experts import triton_plan

    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, GPT_OSS, seed=8)
    ids_c, weights_c = ids.contiguous(), weights.contiguous()
    calls = [("silu", None, None), (VARIANTS["silu"], b13, b2), (GPT_OSS, b13, b2), (GPT_OSS, None, None),
             (VARIANTS["clamp_concatenated"], b13, b2)]
    keys = {plan_key(x, w13, w2, ids_c, weights_c, None, act, None, POISON, bb13, bb2) for act, bb13, bb2 in calls}
    assert len(keys) == len(calls)
    triton_plan.clear_plans()
    for _ in range(2):
        for act, bb13, bb2 in calls:
            _check(interpreter, x, w13, w2, ids, weights, bb13, bb2, act)
        assert len(triton_plan._PLANS) == len(calls)
    ups = [kw for name, kw in launch_log.take() if name == "gate_up_kernel"]
    assert {(kw["INTERLEAVED"], kw["LIMIT"], kw["ALPHA"], kw["UP_SHIFT"]) for kw in ups} == {
        (False, None, 1.0, 0.0), (True, 0.5, 1.702, 1.0), (False, 0.5, 1.0, 1.0)}


def test_the_op_path_equals_the_direct_path(interpreter, monkeypatch):
    """Through the op (no gradient needed: the inference twin; the variant as primitive arguments, rebuilt inside)
    and directly: equal outputs; a plain spec crosses the op as its name, sharing the "silu" plan."""
    calls = []
    real = torch.ops.moekit.triton_experts_infer
    monkeypatch.setattr(torch.ops.moekit, "triton_experts_infer", lambda *a: calls.append(a[8:15]) or real(*a))
    for spec in (GPT_OSS, VARIANTS["relu2_ungated"]):
        x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, spec, seed=9)
        direct = _check(interpreter, x, w13, w2, ids, weights, b13, b2, spec)
        via_op = _run(interpreter, x, w13, w2, ids, weights, b13, b2, spec,
                      options=LaunchOptions(poison_workspace=True, direct_eager=False))
        assert torch.equal(direct, via_op)
    assert calls == [("silu", True, True, 1.702, 0.5, 1.0, False), ("relu2", False, False, 1.0, None, 0.0, False)]
    from moekit.activations import plan_activation  # what the op rebuilds the spec with

    assert plan_activation("silu", True, False, 1.0, None, 0.0, False) == "silu"


def test_a_bias_that_needs_a_gradient_goes_through_the_op(interpreter, monkeypatch):
    calls = count_op_calls(monkeypatch, ("triton_experts",))
    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, GPT_OSS, seed=10)
    b2.requires_grad_()
    out = _run(interpreter, x, w13, w2, ids, weights, b13, b2, GPT_OSS)
    assert calls == ["triton_experts"] and out.requires_grad  # autograd sees the op (its error comes at backward)


def test_opcheck_with_a_variant(interpreter):
    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, GPT_OSS, seed=11)
    options = LaunchOptions(poison_workspace=True).as_op_args()
    variant = ("silu", True, True, 1.702, 0.5, 1.0, False)
    torch.library.opcheck(torch.ops.moekit.triton_experts,
                          (x, w13, w2, ids, weights, None, b13, b2, *variant, *options))
    spec = VARIANTS["relu2_ungated"]
    x, w13, w2, ids, weights, b13, _ = _problem(5, 2, spec, seed=11)
    torch.library.opcheck(torch.ops.moekit.triton_experts,
                          (x, w13, w2, ids, weights, None, b13, None, "relu2", False, False, 1.0, None, 0.0, False,
                           *options))


def test_compiled_fullgraph_with_a_variant(interpreter):
    """torch.compile(fullgraph=True) traces a call with a spec and biases (the spec a constant of the
    graph, the biases graph inputs) into the op (no gradient needed: the twin); its result equals the eager one."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, GPT_OSS, seed=12)
    fn = torch.compile(lambda *t: _run(interpreter, *t, GPT_OSS), fullgraph=True, backend=backend)
    with torch.no_grad():
        compiled = fn(x, w13, w2, ids, weights, b13, b2)
    assert [t for t in seen if "moekit" in t] == ["moekit.triton_experts_infer"], seen
    assert torch.equal(compiled, _run(interpreter, x, w13, w2, ids, weights, b13, b2, GPT_OSS))


def test_bad_variant_arguments(interpreter):
    x, w13, w2, ids, weights, b13, b2 = _problem(5, 2, GPT_OSS, seed=13)
    with pytest.raises(TypeError, match="activation must be a str or an ActivationSpec"):
        interpreter.experts_triton_unchecked(x, w13, w2, ids, weights, activation=3, b13=b13)
    with pytest.raises(TypeError, match="b13 must be one of"):
        interpreter.fused_experts(x, w13, w2, ids, weights, None, GPT_OSS, b13=b13.double(), b2=b2)
    with pytest.raises(ValueError, match="b2 must have shape"):
        interpreter.experts_triton(x, w13, w2, ids, weights, activation=GPT_OSS, b13=b13, b2=b2[:, :5])
    with pytest.raises(ValueError, match="w2 must have shape"):  # an ungated spec with a gated w13 [E, 2N, K]
        interpreter.experts_triton(x, w13, w2, ids, weights, activation=VARIANTS["relu2_ungated"])

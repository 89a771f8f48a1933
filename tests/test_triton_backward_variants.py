"""The Triton experts path trains every variant its forward runs (``triton_backward_recompute``: expert biases,
gpt-oss's interleaved clamped SwiGLU with alpha and up_shift, the clamp after the activation, ungated and
gated activations outside ``BACKWARD_ACTIVATIONS``), under Triton's interpreter at tiny shapes: the gradients
against the float64 autograd of a per-assignment loop written in ``_helpers`` (``experts_loop``, ``glu64``),
the layer's SGD step against grouped_mm's, a transformers block's gradients against its own eager experts'.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from _triton_helpers import interpreter  # noqa: E402, F401  (fixture)
from _helpers import experts_loop, make_problem, partial_expert_map, rel_l2  # noqa: E402
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.experts.triton_backward import BackwardOptions, experts_triton_train, unsupported_variant  # noqa: E402
from moekit.experts.triton_backward_launch import BACKWARD_ACTIVATIONS  # noqa: E402

NAMES = ("x", "w13", "w2", "topk_weights", "b13", "b2")
GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.6, up_shift=1.0)  # 0.6: bites at |h| ~ 1
# (spec, biases): each variant kind of the brief
VARIANTS = {
    "biases": ("silu", True),
    "gpt_oss": (GPT_OSS, True),
    "limit_after_act": (ActivationSpec("silu", limit=0.3, limit_after_act=True), False),
    "ungated_relu2": (ActivationSpec("relu2", gated=False), False),
    "gated_relu2": ("relu2", False),  # gated, outside BACKWARD_ACTIVATIONS
    "gelu_limit": (ActivationSpec("gelu", limit=0.6), True),
}


def _leaves(m, k, e, hidden, inter, spec, biases, seed, dtype) -> dict:
    """The inputs by name in ``dtype`` (topk_weights float32 below float64), w13 [E, R, K] with R = N ungated."""
    x, w13, w2, ids, weights = make_problem(m, k, e, hidden, inter, seed=seed, skips=m > 2)
    if not (ActivationSpec(spec) if isinstance(spec, str) else spec).gated:
        w13 = w13[:, :inter]
    g = torch.Generator().manual_seed(seed + 1)
    b13 = torch.randn(e, w13.shape[1], generator=g) * 0.5 if biases else None
    b2 = torch.randn(e, hidden, generator=g) * 0.5 if biases else None
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {"x": x, "w13": w13, "w2": w2, "topk_weights": weights, "b13": b13, "b2": b2}
    leaves = {n: None if t is None else t.to(wdtype if n == "topk_weights" else dtype) for n, t in leaves.items()}
    return {"ids": ids, **leaves}


def _grads(fn, inputs: dict, spec, dout, requires=NAMES) -> dict:
    leaves = {n: None if inputs[n] is None else inputs[n].clone().requires_grad_(n in requires) for n in NAMES}
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], inputs["ids"], leaves["topk_weights"], spec, leaves["b13"],
             leaves["b2"])
    (out * dout.to(out.dtype)).sum().backward()
    return {n: None if leaves[n] is None else leaves[n].grad for n in NAMES}


def _triton(tri):
    return lambda x, w13, w2, ids, w, spec, b13, b2: tri.experts_triton(x, w13, w2, ids, w, activation=spec,
                                                                        b13=b13, b2=b2)


def _loop(x, w13, w2, ids, w, spec, b13, b2):
    return experts_loop(x, w13, w2, ids, w, b13=b13, b2=b2, spec=spec)


def _check(fn, spec, biases, m=7, k=2, e=4, hidden=16, inter=8, seed=0, requires=NAMES) -> dict:
    got_in = _leaves(m, k, e, hidden, inter, spec, biases, seed, torch.float32)
    want_in = _leaves(m, k, e, hidden, inter, spec, biases, seed, torch.float64)
    dout = torch.randn(m, hidden, generator=torch.Generator().manual_seed(seed + 2))
    got, want = _grads(fn, got_in, spec, dout, requires), _grads(_loop, want_in, spec, dout, requires)
    for name in NAMES:
        if want_in[name] is None or name not in requires:
            assert got[name] is None, name
            continue
        assert got[name].shape == want[name].shape and got[name].dtype == got_in[name].dtype, name
        assert want[name].abs().max() > 0, name  # every gradient here is nonzero: the test can fail
        assert rel_l2(got[name], want[name]) < 1e-5, name
    return got


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_grads_against_the_loop(interpreter, variant):
    spec, biases = VARIANTS[variant]
    assert unsupported_variant(_fields(spec, biases)) is not None  # the recompute, not the fused backward
    _check(_triton(interpreter), spec, biases)


def _fields(spec, biases) -> dict:
    from moekit.activations import spec_fields

    names = ("activation", "gated", "interleaved", "alpha", "limit", "up_shift", "limit_after_act")
    return {**dict(zip(names, spec_fields(spec))), "b13": torch.zeros(1) if biases else None}


def test_the_clamps_bite():
    """The tolerance above can tell the clamps apart: gpt-oss's and the after-activation spec's grads differ
    from their unclamped twins' at these shapes (the loop's, float64)."""
    for spec, plain in ((GPT_OSS, ActivationSpec("silu", interleaved=True, alpha=1.702, up_shift=1.0)),
                        (VARIANTS["limit_after_act"][0], "silu")):
        inputs = _leaves(7, 2, 4, 16, 8, spec, False, 0, torch.float64)
        dout = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
        clamped, unclamped = _grads(_loop, inputs, spec, dout), _grads(_loop, inputs, plain, dout)
        assert rel_l2(clamped["w13"], unclamped["w13"]) > 1e-2


def test_variant_subsets_and_skipped_slots(interpreter):
    """Only what needs a gradient gets one (frozen experts still owe the router its weights' grads; a bias
    alone), with about 20% of the slots -1."""
    spec, biases = VARIANTS["gpt_oss"]
    _check(_triton(interpreter), spec, biases, m=9, requires=("topk_weights",), seed=3)
    _check(_triton(interpreter), spec, biases, m=9, requires=("b13", "x"), seed=4)


def test_variant_with_an_expert_map(interpreter):
    """An expert-parallel rank's call (4 local experts of 6, ids off the rank skipped): the recompute passes the map."""
    spec, biases = VARIANTS["gpt_oss"]
    expert_map = partial_expert_map(6, 4, seed=12)
    got_in, want_in = (_leaves(9, 2, 4, 16, 8, spec, biases, 12, dtype) for dtype in (torch.float32, torch.float64))
    ids = torch.randint(0, 6, (9, 2), generator=torch.Generator().manual_seed(13), dtype=torch.int32)
    got_in["ids"] = want_in["ids"] = ids
    dout = torch.randn(9, 16, generator=torch.Generator().manual_seed(14))
    got = _grads(lambda x, w13, w2, i, w, s, b13, b2: interpreter.experts_triton(
        x, w13, w2, i, w, activation=s, expert_map=expert_map, b13=b13, b2=b2), got_in, spec, dout)
    want = _grads(lambda x, w13, w2, i, w, s, b13, b2: experts_loop(
        x, w13, w2, i, w, expert_map, b13=b13, b2=b2, spec=s), want_in, spec, dout)
    off = expert_map[ids.long()] < 0
    assert off.any() and torch.equal(got["topk_weights"][off], torch.zeros(int(off.sum())))
    for name in NAMES:
        assert rel_l2(got[name], want[name]) < 1e-5, name


def test_train_entry_takes_variants(interpreter):
    """``experts_triton_train`` runs a variant through the op's recomputing backward; options for the fused
    backward are refused for it (they would not apply)."""
    spec, biases = VARIANTS["limit_after_act"]

    def train(x, w13, w2, ids, w, spec, b13, b2):
        return experts_triton_train(x, w13, w2, ids, w, activation=spec, b13=b13, b2=b2)

    _check(train, spec, biases, seed=5)
    _check(train, *VARIANTS["biases"], seed=6)
    x, w13, w2, ids, weights = make_problem(3, 2, 4, 16, 8, seed=7)
    with pytest.raises(ValueError, match="backward=.*fused backward only"):
        experts_triton_train(x, w13, w2, ids, weights, activation=spec, backward=BackwardOptions(recompute=False))
    with pytest.raises(TypeError, match="activation"):
        experts_triton_train(x, w13, w2, ids, weights, activation=object())


def test_plain_specs_keep_the_fused_backward(interpreter):
    """A plain spec's backward is the fused op's, bit for bit (the recompute is never taken for it)."""
    assert all(unsupported_variant({"activation": a}) is None for a in BACKWARD_ACTIVATIONS)
    x, w13, w2, ids, weights = make_problem(9, 2, 4, 16, 8, seed=8)
    dout = torch.randn(9, 16, generator=torch.Generator().manual_seed(9))
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = interpreter.experts_triton(leaves[0], leaves[1], leaves[2], ids, leaves[3], activation="gelu")
    (out * dout).sum().backward()
    fused = torch.ops.moekit.triton_experts_backward(dout, x, w13, w2, ids, weights, None, None, "gelu", True, True,
                                                     True, True, 0, None)
    for leaf, want in zip(leaves, fused):
        assert torch.equal(leaf.grad, want)


def test_variant_under_torch_func_grad(interpreter):
    """torch.func.grad reaches the recompute (through ``func_ops``' function) with the loop's gradients."""
    spec, biases = VARIANTS["gpt_oss"]
    inputs = _leaves(5, 2, 4, 16, 8, spec, biases, 10, torch.float32)
    want_in = _leaves(5, 2, 4, 16, 8, spec, biases, 10, torch.float64)

    def loss(w13, b2, x):
        return interpreter.experts_triton(x, w13, inputs["w2"], inputs["ids"], inputs["topk_weights"],
                                          activation=spec, b13=inputs["b13"], b2=b2).square().sum()

    got = torch.func.grad(loss, argnums=(0, 1))(inputs["w13"], inputs["b2"], inputs["x"])
    leaves = {n: want_in[n].clone().requires_grad_() for n in ("w13", "b2")}
    out = _loop(want_in["x"], leaves["w13"], want_in["w2"], want_in["ids"], want_in["topk_weights"], spec,
                want_in["b13"], leaves["b2"])
    out.square().sum().backward()
    assert rel_l2(got[0], leaves["w13"].grad) < 1e-5 and rel_l2(got[1], leaves["b2"].grad) < 1e-5


def test_compile_traces_a_variant_backward(interpreter):
    """torch.compile(fullgraph=True) through AOTAutograd: the recompute op is traced by its fake, then runs;
    the grads equal eager's."""
    spec, biases = VARIANTS["gpt_oss"]
    fn = _triton(interpreter)
    eager = _check(fn, spec, biases, seed=11)
    traced = _check(torch.compile(fn, fullgraph=True, backend="aot_eager"), spec, biases, seed=11)
    for name in NAMES:
        assert rel_l2(traced[name], eager[name]) < 1e-6, name


def test_layer_step_equals_grouped_mm(interpreter):
    """``MoE(backend="triton")`` with gpt-oss's experts (biases, interleaved clamped SwiGLU) and router bias: one
    SGD step lands every parameter where the same layer's step on grouped_mm does."""
    from moekit import MoE, MoEConfig

    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2, activation=GPT_OSS,
                    expert_bias=True, router_bias=True)
    torch.manual_seed(0)
    layer = MoE(cfg, backend="triton")
    twin = MoE(cfg, backend="grouped_mm")
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    twin.load_state_dict(layer.state_dict())
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    target = torch.randn(10, 16, generator=torch.Generator().manual_seed(2))
    for moe in (layer, twin):
        F.mse_loss(moe(x), target).backward()
        torch.optim.SGD(moe.parameters(), lr=0.5).step()
    moved = 0.0
    for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert rel_l2(p.grad, q.grad) < 1e-5, name
        assert rel_l2(p.detach(), q.detach()) < 1e-6, name
        moved = max(moved, p.grad.abs().max().item())
    assert moved > 0


def _gpt_oss_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=8, intermediate_size=16, num_hidden_layers=1, num_local_experts=4,
                                    num_experts_per_tok=2, layer_types=["full_attention"])
    return transformers.GptOssForCausalLM(cfg).model, 10.0  # inputs x10: past the clamp (7.0)


def _step_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Step3p7TextConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, share_expert_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        vocab_size=97, sliding_window=8, layer_types=["full_attention"], mlp_layer_types=["sparse"],
        swiglu_limits=[3.0], swiglu_limits_shared=[0.0])
    return transformers.Step3p7TextModel(cfg), 10.0  # inputs x10: past the clamp (3.0) after the activation


@pytest.mark.parametrize("family", ["gpt_oss", "step3p7"])
def test_hf_block_grads_equal_transformers(interpreter, monkeypatch, family):
    """A transformers block built offline (random weights) with its experts swapped by ``moekit.hf`` onto the triton
    backend: loss.backward()'s gradients of every parameter (router, experts, biases; Step-3.7's shared MLP) equal
    those of transformers' own eager experts."""
    import moekit.experts
    import moekit.hf as moekit_hf

    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "triton")
    monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
    torch.manual_seed(3)
    model, scale = _gpt_oss_model() if family == "gpt_oss" else _step_model()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    block = model.layers[0].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(4)) * scale
    dout = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5))
    grads = {}
    for implementation in ("eager", "moekit"):
        model.set_experts_implementation(implementation)
        model.zero_grad()
        out = block(x)
        ((out[0] if isinstance(out, tuple) else out) * dout).sum().backward()
        grads[implementation] = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
    assert ("triton", "cpu") in moekit.experts._RESOLVED  # the experts ran on the triton backend
    assert grads["eager"].keys() == grads["moekit"].keys() and len(grads["eager"]) >= 4
    for name, want in grads["eager"].items():
        assert want.abs().max() > 0, name
        assert rel_l2(grads["moekit"][name], want) < 1e-4, name

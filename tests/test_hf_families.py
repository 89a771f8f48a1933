"""Every transformers MoE family on the "moekit" experts implementation, against transformers' eager.

The walk (``tests/_hf_families.py``) finds every experts class the installed transformers wraps with
``use_experts_implementation``; each is built small from its own config class (random weights, random
non-zero biases) and its "moekit" output is held to its eager output in fp32. Then whole tiny models'
logits, and the plan's recognition on modules built to fool it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.hf as moekit_hf  # noqa: E402  (registers "moekit")
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.hf.variants import ComposedPathWarning, build_plan, experts_plan  # noqa: E402

from _hf_families import build_experts, make_case, run_moekit, walk  # noqa: E402
import _hf_tiny_models as tiny  # noqa: E402

FAMILIES = {f"{f.family}:{f.cls.__name__}": f for f in walk()}


def rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def test_walk_finds_the_interface():
    """The walk is not empty and finds the variants the issue names (the count is in the README and docs/hf.md)."""
    families = {f.family for f in FAMILIES.values()}
    assert {"gpt_oss", "glm4_moe", "qwen3_next", "olmoe", "granitemoe", "phimoe", "mixtral"} <= families
    flags = {k for f in FAMILIES.values() for k in f.flags}
    assert {"has_bias", "is_concatenated", "is_transposed"} <= flags


@pytest.mark.parametrize("key", sorted(FAMILIES))
def test_family_matches_eager(key):
    """fp32, rel. L2 < 1e-5; one slot of row 0 is the EP sentinel id E with weight 0."""
    case = make_case(FAMILIES[key])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ComposedPathWarning)
        out = run_moekit(case)
    assert out.dtype == case.eager.dtype and out.shape == case.eager.shape
    assert rel_l2(out, case.eager) < 1e-5


def _plan_of(family: str):
    fam = next(f for f in FAMILIES.values() if f.family == family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ComposedPathWarning)
        return build_plan(build_experts(fam))


def test_known_variants_are_recognised():
    """gpt-oss's clamped SwiGLU (interleaved, alpha, limit, +1) is fused as its spec; so are a clamp with
    no alpha (DeepSeek-V4), the same SwiGLU unconcatenated (MiniMax-M3-VL), an ungated relu² (Nemotron-H)
    and activations named by another config field (Gemma-4) or by a function (LFM2-MoE)."""
    gpt = _plan_of("gpt_oss")
    assert gpt.fused and gpt.transposed and gpt.has_bias
    assert gpt.activation == ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
    v4 = _plan_of("deepseek_v4").activation
    assert isinstance(v4, ActivationSpec) and v4.limit is not None and (v4.alpha, v4.up_shift) == (1.0, 0.0)
    m3 = _plan_of("minimax_m3_vl").activation
    assert isinstance(m3, ActivationSpec) and not m3.interleaved and m3.up_shift == 1.0 and m3.alpha != 1.0
    nemotron = _plan_of("nemotron_h")
    assert nemotron.activation == ActivationSpec("relu2", gated=False) and nemotron.up_name == "up_proj"
    assert _plan_of("gemma4").activation == "gelu_tanh"
    assert _plan_of("lfm2_moe").activation == "silu"


def test_unrecognised_code_runs_composed_with_one_warning():
    """Inkling-2's soft-capped SwiGLU and MuseSpark's post-expert norm are not fused: they run composed
    (correct, tested above), and each class says so once."""
    for family in ("inkling2", "muse_spark"):
        fam = next(f for f in FAMILIES.values() if f.family == family)
        moekit_hf.variants._WARNED.discard(fam.cls)
        with pytest.warns(ComposedPathWarning, match=fam.cls.__name__):
            assert not experts_plan(build_experts(fam)).fused
        with warnings.catch_warnings():
            warnings.simplefilter("error", ComposedPathWarning)
            experts_plan(build_experts(fam, seed=1))  # a second instance of the class: no second warning


def _decoy_experts(gate):
    """Mixtral's experts with another _apply_gate, and gpt-oss's attributes (limit 7, alpha 1.702)."""
    fam = FAMILIES["mixtral:MixtralExperts"]
    cls = type("DecoyExperts", (fam.cls,), {"_apply_gate": gate})
    from _hf_families import Family

    module = build_experts(Family("mixtral", cls))
    module.limit, module.alpha = 7.0, 1.702
    return module


@pytest.mark.parametrize("gate", [
    lambda self, h: torch.nn.functional.silu(h.chunk(2, -1)[0].clamp(max=self.limit / 2)) * h.chunk(2, -1)[1],
    lambda self, h: torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1].clamp(-self.limit, self.limit),
    lambda self, h: torch.tanh(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1],
    lambda self, h: torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1] * 1.001,
], ids=["other-limit", "up-clamp-only", "tanh", "scaled"])
def test_a_near_miss_is_never_fused_as_something_else(gate):
    """An _apply_gate that differs from every spec (even by 0.1%) is not matched to the closest one:
    it runs composed and still equals transformers' "batched_mm" (which calls _apply_gate; the
    decoys inherit Mixtral's eager loop, which does not)."""
    module = _decoy_experts(gate)
    with pytest.warns(ComposedPathWarning):
        assert not experts_plan(module).fused
    g = torch.Generator().manual_seed(3)
    x, ids, w = torch.randn(5, 32, generator=g) * 8, torch.randint(0, 6, (5, 2), generator=g), torch.rand(5, 2)
    with torch.no_grad():
        module.config._experts_implementation = "batched_mm"
        eager = module(x, ids, w)
        module.config._experts_implementation = "moekit"
        assert rel_l2(module(x, ids, w), eager) < 1e-5


def test_plan_is_built_once_per_module(monkeypatch):
    """The probing runs on the first call only: later calls read the cached plan."""
    case = make_case(FAMILIES["qwen3_moe:Qwen3MoeExperts"])
    first = run_moekit(case)
    monkeypatch.setattr(moekit_hf.variants, "build_plan", lambda m: pytest.fail("plan rebuilt"))
    torch.testing.assert_close(run_moekit(case), first, rtol=0, atol=0)
    assert moekit_hf.prepare(torch.nn.Sequential(case.module)) == [case.module._moekit_plan]


@pytest.mark.parametrize("name", list(tiny.MODELS))
def test_tiny_model_logits(name, monkeypatch):
    model, _ = tiny.build(name)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    calls = []
    for target in ("call_backend", "run_composed"):
        original = getattr(moekit_hf, target)
        monkeypatch.setattr(moekit_hf, target, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        model.set_experts_implementation("moekit")
        ours = model(ids).logits
    assert calls, "the moekit implementation was not called"
    assert rel_l2(ours, eager) < 1e-5


def _moe_block(layer: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in layer.modules() if hasattr(m, "experts") and m is not layer)


@pytest.mark.parametrize("fuse_shared", [False, True])
@pytest.mark.parametrize("name", list(tiny.MODELS))
def test_moe_from_hf_equals_block(name, fuse_shared):
    """Router (+ bias, + correction bias) + experts (+ biases, their activation) + shared expert (+ gate)."""
    model, layer = tiny.build(name)
    block = _moe_block(model.model.layers[layer])
    moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        assert rel_l2(moe(x), want) < 1e-5


@pytest.mark.parametrize("family", list(tiny.BLOCKS))
def test_moe_from_hf_equals_block_of_more_routers(family):
    """Jamba (softmax, not renormalised), MiniMax (renormalised), MiniMax-M2 (sigmoid + correction bias),
    ERNIE-4.5 (softmax + correction bias, a shared expert), Hunyuan (renormalised, a shared MLP)."""
    block = tiny.build_block(family)
    moe = moekit_hf.moe_from_hf(block)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = block(x)
        assert rel_l2(moe(x), want[0] if isinstance(want, tuple) else want) < 1e-5


def test_compiled_before_any_eager_call_runs_composed(monkeypatch):
    """torch.compile(fullgraph=True) meeting a module with no plan yet cannot probe it: it traces the
    composed path from the flags (still equal to eager) and caches nothing; an eager call then fuses. (Since
    session 51 set_experts_implementation("moekit"), from_pretrained and a model built from a config naming it build
    the plans; a model built on the meta device and filled leaves none: dropped here to stand for it.)"""
    model, layer = tiny.build("gpt_oss")
    block = model.model.layers[layer].mlp
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(5))
    composed = []
    original = moekit_hf.run_composed
    monkeypatch.setattr(moekit_hf, "run_composed", lambda *a, **k: composed.append(1) or original(*a, **k))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = block(x)[0]
        model.set_experts_implementation("moekit")
        del block.experts.__dict__["_moekit_plan"]
        torch._dynamo.reset()
        got = torch.compile(block, fullgraph=True, backend="eager")(x)[0]
        assert composed and rel_l2(got, want) < 1e-5
        assert "_moekit_plan" not in block.experts.__dict__
        assert rel_l2(block(x)[0], want) < 1e-5 and block.experts._moekit_plan.fused


def test_moe_from_hf_granite_shared_block_has_no_shared_expert():
    """Granite-MoE-Shared keeps its shared MLP on the decoder layer: the block converts without one
    (its config's shared width is not invented as random weights)."""
    cfg = transformers.GraniteMoeSharedConfig(
        vocab_size=97, hidden_size=32, intermediate_size=16, shared_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2)
    block = transformers.GraniteMoeSharedForCausalLM(cfg).eval().model.layers[0].block_sparse_moe
    moe = moekit_hf.moe_from_hf(block)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert moe.config.shared_expert_intermediate_size == 0 and rel_l2(moe(x), block(x)) < 1e-5

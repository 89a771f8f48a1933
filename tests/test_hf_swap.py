"""``moekit.hf.use_moekit_blocks`` on tiny transformers models built offline (random weights): each swapped
model against its unswapped twin (logits, router logits and the aux loss, gradients), the refused families'
report, the state_dict / save_pretrained round trip, generate, torch.compile, moves, pickling, restore,
fp8 experts."""

from __future__ import annotations

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit.hf.swap import SWAP_ATTR, set_blocks_active  # noqa: E402

from _helpers import rel_l2  # noqa: E402
from _hf_families import walk  # noqa: E402
import _hf_tiny_models as tiny  # noqa: E402

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
_FAMILIES = {f"{f.family}:{f.cls.__name__}": f for f in walk()}


def _swaps(model):
    return [m.__dict__[SWAP_ATTR] for m in model.modules() if SWAP_ATTR in m.__dict__]


def _count_moe_calls(model) -> list:
    """A list that grows by one per swapped block's MoE call (its forward wrapped on the instance)."""
    calls = []
    for swap in _swaps(model):
        forward = swap.moe.forward
        swap.moe.forward = lambda x, *a, _f=forward, **k: calls.append(1) or _f(x, *a, **k)
    return calls


@pytest.mark.parametrize("name", list(tiny.MODELS))
def test_swapped_model_equals_its_twin(name):
    """fp32 logits < 1e-5 through moekit's layers (Phi-MoE's sparsemixer as at inference); state_dict keys and the
    parameters unchanged."""
    model, _ = tiny.build(name)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    with torch.no_grad():
        want = model(IDS).logits
    report = moekit_hf.use_moekit_blocks(model)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    calls = _count_moe_calls(model)
    with torch.no_grad():
        got = model(IDS).logits
    assert len(report.swapped) == len(calls) > 0 and not report.left
    assert rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("family", list(tiny.BLOCKS))
def test_more_routers_and_shared_experts(family):
    """Jamba, MiniMax, MiniMax-M2, ERNIE-4.5 (a shared expert), Hunyuan (a shared MLP), Kimi-Linear: a model
    holding one block, swapped; the block's output and its return type kept."""
    holder = torch.nn.ModuleDict({"mlp": tiny.build_block(family)})
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = holder["mlp"](x)
    report = moekit_hf.use_moekit_blocks(holder)
    assert [b.path for b in report.swapped] == ["mlp"] and report.copied_bytes == 0
    with torch.no_grad():
        got = holder["mlp"](x)
    assert isinstance(got, tuple) == isinstance(want, tuple)
    first = (lambda o: o[0] if isinstance(o, tuple) else o)
    assert rel_l2(first(got), first(want)) < 1e-5


def test_tuple_block_and_transposed_views():
    """gpt-oss's block returns (out, router scores): kept a 2-tuple (out, None); its transposed experts are
    read as strided views of the block's storage (nothing copied), so an in-place update is seen."""
    model, _ = tiny.build("gpt_oss")
    report = moekit_hf.use_moekit_blocks(model)
    experts = model.model.layers[0].mlp.experts
    moe = _swaps(model)[0].moe
    assert report.swapped[0].tuple_len == 2 and report.copied_bytes == 0
    assert moe.w13.data_ptr() == experts.gate_up_proj.data_ptr() and moe.w13.shape == (6, 32, 32)
    with pytest.raises(ValueError, match="transposed must be 'copy' or 'view'"):
        moekit_hf.moe_from_hf(model.model.layers[0].mlp, transposed="views")
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        out, scores = model.model.layers[0].mlp(x)
        assert scores is None and out.shape == x.shape
        experts.down_proj.mul_(2)  # an optimizer step's kind of update
        twin = copy.deepcopy(model)
        moekit_hf.restore_blocks(twin)
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5


def test_fused_shared_expert_is_a_copy_that_follows_updates():
    """fuse_shared=True copies Qwen3-Next's shared expert into routed slots (the report's bytes): equal logits,
    re-copied after an in-place update of the block's weights; under autograd the block's own forward."""
    model, _ = tiny.build("qwen3_next")
    report = moekit_hf.use_moekit_blocks(model, fuse_shared=True)
    moe = _swaps(model)[0].moe
    assert moe.fuse_shared and report.swapped[0].copied_bytes == 4 * (moe.w13.numel() + moe.w2.numel())
    twin = copy.deepcopy(model)
    moekit_hf.restore_blocks(twin)
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5
        for m in (model, twin):
            m.model.layers[0].mlp.shared_expert.down_proj.weight.mul_(3)
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5 and _swaps(model)[0].moe is not moe
    calls = _count_moe_calls(model)
    model(IDS).logits.sum().backward()
    assert not calls and model.model.layers[0].mlp.shared_expert.down_proj.weight.grad is not None


@pytest.mark.parametrize("name", ["olmoe", "gpt_oss"])
def test_router_logits_and_aux_loss(name):
    """output_router_logits=True: transformers' hooks on the router record, the loss and the aux loss equal."""
    model, _ = tiny.build(name)
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    with torch.no_grad():
        want = twin(IDS, labels=IDS, output_router_logits=True)
        got = model(IDS, labels=IDS, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["olmoe", "qwen3_next", "glm4_moe", "gpt_oss"])
def test_gradients_reach_the_blocks_parameters(name):
    """Training: a swapped model's gradients (through moekit's layer, or gpt-oss's own forward: its experts are
    views the gradients would not reach) equal the twin's on every Parameter, within fp32 rounding."""
    model, _ = tiny.build(name)
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    calls = _count_moe_calls(model)
    for m in (model, twin):
        m.train()
        m(IDS, labels=IDS).loss.backward()
    assert bool(calls) == (name != "gpt_oss")
    for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None:
            assert p.grad is None, pname
        else:
            assert rel_l2(p.grad, q.grad) < 1e-4, pname


def test_save_pretrained_round_trip(tmp_path):
    """The swapped model saves the checkpoint the unswapped one does and loads it back."""
    model, _ = tiny.build("qwen3_next")
    with torch.no_grad():
        want = model(IDS).logits
    moekit_hf.use_moekit_blocks(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert list(loaded.state_dict()) == list(model.state_dict())
    moekit_hf.use_moekit_blocks(loaded)
    with torch.no_grad():
        assert rel_l2(loaded(IDS).logits, want) < 1e-5
        loaded.load_state_dict(model.state_dict())


def test_generate_and_compile():
    """Greedy generate gives the twin's tokens; torch.compile(model) traces moekit's forward."""
    model, _ = tiny.build("olmoe")
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(model.generate(IDS[:1], **kwargs), twin.generate(IDS[:1], **kwargs))
        torch._dynamo.reset()
        calls = _count_moe_calls(model)
        got = torch.compile(model, backend="eager")(IDS).logits
        assert calls and rel_l2(got, twin(IDS).logits) < 1e-5


def test_moves_pickles_restores_and_is_idempotent():
    model, _ = tiny.build("glm4_moe")
    twin = copy.deepcopy(model)
    first = moekit_hf.use_moekit_blocks(model)
    moe = _swaps(model)[0].moe
    assert moekit_hf.use_moekit_blocks(model) == first and _swaps(model)[0].moe is moe  # kept, not rebuilt
    model.to(torch.bfloat16)
    twin.to(torch.bfloat16)
    assert _swaps(model)[0].moe is not moe and _swaps(model)[0].moe.w13.dtype == torch.bfloat16
    with torch.no_grad():
        want = twin(IDS).logits
        assert rel_l2(model(IDS).logits, want) < 2e-2
        buf = io.BytesIO()
        torch.save(model, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert len(_swaps(loaded)) == 1 and torch.equal(loaded(IDS).logits, model(IDS).logits)
        assert set_blocks_active(model, False) == 1 and torch.equal(model(IDS).logits, want)
        assert moekit_hf.restore_blocks(model) == 1 and not _swaps(model)
        assert type(model.model.layers[1].mlp) is type(twin.model.layers[1].mlp)
        assert torch.equal(model(IDS).logits, want)


def test_fp8_experts_stay_fp8():
    """FineGrainedFP8Config's FP8Experts: the MoE reads them as they are (fp8_block, nothing copied); logits
    equal each block's plain moekit MoE."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    model = tiny.fp8_qwen3_moe()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:
        layer.mlp = moekit_hf.moe_from_hf(layer.mlp)
    report = moekit_hf.use_moekit_blocks(model)
    assert len(report.swapped) == 2 and report.copied_bytes == 0
    assert all(s.moe.quant_scheme == "fp8_block" for s in _swaps(model))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, reference(ids).logits) < 1e-5


def test_functional_call_substitutes_the_weights():
    """torch.func.functional_call's tensors replace the block's Parameters for the call: the block's own forward
    runs on them (the MoE holds the originals), as in the twin."""
    model, _ = tiny.build("olmoe")
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    scaled = {n: p.detach() * 1.5 for n, p in model.named_parameters()}
    with torch.no_grad():
        got = torch.func.functional_call(model, scaled, (IDS,)).logits
        want = torch.func.functional_call(twin, scaled, (IDS,)).logits
        assert torch.equal(got, want) and rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5


_NONE = (lambda: None).__code__  # co_names () for an __init__ inherited from C


class _CannotBuild(Exception):
    """A family's block that this generic build cannot make or call alone from its config."""


# The walk's experts classes whose block _family_block cannot build or call alone (transformers 5.25): each needs
# more than its config (a layer's position embeddings, a width the config leaves None) or no module builds it
_NOT_BUILT_ALONE = {
    "deepseek_v4:DeepseekV4Experts", "diffusion_gemma:DiffusionGemmaTextExperts", "dots1:Dots1Experts",
    "ergo:ErgoExpertProjections", "gemma4:Gemma4TextExperts", "qwen3_omni_moe:Qwen3OmniMoeTalkerTextExperts",
}
_BUILT = sorted(k for k in _FAMILIES if k not in _NOT_BUILT_ALONE)


def _family_block(fam, groups: int = 2, **fields):
    """A small MoE block of ``fam`` (the class of its modeling file that builds its experts class), random weights,
    and a hidden-states input, with ``groups`` expert groups where the config has them and the config ``fields``
    given; raises ``_CannotBuild`` where the block needs more than a config (a layer index, a width) can give."""
    import importlib
    import inspect

    from _hf_families import small_config

    module = importlib.import_module(fam.cls.__module__)
    owners = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__
              and issubclass(c, torch.nn.Module)
              and fam.cls.__name__ in getattr(c.__init__, "__code__", _NONE).co_names]  # its __init__ names the class
    if not owners:
        raise _CannotBuild(f"no class of {module.__name__} builds {fam.cls.__name__}")
    cfg = small_config(fam)
    for name, value in {"n_group": groups, "topk_group": 1, "num_expert_group": groups}.items():
        if isinstance(getattr(cfg, name, None), int):
            setattr(cfg, name, value)
    for name, value in fields.items():
        setattr(cfg, name, value)
    params = inspect.signature(owners[0].__init__).parameters
    kwargs = {k: v for k, v in {"layer_idx": 0, "intermediate_size": 16}.items() if k in params}
    g = torch.Generator().manual_seed(0)
    try:
        torch.manual_seed(0)
        block = owners[0](cfg, **kwargs).float().eval()
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
            for name, b in block.named_buffers():  # correction biases (a buffer in most families): not zero
                if name.endswith(("e_score_correction_bias", "expert_bias")):
                    b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        x = torch.randn(2, 5, cfg.hidden_size, generator=g)
        with torch.no_grad():
            want = block(x)
    except Exception as err:  # noqa: BLE001  (a block this generic build cannot make or call alone)
        raise _CannotBuild(f"{owners[0].__name__} alone: {type(err).__name__}: {str(err)[:80]}") from err
    return block, x, want


# The families whose block the swap takes (MoEConfig.from_hf_config reads their text config): 17 before session 33,
# 38 more in it (moekit/config_hf.py), Kolibri-1 / 1.1 and LongCat-Flash in session 34 (and Mistral-4's groups),
# Phi-MoE's sparsemixer (fam34b)
_SWAPPED = {
    "deepseek_v2", "deepseek_v3", "ernie4_5_moe", "glm4_moe", "gpt_oss", "granitemoe", "granitemoeshared",
    "hunyuan_v1_moe", "jamba", "kimi_linear", "minimax", "minimax_m2", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe",
    "qwen3_next",
    "afmoe", "aria", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_ocr2", "deepseek_v32", "dots3_note",
    "exaone_moe", "flex_olmo", "flint", "glm4_moe_lite", "glm4v_moe", "glm5_next", "glm_moe_dsa", "granitemoe_swa",
    "granitemoehybrid", "hy_v3", "hy_v4", "hy_v4_vl", "laguna", "lara_mini", "lfm2_moe", "mellum", "mimo_v2_flash",
    "minicpm5_moe", "minimax_m3_vl", "mistral4", "mistral_large4", "openai_privacy_filter", "qwen3_5_moe",
    "qwen3_omni_moe", "qwen3_vl_moe", "qwen4_exp", "solar_open", "step3p7", "unlimited_ocr",
    "kolibri1", "kolibri1_1", "longcat_flash",
    "phimoe",
}


@pytest.mark.parametrize("key", sorted(_NOT_BUILT_ALONE))
def test_the_blocks_left_out_of_the_walk_still_cannot_be_built_alone(key):
    """The families the walk's tests leave out fail to build alone, so a transformers release that makes one
    buildable fails here and it joins the walk (they are not skipped tests counted as passing)."""
    with pytest.raises(_CannotBuild):
        _family_block(_FAMILIES[key])


@pytest.mark.parametrize("key", _BUILT)
def test_every_family_is_swapped_or_left_with_its_reason(key):
    """Every experts class the walk finds (tests/_hf_families.py), as its MoE block: swapped and equal to its own
    forward (< 1e-5), or left untouched with moe_from_hf's reason; the swap never raises. The families of
    _SWAPPED are swapped (their correction biases random, not zero)."""
    block, x, want = _family_block(_FAMILIES[key])
    holder = torch.nn.ModuleDict({"mlp": block})
    report = moekit_hf.use_moekit_blocks(holder)
    family = _FAMILIES[key].family
    assert bool(report.swapped) == (family in _SWAPPED), report.left
    with torch.no_grad():
        got = block(x)
    first = (lambda o: o[0] if isinstance(o, tuple) else o)
    if report.swapped:
        assert rel_l2(first(got), first(want)) < 1e-5
    else:
        assert report.left and report.left[0].reason and torch.equal(first(got), first(want))


_OPTIONS = [("mistral4", {}), ("mistral_large4", {}), ("lfm2_moe", {"use_expert_bias": False}),
            ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False}),
            ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": True, "num_shared_experts": 1,
                             "shared_expert_combination_strategy": "sum"}),
            # session 34's router options switched on (the walk's default configs leave them off)
            ("laguna", {"moe_router_logit_softcapping": 1.0}),
            ("cohere2_moe", {"num_shared_experts": 1, "shared_expert_combination_strategy": "average"}),
            ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": True, "num_shared_experts": 2,
                             "shared_expert_combination_strategy": "average"}),
            ("axk2", {"n_group": 2, "topk_group": 1}), ("axk2", {"n_group": 3, "topk_group": 2}),
            ("longcat_flash", {"zero_expert_num": 3, "router_bias": True}),
            ("longcat_flash", {"zero_expert_num": 0}),
            # Phi-MoE's sparsemixer with several experts near each round's max (its 0.01 keeps mostly one)
            ("phimoe", {"router_jitter_noise": 0.5}), ("phimoe", {"router_jitter_noise": 0.0})]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family, fields", _OPTIONS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(_OPTIONS)])
def test_config_options_the_walk_does_not_set(family, fields):
    """Mistral-4 / Mistral-Large-4 as their configs ship them (one expert group), LFM2-MoE without its bias,
    Cohere2-MoE's sigmoid selection (renormalised or not) with a summed shared expert; Laguna's soft-cap,
    Cohere2-MoE's averaged shared expert, A.X-K2's groups, LongCat-Flash's identity experts (3 of them, with the
    router bias its router never adds; and none), Phi-MoE's sparsemixer at jitter 0.5 and 0: swapped and equal to
    their own forward, and so is moe_from_hf's layer with the shared expert in it (separate and fused)."""
    key = next(k for k, f in _FAMILIES.items() if f.family == family)
    block, x, want = _family_block(_FAMILIES[key], groups=1, **fields)
    with torch.no_grad():
        for fuse_shared in (False, True):
            assert rel_l2(_first(moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)(x)), _first(want)) < 1e-5
    holder = torch.nn.ModuleDict({"mlp": block})
    assert moekit_hf.use_moekit_blocks(holder).swapped
    with torch.no_grad():
        assert rel_l2(_first(block(x)), _first(want)) < 1e-5


def test_dropped_groups_filled_with_zero_win_over_negative_scores():
    """A.X-K2 with groups and a correction bias mostly below -0.5: its dropped groups' experts score 0 for the
    choice and take slots from the kept group (the block's own router shows it); moekit's swap chooses the same."""
    key = next(k for k, f in _FAMILIES.items() if f.family == "axk2")
    block, x, _ = _family_block(_FAMILIES[key], groups=3, topk_group=1)
    with torch.no_grad():
        block.gate.e_score_correction_bias.sub_(0.8)
        _, _, ids = block.gate(x.view(-1, x.shape[-1]))
        want = block(x)
    assert ((ids // 2).amin(dim=1) != (ids // 2).amax(dim=1)).any()  # a token's k experts span groups
    holder = torch.nn.ModuleDict({"mlp": block})
    assert moekit_hf.use_moekit_blocks(holder).swapped
    with torch.no_grad():
        assert rel_l2(_first(block(x)), _first(want)) < 1e-5


@pytest.mark.parametrize("key", [k for k in _BUILT if _FAMILIES[k].family in _SWAPPED])
def test_moe_from_hf_with_the_shared_expert_equals_the_block(key):
    """moe_from_hf itself (the shared expert copied into the MoE's own MLP, not the block's run): equal to the
    block's forward (< 1e-5) for every family the swap takes."""
    fam = _FAMILIES[key]
    block, x, want = _family_block(fam)
    with torch.no_grad():
        got = moekit_hf.moe_from_hf(block)(x)
    first = (lambda o: o[0] if isinstance(o, tuple) else o)
    assert rel_l2(first(got), first(want)) < 1e-5

"""The family walk of ``moekit.hf.use_moekit_blocks`` (transformers 5.25, fp32, random weights and correction
biases): every experts class tests/_hf_families.py finds, as its MoE block, swapped and equal to its own forward
(< 1e-5) or left with moe_from_hf's reason; the router options its default configs leave off; moe_from_hf with the
shared expert in the layer; A.X-K1's output norm kept the block's."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit.hf.blocks import block_output_norm  # noqa: E402

from _helpers import rel_l2  # noqa: E402
from _hf_families import walk  # noqa: E402
from _hf_fuzz_fills import NONE_FILLS  # noqa: E402

_FAMILIES = {f"{f.family}:{f.cls.__name__}": f for f in walk()}


_NONE = (lambda: None).__code__  # co_names () for an __init__ inherited from C


class _CannotBuild(Exception):
    """A family's block that this generic build cannot make or call alone from its config."""


# The walk's experts classes whose block _family_block cannot build or call alone (transformers 5.25), and why.
# (dots1 left this list in session 48: the fuzzer's fills give its n_shared_experts, None by default.)
_NOT_BUILT_ALONE = {
    "deepseek_v4:DeepseekV4Experts": "its hash layer's block needs the input ids (tests/test_hf_deepseek_v4.py)",
    "diffusion_gemma:DiffusionGemmaTextExperts": "its MoE is in the decoder layer (no block of its own), which needs "
                                                 "the model's position embeddings (the fuzzer runs the whole model)",
    "ergo:ErgoExpertProjections": "no class of its modeling file builds it",
    "gemma4:Gemma4TextExperts": "its MoE is in the decoder layer (no block of its own), which needs the model's "
                                "position embeddings (the fuzzer runs the whole model)",
    "qwen3_omni_moe:Qwen3OmniMoeTalkerTextExperts": "its MoE block reads a shared width its config class does not "
                                                    "declare (swapped whole: tests/test_hf_omni_talker.py)",
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
    for name, value in NONE_FILLS.items():  # the fuzzer's: None defaults a family's code needs, filled by name
        if getattr(cfg, name, 0) is None:
            setattr(cfg, name, value)
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
            for name, p in block.named_parameters():  # a router's learned scale (Inkling's): > 0 as trained
                if name.endswith("gate.global_scale"):
                    p.abs_().add_(0.5)
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
# Phi-MoE's sparsemixer, A.X-K1 (its output norm kept the block's) (fam34b)
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
    "phimoe", "axk1", "inkling", "ernie4_5_vl_moe",
    "dots1",  # built alone since session 48 (the fuzzer's fills)
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
            ("phimoe", {"router_jitter_noise": 0.5}), ("phimoe", {"router_jitter_noise": 0.0}),
            ("inkling", {"n_shared_experts": 1}), ("inkling", {"n_shared_experts": 3, "route_scale": 2.5})]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family, fields", _OPTIONS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(_OPTIONS)])
def test_config_options_the_walk_does_not_set(family, fields):
    """Mistral-4 / Mistral-Large-4 as their configs ship them (one expert group), LFM2-MoE without its bias,
    Cohere2-MoE's sigmoid selection (renormalised or not) with a summed shared expert; Laguna's soft-cap,
    Cohere2-MoE's averaged shared expert, A.X-K2's groups, LongCat-Flash's identity experts (3 of them, with the
    router bias its router never adds; and none), Phi-MoE's sparsemixer at jitter 0.5 and 0, Inkling's router-weighted
    shared experts (1 and 3, route_scale): swapped and equal to
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
    block's forward (< 1e-5; flattened) for every family the swap takes; a block that norms its output (A.X-K1) is
    refused naming the norm, and with output_norm="caller" the MoE, then the block's norm, equals it."""
    fam = _FAMILIES[key]
    block, x, want = _family_block(fam)
    norm = block_output_norm(block)
    with torch.no_grad():
        if norm is None:
            got = moekit_hf.moe_from_hf(block)(x)
        else:
            with pytest.raises(ValueError, match="applies .*RMSNorm to its output"):
                moekit_hf.moe_from_hf(block)
            got = norm(moekit_hf.moe_from_hf(block, output_norm="caller")(x))
    first = (lambda o: o[0] if isinstance(o, tuple) else o)
    assert rel_l2(first(got).flatten(), first(want).flatten()) < 1e-5  # ERNIE-4.5-VL's blocks return it flat


_CLAMPED = [k for k in _BUILT if _FAMILIES[k].family in ("hy_v4", "hy_v4_vl", "glm5_next")]


@pytest.mark.parametrize("key", _CLAMPED)
def test_a_shared_expert_beside_clamped_experts_equals_the_block(key):
    """HY-V4 (and its VL text block) clamp their experts' SwiGLU (limit 10) beside a plain act_fn(gate) * up shared
    MLP, GLM-5-Next clamps both: at x * 30, past the clamp, moe_from_hf's MoE (the shared MLP in the layer, its own
    activation) equals the block (< 1e-5; 0.94 rel-L2 off when the shared MLP ran the experts' clamp). Fusing the
    shared expert into routed slots, which run the experts' activation, is refused by name where the two differ;
    offload_experts (an OffloadedMoE from moe_from_hf's layer, 2 of the 6 experts cached) equals the block too."""
    block, x, _ = _family_block(_FAMILIES[key])
    x = x * 30
    with torch.no_grad():
        want = block(x)
    plain = _FAMILIES[key].family != "glm5_next"
    moe = moekit_hf.moe_from_hf(block)
    assert moe.config.shared_activation == ("silu" if plain else None)
    with torch.no_grad():
        assert rel_l2(moe(x).flatten(), want.flatten()) < 1e-5
        if plain:
            with pytest.raises(TypeError, match=r"fuse_shared=True: .* computes silu\(gate\) \* up and its experts"):
                moekit_hf.moe_from_hf(block, fuse_shared=True)
        else:
            assert rel_l2(moekit_hf.moe_from_hf(block, fuse_shared=True)(x).flatten(), want.flatten()) < 1e-5
    holder = torch.nn.Module()
    holder.mlp = block
    expert_bytes = (block.experts.gate_up_proj[0].numel() + block.experts.down_proj[0].numel()) * 4
    moekit_hf.offload_experts(holder, gpu_budget_bytes=2 * expert_bytes, device="cpu", backend="grouped_mm",
                              progress=False)
    assert isinstance(holder.mlp, moekit_hf.OffloadedBlock)
    assert holder.mlp.moe.config.shared_activation == moe.config.shared_activation
    with torch.no_grad():
        assert rel_l2(holder.mlp(x).flatten(), want.flatten()) < 1e-5


@pytest.mark.parametrize("fuse_shared", [False, True])
def test_axk1_keeps_its_output_norm_after_moekit(fuse_shared):
    """A.X-K1: the swapped block norms routed + shared (fused into the MoE or the block's own) with its own
    post_mlp_layernorm, a module of the block: a change to its weight is followed without a rebuild."""
    key = next(k for k, f in _FAMILIES.items() if f.family == "axk1")
    block, x, want = _family_block(_FAMILIES[key])
    holder = torch.nn.ModuleDict({"mlp": block})
    assert moekit_hf.use_moekit_blocks(holder, fuse_shared=fuse_shared).swapped
    with torch.no_grad():
        assert rel_l2(block(x), want) < 1e-5
        block.post_mlp_layernorm.weight.mul_(3.0)
        assert rel_l2(block(x), 3.0 * want) < 1e-5


@pytest.mark.parametrize("key", _CLAMPED)
def test_a_layer_built_from_the_config_alone_clamps_as_the_block(key):
    """MoEConfig.from_hf_config (what MoE(config), `moekit bench --config/--preset` build from) reads the experts'
    swiglu_limit and the shared MLP's own activation (HY-V4's plain silu, GLM-5-Next's clamped one) from the config:
    a MoE of that config alone, given the block's weights, equals the block at x * 30, past the clamp (< 1e-5). The
    same config read as config.json's dict, and a VL model's top-level config, give the same layer. With the
    activations of the plain hidden_act (the reading before session 46) it is > 0.1 off."""
    from moekit import MoE, MoEConfig

    block, x, _ = _family_block(_FAMILIES[key])
    x = x * 30
    with torch.no_grad():
        want = block(x)
    cfg = block.experts.config
    config = MoEConfig.from_hf_config(cfg)
    assert config == MoEConfig.from_hf_config(cfg.to_dict())
    top = {"model_type": "wrapper", "text_config": cfg.to_dict()}  # a VL / omni config.json's nesting
    assert config == MoEConfig.from_hf_config(top)
    weights = moekit_hf.moe_from_hf(block).state_dict()
    moe = MoE(config, backend="reference", fuse_shared=False).eval()
    moe.load_state_dict(weights)
    plain = MoE(config.replace(activation="silu", shared_activation=None), backend="reference", fuse_shared=False)
    plain.load_state_dict(weights)
    with torch.no_grad():
        assert rel_l2(moe(x).flatten(), want.flatten()) < 1e-5
        assert rel_l2(plain(x).flatten(), want.flatten()) > 0.1

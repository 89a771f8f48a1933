"""MoEConfig.from_hf_config on the model types session 33 taught it: transformers' own config classes (their
defaults) read into the fields their routers use, the router options of session 34 read where a config switches
them on, and the refused families naming their reason. The block-level check (each family's block
swapped and equal to its own forward) is tests/test_hf_swap_walk.py."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from moekit.config import MoEConfig  # noqa: E402
from moekit.config_hf import HF_READERS, REFUSED  # noqa: E402


def _read(model_type: str, **changes) -> tuple[MoEConfig, object]:
    cfg = transformers.AutoConfig.for_model(model_type, **changes)
    return MoEConfig.from_hf_config(cfg), cfg


def _sparse(cfg) -> int:
    return sum(1 for t in cfg.mlp_layer_types if t == "sparse")


def test_every_reader_reads_its_own_config_class():
    """Each model type transformers registers reads from its default config: a layer of the config's own hidden
    size, with at least one expert per token (DeepSeek-V2's and DeepSeek-OCR-2's default leaves num_experts_per_tok
    None: given 6, as their checkpoints do; dots1's its expert counts too: 64 routed, 2 shared)."""
    known = set(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
    for model_type in sorted(set(HF_READERS) & known):
        default = transformers.AutoConfig.for_model(model_type)
        unset = {n: v for n, v in {"num_experts_per_tok": 6, "n_routed_experts": 64, "n_shared_experts": 2}.items()
                 if hasattr(default, n) and getattr(default, n) is None}
        config, cfg = _read(model_type, **unset)
        assert config.hidden_size == cfg.hidden_size and 1 <= config.top_k <= config.num_experts, model_type


def test_deepseek_v3_router_families():
    """Dots-3's shared experts have their own width; Bailing-Hybrid spells Kimi-Linear's fields; EXAONE-MoE counts
    its shared experts as num_shared_experts; MiMo-V2-Flash has none; layers from mlp_layer_types."""
    dots, cfg = _read("dots3_note_text")
    assert (dots.scoring, dots.use_correction_bias, dots.renormalize) == ("sigmoid", True, cfg.norm_topk_prob)
    assert dots.shared_expert_intermediate_size == cfg.shared_experts_intermediate_size * cfg.n_shared_experts
    assert dots.num_moe_layers == _sparse(cfg) and dots.num_experts == cfg.n_routed_experts
    ling, cfg = _read("bailing_hybrid")
    assert (ling.num_experts, ling.top_k, ling.n_group, ling.topk_group) == (
        cfg.num_experts, cfg.num_experts_per_token, cfg.num_expert_group, cfg.topk_group)
    assert ling.routed_scaling_factor == cfg.routed_scaling_factor and ling.num_moe_layers == _sparse(cfg)
    exaone, cfg = _read("exaone_moe")
    assert exaone.shared_expert_intermediate_size == cfg.moe_intermediate_size * cfg.num_shared_experts
    assert _read("mimo_v2_flash")[0].shared_expert_intermediate_size == 0


def test_sigmoid_topk_families_scale_and_share():
    """Step-3.5/3.7, Laguna, HY-V3, AFMoE: sigmoid with a correction bias, renormalised, each family's own
    scaling field; LFM2-MoE without use_expert_bias has no bias; Flint none at all."""
    step, cfg = _read("step3p5", moe_router_scaling_factor=2.5)
    assert (step.scoring, step.use_correction_bias, step.renormalize, step.routed_scaling_factor) == (
        "sigmoid", True, True, 2.5)
    assert step.shared_expert_intermediate_size == cfg.share_expert_dim and step.num_moe_layers == _sparse(cfg)
    assert _read("laguna", moe_routed_scaling_factor=1.5)[0].routed_scaling_factor == 1.5
    assert _read("hy_v3")[0].routed_scaling_factor == pytest.approx(2.826)
    afmoe, cfg = _read("afmoe", route_scale=2.0)
    assert afmoe.routed_scaling_factor == 2.0 and afmoe.num_moe_layers == cfg.num_hidden_layers - cfg.num_dense_layers
    lfm, _ = _read("lfm2_moe", use_expert_bias=False, norm_topk_prob=False)
    assert not lfm.use_correction_bias and not lfm.renormalize
    flint, cfg = _read("flint")
    assert not flint.use_correction_bias and flint.num_moe_layers == cfg.num_hidden_layers - len(cfg.mlp_only_layers)


def test_softmax_families():
    """Qwen3-VL-MoE and Qwen3.5-MoE always renormalise (no switch in their routers); Aria's experts and shared
    experts are intermediate_size wide; Cohere2-MoE's sigmoid selection renormalises only with norm_topk_prob;
    Mistral-Large-4 always renormalises; the privacy filter has gpt-oss's router bias and clamped SwiGLU (halves)."""
    assert _read("qwen3_vl_moe_text", norm_topk_prob=False)[0].renormalize
    qwen35 = _read("qwen3_5_moe_text", norm_topk_prob=False)[0]
    assert qwen35.renormalize and qwen35.shared_expert_gate
    aria, cfg = _read("aria_text")
    assert aria.moe_intermediate_size == cfg.intermediate_size and aria.top_k == cfg.moe_topk
    assert aria.shared_expert_intermediate_size == cfg.intermediate_size * cfg.moe_num_shared_experts
    cohere = _read("cohere2_moe", expert_selection_fn="sigmoid", norm_topk_prob=False)[0]
    assert (cohere.scoring, cohere.renormalize) == ("sigmoid", False)
    assert _read("mistral_large4_text")[0].renormalize
    privacy = _read("openai_privacy_filter")[0]
    assert privacy.router_bias and privacy.expert_bias and not privacy.activation.interleaved
    assert privacy.activation.up_shift == 1.0


@pytest.mark.parametrize("model_type, changes, options", [
    ("cohere2_moe", {"num_shared_experts": 1, "shared_expert_combination_strategy": "average"},
     {"shared_expert_combine": "average"}),
    ("cohere2_moe", {"num_shared_experts": 0, "shared_expert_combination_strategy": "average"}, {}),
    ("laguna", {"moe_router_logit_softcapping": 30.0}, {"router_logit_softcap": 30.0}),
    ("laguna", {"moe_router_logit_softcapping": 0.0}, {}),
    ("axk2", {"n_group": 4, "topk_group": 2}, {"group_score": "top2_sum", "dropped_group_fill": "zero"}),
    ("axk2", {}, {}),
    ("mistral4", {"n_group": 4, "topk_group": 2}, {"group_score": "top2_sum", "dropped_group_fill": "zero"}),
    ("mistral4", {}, {}),
    ("kolibri1", {}, {"correction_bias_on": "logits"}),
    ("kolibri1_1", {}, {"correction_bias_on": "logits"}),
])
def test_the_router_options_of_session_34_are_read(model_type, changes, options):
    """The options that were refused until session 34 are read into MoEConfig's fields (only where the family's
    config switches them on: every other config keeps the defaults, and with them the fused routers)."""
    config, cfg = _read(model_type, **changes)
    assert config.changed_router_options() == options
    if model_type == "mistral4" and changes:
        assert (config.n_group, config.topk_group, config.scoring) == (4, 2, "softmax")


def test_kolibri_reads_its_router_and_shared_expert():
    """Kolibri-1 / 1.1: sigmoid, the correction bias on the logits, renormalised with norm_topk_prob, an ungated
    shared expert; Kolibri-1.1's mlp_only_layers are dense."""
    one, cfg = _read("kolibri1", norm_topk_prob=True)
    assert (one.scoring, one.use_correction_bias, one.renormalize, one.shared_expert_gate) == (
        "sigmoid", True, True, False)
    assert one.shared_expert_intermediate_size == cfg.shared_expert_intermediate_size
    assert one.num_moe_layers == cfg.num_hidden_layers and one.num_experts == cfg.num_experts
    later, cfg = _read("kolibri1_1")
    assert not later.renormalize and later.num_moe_layers == cfg.num_hidden_layers - len(cfg.mlp_only_layers)


def test_an_unknown_cohere2_strategy_is_refused_naming_it():
    with pytest.raises(ValueError, match="shared_expert_combination_strategy='median'"):
        MoEConfig.from_hf_config({"model_type": "cohere2_moe", "hidden_size": 32, "intermediate_size": 16,
                                  "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
                                  "shared_expert_combination_strategy": "median"})


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_families_say_why(model_type):
    with pytest.raises(ValueError, match=f"cfg.model_type '{model_type}': .{{40}}"):
        MoEConfig.from_hf_config({"model_type": model_type, "hidden_size": 32})


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "glm4v_moe", "qwen3_5_moe", "qwen3_omni_moe"])
def test_a_vl_models_top_level_config_reads_its_text_config(model_type):
    """Qwen3-Omni's MoE text model is its thinker's (thinker_config.text_config), which get_text_config() returns."""
    cfg = transformers.AutoConfig.for_model(model_type)
    text = MoEConfig.from_hf_config(cfg.get_text_config())
    assert MoEConfig.from_hf_config(cfg) == MoEConfig.from_hf_config(cfg.to_dict()) == text


def test_the_families_of_fam34b():
    """Phi-MoE: two experts whatever num_experts_per_tok (its router's two rounds), its jitter as the sparsemixer's
    eps, not renormalised; Inkling: sigmoid + bias, the router-weighted shared experts and route_scale, float32
    routing, refused without a shared expert (its router reads the last n_shared_experts logits); A.X-K1: DeepSeek-V3's
    router (its output norm is the block's); ERNIE-4.5-VL's top-level config reads its text experts' width."""
    phi, _ = _read("phimoe", num_experts_per_tok=3, router_jitter_noise=0.05)
    assert (phi.top_k, phi.sparsemixer_jitter_eps, phi.renormalize, phi.scoring) == (2, 0.05, False, "softmax")
    ink, cfg = _read("inkling_text")
    assert (ink.scoring, ink.use_correction_bias, ink.renormalize, ink.shared_expert_combine) == (
        "sigmoid", True, True, "router")
    assert ink.num_shared_slots == cfg.n_shared_experts and ink.router_width == cfg.n_routed_experts + 2
    assert ink.routed_scaling_factor == cfg.route_scale and ink.router_dtype == "float32"
    with pytest.raises(ValueError, match="n_shared_experts=0"):
        _read("inkling_text", n_shared_experts=0)
    axk1, cfg = _read("axk1")
    assert (axk1.n_group, axk1.topk_group, axk1.use_correction_bias, axk1.group_score) == (
        cfg.n_group, cfg.topk_group, True, "auto")
    assert axk1.shared_expert_intermediate_size == cfg.n_shared_experts * cfg.moe_intermediate_size
    vl, cfg = _read("ernie4_5_vl_moe")
    assert vl.moe_intermediate_size == cfg.text_config.moe_intermediate_size[0] and vl.router_dtype == "float32"


@pytest.mark.parametrize("model_type, changes", [
    ("deepseek_v3", dict(first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         moe_intermediate_size=8, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=4)),
    ("deepseek_v2", dict(first_k_dense_replace=1, moe_layer_freq=2, n_routed_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=4,
                         qk_nope_head_dim=4, v_head_dim=4)),  # transformers reads first_k_dense_replace alone
    ("qwen2_moe", dict(mlp_only_layers=[1], decoder_sparse_step=1, num_experts=4, moe_intermediate_size=8,
                       shared_expert_intermediate_size=8)),
    ("qwen3_moe", dict(decoder_sparse_step=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)),
    # Jamba: a MoE block where i % expert_layer_period == expert_layer_offset (read as every layer before session 49)
    ("jamba", dict(expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                   attn_layer_period=2, attn_layer_offset=0, mamba_d_state=4, mamba_dt_rank=4,
                   use_mamba_kernels=False)),
    # ERNIE-4.5-MoE: layers start..end (inclusive) where (i + 1) % interval == 0 (read as no count until session 49)
    ("ernie4_5_moe", dict(moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1, moe_num_experts=4,
                          moe_k=2, moe_intermediate_size=8)),
])
def test_layer_of_a_dense_decoder_layer_is_refused(model_type, changes):
    """``from_hf_config(cfg, layer=i)`` reads layer i where transformers' model built from cfg has a MoE block there
    (a module with ``experts``: the reference), and refuses, naming the layer and the fields, where it has a dense
    MLP (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers / decoder_sparse_step, Jamba's expert_layer_period /
    offset, ERNIE's moe_layer_start_index / end_index / interval). DeepSeek-V2's moe_layer_freq,
    which transformers' modeling does not read, counts for nothing, as there."""
    cfg = transformers.AutoConfig.for_model(model_type, hidden_size=16, intermediate_size=16, num_hidden_layers=4,
                                            num_attention_heads=2, num_key_value_heads=1, vocab_size=32, **changes)
    model = transformers.AutoModel.from_config(cfg)
    moe = [hasattr(getattr(layer, "mlp", None) or layer.feed_forward, "experts") for layer in model.layers]
    assert any(moe) and not all(moe), moe  # both kinds present: the test can fail either way
    assert MoEConfig.from_hf_config(cfg).num_moe_layers == sum(moe)
    for i, is_moe in enumerate(moe):
        if is_moe:
            assert MoEConfig.from_hf_config(cfg, layer=i).num_experts == 4
        else:
            with pytest.raises(ValueError, match=rf"layer {i} is a dense MLP layer \(cfg\.\w+"):
                MoEConfig.from_hf_config(cfg, layer=i)


def _walk_model_types() -> list[str]:
    from _hf_families import walk

    names = transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES
    return sorted({fam.family for fam in walk()} & set(names))


@pytest.mark.parametrize("model_type", _walk_model_types())
def test_every_moe_family_transformers_ships_is_read_or_refused_saying_why(model_type):
    """Each family whose experts the installed transformers wraps (the walk), from its top-level default config (what
    a checkpoint's config.json says): ``from_hf_config`` reads it, or refuses it saying why (REFUSED's reason, a
    missing field, a dense layer), never with the list of the model types it knows as if it were not a MoE model.
    Before session 49 Gemma-4, DiffusionGemma, Nemotron-H, Ergo, Inkling-2 (and its loop), Muse-Spark and Qwen3-Omni's
    top-level config (its MoE text model under thinker_config) met that list."""
    cfg = transformers.AutoConfig.for_model(model_type)
    try:
        MoEConfig.from_hf_config(cfg, layer="typical")
    except (ValueError, KeyError) as err:
        assert "must be one of" not in str(err), str(err)[:200]


@pytest.mark.parametrize("as_path", [str, lambda p: p])
def test_a_config_json_s_path_is_refused_saying_how_to_read_it(tmp_path, as_path):
    """A user with a downloaded config.json passes its path (``moekit analyze --config`` takes one): the error says how
    to read it, and what it says reads the same layer as transformers' config object."""
    import json

    hf = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    hf.to_json_file(tmp_path / "config.json")
    said = r"got (str|PosixPath) \(a path\?\): .*from_hf_config\(json.load\(open\(path\)\)\)"
    with pytest.raises(TypeError, match=said):
        MoEConfig.from_hf_config(as_path(tmp_path / "config.json"))
    with open(tmp_path / "config.json") as f:
        assert MoEConfig.from_hf_config(json.load(f)) == MoEConfig.from_hf_config(hf)


@pytest.mark.parametrize("dense", [3, 5])
def test_a_deepseek_v3_config_with_no_moe_layer_is_refused_naming_first_k_dense_replace(dense):
    """``first_k_dense_replace >= num_hidden_layers`` (transformers' DeepseekV3Config: every decoder layer dense) is
    refused naming the field the user set and the layer count, not MoEConfig's ``num_moe_layers=0``; one MoE layer
    fewer than the count still reads (num_moe_layers 1)."""
    fields = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1)
    with pytest.raises(ValueError, match=rf"cfg.first_k_dense_replace={dense}, num_hidden_layers=3: no decoder "
                                         r"layer holds a MoE block") as err:
        MoEConfig.from_hf_config(transformers.DeepseekV3Config(first_k_dense_replace=dense, **fields))
    assert "num_moe_layers" not in str(err.value)
    cfg = transformers.DeepseekV3Config(first_k_dense_replace=2, **fields)
    assert MoEConfig.from_hf_config(cfg).num_moe_layers == 1

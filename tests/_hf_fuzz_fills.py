"""The hf fuzzer's tiny-config rules beyond the size cut of ``_hf_fuzz_models.tiny_config``: None defaults a family's
code needs (filled by the field's name: the field means the same in every family that has it), per-layer lists a
family leaves None, M-RoPE sections over a tiny rotary half, mamba groups within the cut heads, MLA's rope head, and
the few fields one family needs (``FAMILY_FIELDS``, each with its reason; those fields are not drawn).

A list value is the layer kinds, each kept once and cycled over the L layers (``kinds_over``).
"""

from __future__ import annotations

# A None default filled by name: the family's model reads the field without a default of its own.
NONE_FILLS = {
    "n_shared_experts": 1,  # dots1: its MoE builds the shared MLP at moe_intermediate_size * n_shared_experts
    "mlp_layer_types": ["sparse"],  # deepseek_ocr2: its layers read one kind each, the config derives none
    "top_k_experts": 2,  # gemma4, diffusion_gemma: no MoE by default (num_experts None too: SMALL fills it)
    # qwen4_exp: the indexed-attention layers' indexer (QSA) reads all five; kv heads 1 and budget a multiple of
    # the compress ratio are its config's own rules
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}

SWITCHES = ("enable_moe_block",)  # gemma4, diffusion_gemma: off by default, set on (the fuzzer wants the MoE)

# M-RoPE families whose model defaults the sections at full size (glm4v_moe [8, 12, 12], ernie4_5_vl_moe [22, 22,
# 20]) when the config has none: the tiny config gets them over its rotary half. (Qwen3-VL's and the others' models
# run text positions with their defaults at the tiny head.)
MROPE_DEFAULTED = ("glm4v_moe", "ernie4_5_vl_moe")

# family (or "family:ExpertsClass") -> (fields it needs at the tiny sizes, why); the drawn fields never change them
FAMILY_FIELDS = {
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"]},
                 "layer_types is None by default (the hub configs list it) and its layers read one kind each"),
    "granitemoehybrid": ({"layer_types": ["linear_attention", "full_attention"]},
                         "the default is all mamba layers; its mask code needs an attention layer"),
    "step3p7": ({"sliding_window": 4}, "its sliding layers' mask needs a window the default leaves None (mixtral's "
                "None means no window: not a rule by name)"),
    "zaya": ({"num_experts_per_tok": 1}, "its config accepts k = 1 only"),
    "kolibri1_1": ({"head_dim": 16, "index_num_heads": 2}, "its NVFP4 rounding of keys and values wants a head_dim "
                   "multiple of 16; its indexer at most the query heads of a key head (4 / 2)"),
}


# experts classes whose model cannot run the fuzzer's checks at any size, with why (``family_of`` skips them unbuilt)
UNFUZZABLE = {
    "qwen3_omni_moe:Qwen3OmniMoeTalkerTextExperts": (
        "the talker's model has no token embedding (its codec_embedding is the caller's: it runs on the thinker's "
        "hidden states as inputs_embeds) and its MoE block reads a shared width its config class does not declare; "
        "its experts class is tested at the experts level (test_hf_families.py), its whole model swapped by "
        "test_hf_omni_talker.py"),
}


def kinds_over(kinds: list, layers: int) -> list:
    """``kinds`` cycled over ``layers`` layers."""
    return [kinds[i % len(kinds)] for i in range(layers)]


def family_fields(key: str) -> dict:
    """The fixed fields of the family of ``key`` ("family:ExpertsClass")."""
    found = FAMILY_FIELDS.get(key) or FAMILY_FIELDS.get(key.split(":")[0])
    return dict(found[0]) if found else {}


def fills(default, kw: dict, key: str) -> dict:
    """The fields the rules above set on top of the size cut ``kw`` (L = kw["num_hidden_layers"])."""
    layers = kw["num_hidden_layers"]
    out = {n: v for n, v in NONE_FILLS.items() if hasattr(default, n) and getattr(default, n) is None}
    out |= {n: True for n in SWITCHES if getattr(default, n, None) is False}
    out |= family_fields(key)
    out = {n: kinds_over(v, layers) if isinstance(v, list) else v for n, v in out.items()}
    heads = kw.get("mamba_num_heads", kw.get("mamba_n_heads"))
    for name in ("n_groups", "mamba_n_groups"):  # mamba's B / C groups must divide its (cut) heads
        if heads and type(getattr(default, name, None)) is int and heads % getattr(default, name):
            out[name] = 1
    if getattr(default, "kv_lora_rank", None) and getattr(default, "head_dim", None) == getattr(
            default, "qk_rope_head_dim", -1):  # longcat_flash: its rotary embedding reads head_dim as the rope head
        out["head_dim"] = kw.get("qk_rope_head_dim", default.qk_rope_head_dim)
    rope = getattr(default, "rope_parameters", None)
    if (isinstance(rope, dict) and rope.get("mrope_section")) or key.split(":")[0] in MROPE_DEFAULTED:
        out["rope_parameters"] = _mrope(default, {**kw, **out})
    return out


def _mrope(default, kw: dict) -> dict:
    """rope_parameters with M-RoPE sections over the tiny rotary half, each at least 1 (the last takes the
    rounding, 0 where the half is 2: glm4v_moe's)."""
    rope = dict(kw.get("rope_parameters") or default.rope_parameters or {})
    head = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    half = int(head * rope.get("partial_rotary_factor", 1.0)) // 2
    sections = rope.get("mrope_section") or [1, 1, 1]
    scaled = [max(1, s * half // sum(sections)) for s in sections[:-1]]
    return {**rope, "mrope_section": scaled + [half - sum(scaled)]}

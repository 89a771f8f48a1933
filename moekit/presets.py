"""Published model configurations, as the fields of their ``config.json``.

A preset is the model's own config (the subset of fields moekit reads), so the same dict feeds
``MoEConfig.from_hf_config`` (one MoE layer) and ``moekit.analysis`` (whole-model bills). Values are
copied from each model card's ``config.json``.
"""

from __future__ import annotations

import copy

_PRESETS: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V3: 671B total, 37B activated; 61 layers, the first 3 dense.
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-30B-A3B: 30.5B total, 3.3B activated; every layer sparse, no shared expert.
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x7B-v0.1: 46.7B total, 12.9B activated.
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen1.5-MoE-A2.7B (model_type qwen2_moe): a gated shared expert 4x the routed width.
    "qwen1.5-moe-a2.7b": {
        "model_type": "qwen2_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    # deepseek-ai/DeepSeek-V2-Lite: softmax routing, two shared experts, no groups.
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
}


def preset_names() -> list[str]:
    """The names ``MoEConfig.preset`` and ``hf_config_of_preset`` accept."""
    return sorted(_PRESETS)


def hf_config_of_preset(name: str) -> dict:
    """A copy of the preset's ``config.json`` fields; raises ``KeyError`` naming the valid presets."""
    if name not in _PRESETS:
        raise KeyError(f"preset must be one of {preset_names()}, got {name!r}")
    return copy.deepcopy(_PRESETS[name])

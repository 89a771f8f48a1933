"""Tiny whole models of the families the issue names (random weights, built offline from configs), and
the index of each one's first MoE layer; for the logits and ``moe_from_hf`` parity tests."""

from __future__ import annotations

import types

import torch
import transformers

COMMON = dict(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def gpt_oss():
    cfg = transformers.GptOssConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
                                    num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention",
                                                                                       "full_attention"])
    return transformers.GptOssForCausalLM(cfg), 0


def glm4_moe():
    cfg = transformers.Glm4MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                                     first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
                                     topk_group=1, n_shared_experts=1, routed_scaling_factor=1.5)
    return transformers.Glm4MoeForCausalLM(cfg), 1


def qwen3_next():
    cfg = transformers.Qwen3NextConfig(
        **COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_experts=8,
        num_experts_per_tok=3, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    return transformers.Qwen3NextForCausalLM(cfg), 0


def olmoe():
    cfg = transformers.OlmoeConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_experts=8,
                                   num_experts_per_tok=3)
    return transformers.OlmoeForCausalLM(cfg), 0


def granitemoe():
    cfg = transformers.GraniteMoeConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
                                        num_experts_per_tok=2)
    return transformers.GraniteMoeForCausalLM(cfg), 0


def phimoe():
    cfg = transformers.PhimoeConfig(**COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
                                    num_experts_per_tok=2)
    return transformers.PhimoeForCausalLM(cfg), 0


MODELS = {"gpt_oss": gpt_oss, "glm4_moe": glm4_moe, "qwen3_next": qwen3_next, "olmoe": olmoe,
          "granitemoe": granitemoe, "phimoe": phimoe}


def build(name: str, seed: int = 0):
    """(model in eval mode, index of a MoE layer); biases and correction biases random and non-zero."""
    torch.manual_seed(seed)
    model, layer = MODELS[name]()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("_bias", "router.bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for buf_name, b in model.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model.eval(), layer


# family -> (config class, block class name, block kwargs): MoE blocks built alone, for the routers of
# the families with no tiny whole model above.
BLOCKS = {
    "jamba": ("JambaConfig", "JambaSparseMoeBlock", {}),
    "minimax": ("MiniMaxConfig", "MiniMaxSparseMoeBlock", {}),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2SparseMoeBlock", {}),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeSparseMoeBlock", {}),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1Moe", {"layer_idx": 0}),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearMoE", {}),
}


def build_block(family: str, seed: int = 0) -> torch.nn.Module:
    """A small MoE block of ``family`` (hidden 32, 8 experts of width 16, top-3) with random weights and a
    random non-zero correction bias where it has one."""
    import importlib

    config_name, block_name, kwargs = BLOCKS[family]
    cfg = getattr(transformers, config_name)()
    small = dict(hidden_size=32, intermediate_size=16, moe_intermediate_size=16, num_experts=8, num_local_experts=8,
                 moe_num_experts=8, num_experts_per_tok=3, moe_k=3, moe_topk=3, moe_num_shared_experts=1,
                 n_group=2, num_expert_group=2, topk_group=1)
    for name, value in small.items():
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    torch.manual_seed(seed)
    block = getattr(module, block_name)(cfg, **kwargs).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            scale = 0.1 if "correction_bias" in name else t.shape[-1] ** -0.5
            t.copy_(torch.randn(t.shape, generator=g) * scale)
    return block


def qwen3_moe_small():
    """Qwen3-MoE, 3 layers of 8 experts (top-2) at hidden 32, seeded, in eval mode: the offload tests' model and
    the docs' examples' ``model``."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def fp8_qwen3_moe():
    """A 2-layer Qwen3-MoE whose experts transformers swapped for its FP8Experts, filled by transformers'
    own fp8 quantizer (it quantizes block-divisible shapes only: K, N multiples of 128); attention stays
    float (transformers' fp8 linear needs its GPU kernels)."""
    from transformers.integrations import finegrained_fp8 as fp8

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    originals = [{n: p.detach().clone() for n, p in layer.mlp.experts.named_parameters()}
                 for layer in model.model.layers]
    qc = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    fp8.replace_with_fp8_linear(model, modules_to_not_convert=["lm_head", "q_proj", "k_proj", "v_proj", "o_proj"],
                                quantization_config=qc)
    quantizer = fp8.Fp8Quantize(types.SimpleNamespace(quantization_config=qc))
    for layer, original in zip(model.model.layers, originals):
        experts = layer.mlp.experts.to_empty(device="cpu")
        for name in ("gate_up_proj", "down_proj"):
            for key, value in quantizer.convert({name: original[name]}).items():
                getattr(experts, key).data.copy_(value)
    return model

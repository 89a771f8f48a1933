"""The MoE families transformers 5.25 ships as a config class over another family's model: Sarvam-MoE and Param-2-MoE
(``sarvam_moe``, ``param2moe``: ``Glm4MoeForCausalLM``) and Sarvam-MLA (``sarvam_mla``: ``DeepseekV3ForCausalLM``).
Their config.json names its own ``model_type``, which ``from_hf_config`` (and so ``moekit analyze`` / ``simulate``,
``moe_from_hf``, ``use_moekit_blocks``) refused as unknown until session 51. Each tiny model built offline with random
weights and correction biases, swapped whole and held to its own forward; its bill to the meta-device model's count."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit import MoEConfig  # noqa: E402
from moekit.analysis.bills import param_bill  # noqa: E402
from moekit.cli import main  # noqa: E402

from _helpers import rel_l2  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
             norm_topk_prob=True)
FAMILIES = {  # model type -> its config class and its own fields
    "sarvam_moe": ("SarvamMoEConfig", dict(head_dim=8)),
    "param2moe": ("Param2MoeConfig", dict(head_dim=8)),
    "sarvam_mla": ("SarvamMLAConfig", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4,
                                           qk_nope_head_dim=8, v_head_dim=8)),
}


def _config(model_type: str):
    name, own = FAMILIES[model_type]
    return getattr(transformers, name)(**(SIZES | own))


def _model(cfg) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1) + (p.dim() == 1))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_family_is_read_as_the_model_it_runs_as(model_type):
    """DeepSeek-V3's router (sigmoid, correction bias, groups, w / (sum + 1e-20), routed scaling), its shared expert,
    the dense first layer."""
    cfg = MoEConfig.from_hf_config(_config(model_type))
    assert (cfg.num_experts, cfg.top_k, cfg.scoring, cfg.use_correction_bias, cfg.n_group, cfg.topk_group) == (
        8, 2, "sigmoid", True, 2, 1)
    assert (cfg.routed_scaling_factor, cfg.shared_expert_intermediate_size, cfg.num_moe_layers) == (2.5, 16, 2)
    assert cfg.renormalize and cfg.renorm_eps == 1e-20


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_model_swapped_equals_its_own_forward(model_type):
    model = _model(_config(model_type))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        report = moekit_hf.use_moekit_blocks(model)
        got = model(ids).logits
    assert len(report.swapped) == 2 and not report.left, report.left
    assert rel_l2(got, expected) < 1e-5


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_bill_counts_the_model(model_type, tmp_path, capsys):
    """The bill's total against transformers' model on the meta device (its attention: GLM-4.5's with q / k norms,
    or DeepSeek-V3's MLA); ``moekit analyze --config`` of its config.json reads it."""
    cfg = _config(model_type)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert param_bill(cfg.to_dict()).total == sum(p.numel() for p in model.parameters())
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    assert main(["analyze", "--config", str(path), "--batches", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["num_experts"] == 8 and data["note"] is None

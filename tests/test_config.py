"""Presets carry the published shapes; from_hf_config reads config.json dicts and rejects what it can't."""

import pytest

from moekit import MoEConfig, hf_config_of_preset, preset_names
from moekit.config import HF_READERS


def test_presets_have_the_published_shapes():
    v3 = MoEConfig.preset("deepseek-v3")
    assert (v3.hidden_size, v3.moe_intermediate_size, v3.num_experts, v3.top_k) == (7168, 2048, 256, 8)
    assert (v3.n_group, v3.topk_group, v3.num_moe_layers, v3.routed_scaling_factor) == (8, 4, 58, 2.5)
    q3 = MoEConfig.preset("qwen3-30b-a3b")
    assert (q3.hidden_size, q3.moe_intermediate_size, q3.num_experts, q3.top_k,
            q3.num_moe_layers) == (2048, 768, 128, 8, 48)
    mx = MoEConfig.preset("mixtral-8x7b")
    assert (mx.hidden_size, mx.moe_intermediate_size, mx.num_experts, mx.top_k) == (4096, 14336, 8, 2)
    assert {"deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"} <= set(preset_names())


def test_preset_dicts_are_copies():
    d = hf_config_of_preset("mixtral-8x7b")
    d["hidden_size"] = 1
    assert hf_config_of_preset("mixtral-8x7b")["hidden_size"] == 4096


@pytest.mark.parametrize(("fields", "said"), [
    ({"model_type": "llama", "hidden_size": 64}, "names no routed experts (num_experts, num_local_experts, "
                                                 "n_routed_experts, ...): a dense model has no MoE layer"),
    ({"model_type": "qwen3moe", "num_experts": 8}, "did you mean 'qwen3_moe'"),
])
def test_an_unknown_model_type_is_told_in_one_short_line(fields, said):
    """Session 53: a dense model's config.json (``moekit analyze --config``) got the 70 model types read, one line of
    1,300 characters, and nothing on why."""
    with pytest.raises(ValueError) as caught:
        MoEConfig.from_hf_config(fields)
    message = str(caught.value)
    assert message.startswith(f"cfg.model_type must be one of the {len(HF_READERS)} MoE model types moekit reads ")
    assert f"got {fields['model_type']!r}" in message and said in message and len(message) < 400
    assert "docs/hf.md#coverage" in message and "moekit.config.HF_READERS" in message


def test_unknown_inputs_are_named():
    with pytest.raises(KeyError, match="preset must be one of"):
        MoEConfig.preset("gpt-5")
    with pytest.raises(ValueError, match="model_type must be one of"):
        MoEConfig.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        MoEConfig.from_hf_config({**hf_config_of_preset("mixtral-8x7b"), "hidden_act": "swiglu9"})
    with pytest.raises(ValueError, match="activation must be one of"):
        MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=4, top_k=2, activation="tanh")


def test_replace_names_a_misspelt_field():
    """``cfg.replace(hiden_size=256)`` said only "unexpected keyword argument"; now the closest field, and a
    replaced value is checked as the constructor checks it."""
    cfg = MoEConfig.preset("qwen3-30b-a3b")
    with pytest.raises(TypeError, match="MoEConfig has no field 'hiden_size' \\(did you mean 'hidden_size'\\?\\)"):
        cfg.replace(hiden_size=256)
    with pytest.raises(TypeError, match="no field 'zzz'; the fields: \\['hidden_size', "):
        cfg.replace(zzz=1)
    with pytest.raises(ValueError, match="top_k must be <= num_experts"):
        cfg.replace(top_k=cfg.num_experts + 1)
    assert cfg.replace(hidden_size=256).hidden_size == 256 and cfg.hidden_size == 2048


def test_missing_fields_are_named():
    from moekit.config import MissingConfigField

    mixtral = hf_config_of_preset("mixtral-8x7b")
    with pytest.raises(MissingConfigField, match="config has no 'hidden_size': a mixtral MoE layer needs it"):
        MoEConfig.from_hf_config({k: v for k, v in mixtral.items() if k != "hidden_size"})
    with pytest.raises(KeyError, match=r"no 'num_local_experts' \(or 'num_experts'\)"):  # still a KeyError
        MoEConfig.from_hf_config({k: v for k, v in mixtral.items() if k != "num_local_experts"})
    with pytest.raises(TypeError, match="got list"):
        MoEConfig.from_hf_config([mixtral])
    no_layers = MoEConfig.from_hf_config({k: v for k, v in mixtral.items() if k != "num_hidden_layers"})
    assert no_layers.num_moe_layers is None and no_layers.num_experts == 8

"""A bad value in a downloaded config.json is named by the key the file holds it under (and the value), with moekit's
field in parentheses, by ``MoEConfig.from_hf_config`` and by ``moekit analyze`` / ``simulate --config``: one case per
reader kind, each config.json written by transformers' own config class (``to_json_file``)."""

import json

import pytest

from moekit.analysis.billed import billed_layer
from moekit.config import MoEConfig

from _helpers import cli_error

transformers = pytest.importorskip("transformers")


def _file(tmp_path, config, **edits) -> str:
    """``config`` written by transformers (``to_json_file``), then ``edits`` made to the file as a user would."""
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    if edits:
        path.write_text(json.dumps({**json.loads(path.read_text()), **edits}))
    return str(path)


CASES = [  # (config class, its arguments, edits to the file, what the message must hold)
    ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=9), {},
     ["cfg.num_experts_per_tok=9 (moekit's top_k)", "=8 (moekit's num_experts)"]),
    ("DeepseekV3Config", dict(n_group=3), {}, ["cfg.n_routed_experts=256 (moekit's num_experts)", "cfg.n_group=3"]),
    ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=6), {},
     ["cfg.num_experts_per_tok=6 (moekit's top_k)", "cfg.num_local_experts=4 (moekit's num_experts)"]),
    ("GptOssConfig", {}, {"swiglu_limit": -3.0}, ["cfg.swiglu_limit=-3.0 (moekit's limit)"]),
    ("GptOssConfig", {}, {"swiglu_limit": "seven"}, ["reading cfg.swiglu_limit='seven'"]),  # float() inside the reader
    ("MixtralConfig", dict(intermediate_size=0), {}, ["cfg.intermediate_size=0 (moekit's moe_intermediate_size)"]),
    ("MixtralConfig", {}, {"num_experts_per_tok": "2"}, ["cfg.num_experts_per_tok='2' (moekit's top_k)"]),
    ("Ernie4_5_MoeConfig", dict(moe_norm_min=-1.0), {}, ["cfg.moe_norm_min=-1.0 (moekit's renorm_clamp)"]),
    ("DeepseekV3Config", {}, {"n_shared_experts": "2"},  # a string multiplied by the width: cut in the message
     ["cfg.n_shared_experts='2' (moekit's shared_expert_intermediate_size)", "..."]),
    ("Gemma4TextConfig", dict(enable_moe_block=True, num_experts=4, top_k_experts=6, moe_intermediate_size=32), {},
     ["cfg.top_k_experts=6 (moekit's top_k)", "cfg.num_experts=4"]),  # a refused family's bill reads it too
    ("DbrxConfig", dict(ffn_config=dict(moe_num_experts=4, moe_top_k=6)), {},  # a nested key, by its path
     ["cfg.ffn_config.moe_top_k=6 (moekit's top_k)", "cfg.ffn_config.moe_num_experts=4 (moekit's num_experts)"]),
]


@pytest.mark.parametrize("class_name, arguments, edits, said", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_bad_value_is_named_by_the_file_s_key(tmp_path, capsys, class_name, arguments, edits, said):
    path = _file(tmp_path, getattr(transformers, class_name)(**arguments), **edits)
    with open(path) as f:
        fields = json.load(f)
    read = billed_layer if class_name in ("Gemma4TextConfig", "DbrxConfig") else MoEConfig.from_hf_config
    with pytest.raises((TypeError, ValueError)) as err:
        read(fields)
    assert all(s in str(err.value) for s in said), str(err.value)
    assert len(str(err.value)) < 400
    for command in ("analyze", "simulate"):
        line = cli_error(capsys, [command, "--config", path])
        assert f"config.json at {path}: " in line and all(s in line for s in said), line


def test_a_message_that_names_the_file_s_key_already_is_kept():
    """The readers' own refusals (``cfg.model_type ...``) and a good config are left as they were."""
    fields = transformers.Cohere2MoeConfig(shared_expert_combination_strategy="mean", num_shared_experts=1).to_dict()
    with pytest.raises(ValueError, match=r"^cfg.model_type 'cohere2_moe' with shared_expert_combination_strategy="):
        MoEConfig.from_hf_config(fields)
    assert MoEConfig.from_hf_config(transformers.Qwen3MoeConfig().to_dict()).top_k == 8


def test_a_null_the_layer_needs_is_named_as_missing(tmp_path, capsys):
    """DeepSeek-V2's class default ``num_experts_per_tok=None`` (read by ``d[key]``, which takes a null as present):
    the key named as missing, not as a bad value of moekit's field (Dots-1's ``n_routed_experts=None``, read by
    ``get_field``, was named so already)."""
    key = "num_experts_per_tok"
    path = _file(tmp_path, transformers.DeepseekV2Config())
    with open(path) as f:
        fields = json.load(f)
    with pytest.raises(KeyError) as err:
        MoEConfig.from_hf_config(fields)
    assert str(err.value) == f"config has no {key!r} (it is null): a {fields['model_type']} MoE layer needs it"
    for command in ("analyze", "simulate"):
        line = cli_error(capsys, [command, "--config", path])
        assert f"config.json at {path} has no {key!r} (it is null)" in line and "must be a positive int" not in line

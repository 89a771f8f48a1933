"""``moekit analyze`` / ``simulate`` / ``serve`` bill the MoE families ``from_hf_config`` refuses (Gemma-4, Nemotron-H,
Ergo, ...), and those it does not read (DBRX, JetMoE: ``UNSERVED``), from their own numbers, with the refusal's reason
as a note: each part of the bill against transformers' own model built on the meta device, the byte model's B = 1
bytes against that model's experts, and the closed form of experts touched against a Monte Carlo of uniform routing."""

import collections
import json

import numpy as np
import pytest
import torch

from moekit.analysis import experts_touched, get_format, get_gpu
from moekit.analysis.billed import billed_layer
from moekit.analysis.bills import param_bill
from moekit.analysis.bills_hybrid import OWN_LAYERS
from moekit.analysis.roofline import batch_cost
from moekit.cli import main
from moekit.config import REFUSED, UNSERVED, MissingConfigField, MoEConfig

from _helpers import cli_error

transformers = pytest.importorskip("transformers")

TINY = {  # each family's config class with small shapes; the experts' fields as transformers names them
    "gemma4_text": dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64,
                        hidden_size=128, intermediate_size=256, num_hidden_layers=3, vocab_size=100,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, hidden_size_per_layer_input=16),
    "nemotron_h": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, hidden_size=128,
                       moe_shared_expert_intermediate_size=96, moe_latent_size=32, vocab_size=100,
                       layers_block_type=["linear_attention", "moe", "full_attention", "moe", "mlp"]),
    "ergo": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, hidden_size=128,
                 shared_intermediate_size=96, num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"],
                 first_dense_intermediate_size=200, vocab_size=100, num_attention_heads=2, num_key_value_heads=1),
    "dbrx": dict(d_model=64, n_layers=2, n_heads=4, vocab_size=50, attn_config=dict(kv_n_heads=2),
                 ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)),
    "jetmoe": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                   num_experts_per_tok=2, num_key_value_heads=2, kv_channels=16, vocab_size=50),
}
# the parameters of transformers' model by part: the first key a name (digits dropped) holds -> its part
PARTS = {"gemma4_text": {"experts.gate_up_proj": "routed", "experts.down_proj": "routed", "router.": "router",
                         "mlp.": "dense", "embed_tokens": "embedding"},
         "nemotron_h": {"shared_experts.": "shared", "experts.up_proj": "routed", "experts.down_proj": "routed",
                        "mixer.gate.": "router", "latent_proj": "shared"},
         "ergo": {"shared_experts.": "shared", "experts.up_proj": "routed", "experts.down_proj": "routed",
                  "mlp.gate.": "router", "post_expert_norm": "router", "layers.mlp.up_proj": "dense",
                  "layers.mlp.down_proj": "dense"},
         "dbrx": {"ffn.experts.": "routed", "ffn.router.": "router"},
         "jetmoe": {"layers.mlp.input_linear": "routed", "layers.mlp.output_linear": "routed",
                    "layers.mlp.router.": "router", "layers.mlp.bias": "router"}}


def _config(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**TINY[model_type])
    if model_type == "dbrx":  # transformers 5.25's DbrxAttentionConfig keeps no rope_theta its attention reads
        config.attn_config.rope_theta = 10000.0
    return config


def _meta_parts(config) -> collections.Counter:
    """transformers' model of ``config`` on the meta device: its parameters summed by ``PARTS``' parts."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    parts = collections.Counter()
    for name, p in model.named_parameters():
        name = ".".join(piece for piece in name.split(".") if not piece.isdigit())
        part = next((part for key, part in PARTS[config.model_type].items() if key in name), "other")
        parts[part] += p.numel()
    return parts


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_a_refused_family_is_billed_as_its_model_holds_its_experts(model_type):
    """Routed experts, shared experts (and latent projections) and router per MoE layer equal transformers' model's
    parameters by part; where a whole-model bill is made, its parts too (Gemma-4's dense MLP in every layer beside
    the experts, Ergo's ungated dense layer); the byte model's B = 1 bytes and FLOPs read k of that model's experts."""
    config = _config(model_type)
    parts, layer = _meta_parts(config), billed_layer(config.to_dict())
    cfg = layer.config
    hand = {"gemma4_text": (3, 8, 2, 3), "nemotron_h": (2, 8, 2, 2), "ergo": (2, 8, 2, 2), "dbrx": (3, 4, 2, 2),
            "jetmoe": (3, 4, 2, 2)}[model_type]  # m, E, k, L
    matrices, experts, top_k, moe_layers = hand
    assert (layer.expert_matrices, cfg.num_experts, cfg.top_k, cfg.num_moe_layers) == hand
    assert moe_layers * experts * layer.expert_params == parts["routed"]
    assert moe_layers * layer.shared_params == parts["shared"]
    assert moe_layers * layer.router_params == parts["router"]
    one_expert = parts["routed"] // (experts * moe_layers)  # weights of one expert in transformers' model
    fmt = get_format("bf16")
    cost = batch_cost(cfg, 1, fmt, get_gpu("h200"), matrices=layer.expert_matrices)
    assert cost.weight_bytes == top_k * one_expert * 2
    assert cost.flops == 2 * top_k * one_expert
    assert model_type in layer.note and (REFUSED.get(model_type) or UNSERVED[model_type]) in layer.note
    assert f"E={experts}, k={top_k}, d={cfg.hidden_size}, d_ff={cfg.moe_intermediate_size}" in layer.note
    assert cfg.hidden_size == {"nemotron_h": 32, "dbrx": 64, "jetmoe": 64}.get(model_type, 128)  # Nemotron-H: latent
    if model_type in OWN_LAYERS:  # their whole-model bills, part by part: tests/test_analysis_whole.py
        return
    bill = param_bill(config.to_dict())
    assert (bill.routed_experts, bill.shared_experts, bill.router, bill.dense_mlp) == (
        parts["routed"], parts["shared"], parts["router"], parts["dense"])
    if model_type == "gemma4_text":  # its per-layer input embeddings too (a lookup [V_pl, L·h_pl]): 96% of this one
        assert bill.embedding == parts["embedding"]
    assert bill.active_routed_experts == moe_layers * top_k * one_expert and not bill.exact


def test_experts_touched_closed_form_against_a_monte_carlo():
    """E·(1 - (1 - k/E)^B) against the mean distinct experts of B tokens each routed to k distinct experts drawn
    uniformly (4000 trials; within 4 standard errors)."""
    rng = np.random.default_rng(0)
    for experts, top_k, batch in ((8, 2, 3), (128, 8, 8), (64, 6, 64)):
        picks = rng.random((4000, batch, experts)).argsort(-1)[..., :top_k]  # [T, B, k] distinct a token
        touched = np.array([len(np.unique(p)) for p in picks])  # [T]
        stderr = touched.std() / np.sqrt(touched.size)
        assert abs(touched.mean() - experts_touched(batch, experts, top_k)) < 4 * stderr + 1e-9


def _write(tmp_path, model_type, **changes):
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({**_config(model_type).to_dict(), **changes}))
    return str(path)


def test_analyze_and_simulate_print_the_note_and_bill_the_numbers(tmp_path, capsys):
    path = _write(tmp_path, "gemma4_text")
    assert main(["analyze", "--config", path, "--json", "--batches", "1", "--dtype", "bf16", "--gpu", "h200"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["note"].startswith("moekit cannot serve this layer (gemma4_text): its router")
    assert data["rows"][0]["weight_bytes"] == 2 * 3 * 128 * 64 * 2  # k x 3·d·N x 2 bytes
    assert main(["analyze", "--config", path, "--batches", "1"]) == 0
    assert "note: moekit cannot serve this layer (gemma4_text)" in capsys.readouterr().out
    for flag in ("--measure", "--offload"):
        assert "moekit's own layer, which cannot serve" in cli_error(capsys, ["analyze", "--config", path, flag])
    assert main(["simulate", "--config", path, "--tokens", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["note"].startswith("moekit cannot serve this layer (gemma4_text)")
    assert (result["params"]["experts"], result["params"]["top_k"]) == (8, 2)


def test_the_served_page_says_the_note(tmp_path):
    from moekit.sim.server import make_server

    fields = _config("ergo").to_dict()
    server = make_server(port=0, model=billed_layer(fields).config, model_name="ergo-tiny", model_fields=fields)
    try:
        defaults = server.defaults()
    finally:
        server.server_close()
    assert defaults["note"].startswith("moekit cannot serve this layer (ergo)") and "ungated" in defaults["note"]


@pytest.mark.parametrize("model_type, changes, named", [
    ("gemma4_text", {"num_experts": None}, "'num_experts'"),
    ("gemma4_text", {"enable_moe_block": False}, "enable_moe_block=False"),
    ("ergo", {"shared_intermediate_size": None}, "'shared_intermediate_size'"),
])
def test_a_number_the_bill_needs_is_named_as_the_file_has_it(tmp_path, capsys, model_type, changes, named):
    fields = {**_config(model_type).to_dict(), **changes}
    with pytest.raises((MissingConfigField, ValueError), match=named):
        billed_layer(fields)
    assert named in cli_error(capsys, ["analyze", "--config", _write(tmp_path, model_type, **changes)])


def test_a_served_family_bills_as_from_hf_config_reads_it():
    from moekit.presets import hf_config_of_preset

    layer = billed_layer(hf_config_of_preset("qwen3-30b-a3b"))
    assert layer.config == MoEConfig.preset("qwen3-30b-a3b") and layer.note is None and layer.expert_matrices == 3

"""MoE families moekit serves neither way (``UNSERVED``: Switch-Transformers, NLLB-MoE, Doge, ViTPose's backbone) get
a one-line refusal saying why from ``from_hf_config`` and ``moekit analyze --config``, not the list of the families it
reads; those whose numbers are readable are billed, each part against transformers' own model built on the meta
device from its own config class."""

import collections
import json

import pytest
import torch

from moekit.analysis import get_format, get_gpu
from moekit.analysis.billed import billed_layer
from moekit.analysis.bills import param_bill
from moekit.analysis.roofline import batch_cost
from moekit.cli import main
from moekit.config import UNSERVED, MoEConfig

from _helpers import cli_error

transformers = pytest.importorskip("transformers")

TINY = {  # small shapes; uneven sparse layers so the rule that picks them is exercised
    "switch_transformers": dict(d_model=32, d_ff=48, num_layers=4, num_decoder_layers=3, num_sparse_encoder_layers=2,
                                num_sparse_decoder_layers=1, num_experts=4, vocab_size=50, num_heads=2, d_kv=16),
    "nllb-moe": dict(d_model=32, encoder_ffn_dim=48, decoder_ffn_dim=48, encoder_layers=4, decoder_layers=4,
                     encoder_sparse_step=2, decoder_sparse_step=4, num_experts=4, vocab_size=50,
                     encoder_attention_heads=2, decoder_attention_heads=2),
    "doge": dict(is_moe=True, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_experts=16,
                 num_experts_per_tok=4, vocab_size=50, num_attention_heads=2),
}
# a parameter's name (digits and expert_<i> dropped) -> its part; the first key it holds
PARTS = {"switch_transformers": {"mlp.experts.": "routed", "mlp.router.": "router"},
         "nllb-moe": {"ffn.experts.": "routed", "ffn.router.": "router"},
         "doge": {"mlp.down_embed": "routed", "mlp.up_embed": "routed", "mlp.router_gate": "router",
                  "mlp.gate_proj": "shared", "mlp.up_proj": "shared", "mlp.down_proj": "shared"}}
NEW = ("switch_transformers", "nllb-moe", "doge", "vitpose_backbone")  # DBRX, JetMoE: test_analysis_refused.py
# E, k, the decoder's MoE layers (a decode step's), d, N; and the encoder's MoE layers
HAND = {"switch_transformers": (4, 1, 1, 32, 48),  # decoder layer 1; encoder layers 1, 3
        "nllb-moe": (4, 2, 1, 32, 48),  # decoder layer 4 (every 4th); encoder layers 2, 4 (every 2nd)
        "doge": (16, 4, 2, 32, 1)}  # one-neuron experts, no encoder
ENCODER_MOE_LAYERS = {"switch_transformers": 2, "nllb-moe": 2}


def _config(model_type: str, **changes):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**{**TINY.get(model_type, {}), **changes})


def _meta_parts(config) -> collections.Counter:
    auto = transformers.AutoModelForCausalLM if config.model_type == "doge" else transformers.AutoModelForSeq2SeqLM
    with torch.device("meta"):
        model = auto.from_config(config)
    parts = collections.Counter()
    for name, p in model.named_parameters():
        name = ".".join(piece for piece in name.split(".") if not piece.isdigit() and not piece.startswith("expert_"))
        parts[next((part for key, part in PARTS[config.model_type].items() if key in name), "other")] += p.numel()
    return parts


@pytest.mark.parametrize("model_type", sorted(UNSERVED))
def test_from_hf_config_refuses_in_one_line_saying_why(model_type):
    """Each family's own config class (its defaults): the reason, not the list of the families moekit reads."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with pytest.raises(ValueError) as info:
        MoEConfig.from_hf_config(CONFIG_MAPPING[model_type]())
    message = str(info.value)
    assert message.startswith(f"cfg.model_type {model_type!r}: moekit does not serve ")
    assert "must be one of" not in message and "\n" not in message and len(message) < 600


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_a_readable_unserved_family_is_billed_as_its_model_holds_it(model_type):
    """Routed experts, router and (Doge) the dense MLP beside them equal transformers' model's parameters by part;
    the byte model's B = 1 bytes read k ungated experts' weights (NLLB's biases are not read by the GEMMs' bytes)."""
    config = _config(model_type)
    parts, layer = _meta_parts(config), billed_layer(config.to_dict())
    cfg = layer.config
    experts, top_k, moe_layers, hidden, width = HAND[model_type]
    assert (cfg.num_experts, cfg.top_k, cfg.num_moe_layers, cfg.hidden_size, cfg.moe_intermediate_size) == \
        HAND[model_type]
    assert layer.expert_matrices == 2  # ungated: up and down
    assert layer.encoder_moe_layers == ENCODER_MOE_LAYERS.get(model_type)
    moe_layers += layer.encoder_moe_layers or 0  # the model's, encoder and decoder
    assert moe_layers * experts * layer.expert_params == parts["routed"]
    assert moe_layers * layer.router_params == parts["router"]
    assert moe_layers * layer.shared_params == parts["shared"]
    assert UNSERVED[model_type] in layer.note
    cost = batch_cost(cfg, 1, get_format("bf16"), get_gpu("h200"), matrices=layer.expert_matrices)
    assert cost.weight_bytes == top_k * 2 * hidden * width * 2
    if model_type == "doge":  # a decoder-only model: the whole-model bill, its attention's extras uncounted
        bill = param_bill(config.to_dict())
        assert (bill.routed_experts, bill.shared_experts, bill.router) == (
            parts["routed"], parts["shared"], parts["router"])
        with torch.device("meta"):
            total = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        assert abs(bill.total / total - 1) < 0.02  # dt_proj, A and the residual scales: 1.4% at these tiny shapes
    else:  # the encoder-decoders' whole-model bills, part by part: tests/test_analysis_whole.py
        assert "a decode step runs the decoder only" in layer.note


def test_the_bill_says_what_it_cannot_read(tmp_path):
    with pytest.raises(ValueError, match=r"cfg.is_moe=False: this Doge has no MoE block"):
        billed_layer(_config("doge", is_moe=False).to_dict())
    with pytest.raises(ValueError, match=r"cfg.encoder_ffn_dim=48 and cfg.decoder_ffn_dim=64 differ"):
        billed_layer(_config("nllb-moe", decoder_ffn_dim=64).to_dict())


@pytest.mark.parametrize("model_type", NEW)
def test_analyze_config_bills_or_refuses_in_one_line(model_type, tmp_path, capsys):
    """The config.json the class writes: billed with the note where its numbers are readable, else one usage line."""
    path = tmp_path / "config.json"
    _config(model_type).to_json_file(str(path))
    if model_type in TINY:
        assert main(["analyze", "--config", str(path), "--json", "--batches", "1", "--dtype", "bf16",
                     "--gpu", "h200"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["note"].startswith(f"moekit cannot serve this layer ({model_type}): moekit does not serve ")
        _, top_k, _, hidden, width = HAND[model_type]
        assert data["rows"][0]["weight_bytes"] == top_k * 2 * hidden * width * 2
    else:
        line = cli_error(capsys, ["analyze", "--config", str(path)])
        assert f"cfg.model_type {model_type!r}: moekit does not serve" in line and "must be one of" not in line

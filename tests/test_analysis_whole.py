"""Whole-model bills of the families whose layers are their own (session 52): Nemotron-H (one mixer a layer), DBRX
(its own attention fields), JetMoE (a mixture of attention experts), and the encoder-decoders Switch-Transformers and
NLLB-MoE (encoder and decoder billed apart). Each part of ``param_bill`` against transformers' own model built on the
meta device, from a tiny config and from the published checkpoint's, its parameters summed by part from
``named_parameters()``; the bytes a decode step's token reads against a count by hand; ``analyze`` / ``simulate
--config`` saying what they bill."""

import collections
import json

import pytest
import torch

from moekit.analysis import analyze, get_gpu
from moekit.analysis.billed import billed_layer
from moekit.analysis.bills import param_bill
from moekit.cli import main
from moekit.sim import SimParams, simulate

transformers = pytest.importorskip("transformers")

TINY = {  # every kind of layer and the options that add tensors (biases, latent experts, an untied head)
    "nemotron_h": dict(vocab_size=50, hidden_size=32, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                         "mlp", "moe", "linear_attention"],
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40, mlp_bias=True,
                       mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=6, conv_kernel=3, use_bias=True,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                       moe_shared_expert_intermediate_size=20, moe_latent_size=16),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=3, vocab_size=50, attn_config=dict(kv_n_heads=2, rope_theta=1e4),
                 ffn_config=dict(ffn_hidden_size=24, moe_num_experts=4, moe_top_k=2)),
    "jetmoe": dict(hidden_size=32, num_hidden_layers=2, intermediate_size=24, num_local_experts=4,
                   num_experts_per_tok=2, num_key_value_heads=2, kv_channels=8, vocab_size=50,
                   tie_word_embeddings=False),
    "switch_transformers": dict(d_model=32, d_ff=48, num_layers=4, num_decoder_layers=3, num_sparse_encoder_layers=2,
                                num_sparse_decoder_layers=1, num_experts=4, vocab_size=50, num_heads=2, d_kv=16,
                                router_bias=True, tie_word_embeddings=False),
    "nllb-moe": dict(d_model=32, encoder_ffn_dim=48, decoder_ffn_dim=48, encoder_layers=4, decoder_layers=4,
                     encoder_sparse_step=2, decoder_sparse_step=4, num_experts=4, vocab_size=50, router_bias=True,
                     encoder_attention_heads=2, decoder_attention_heads=2),
}
PUBLISHED = {  # the checkpoints' config.json (the fields that shape the model; the rest are the classes' defaults)
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16: 23 Mamba-2, 23 MoE, 6 attention layers
    "nemotron_h": dict(vocab_size=131072, hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                       hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                       mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4,
                       n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                       moe_shared_expert_intermediate_size=3712, tie_word_embeddings=False),
    # databricks/dbrx-instruct
    "dbrx": dict(d_model=6144, n_heads=48, n_layers=40, vocab_size=100352, max_seq_len=32768,
                 attn_config=dict(kv_n_heads=8, clip_qkv=8, rope_theta=500000),
                 ffn_config=dict(ffn_hidden_size=10752, moe_num_experts=16, moe_top_k=4)),
    # jetmoe/jetmoe-8b
    "jetmoe": dict(hidden_size=2048, num_hidden_layers=24, num_key_value_heads=16, kv_channels=128,
                   intermediate_size=5632, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000),
    # google/switch-base-8
    "switch_transformers": dict(d_model=768, d_ff=3072, d_kv=64, num_heads=12, num_layers=12, num_decoder_layers=12,
                                num_sparse_encoder_layers=6, num_sparse_decoder_layers=6, num_experts=8,
                                vocab_size=32128),
    # facebook/nllb-moe-54b
    "nllb-moe": dict(d_model=2048, encoder_layers=24, decoder_layers=24, encoder_ffn_dim=8192, decoder_ffn_dim=8192,
                     encoder_attention_heads=16, decoder_attention_heads=16, num_experts=128, vocab_size=256206),
}
# the model cards' totals and active parameters (billions; Nemotron-H and DBRX without the embedding)
CARDS = {"nemotron_h": (31.6, 3.2), "dbrx": (132, 36), "nllb-moe": (54.5, None)}
# a parameter's name (digits and expert_<i> dropped) -> its part: the first key the name holds; "encoder." first
PARTS = {
    "nemotron_h": {"embeddings": "embedding", "lm_head": "output", "mixer.experts.": "routed_experts",
                   "mixer.gate.": "router", "shared_experts.": "shared_experts", "latent_proj": "shared_experts",
                   "mixer.up_proj": "dense_mlp", "mixer.down_proj": "dense_mlp", "mixer.": "attention",
                   "norm": "norms"},
    "dbrx": {"wte": "embedding", "lm_head": "output", "ffn.experts.": "routed_experts", "ffn.router.": "router",
             ".attn.": "attention", "norm": "norms"},
    "jetmoe": {"embed_tokens": "embedding", "lm_head": "output",
               "self_attention.experts.input_linear": "attention_experts",
               "self_attention.experts.output_linear": "attention_experts", "self_attention.": "attention",
               "mlp.input_linear": "routed_experts", "mlp.output_linear": "routed_experts", "mlp.": "router",
               "norm": "norms"},
    "switch_transformers": {"shared.": "embedding", "embed_tokens": "embedding", "lm_head": "output",
                            "layer_norm": "norms", "EncDecAttention.k.": "cross_kv", "EncDecAttention.v.": "cross_kv",
                            "Attention.": "attention", "mlp.experts.": "routed_experts", "mlp.router.": "router",
                            "mlp.": "dense_mlp"},
    "nllb-moe": {"shared.": "embedding", "embed_tokens": "embedding", "lm_head": "output", "layer_norm": "norms",
                 "cross_attention.k_proj": "cross_kv", "cross_attention.v_proj": "cross_kv", "self_attn.": "attention",
                 "cross_attention.": "attention", "ffn.experts.": "routed_experts", "ffn.router.": "router",
                 "ffn.": "dense_mlp"},
}
FIELDS = ("embedding", "output", "attention", "attention_experts", "cross_kv", "dense_mlp", "routed_experts",
          "shared_experts", "router", "norms")


def _config(model_type: str, shapes: dict):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type](**shapes)


def _model(config):
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def _parts(config) -> collections.Counter:
    """transformers' model of ``config``: its parameters summed by (stack, part), the stack "encoder" for the
    encoder's (the shared embedding is the decoder's), else "decoder"."""
    parts = collections.Counter()
    for name, p in _model(config).named_parameters():
        name = ".".join(piece for piece in name.split(".") if not piece.isdigit() and not piece.startswith("expert_"))
        part = next(part for key, part in PARTS[config.model_type].items() if key in name)
        stack = "encoder" if name.startswith(("encoder.", "model.encoder.")) else "decoder"
        parts[stack, part] += p.numel()
    return parts


def _check_parts(config) -> None:
    bill, parts = param_bill(config.to_dict()), _parts(config)
    assert {f: getattr(bill, f) for f in FIELDS} == {f: parts["decoder", f] for f in FIELDS}
    encoder = {f: getattr(bill.encoder, f) for f in FIELDS} if bill.encoder else {}
    assert encoder == {f: parts["encoder", f] for f in FIELDS if parts["encoder", f] or bill.encoder}
    assert bill.total == sum(parts.values()) and bill.exact


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_each_part_equals_transformers_model_at_tiny_shapes(model_type):
    _check_parts(_config(model_type, TINY[model_type]))


@pytest.mark.parametrize("model_type", sorted(PUBLISHED))
def test_each_part_equals_transformers_model_of_the_published_config(model_type):
    """And the model cards' figures: Nemotron-3-Nano 31.6B (3.2B active), DBRX 132B (36B), NLLB-MoE 54.5B."""
    config = _config(model_type, PUBLISHED[model_type])
    _check_parts(config)
    bill = param_bill(config.to_dict())
    total, active = CARDS.get(model_type, (None, None))
    assert total is None or bill.total / 1e9 == pytest.approx(total, rel=0.005)
    assert active is None or bill.active_matmul / 1e9 == pytest.approx(active, rel=0.015)


def test_the_published_configs_layers():
    """Nemotron-3-Nano's 52 layers are 23 MoE and 29 others; switch-base-8's every other layer is sparse (6 + 6 of
    12 + 12); NLLB-MoE's every 4th (6 + 6 of 24 + 24); the billed layer's MoE layers are the decoder's."""
    layers = {}
    for model_type in PUBLISHED:
        fields = _config(model_type, PUBLISHED[model_type]).to_dict()
        bill, layer = param_bill(fields), billed_layer(fields)
        assert layer.config.num_moe_layers == bill.num_moe_layers
        layers[model_type] = (bill.num_moe_layers, bill.num_dense_layers, bill.encoder and bill.encoder.num_moe_layers)
    assert layers == {"nemotron_h": (23, 29, None), "dbrx": (40, 0, None), "jetmoe": (24, 0, None),
                      "switch_transformers": (6, 6, 6), "nllb-moe": (6, 18, 6)}


def test_a_decode_steps_bytes_against_a_count_by_hand():
    """The weights one token of a decode step reads (bf16, B = 1, memory-bound: the step's floor times the
    bandwidth), counted here for the tiny Switch (d 32, N 48, E 4, top-1, H·d_kv 32, vocab 50, untied head): its
    decoder's 3 layers only, the cross-attention's k and v not (projected once per prompt), the encoder not."""
    d, n, e, inner, vocab = 32, 48, 4, 32, 50
    self_attention, cross_q_o, position = 4 * d * inner, 2 * d * inner, 32 * 2  # the first layer's [buckets, H]
    moe = 1 * 2 * d * n + (d + 1) * e  # decoder layer 1 (of 0, 1, 2) is sparse: one expert a token, the router
    dense = 2 * (2 * d * n)  # layers 0 and 2
    weights = 3 * (self_attention + cross_q_o) + position + moe + dense + vocab * d  # + the head
    fields = _config("switch_transformers", TINY["switch_transformers"]).to_dict()
    layer = billed_layer(fields)
    report = analyze(layer.config, "h200", "bf16", (1,), fields, expert_matrices=layer.expert_matrices)
    row = report.rows[0]
    assert row.cost.bound == "memory"
    assert row.model_step_floor_s * get_gpu("h200").bandwidth_bytes_s == pytest.approx(2 * weights, rel=1e-12)
    bill = report.bills.params
    assert bill.active_matmul == weights  # the relative bias (a lookup) is counted with attention
    assert bill.total - bill.step_total == bill.encoder.total > 0


def test_jetmoe_reads_k_of_its_attention_experts():
    """A token runs the kv projection, the MoA router and bias, and k = 2 of E = 4 attention experts a layer."""
    c = TINY["jetmoe"]
    bill = param_bill(_config("jetmoe", c).to_dict())
    d, a, layers = 32, 8 * 2, 2
    assert bill.attention == layers * (2 * a * d + 4 * d + d)
    assert (bill.attention_experts, bill.active_attention_experts) == (layers * 4 * 2 * d * a, layers * 2 * 2 * d * a)
    assert bill.total - bill.active == bill.routed_experts - bill.active_routed_experts + layers * 2 * 2 * d * a


def test_jetmoe_steps_read_the_attention_experts_a_batch_touches():
    """The step's bytes (bf16, memory-bound) counted here: per layer the kv projection, the MoA router and bias, the
    MLP's router and bias, each read once; of the E = 4 attention experts and the E = 4 MLP experts, 4·(1 - (1 -
    2/4)^B) each touched under uniform routing (B = 1: k = 2), each read once; the untied head."""
    d, a, n, layers, vocab = 32, 8 * 2, 24, 2, 50
    always = layers * (2 * a * d + 4 * d + d + 4 * d + d) + vocab * d
    fields = _config("jetmoe", TINY["jetmoe"]).to_dict()
    layer = billed_layer(fields)
    report = analyze(layer.config, "h200", "bf16", (1, 8), fields, expert_matrices=layer.expert_matrices)
    for row, touched in zip(report.rows, (2, 4 * (1 - 0.5 ** 8))):
        assert row.cost.bound == "memory" and row.cost.experts_touched == pytest.approx(touched, rel=1e-12)
        weights = always + layers * touched * (2 * d * a + 3 * d * n)  # attention experts, MLP experts
        assert row.model_step_floor_s * get_gpu("h200").bandwidth_bytes_s == pytest.approx(2 * weights, rel=1e-12)


def test_nemotron_h_reads_its_pattern_as_its_config_class_does():
    """``hybrid_override_pattern`` (the published files'), ``layers_block_type`` (transformers' to_dict) and
    ``layer_types`` (its attribute map's), older names ("mamba", "attention") too, give one bill; a letter or a name
    that is no layer is named."""
    fields = _config("nemotron_h", TINY["nemotron_h"]).to_dict()
    assert "hybrid_override_pattern" not in fields  # a property of the class: to_dict writes the list
    bill = param_bill(fields)
    types = fields.pop("layers_block_type")
    for changes in ({"hybrid_override_pattern": "ME*-EM"}, {"layer_types": types},
                    {"layers_block_type": ["mamba", "moe", "attention", "mlp", "moe", "mamba"]}):
        assert param_bill({**fields, **changes}) == bill
    with pytest.raises(ValueError, match=r"cfg.hybrid_override_pattern='ME\*X': 'X' is no layer"):
        billed_layer({**fields, "hybrid_override_pattern": "ME*X"})
    with pytest.raises(ValueError, match=r"cfg.layers_block_type=\['moe', 'dense'\]: 'dense' is no layer"):
        param_bill({**fields, "layers_block_type": ["moe", "dense"]})


def _write(tmp_path, model_type: str) -> str:
    path = tmp_path / "config.json"
    _config(model_type, PUBLISHED[model_type]).to_json_file(str(path))
    return str(path)


def test_analyze_bills_an_encoder_decoder_apart_and_says_so(tmp_path, capsys):
    path = _write(tmp_path, "nllb-moe")
    assert main(["analyze", "--config", path, "--json", "--batches", "1", "--dtype", "bf16", "--gpu", "h200"]) == 0
    data = json.loads(capsys.readouterr().out)
    params, bill = data["bills"]["params"], param_bill(json.loads(open(path).read()))
    assert (params["total"], params["active"], params["encoder"]["total"]) == (bill.total, bill.active,
                                                                             bill.encoder.total)
    assert "a decode step runs the decoder only" in data["note"] and "encoder's 6 MoE layers" in data["note"]
    assert main(["analyze", "--config", path, "--batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "encoder (B)" in out and "cross-attention k, v (once per prompt)" in out
    assert "decoder 18 dense + 6 MoE layers; encoder 18 dense + 6 MoE layers" in out


@pytest.mark.parametrize("model_type", sorted(PUBLISHED))
def test_analyze_and_simulate_price_the_real_shapes(model_type, tmp_path, capsys):
    """No "no whole-model bill" note, no Mixtral shapes: the bill of the file, and simulate's total is it."""
    path = _write(tmp_path, model_type)
    assert main(["analyze", "--config", path, "--json", "--batches", "1", "--dtype", "bf16"]) == 0
    out = capsys.readouterr()
    assert "no parameter or memory bills" not in out.err
    fields = json.loads(open(path).read())
    bill = param_bill(fields)
    assert json.loads(out.out)["bills"]["params"]["total"] == bill.total
    layer = billed_layer(fields).config
    result = simulate(SimParams(experts=layer.num_experts, top_k=layer.top_k, tokens=16, gpus=1, spare_slots=0),
                      fields)
    assert result.total_params == bill.total and result.param_shape.startswith(f"{model_type} shapes (")
    assert ("in the encoder" in result.param_shape) == (bill.encoder is not None)

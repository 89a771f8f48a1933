"""Bills: parameter counts against transformers' own models and the published totals; memory and fit;
the GPU table."""

import pytest
import torch

from moekit.analysis.bills import param_bill
from moekit.analysis.formats import FORMATS, get_format
from moekit.analysis.gpus import GPUS, get_gpu
from moekit.analysis.memory import GB, fit_on_gpus, weight_memory
from moekit.presets import hf_config_of_preset, preset_names

# Published (total, active) in billions, from the model cards. DeepSeek-V3's 671B excludes its 14B MTP module.
# gpt-oss: the model card's table (20.91B / 3.61B, 116.83B / 5.13B; active without the embedding).
# GLM-4.5-Air's 106B excludes its MTP layer, as transformers does; Kimi-K2: the tech report's 1.04T.
PUBLISHED = {"deepseek-v3": (671, 37), "qwen3-30b-a3b": (30.5, 3.3), "mixtral-8x7b": (46.7, 12.9),
             "gpt-oss-20b": (20.91, 3.61), "gpt-oss-120b": (116.83, 5.13), "glm-4.5-air": (106, 12),
             "qwen3-next-80b-a3b": (80, 3), "kimi-k2": (1040, 32), "olmoe-1b-7b": (6.9, 1.3)}
# Kimi-K2 counts 1026.4B (transformers' DeepseekV3 model, exactly); the report rounds to 1.04T, 1.3% apart.
TOTAL_REL = {"kimi-k2": 0.015}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_totals_reconcile_with_published(name):
    bill = param_bill(hf_config_of_preset(name))
    total, _ = PUBLISHED[name]
    assert bill.total / 1e9 == pytest.approx(total, rel=TOTAL_REL.get(name, 0.01))


def test_active_of_the_new_presets_reconciles():
    """gpt-oss's card counts the active parameters without the embedding (3.608B -> 3.61B); GLM-4.5-Air's
    12.80B, Qwen3-Next's 3.56B truncate to the names' 12B and A3B; Kimi-K2's 31.69B -> 32B; OLMoE counts
    the embedding (1.282B -> 1.3B)."""
    for name in ("gpt-oss-20b", "gpt-oss-120b", "kimi-k2"):
        assert param_bill(hf_config_of_preset(name)).active_matmul / 1e9 == pytest.approx(PUBLISHED[name][1], rel=0.01)
    for name in ("glm-4.5-air", "qwen3-next-80b-a3b"):
        assert int(param_bill(hf_config_of_preset(name)).active_matmul / 1e9) == PUBLISHED[name][1]
    assert param_bill(hf_config_of_preset("olmoe-1b-7b")).active / 1e9 == pytest.approx(1.3, rel=0.02)


def test_active_reconciles_with_published():
    # The cards round to two significant figures and differ in convention: Mixtral and Qwen count the
    # embedding (12.88B -> 12.9B, 3.353B -> 3.3B), DeepSeek does not (36.62B -> 37B, and V2-Lite's
    # 2.45B -> 2.4B). Held at 1% where the rounding allows it, at the rounding itself where it does not.
    mixtral = param_bill(hf_config_of_preset("mixtral-8x7b"))
    assert mixtral.active / 1e9 == pytest.approx(12.9, rel=0.01)
    v3 = param_bill(hf_config_of_preset("deepseek-v3"))
    assert round(v3.active_matmul / 1e9) == 37
    assert v3.active_matmul / 1e9 == pytest.approx(37, rel=0.011)
    qwen3 = param_bill(hf_config_of_preset("qwen3-30b-a3b"))
    assert int(qwen3.active / 1e8) / 10 == 3.3  # 3.353B, truncated on the card
    assert qwen3.active / 1e9 == pytest.approx(3.3, rel=0.02)


@pytest.mark.parametrize("name", preset_names())
def test_bill_equals_transformers_model(name):
    """Exact: instantiate the model on the meta device from the same config and count its parameters."""
    transformers = pytest.importorskip("transformers")
    hf = hf_config_of_preset(name)
    # Kimi-K2's config.json says kimi_k2 and DeepseekV3ForCausalLM: transformers builds it as deepseek_v3
    fields = {k: v for k, v in hf.items() if k != "model_type"}
    kind = {"kimi_k2": "deepseek_v3"}.get(hf["model_type"], hf["model_type"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **fields))
    assert param_bill(hf).total == sum(p.numel() for p in model.parameters())


def test_bill_parts():
    v3 = param_bill(hf_config_of_preset("deepseek-v3"))
    assert (v3.num_dense_layers, v3.num_moe_layers) == (3, 58)
    assert v3.routed_experts == 58 * 256 * 44_040_192
    assert v3.active - v3.active_routed_experts == v3.total - v3.routed_experts
    # The seed's three derived rows (routed active, shared, attention) sum to 34.40B.
    assert (v3.active_routed_experts + v3.shared_experts + v3.attention) / 1e9 == pytest.approx(34.40, abs=0.005)
    assert param_bill(hf_config_of_preset("mixtral-8x7b")).dense_mlp == 0


def test_memory_seed_numbers():
    v3 = param_bill(hf_config_of_preset("deepseek-v3"))
    fp8, bf16 = (weight_memory(v3, get_format(d)) for d in ("fp8", "bf16"))
    assert fp8.routed_expert_gb == pytest.approx(653.9, abs=0.05)  # 97.5% of 671 GB; 97.2% of our 673 GB
    assert bf16.routed_expert_gb == pytest.approx(1308, abs=0.5)
    assert fp8.routed_expert_bytes / fp8.total_bytes == pytest.approx(0.9715, abs=0.001)
    qwen3 = weight_memory(param_bill(hf_config_of_preset("qwen3-30b-a3b")), get_format("fp8"))
    assert qwen3.routed_expert_gb == pytest.approx(28.99, abs=0.005)
    assert qwen3.total_gib == pytest.approx(qwen3.total_bytes / 2**30)


def test_formats():
    assert [FORMATS[d].bytes_per_weight for d in ("bf16", "fp8")] == [2.0, 1.0]
    assert FORMATS["int4"].bytes_per_weight == 0.5 + 2 / 128  # int4 plus one bf16 scale per 128
    assert FORMATS["int4"].compute_dtype == "bf16"
    with pytest.raises(KeyError, match="dtype must be one of"):
        get_format("fp4")


def test_fit_seed_numbers():
    h100 = get_gpu("h100")
    fit = fit_on_gpus(0, h100, 1)
    assert fit.usable_gib == pytest.approx(67.28, abs=0.005)  # 79.65 x 0.92 - 6.0
    assert fit.usable_gib * 2**30 / GB == pytest.approx(72.2, abs=0.05)  # "~72 GB per GPU"
    v3 = weight_memory(param_bill(hf_config_of_preset("deepseek-v3")), get_format("fp8"))
    assert not fit_on_gpus(v3.total_bytes, h100, 8).fits
    assert fit_on_gpus(v3.total_bytes, h100, 16).fits
    need = fit_on_gpus(v3.total_bytes, h100, 1).min_gpus
    assert fit_on_gpus(v3.total_bytes, h100, need).fits and not fit_on_gpus(v3.total_bytes, h100, need - 1).fits
    assert fit_on_gpus(v3.total_bytes, h100, 1, utilization=0.05).min_gpus == 0  # reserve exceeds the share


def test_gpu_table():
    for key in ("h100", "h200", "b200", "a100", "mi300x", "l40s", "rtx4090"):
        spec = GPUS[key]
        assert spec.bandwidth_tb_s > 0 and spec.memory_gib > 0 and spec.dense_tflops["bf16"] > 0 and spec.source
    assert get_gpu("H100-SXM") is GPUS["h100"]
    with pytest.raises(KeyError, match="gpu must be one of"):
        get_gpu("tpu")
    with pytest.raises(KeyError, match="no fp8"):
        get_gpu("a100").flops_per_s("fp8")
    custom = get_gpu("h100").with_overrides(bandwidth_tb_s=3.0, dense_tflops={"fp8": 1000.0})
    assert custom.ridge_intensity("fp8") == pytest.approx(1000 / 3.0) and "user-supplied" in custom.source
    with pytest.raises(ValueError, match="bandwidth_tb_s"):
        get_gpu("h100").with_overrides(bandwidth_tb_s=-1.0)
    with pytest.raises(ValueError, match="dense_tflops"):
        get_gpu("h100").with_overrides(dense_tflops={"fp8": 0.0})


def test_analysis_imports_no_kernels():
    """design.md: analysis reasons about shapes and counts; beyond what ``import moekit`` loads, it
    imports no experts backend, layout or Triton."""
    import subprocess
    import sys

    code = ("import sys, moekit; before = set(sys.modules); import moekit.analysis; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if m.startswith(('moekit.experts', 'moekit.layouts', 'moekit.layer', 'triton'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


LONGCAT_TINY = dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4, ffn_hidden_size=48,
                    q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                    head_dim=4, moe_topk=3, n_routed_experts=6, zero_expert_num=3, expert_ffn_hidden_size=12)


def _longcat_by_hand(c: dict) -> int:
    """LongCat-Flash's parameters summed from its modules' shapes: per decoder layer two MLA sublayers (q_a, its
    norm, q_b; kv_a with the rope key, its norm, kv_b; o), two dense MLPs, four RMSNorms, one MoE (E experts of
    gate_up [2N, d] and down [d, N], a classifier [E + Z, d]); embedding, final norm, LM head."""
    d, heads, qk = c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    mla = (d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk
           + d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
           + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * d)
    mlp = 3 * d * c["ffn_hidden_size"]
    experts, router = c["n_routed_experts"], c["n_routed_experts"] + c["zero_expert_num"]
    moe = experts * 3 * d * c["expert_ffn_hidden_size"] + router * d
    layer = 2 * mla + 2 * mlp + 4 * d + moe
    return c["num_layers"] * layer + 2 * c["vocab_size"] * d + d


def test_longcat_bill_reads_its_layer_count():
    """LongCat's config.json has num_layers (its config derives num_hidden_layers = 2 * num_layers, unserialised):
    the bill equals a count by hand and the transformers model built offline (random weights)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.longcat_flash")
    hf_cfg = transformers.LongcatFlashConfig(**LONGCAT_TINY)
    d = hf_cfg.to_dict()
    assert "num_hidden_layers" not in d and d["num_layers"] == 2
    torch.manual_seed(0)
    model = transformers.LongcatFlashForCausalLM(hf_cfg)
    bill = param_bill(d)
    assert bill.total == _longcat_by_hand(LONGCAT_TINY) == sum(p.numel() for p in model.parameters())
    assert (bill.num_moe_layers, bill.dense_mlp) == (2, 4 * 3 * 32 * 48)  # 2 MoE blocks, 2 dense MLPs each
    assert bill.active_routed_experts == 2 * 2 * 3 * 32 * 12  # k·E/(E+Z) = 2 experts a token run, a layer


def test_longcat_flash_reconciles_with_published():
    """transformers' LongcatFlashConfig defaults are LongCat-Flash-Chat's shapes: 560B total (the card), ~27B
    active on average (the report; k·E/(E+Z) = 12·512/768 = 8 experts a token under uniform routing)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.longcat_flash")
    bill = param_bill(transformers.LongcatFlashConfig().to_dict())
    assert bill.total / 1e9 == pytest.approx(560, rel=0.01) and bill.active_matmul / 1e9 == pytest.approx(27, rel=0.01)


def _default_model_count(transformers, model_type: str) -> tuple[dict, int]:
    """A family's default config (DeepSeek-V2's None top-k given 6, as its checkpoints) and its model's count."""
    cfg = transformers.AutoConfig.for_model(model_type)
    if getattr(cfg, "num_experts_per_tok", 0) is None:
        cfg = transformers.AutoConfig.for_model(model_type, num_experts_per_tok=6)
    if model_type == "dbrx":  # transformers 5.25's DbrxAttentionConfig keeps no rope_theta its attention reads
        cfg.attn_config.rope_theta = 10000.0
    return cfg.to_dict(), _meta_count(transformers, cfg)


def _meta_count(transformers, cfg) -> int:
    """The parameters of transformers' causal LM of ``cfg`` (the privacy filter, a token classifier: its token
    classification model; an encoder-decoder: its sequence-to-sequence model), built on the meta device."""
    auto = (transformers.AutoModelForTokenClassification if cfg.model_type == "openai_privacy_filter"
            else transformers.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


V4_TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
               q_lora_rank=24, o_groups=2, o_lora_rank=8, hc_mult=3, index_n_heads=2, index_head_dim=8,
               n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
               layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
               mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={"compressed_sparse_attention": 4,
                                                                            "heavily_compressed_attention": 8})


def _v4_by_hand(c: dict) -> int:
    """DeepSeek-V4's parameters summed from its modules' shapes. Attention (every layer): q_a [qr, d], its norm, q_b
    [H·h, qr]; one shared kv head [h, d] and its norm; the grouped output projection o_a (g blocks of [o_rank, H·h/g])
    then o_b [d, g·o_rank]; one sink a head. A compressed layer adds its compressor: kv and gate projections [w, d],
    a position bias [rate, w], a norm of h (w = h on the heavily compressed layers, 2h on the sparse ones, whose
    indexer adds its own kv / gate [2·ih, d], bias [rate, 2·ih], norm ih, q_b [iH·ih, qr] and head weights [iH, d]).
    Per layer two hyper-connection mixers (fn [(2+N)·N, N·d], base, 3 scales), two RMSNorms and one MoE block (E
    experts, one shared, a router [E, d]); the model: embedding, LM head, final norm, the head mixer [N, N·d], N, 1."""
    names = ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult")
    d, heads, h, qr, g, o_rank, n = (c[k] for k in names)
    ih, ih_heads = c["index_head_dim"], c["index_n_heads"]
    csa, hca = (c["compress_rates"][t] for t in ("compressed_sparse_attention", "heavily_compressed_attention"))
    core = d * qr + qr + qr * heads * h + d * h + h + o_rank * heads * h + g * o_rank * d + heads
    indexer = 2 * d * 2 * ih + csa * 2 * ih + ih + qr * ih_heads * ih + d * ih_heads
    compressor = {"sliding_attention": 0, "heavily_compressed_attention": 2 * d * h + hca * h + h,
                  "compressed_sparse_attention": 2 * d * 2 * h + csa * 2 * h + h + indexer}
    mixers = 2 * ((2 + n) * n * n * d + (2 + n) * n + 3)
    experts = c["n_routed_experts"] + c["n_shared_experts"]
    moe = experts * 3 * d * c["moe_intermediate_size"] + c["n_routed_experts"] * d
    layers = sum(core + compressor[t] + mixers + 2 * d + moe for t in c["layer_types"])
    return layers + 2 * c["vocab_size"] * d + d + n * n * d + n + 1


JAMBA_TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=24, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=0, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2,
                  mamba_dt_rank=5, use_mamba_kernels=False)


def _jamba_by_hand(c: dict) -> int:
    """Jamba's parameters from its modules' shapes: a Mamba mixer on the layers that are not attention ones (in_proj
    [2I, d], a depthwise conv [I, 1, k] with its bias, x_proj [R + 2S, I], dt_proj [I, R] with its bias, A_log [I, S],
    D [I], out_proj [d, I], RMSNorms of R, S, S; I = expand·d), grouped-query attention on the others; a MoE block
    (E experts, a router [E, d]) where i % expert_layer_period == expert_layer_offset, a dense MLP elsewhere; two
    RMSNorms a layer; embedding, LM head, final norm."""
    d, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    h, inner, rank, state = d // heads, c["mamba_expand"] * d, c["mamba_dt_rank"], c["mamba_d_state"]
    mamba = (d * 2 * inner + inner * c["mamba_d_conv"] + inner + inner * (rank + 2 * state) + rank * inner + inner
             + inner * state + inner + inner * d + rank + 2 * state)
    attention = 2 * d * heads * h + 2 * d * kv * h
    moe = c["num_experts"] * 3 * d * c["intermediate_size"] + c["num_experts"] * d
    total = 0
    for i in range(c["num_hidden_layers"]):
        total += attention if i % c["attn_layer_period"] == c["attn_layer_offset"] else mamba
        total += moe if i % c["expert_layer_period"] == c["expert_layer_offset"] else 3 * d * c["intermediate_size"]
        total += 2 * d
    return total + 2 * c["vocab_size"] * d + d


@pytest.mark.parametrize("model_type, tiny, by_hand, card", [
    ("deepseek_v4", V4_TINY, _v4_by_hand, (284, 13)),  # V4-Flash's card: 284B total, 13B active
    ("jamba", JAMBA_TINY, _jamba_by_hand, (52, 12)),  # Jamba's card: 52B total, 12B active
])
def test_a_family_of_its_own_token_mixer_bills_as_transformers_model(model_type, tiny, by_hand, card):
    """DeepSeek-V4's attention is not grouped-query: one shared kv head, low-rank q and a grouped low-rank output,
    and a compressor (with an indexer on the sparse layers) by layer type; its residual stream runs hyper-connection
    mixers. Read as grouped-query attention its default config (V4-Flash's shapes) billed 290.9B total, 20.4B active.
    Jamba mixes Mamba and attention layers, MoE and dense MLPs; billed as attention and MoE on every layer it came to
    92.1B (49.8B with its MoE layers counted, the Mamba mixers still as attention), against transformers' 51.57B.
    Each held to a count by hand and transformers' model at tiny shapes (every layer kind), to its default config's
    model on the meta device, and to its card (total, active matmul parameters)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip(f"transformers.models.{model_type}")
    small = transformers.AutoConfig.for_model(model_type, **tiny)
    assert param_bill(small.to_dict()).total == by_hand(tiny) == _meta_count(transformers, small)
    fields, count = _default_model_count(transformers, model_type)
    bill = param_bill(fields)
    assert bill.total == count
    assert bill.total / 1e9 == pytest.approx(card[0], rel=0.01) and round(bill.active_matmul / 1e9) == card[1]

@pytest.mark.parametrize("proj_bias, conv_bias", [(False, True), (True, False)])
def test_granitemoe_hybrid_bills_its_mamba2_and_attention_layers(proj_bias, conv_bias):
    """GraniteMoE-Hybrid's Mamba-2 layers (every layer of its default config) were billed as attention: 3.0% short of
    transformers' model. A tiny config mixing Mamba-2 and attention layers, each bias setting, against transformers'
    model on the meta device (the default config: ``test_the_families_billed_exactly_are...``)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.granitemoehybrid")
    tiny = transformers.AutoConfig.for_model(
        "granitemoehybrid", vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=16, shared_intermediate_size=8, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["linear_attention", "attention", "linear_attention"], mamba_n_heads=8,
        mamba_d_head=8, mamba_d_state=6, mamba_n_groups=2, mamba_d_conv=3, mamba_expand=2,
        mamba_proj_bias=proj_bias, mamba_conv_bias=conv_bias)
    assert param_bill(tiny.to_dict()).total == _meta_count(transformers, tiny)


def test_qwen3_5_moe_bill_equals_transformers_model():
    """Qwen3.5-MoE's text model runs Qwen3-Next's Gated DeltaNet on its layer_types' "linear_attention" layers (30 of
    40) and gated attention on the others; billed as plain attention everywhere it came to 34.13B against
    transformers' 34.66B (the card's 35B-A3B). The default config, on the meta device; the top-level (VL) config
    bills its text model."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.qwen3_5_moe")
    fields, count = _default_model_count(transformers, "qwen3_5_moe_text")
    bill = param_bill(fields)
    assert bill.total == count
    assert round(bill.total / 1e9) == 35 and round(bill.active_matmul / 1e9) == 3
    assert param_bill(transformers.AutoConfig.for_model("qwen3_5_moe").to_dict()) == bill


def test_the_families_billed_exactly_are_and_the_others_say_approximate():
    """``ParamBill.exact``: the model types whose bill is held to the parameter (every EXACT_BILL type transformers
    registers, its default config against its model on the meta device), and False for a family whose own attention
    the bill reads as grouped-query or MLA (AFMoE: 0.7% short), which ``moekit analyze`` then says. Session 49's fix49
    made four more exact: MiniCPM5-MoE's gated q (1.6% short), MiniMax's lightning attention (1.4%), GraniteMoE-Hybrid's
    Mamba-2 layers (3.0%), the privacy filter's label head in place of an LM head (9.1% over). Kimi-K2's config is
    DeepSeek-V3's model (test_bill_equals_transformers_model). HY-V4 (its MLA's output gate and sinks, DSA indexers
    on the "full" layers, hyper-connections) billed 57.45B against 58.28B before session 49."""
    transformers = pytest.importorskip("transformers")
    from moekit.analysis.bills import EXACT_BILL

    known = set(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
    assert EXACT_BILL - known == {"kimi_k2"}
    for model_type in sorted(EXACT_BILL & known):
        fields, count = _default_model_count(transformers, model_type)
        bill = param_bill(fields)
        assert bill.exact and bill.total == count, model_type
    for model_type in ("afmoe",):
        fields, count = _default_model_count(transformers, model_type)
        bill = param_bill(fields)
        assert not bill.exact and bill.total != count, model_type


def test_ernie_vl_bills_both_sparse_blocks_of_a_moe_layer():
    """ERNIE-4.5-VL's text model (transformers' default config: 27 sparse layers of 64 text experts of width 1536 and
    64 vision experts of width 512, a gate each) against its model built on the meta device, counted by part: the
    bill's total is the model's but for the blocks' ``moe_statics`` Parameters (a correction bias, not billed, as V3's
    buffer); a text token's active count leaves every vision expert and gate out. Before session 50 the vision blocks
    were not billed (21.8B of the model's 28.6B)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as modeling

    text = transformers.AutoConfig.for_model("ernie4_5_vl_moe").text_config
    with torch.device("meta"):
        model = modeling.Ernie4_5_VLMoeTextModel(text)
    parts = {"statics": 0, "vision": 0, "text_experts": 0, "rest": 0}
    for name, p in model.named_parameters():
        part = ("statics" if "moe_statics" in name else "vision" if ".vision_moe." in name
                else "text_experts" if ".text_moe.experts." in name else "rest")
        parts[part] += p.numel()
    assert parts["vision"] > 6e9  # 27 layers x 64 experts x 3 x 2560 x 512, and the gates
    bill = param_bill(transformers.AutoConfig.for_model("ernie4_5_vl_moe").to_dict())
    assert bill.total == sum(parts.values()) - parts["statics"]
    active_text = round(parts["text_experts"] * text.moe_k / text.moe_num_experts)
    assert bill.active == parts["rest"] + active_text

"""Parameter and memory bills of a whole model, read from its ``config.json`` fields.

Shapes: V = vocab, d = hidden size, L = layers, H = attention heads, H_kv = key/value heads,
h = head dim, E = routed experts, k = experts per token, N = one expert's intermediate size.

Counted: input embedding, output head, attention (GQA, DeepSeek's MLA with its low-rank projections
and norms, or DeepSeek-V4's compressed attention by layer type; Qwen3-Next's and Qwen3.5's Gated DeltaNet and Jamba's
Mamba mixers on their layers), dense MLP layers, routed experts, shared experts (and Qwen2-MoE's shared gate), the
router, and the RMSNorms. Nemotron-H's, DBRX's and JetMoE's layers (``bills_hybrid``) and the encoder-decoders'
(``bills_seq2seq``: the encoder billed apart) are read by their own readers. Not counted: DeepSeek-V3's
multi-token-prediction module (14B), which the published 671B total also excludes, and non-parameter buffers
(DeepSeek-V3's e_score_correction_bias).
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.analysis.bill_parts import ParamBill, moe_parts
from moekit.analysis.billed import billed_layer
from moekit.analysis.bills_hybrid import OWN_LAYERS, mamba2_mixer_params
from moekit.analysis.bills_seq2seq import ENCODER_DECODERS
from moekit.config import hf_layer_fields


# The model types whose bill equals transformers' model of their default config to the parameter (transformers 5.25,
# tests/test_analysis_bills.py); Kimi-K2's config.json is DeepSeek-V3's model. Any other family's own attention (or
# token mixer) is read as grouped-query or MLA: within 0.1-1% of its model on the families of transformers 5.25
# (benchmarks/triton-notes.md, session 49), and ``moekit analyze`` says the bill is approximate.
EXACT_BILL = frozenset({
    "aria_text", "deepseek_v2", "deepseek_v3", "deepseek_v4", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granitemoe",
    "granitemoehybrid", "granitemoeshared", "hy_v4", "jamba", "kimi_k2", "llama4_text", "longcat_flash", "minicpm5_moe",
    "minimax", "mixtral", "olmoe", "openai_privacy_filter", "param2moe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe",
    "qwen3_next", "sarvam_mla", "sarvam_moe", "solar_open",
    *OWN_LAYERS, *ENCODER_DECODERS,  # their own readers (session 52; tests/test_analysis_whole.py)
})
TOKEN_CLASSIFIERS = frozenset({"openai_privacy_filter"})  # a label head in place of the LM head


def param_bill(hf_config: dict) -> ParamBill:
    """The bill of a config dict of a preset's family: Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek-V2/V3,
    Kimi-K2, GLM-4.5, gpt-oss, OLMoE; and LongCat-Flash (``num_hidden_layers``: its attention sublayers). A VL /
    omni model's top-level config is billed as its text model's (``hf_layer_fields``: the vision tower not counted).
    A family ``from_hf_config`` refuses is billed from its own numbers (``billed_layer``: its experts, shared experts
    and router counted as its model holds them), approximately. The families whose layers are their own (one mixer a
    layer, their own attention fields, an encoder and a decoder) are counted by their own readers (``OWN_LAYERS``,
    ``ENCODER_DECODERS``)."""
    hf_config = hf_layer_fields(hf_config)
    layer = billed_layer(hf_config)
    own = OWN_LAYERS.get(hf_config["model_type"]) or ENCODER_DECODERS.get(hf_config["model_type"])
    if own is not None:
        return own(hf_config, layer)
    cfg = layer.config
    d, layers = hf_config["hidden_size"], num_hidden_layers(hf_config)
    moe_layers = cfg.num_moe_layers or layers
    vocab = hf_config["vocab_size"]
    second = second_sparse_block(hf_config)  # ERNIE-4.5-VL's vision blocks
    return ParamBill(
        embedding=vocab * d + _per_layer_embedding(hf_config, layers),
        output=_output_params(hf_config, vocab, d),
        attention=sum(_layer_attention_params(hf_config, i) for i in range(layers)),
        dense_mlp=_dense_mlp_params(hf_config, layers, moe_layers),
        **moe_parts(layer, moe_layers),
        second_blocks=moe_layers * (second.experts + second.router),
        norms=layers * 2 * d + d + _hyper_connection_params(hf_config, layers),
        num_moe_layers=moe_layers,
        num_dense_layers=layers - moe_layers,
        exact=hf_config["model_type"] in EXACT_BILL,
    )


def _per_layer_embedding(c: dict, layers: int) -> int:
    """Gemma-4's per-layer input embeddings (a lookup, ``embed_tokens_per_layer`` [V_pl, L·h_pl]); their three small
    projections (3·d·L·h_pl, 0.2% of a 26B model) are left out. 0 for every other family."""
    if c.get("model_type") not in DENSE_BESIDE_MOE or not c.get("hidden_size_per_layer_input"):
        return 0
    return c.get("vocab_size_per_layer_input", c["vocab_size"]) * layers * c["hidden_size_per_layer_input"]


@dataclass(frozen=True)
class SecondBlock:
    """A MoE layer's second sparse block, beside the one ``MoEConfig`` reads (ERNIE-4.5-VL: the vision tokens'):
    parameters a MoE layer; a token of the first kind uses none of them (not active)."""

    experts: int = 0  # E2·3·d·N2
    router: int = 0  # d·E2


def second_sparse_block(c: dict) -> SecondBlock:
    """ERNIE-4.5-VL's text model: each sparse layer holds ``text_moe`` and ``vision_moe`` (transformers'
    ``Ernie4_5_VLMoeMoeBlock``), the same expert count, widths ``moe_intermediate_size`` [text, vision], a gate each;
    a token routes through its modality's block only. Any other family: none."""
    widths = c.get("moe_intermediate_size")
    if c.get("model_type") != "ernie4_5_vl_moe_text" or not isinstance(widths, (list, tuple)) or len(widths) < 2:
        return SecondBlock()
    d, experts = c["hidden_size"], c.get("moe_num_experts") or c["num_experts"]
    experts = experts[1] if isinstance(experts, (list, tuple)) else experts
    return SecondBlock(experts=experts * 3 * d * widths[1], router=d * experts)


def _output_params(c: dict, vocab: int, d: int) -> int:
    """The head: the LM head V·d (0 when tied to the embedding); the privacy filter's, a token classifier (no LM head),
    is its score Linear of one row and bias per label (``id2label``: 33 in its default config)."""
    if c["model_type"] in TOKEN_CLASSIFIERS:
        labels = len(c.get("id2label") or {}) or c.get("num_labels", 2)  # transformers' default: two labels
        return labels * d + labels
    return 0 if c.get("tie_word_embeddings", False) else vocab * d


def num_hidden_layers(c: dict) -> int:
    """The attention layers: ``num_hidden_layers``; LongCat-Flash's config.json holds ``num_layers`` decoder layers
    of two attention sublayers each, and its transformers config derives ``num_hidden_layers = 2 * num_layers`` (a
    property, so ``to_dict()`` leaves it out)."""
    if c.get("num_hidden_layers") is None and c.get("model_type") == "longcat_flash":
        return 2 * c["num_layers"]
    return c["num_hidden_layers"]


DENSE_BESIDE_MOE = ("gemma4_text", "diffusion_gemma_text")  # a dense MLP beside the MoE block in every layer


def _dense_mlps(c: dict, layers: int, moe_layers: int) -> int:
    """Dense MLPs in the model: one a layer without an MoE block; LongCat-Flash: one an attention sublayer (each
    decoder layer holds two MLPs besides its shortcut-connected MoE block); Gemma-4's: one every layer."""
    return layers if c.get("model_type") in ("longcat_flash", *DENSE_BESIDE_MOE) else layers - moe_layers


# The dense MLP's width where a family's config.json does not call it intermediate_size: LongCat-Flash's
# ffn_hidden_size (its transformers attribute map), Kolibri-1.1's mlp_only_intermediate_size (its mlp_only_layers),
# Ergo's first_dense_intermediate_size (an ungated MLP: up and down)
DENSE_WIDTH = {"longcat_flash": "ffn_hidden_size", "kolibri1_1": "mlp_only_intermediate_size",
               "ergo": "first_dense_intermediate_size"}
UNGATED_DENSE = ("ergo",)


def _dense_mlp_params(c: dict, layers: int, moe_layers: int) -> int:
    """3·d·width a dense MLP (2·d·width ungated: Ergo's). A model whose every layer is MoE (DeepSeek-V4, Qwen3.5-MoE,
    Solar-Open: configs without ``intermediate_size``, which a bill read whatever the count until session 48, so
    ``moekit simulate`` priced them at Mixtral's shapes) reads no width."""
    count = _dense_mlps(c, layers, moe_layers)
    if not count:
        return 0
    matrices = 2 if c.get("model_type") in UNGATED_DENSE else 3
    return count * matrices * c["hidden_size"] * c[DENSE_WIDTH.get(c.get("model_type"), "intermediate_size")]


GLM_MODEL = ("glm4_moe", "sarvam_moe", "param2moe")  # Glm4MoeForCausalLM's config classes
HY_V4 = ("hy_v4", "hy_v4_vl_text")  # MLA with an output gate, sinks and DSA indexers; hyper-connections
QWEN_DELTANET = ("qwen3_next", "qwen3_5_moe_text")  # Gated DeltaNet layers beside gated attention (q_proj: 2H heads)


def _layer_attention_params(c: dict, layer: int) -> int:
    """Layer ``layer``'s token mixer: Qwen3-Next's and Qwen3.5-MoE's Gated DeltaNet on their ``layer_types``'
    "linear_attention" layers (else 3 of every 4), Jamba's Mamba on the layers off its attention period,
    GraniteMoE-Hybrid's Mamba-2 on its "linear_attention" ("mamba") layers, MiniMax's lightning attention on its
    "linear_attention" layers, else attention."""
    if c["model_type"] in QWEN_DELTANET:
        types, interval = c.get("layer_types"), c.get("full_attention_interval", 4)
        linear = types[layer] == "linear_attention" if types else (layer + 1) % interval != 0
        if linear:
            return _gated_deltanet_params(c)
    if c["model_type"] == "jamba" and layer % c.get("attn_layer_period", 8) != c.get("attn_layer_offset", 4):
        return _mamba_params(c)
    if c["model_type"] == "minimax" and (c.get("layer_types") or ["full_attention"] * (layer + 1))[layer] == \
            "linear_attention":
        return _lightning_params(c)
    if c["model_type"] == "granitemoehybrid":  # its layer_types (None: every layer Mamba-2, transformers' default)
        types = c.get("layer_types") or c.get("layers_block_type")
        if not types or types[layer] in ("linear_attention", "mamba"):
            return _mamba2_params(c)
    return attention_params(c, layer)


def attention_params(c: dict, layer: int = 0) -> int:
    """Layer ``layer``'s attention: DeepSeek-V4's by its layer type, MLA when the config has ``kv_lora_rank``,
    grouped-query otherwise."""
    if c["model_type"] == "deepseek_v4":
        return _v4_attention_params(c, c["layer_types"][layer])
    if c["model_type"] in HY_V4:
        return _hy_v4_attention_params(c, layer)
    if c.get("kv_lora_rank"):
        return _mla_params(c)
    d, heads, kind = c["hidden_size"], c["num_attention_heads"], c["model_type"]
    kv_heads = c.get("num_key_value_heads") or heads
    h = c.get("head_dim") or d // heads
    # Qwen3-Next's q_proj also makes the output gate, as MiniCPM5-MoE's q_gate_proj [2·H·h, d]
    q_heads = 2 * heads if kind in (*QWEN_DELTANET, "minicpm5_moe") else heads
    weights = d * q_heads * h + 2 * d * kv_heads * h + heads * h * d  # q, k, v, o
    qkv_bias = (heads + 2 * kv_heads) * h if c.get("qkv_bias", c.get("attention_bias", kind == "qwen2_moe")) else 0
    if kind in ("gpt_oss", "openai_privacy_filter"):  # an o_proj bias, and one attention sink per head
        qkv_bias += d + heads
    # per-head RMSNorm on q and k (GLM-4.5's model where use_qk_norm: Sarvam-MoE and Param-2-MoE set it)
    qk_norm = 2 * h if kind in ("qwen3_moe", *QWEN_DELTANET) or (kind in GLM_MODEL and c.get("use_qk_norm")) else 0
    if kind == "olmoe":  # RMSNorm over all of q and all of k
        qk_norm = (heads + kv_heads) * h
    return weights + qkv_bias + qk_norm


def _gated_deltanet_params(c: dict) -> int:
    """Qwen3-Next's linear attention: qkvz and beta/alpha projections, a causal conv over q, k, v, the
    per-head decay (dt_bias, A_log), a gated RMSNorm over the value head, the output projection."""
    d, kernel = c["hidden_size"], c["linear_conv_kernel_dim"]
    v_heads = c["linear_num_value_heads"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = v_heads * c["linear_value_head_dim"]
    in_proj = d * (2 * key_dim + 2 * value_dim) + d * 2 * v_heads
    conv = (2 * key_dim + value_dim) * kernel
    return in_proj + conv + 2 * v_heads + c["linear_value_head_dim"] + value_dim * d


def _mamba_params(c: dict) -> int:
    """Jamba's Mamba mixer, I = mamba_expand·d inner channels, R the time-step rank, S the state: in_proj [2I, d], a
    depthwise conv of kernel k over I (its bias), x_proj [R + 2S, I], dt_proj [I, R] and its bias, A_log [I, S],
    D [I], out_proj [d, I] (in and out biases with mamba_proj_bias), RMSNorms over R, S and S."""
    d = c["hidden_size"]
    inner, state = c.get("mamba_expand", 2) * d, c.get("mamba_d_state", 16)
    rank = c.get("mamba_dt_rank", "auto")
    rank = -(-d // 16) if rank == "auto" else rank
    proj = d * 2 * inner + inner * d + (2 * inner + d if c.get("mamba_proj_bias", False) else 0)
    conv = inner * c.get("mamba_d_conv", 4) + (inner if c.get("mamba_conv_bias", True) else 0)
    ssm = inner * (rank + 2 * state) + rank * inner + inner + inner * state + inner
    return proj + conv + ssm + rank + 2 * state


def _lightning_params(c: dict) -> int:
    """MiniMax's lightning (linear) attention, I = H·h: qkv_proj [3I, d], out_proj [d, I], output_gate [I, d], an
    RMSNorm over I."""
    d, heads = c["hidden_size"], c["num_attention_heads"]
    inner = heads * (c.get("head_dim") or d // heads)
    return 5 * inner * d + inner


def _mamba2_params(c: dict) -> int:
    """GraniteMoE-Hybrid's Mamba-2 mixer (``bills_hybrid.mamba2_mixer_params``), I = mamba_expand·d inner channels,
    ``mamba_n_heads`` heads, ``mamba_n_groups`` groups of state ``mamba_d_state``."""
    d = c["hidden_size"]
    return mamba2_mixer_params(d, inner=int(c.get("mamba_expand", 2) * d), heads=c["mamba_n_heads"],
                               groups=c.get("mamba_n_groups", 1), state=c["mamba_d_state"],
                               kernel=c.get("mamba_d_conv", 4), conv_bias=c.get("mamba_conv_bias", True),
                               proj_bias=c.get("mamba_proj_bias", False))


def _mla_params(c: dict) -> int:
    """DeepSeek's multi-head latent attention: low-rank q (optional) and a shared compressed kv."""
    d, heads, q_rank, kv_rank = c["hidden_size"], c["num_attention_heads"], c.get("q_lora_rank"), c["kv_lora_rank"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    q = d * q_rank + q_rank + q_rank * heads * qk_head if q_rank else d * heads * qk_head  # a, norm, b
    kv_a = d * (kv_rank + c["qk_rope_head_dim"]) + kv_rank  # compress to the latent + rope key, norm
    kv_b = kv_rank * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])  # latent -> per-head k_nope, v
    return q + kv_a + kv_b + heads * c["v_head_dim"] * d  # + o_proj


def _v4_attention_params(c: dict, layer_type: str) -> int:
    """DeepSeek-V4's attention: low-rank q (a, norm, b), one kv head shared by key and value (and its norm), the
    grouped low-rank output (o_a: g blocks of [o_rank, H·h/g]; o_b [d, g·o_rank]), a sink a head; a compressed
    layer's compressor (kv and gate projections to w, a position bias [rate, w], a norm of h: w = h heavily
    compressed, 2h sparse, whose lightning indexer adds the same at its head dim ih, its q_b [iH·ih, q_rank] and
    head weights [iH, d]). Without this reading (grouped-query) V4-Flash's bill was 290.9B total, 20.4B active,
    against the card's 284B and 13B."""
    d, heads, h, q_rank = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    o_rank = c["o_lora_rank"]
    core = (d * q_rank + q_rank + q_rank * heads * h + d * h + h + o_rank * heads * h + c["o_groups"] * o_rank * d
            + heads)
    if layer_type == "sliding_attention":
        return core
    rate = c["compress_rates"][layer_type]
    if layer_type == "heavily_compressed_attention":
        return core + 2 * d * h + rate * h + h
    ih, i_heads = c["index_head_dim"], c["index_n_heads"]
    indexer = 2 * d * 2 * ih + rate * 2 * ih + ih + q_rank * i_heads * ih + d * i_heads
    return core + 2 * d * 2 * h + rate * 2 * h + h + indexer


def _hy_v4_attention_params(c: dict, layer: int) -> int:
    """HY-V4's attention: DeepSeek's MLA, an output gate [H·v, d] and a sink a head; on its ``indexer_types``' "full"
    layers a DSA indexer (q_b [iH·ih, q_rank], k [ih, d], a LayerNorm of ih, head weights [iH, d]); a "shared" layer
    reuses the previous one's choice."""
    d, heads, v = c["hidden_size"], c["num_attention_heads"], c["v_head_dim"]
    own = heads * v * d + heads
    if c["indexer_types"][layer] == "full":
        ih, i_heads = c["index_head_dim"], c["index_n_heads"]
        own += c["q_lora_rank"] * i_heads * ih + d * ih + 2 * ih + d * i_heads
    return _mla_params(c) + own


def _hyper_connection_params(c: dict, layers: int) -> int:
    """DeepSeek-V4's manifold-constrained hyper-connections over N = hc_mult residual streams: per layer two mixers
    (attention's, the MLP's) of a projection [(2 + N)·N, N·d], its bias and 3 scales; HY-V4's without the comb
    output, [2N, N·d], 2N, 2; the head's [N, N·d], N, 1. 0 for every other family."""
    if c["model_type"] not in ("deepseek_v4", *HY_V4):
        return 0
    d, n = c["hidden_size"], c["hc_mult"]
    outputs, scales = (2 * n, 2) if c["model_type"] in HY_V4 else ((2 + n) * n, 3)
    mixer = outputs * n * d + outputs + scales
    return layers * 2 * mixer + n * n * d + n + 1

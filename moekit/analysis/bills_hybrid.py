"""Whole-model bills of the decoder-only families whose layers are their own, each counted as transformers 5.25's
model holds its tensors (``tests/test_analysis_whole.py`` holds each part against that model built on the meta device):

- Nemotron-H: one mixer a layer (Mamba-2, attention, an ungated MLP or the MoE block, ``nemotron_h_layer_types``) and
  one RMSNorm before it;
- DBRX: its own fields (``d_model``, ``n_layers``, ``n_heads``, ``attn_config.kv_n_heads``), a fused Wqkv, two
  LayerNorms a layer (weights only), a MoE block on every layer;
- JetMoE: attention that is itself a mixture of experts (MoA: E query / output projection pairs, k of them a token,
  beside one shared kv projection), a MoE block on every layer.

Shapes: V = vocab, d = hidden size, L = layers, H = attention heads, H_kv = key/value heads, h = head dim.
"""

from __future__ import annotations

from moekit.analysis.bill_parts import ParamBill, moe_parts
from moekit.analysis.billed import BilledLayer, nemotron_h_layer_types


def mamba2_mixer_params(d: int, inner: int, heads: int, groups: int, state: int, kernel: int, conv_bias: bool,
                        proj_bias: bool) -> int:
    """A Mamba-2 mixer of I = ``inner`` channels, H ``heads``, G ``groups`` of state S, C = I + 2GS conv channels:
    in_proj [I + C + H, d], a depthwise conv [C, 1, kernel] (its bias with ``conv_bias``), dt_bias, A_log and D [H]
    each, a gated RMSNorm over I, out_proj [d, I] (in and out biases with ``proj_bias``)."""
    conv = inner + 2 * groups * state
    in_proj = (d + proj_bias) * (inner + conv + heads)
    return in_proj + conv * (kernel + conv_bias) + 3 * heads + inner + inner * d + (d if proj_bias else 0)


def _first(c: dict, names: tuple[str, ...], default):
    """The first of ``names`` the file has (a config class's name, then the older one its ``__post_init__`` renames),
    else the class default."""
    return next((c[name] for name in names if name in c), default)


def _nemotron_h_mamba(c: dict) -> int:
    """Nemotron-H's Mamba-2: I = ``mamba_num_heads``·``mamba_head_dim`` (not expand·d), NemotronHConfig's defaults
    and its older names (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_conv_bias``)."""
    heads = c.get("mamba_num_heads", 128)
    return mamba2_mixer_params(c["hidden_size"], inner=heads * c.get("mamba_head_dim", 64), heads=heads,
                               groups=_first(c, ("n_groups", "mamba_n_groups"), 8), state=c.get("ssm_state_size", 128),
                               kernel=_first(c, ("conv_kernel", "mamba_d_conv"), 4),
                               conv_bias=_first(c, ("use_conv_bias", "mamba_conv_bias"), True),
                               proj_bias=c.get("use_bias", False))


def _nemotron_h(c: dict, layer: BilledLayer) -> ParamBill:
    """Nemotron-H: per layer an RMSNorm [d] and its one mixer: Mamba-2, grouped-query attention (q, k, v, o without
    biases, h = ``head_dim``), an ungated MLP (up [width, d], down [d, width], biases with ``mlp_bias``) or the MoE
    block (``BilledLayer``'s); the final norm, the embedding and an untied head. Its multi-token-prediction layers are
    not built by transformers' model (their weights are ignored on load), and not counted."""
    d, vocab, types = c["hidden_size"], c["vocab_size"], nemotron_h_layer_types(c)
    heads, h = c.get("num_attention_heads", 32), c.get("head_dim", 128)
    attention = d * heads * h + 2 * d * c.get("num_key_value_heads", heads) * h + heads * h * d
    width, bias = c.get("intermediate_size", 21504), bool(c.get("mlp_bias"))
    moe_layers = types.count("moe")
    return ParamBill(
        embedding=vocab * d, output=0 if c.get("tie_word_embeddings", False) else vocab * d,
        attention=types.count("linear_attention") * _nemotron_h_mamba(c) + types.count("full_attention") * attention,
        dense_mlp=types.count("mlp") * (2 * d * width + bias * (width + d)), **moe_parts(layer, moe_layers),
        norms=len(types) * d + d, num_moe_layers=moe_layers, num_dense_layers=len(types) - moe_layers, exact=True)


def _dbrx(c: dict, layer: BilledLayer) -> ParamBill:
    """DBRX: per layer two norms (weights [d]), Wqkv [(H + 2·H_kv)·h, d] (h = d / H, H_kv = ``attn_config``'s
    ``kv_n_heads``, 1 by default), out_proj [d, d], and the MoE block; the final norm, the embedding and the head
    (DBRX refuses tied embeddings)."""
    d, heads, layers, vocab = c["d_model"], c["n_heads"], c["n_layers"], c["vocab_size"]
    kv_heads = (c.get("attn_config") or {}).get("kv_n_heads", 1)
    attention = d * (heads + 2 * kv_heads) * (d // heads) + d * d
    return ParamBill(embedding=vocab * d, output=vocab * d, attention=layers * attention, dense_mlp=0,
                     **moe_parts(layer, layers), norms=2 * layers * d + d, num_moe_layers=layers, num_dense_layers=0,
                     exact=True)


def _jetmoe(c: dict, layer: BilledLayer) -> ParamBill:
    """JetMoE: per layer two RMSNorms, the MoE block, and the mixture of attention heads: kv_proj [2·a, d] (a =
    ``kv_channels``·``num_key_value_heads``), a router [E, d] and an output bias [d] every token runs, and E experts
    (input_linear [a, d], output_linear [d, a]) of which k = ``num_experts_per_tok`` run a token; the final norm, the
    embedding and the head (tied by default)."""
    d, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    inner = c.get("kv_channels", 128) * c.get("num_key_value_heads", 16)
    experts, top_k = layer.config.num_experts, layer.config.top_k
    return ParamBill(embedding=vocab * d, output=0 if c.get("tie_word_embeddings", True) else vocab * d,
                     attention=layers * (2 * inner * d + experts * d + d), dense_mlp=0, **moe_parts(layer, layers),
                     norms=2 * layers * d + d, num_moe_layers=layers, num_dense_layers=0,
                     attention_experts=layers * experts * 2 * d * inner,
                     active_attention_experts=layers * top_k * 2 * d * inner, exact=True)


OWN_LAYERS = {"nemotron_h": _nemotron_h, "dbrx": _dbrx, "jetmoe": _jetmoe}

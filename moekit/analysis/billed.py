"""The MoE layer the byte model bills from a config.json's fields: ``MoEConfig.from_hf_config``'s, or, for a family it
refuses (``moekit.config.REFUSED``: moekit's layer does not compute its router, experts or combine), the numbers a
bill needs alone, read from the family's own fields, with the refusal's reason kept as a note (``BilledLayer.note``).

The byte model needs E, k, the experts' hidden size d and width N, the MoE layers, and the weights of one expert: 3·d·N
for gated experts (w13 [2N, d], w2 [d, N]), 2·d·N for ungated ones (up [N, d], down [d, N]: Nemotron-H, Ergo). A
refused family's layer is billed as a softmax top-k layer of those numbers (the router's rule changes which experts a
batch touches only through skew, which uniform routing leaves out anyway); a number it needs that the config lacks is a
``MissingConfigField`` naming the file's key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.config import REFUSED, UNSERVED, Fields, MissingConfigField, MoEConfig, hf_layer_fields, in_file_words

GATED, UNGATED = 3, 2  # an expert's weights in units of d·N


@dataclass(frozen=True)
class BilledLayer:
    """One MoE layer as the byte model reads it; the parameters are per MoE layer (one expert: ``expert_params``)."""

    config: MoEConfig  # E, k, d, N, MoE layers, shared width (a refused family's: routed as softmax top-k)
    expert_matrices: int  # GATED or UNGATED: one expert holds expert_matrices·d·N weights
    expert_params: int  # one routed expert's weights and biases
    shared_params: int  # the shared experts' (and their gate's) weights
    router_params: int  # the router's weights
    refused: str | None = None  # why moekit cannot serve this layer (REFUSED's reason); None: from_hf_config reads it
    model_type: str = ""
    # an encoder-decoder's encoder MoE layers (``config.num_moe_layers``: the decoder's, which a decode step runs)
    encoder_moe_layers: int | None = None

    @property
    def note(self) -> str | None:
        """For a refused family: what moekit cannot serve, and the numbers the bill uses instead; else None."""
        if self.refused is None:
            return None
        c = self.config
        layers = "an unknown number of" if c.num_moe_layers is None else str(c.num_moe_layers)
        kind = "gated" if self.expert_matrices == GATED else "ungated"
        note = (f"moekit cannot serve this layer ({self.model_type}): {self.refused}; billed as a softmax top-k layer "
                f"of E={c.num_experts}, k={c.top_k}, d={c.hidden_size}, d_ff={c.moe_intermediate_size}, {kind} "
                f"experts ({self.expert_matrices}·d·d_ff weights each), {layers} MoE layers")
        if self.encoder_moe_layers is None:
            return note
        return (f"{note} in the decoder: a decode step runs the decoder only, its cross-attention reading the "
                f"encoder's output; the encoder's {self.encoder_moe_layers} MoE layers run once per prompt (billed "
                "apart: the parameter table's encoder column)")


def billed_layer(hf: dict) -> BilledLayer:
    """The layer of ``hf`` (a config.json's fields; a VL / omni model's top-level config reads its text model's):
    ``from_hf_config``'s (``layer="typical"``) where it reads the family, else a refused (or ``UNSERVED``) family's
    numbers; an ``UNSERVED`` family without them (ViTPose's backbone: no router) raises its reason."""
    d = Fields(hf_layer_fields(hf))
    kind = d.get("model_type")
    if kind not in _REFUSED_READERS:
        cfg = MoEConfig.from_hf_config(d, layer="typical")
        n, k = cfg.moe_intermediate_size, cfg.hidden_size
        return BilledLayer(cfg, GATED, expert_params=3 * k * n + ((2 * n + k) if cfg.expert_bias else 0),
                           shared_params=3 * k * cfg.shared_expert_intermediate_size + (k if cfg.shared_expert_gate
                                                                                        else 0),
                           router_params=(k + cfg.router_bias) * cfg.router_width, model_type=kind)
    with in_file_words(d):  # a bad value named by the file's key, as from_hf_config names it
        numbers = _REFUSED_READERS[kind](d)
        cfg = MoEConfig(**numbers.fields)
    n, k = cfg.moe_intermediate_size, cfg.hidden_size
    return BilledLayer(cfg, numbers.matrices, numbers.matrices * k * n + numbers.expert_bias, numbers.shared_params,
                       numbers.router_params, REFUSED.get(kind) or UNSERVED[kind], kind, numbers.encoder_moe_layers)


@dataclass(frozen=True)
class _Numbers:
    """A refused family's byte-model numbers: the ``MoEConfig`` fields and the per-layer parameters besides."""

    fields: dict
    matrices: int
    shared_params: int
    router_params: int
    expert_bias: int = 0  # one expert's biases (NLLB-MoE's fc1 [N] and fc2 [d])
    encoder_moe_layers: int | None = None  # an encoder-decoder's encoder MoE layers (``fields``' are the decoder's)


def _need(d: dict, *names: str):
    """The first of ``names`` present and not None, else ``MissingConfigField`` naming them (the file's keys)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    raise MissingConfigField(names, d.get("model_type"))


def _layers_of_kind(d: dict, key: str, kinds: tuple[str, ...]) -> int | None:
    """The decoder layers whose ``d[key]`` entry is one of ``kinds``; None when the config has no such list."""
    types = d.get(key)
    return sum(1 for t in types if t in kinds) if isinstance(types, (list, tuple)) else None


def _numbers(d: dict, experts: tuple[str, ...], top_k: tuple[str, ...] | int, layers: int | None,
             hidden: int | None = None, matrices: int = GATED, shared_params: int = 0, router_params: int | None = None,
             width: tuple[str, ...] | int = ("moe_intermediate_size",), expert_bias: int = 0,
             encoder_moe_layers: int | None = None, **extra) -> _Numbers:
    """``top_k`` / ``width``: the keys to read it from, or the family's fixed number (Switch's top-1, Doge's one
    neuron)."""
    hidden = d["hidden_size"] if hidden is None else hidden
    e = _need(d, *experts)
    fields = dict(hidden_size=hidden, moe_intermediate_size=width if isinstance(width, int) else _need(d, *width),
                  num_experts=e, top_k=top_k if isinstance(top_k, int) else _need(d, *top_k), num_moe_layers=layers,
                  **extra)
    return _Numbers(fields, matrices, shared_params, hidden * e if router_params is None else router_params,
                    expert_bias, encoder_moe_layers)


def _gemma4(d: dict) -> _Numbers:
    """Gemma-4 (with ``enable_moe_block``) and DiffusionGemma: experts beside the dense MLP in every layer; the router
    a linear layer with a scale [d] and a per-expert scale [E]."""
    if d["model_type"] == "gemma4_text" and not d.get("enable_moe_block"):
        raise ValueError(f"cfg.enable_moe_block={d.get('enable_moe_block')!r}: this Gemma-4 has no MoE block (its "
                         "layers hold a dense MLP only), so there is no MoE layer to bill")
    e, hidden = _need(d, "num_experts"), d["hidden_size"]
    return _numbers(d, ("num_experts",), ("top_k_experts",), d.get("num_hidden_layers"),
                    router_params=hidden * e + hidden + e)


def _zaya(d: dict) -> _Numbers:
    """ZAYA: a MoE block in every layer; its MLP router (R = router_hidden_size: down_proj [R, d] with a bias, a norm,
    two R x R layers with biases, out_proj [E + 1, R]; the scale of the previous layer's state left out) may choose a
    skip expert (weight 0, no compute), billed as one identity expert: a slot that runs no expert (k·E/(E + 1)
    experts a token under uniform routing)."""
    e, rh = _need(d, "num_experts"), _need(d, "router_hidden_size")
    return _numbers(d, ("num_experts",), ("num_experts_per_tok",), d.get("num_hidden_layers"), num_identity_experts=1,
                    router_params=d["hidden_size"] * rh + 2 * rh + 2 * (rh * rh + rh) + rh * (e + 1))


NEMOTRON_H_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
NEMOTRON_H_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}  # transformers' older names


def nemotron_h_layer_types(d: dict) -> list[str]:
    """Nemotron-H's layers, one mixer each ("linear_attention": Mamba-2, "full_attention", "mlp", "moe"), as its
    config class reads them: ``layers_block_type`` (or ``layer_types``; its older names remapped), else
    ``hybrid_override_pattern``'s letters (M, *, -, E), else the class default of four layers; ``num_hidden_layers``
    is ignored, as there. A layer of no known kind is named."""
    key = "layers_block_type" if d.get("layers_block_type") is not None else "layer_types"
    types = d.get(key)
    if types is None and isinstance(d.get("hybrid_override_pattern"), str):
        key, types = "hybrid_override_pattern", [NEMOTRON_H_PATTERN.get(letter, letter)
                                                 for letter in d["hybrid_override_pattern"]]
    types = ["linear_attention", "moe", "full_attention", "mlp"] if types is None else types
    types = [NEMOTRON_H_LEGACY.get(t, t) for t in types]
    bad = next((t for t in types if t not in NEMOTRON_H_PATTERN.values()), None)
    if bad is not None:
        raise ValueError(f"cfg.{key}={d[key]!r}: {bad!r} is no layer ({', '.join(NEMOTRON_H_PATTERN.values())}; "
                         "in the pattern M, E, *, -)")
    return types


def _nemotron_h(d: dict) -> _Numbers:
    """Nemotron-H: ungated experts (up, relu^2, down) on ``moe_latent_size`` (else d), the shared ungated MLP on d
    (its model builds one whatever ``n_shared_experts`` says) and the latent projections (biases with ``mlp_bias``),
    on its "moe" layers (``nemotron_h_layer_types``)."""
    layers = nemotron_h_layer_types(d).count("moe")
    latent, hidden, bias = d.get("moe_latent_size"), d["hidden_size"], bool(d.get("mlp_bias"))
    width = _need(d, "moe_shared_expert_intermediate_size")
    shared = 2 * hidden * width + bias * (width + hidden)
    latent_proj = (2 * hidden * latent + bias * (latent + hidden)) if latent else 0  # fc1 / fc2, with the shared
    return _numbers(d, ("n_routed_experts", "num_local_experts"), ("num_experts_per_tok",), layers,
                    hidden=latent or hidden, matrices=UNGATED, shared_params=shared + latent_proj,
                    router_params=hidden * _need(d, "n_routed_experts", "num_local_experts"))


def _ergo(d: dict) -> _Numbers:
    """Ergo: ungated experts and a shared ungated MLP on the ``mlp_layer_types`` "sparse" layers; each expert's output
    RMS-normalised (a weight [E, d], counted with the router), the shared MLP's too (a weight [d])."""
    e, hidden = _need(d, "num_experts"), d["hidden_size"]
    return _numbers(d, ("num_experts",), ("num_experts_per_tok",), _layers_of_kind(d, "mlp_layer_types", ("sparse",)),
                    matrices=UNGATED, shared_params=2 * hidden * _need(d, "shared_intermediate_size") + hidden,
                    router_params=2 * hidden * e)


def _inkling2(d: dict) -> _Numbers:
    """Inkling-2 (and its loop): a MoE block in every layer, experts with a soft-capped SwiGLU."""
    return _numbers(d, ("n_routed_experts",), ("num_experts_per_tok",), d.get("num_hidden_layers"))


def _muse_spark(d: dict) -> _Numbers:
    """Muse-Spark: experts on ``moe_hidden_size`` w (projected from d and back, w normalised between: counted with
    the shared parameters), routed from d, on the "sparse" layers."""
    hidden, width = d["hidden_size"], _need(d, "moe_hidden_size")
    return _numbers(d, ("num_local_experts", "num_experts"), ("num_experts_per_tok",),
                    _layers_of_kind(d, "mlp_layer_types", ("sparse",)), hidden=width,
                    shared_params=2 * hidden * width + width,
                    router_params=hidden * _need(d, "num_local_experts", "num_experts"))


def _dbrx(d: dict) -> _Numbers:
    """DBRX: gated experts on every one of its ``n_layers``, its MoE numbers in the nested ``ffn_config`` (named
    here ``ffn_config.<key>``)."""
    ffn = d.get("ffn_config") or {}
    flat = Fields({f"ffn_config.{key}": value for key, value in ffn.items()}, model_type="dbrx", d_model=d["d_model"])
    flat.__dict__["read"] = d.__dict__.setdefault("read", {})  # one record of what was read: in_file_words
    return _numbers(flat, ("ffn_config.moe_num_experts",), ("ffn_config.moe_top_k",), d.get("n_layers"),
                    hidden=flat["d_model"], width=("ffn_config.ffn_hidden_size",))


def _jetmoe(d: dict) -> _Numbers:
    """JetMoE: gated experts (input_linear [E, 2N, d], output_linear [E, d, N]) in every layer; the block's output
    bias [d] counted with the router."""
    return _numbers(d, ("num_local_experts",), ("num_experts_per_tok",), d.get("num_hidden_layers"),
                    width=("intermediate_size",),
                    router_params=d["hidden_size"] * (_need(d, "num_local_experts") + 1))


def _switch_sparse(layers: int, sparse: int) -> int:
    """Switch-Transformers' sparse layers of a stack of ``layers`` of which ``num_sparse_*_layers`` asks ``sparse``:
    its model's rule (every ``step``-th from layer 1, step = layers // sparse, or layers where sparse is 0)."""
    step = layers // sparse if sparse > 0 else layers
    return sum(1 for i in range(layers) if step == 1 or i % step == 1) if step > 0 else 0


def _switch(d: dict) -> _Numbers:
    """Switch-Transformers: top-1, ungated experts (wi [N, d], relu, wo [d, N]) on the decoder's sparse layers (the
    encoder's apart); the router a linear layer (with ``router_bias``)."""
    encoder, decoder = switch_sparse_layers(d)
    e, hidden = _need(d, "num_experts"), _need(d, "d_model")
    return _numbers(d, ("num_experts",), 1, decoder, hidden=hidden, width=("d_ff",), matrices=UNGATED,
                    router_params=(hidden + bool(d.get("router_bias"))) * e, encoder_moe_layers=encoder)


def switch_sparse_layers(d: dict) -> tuple[int, int]:
    """Switch-Transformers' sparse layers, (encoder, decoder): ``_switch_sparse`` of ``num_layers`` and
    ``num_decoder_layers`` (None: ``num_layers``)."""
    layers = _need(d, "num_layers")
    decoder = layers if d.get("num_decoder_layers") is None else d["num_decoder_layers"]
    return (_switch_sparse(layers, d.get("num_sparse_encoder_layers", 3)),
            _switch_sparse(decoder, d.get("num_sparse_decoder_layers", 3)))


def _nllb_moe(d: dict) -> _Numbers:
    """NLLB-MoE: top-2, ungated experts with biases (fc1 [N, d], relu, fc2 [d, N]) on every ``*_sparse_step``-th
    decoder layer (the encoder's apart); one width for both (``encoder_ffn_dim`` = ``decoder_ffn_dim``) or no bill."""
    width, decoder_width = _need(d, "encoder_ffn_dim"), _need(d, "decoder_ffn_dim")
    if width != decoder_width:
        raise ValueError(f"cfg.encoder_ffn_dim={width} and cfg.decoder_ffn_dim={decoder_width} differ: the byte "
                         "model bills one expert width")
    encoder, decoder = (nllb_sparse_layers(d, part) for part in ("encoder", "decoder"))
    e, hidden = _need(d, "num_experts"), _need(d, "d_model")
    return _numbers(d, ("num_experts",), 2, decoder, hidden=hidden, width=("encoder_ffn_dim",), matrices=UNGATED,
                    router_params=(hidden + bool(d.get("router_bias"))) * e, expert_bias=width + hidden,
                    encoder_moe_layers=encoder)


def nllb_sparse_layers(d: dict, part: str) -> int:
    """NLLB-MoE's sparse layers of its ``part`` ("encoder", "decoder"): every ``<part>_sparse_step``-th layer (0:
    none)."""
    step = d.get(f"{part}_sparse_step", 4)
    return _need(d, f"{part}_layers") // step if step > 0 else 0


def _doge(d: dict) -> _Numbers:
    """Doge (``is_moe``): one-neuron ungated experts (a row of down_embed [E, d] and of up_embed [E, d]) routed by
    product keys (router_gate [2·floor(sqrt(E)), d]), beside a dense gated MLP (counted as shared) in every layer."""
    if not d.get("is_moe"):
        raise ValueError(f"cfg.is_moe={d.get('is_moe')!r}: this Doge has no MoE block (its layers hold a dense MLP "
                         "only), so there is no MoE layer to bill")
    e, hidden, width = _need(d, "num_experts"), d["hidden_size"], _need(d, "intermediate_size")
    dense = 3 * hidden * width + ((2 * width + hidden) if d.get("mlp_bias") else 0)
    return _numbers(d, ("num_experts",), ("num_experts_per_tok",), d.get("num_hidden_layers"), matrices=UNGATED,
                    shared_params=dense, router_params=hidden * 2 * math.isqrt(e), width=1)


_REFUSED_READERS = {"gemma4_text": _gemma4, "diffusion_gemma_text": _gemma4, "zaya": _zaya, "nemotron_h": _nemotron_h,
                    "ergo": _ergo, "inkling2_text": _inkling2, "inkling2_loop_text": _inkling2,
                    "muse_spark_text": _muse_spark, "dbrx": _dbrx, "jetmoe": _jetmoe,
                    "switch_transformers": _switch, "nllb-moe": _nllb_moe, "doge": _doge}

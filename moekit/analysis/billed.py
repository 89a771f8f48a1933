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

from dataclasses import dataclass

from moekit.config import REFUSED, Fields, MissingConfigField, MoEConfig, hf_layer_fields, in_file_words

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

    @property
    def note(self) -> str | None:
        """For a refused family: what moekit cannot serve, and the numbers the bill uses instead; else None."""
        if self.refused is None:
            return None
        c = self.config
        layers = "an unknown number of" if c.num_moe_layers is None else str(c.num_moe_layers)
        kind = "gated" if self.expert_matrices == GATED else "ungated"
        return (f"moekit cannot serve this layer ({self.model_type}): {self.refused}; billed as a softmax top-k layer "
                f"of E={c.num_experts}, k={c.top_k}, d={c.hidden_size}, d_ff={c.moe_intermediate_size}, {kind} "
                f"experts ({self.expert_matrices}·d·d_ff weights each), {layers} MoE layers")


# MoE families of transformers that moekit neither reads nor refuses by name (no experts class behind transformers'
# experts interface, so no swap of theirs is built or tested): billed alike, each with why
UNREAD = {
    "dbrx": "DBRX's experts (DbrxExperts: w1, v1, w2 stacked [E·N, d]) are not behind transformers' experts "
            "interface, so neither moe_from_hf nor set_experts_implementation('moekit') takes them",
    "jetmoe": "JetMoE's experts (JetMoeParallelExperts) are not behind transformers' experts interface, and its "
              "attention is a mixture of attention heads routed per token (MoA), which moekit does not compute",
}


def billed_layer(hf: dict) -> BilledLayer:
    """The layer of ``hf`` (a config.json's fields; a VL / omni model's top-level config reads its text model's):
    ``from_hf_config``'s (``layer="typical"``) where it reads the family, else a refused (or ``UNREAD``) family's
    numbers."""
    d = Fields(hf_layer_fields(hf))
    kind = d.get("model_type")
    if kind not in REFUSED and kind not in UNREAD:
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
    return BilledLayer(cfg, numbers.matrices, numbers.matrices * k * n, numbers.shared_params,
                       numbers.router_params, REFUSED.get(kind) or UNREAD[kind], kind)


@dataclass(frozen=True)
class _Numbers:
    """A refused family's byte-model numbers: the ``MoEConfig`` fields and the per-layer parameters besides."""

    fields: dict
    matrices: int
    shared_params: int
    router_params: int


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


def _numbers(d: dict, experts: tuple[str, ...], top_k: tuple[str, ...], layers: int | None, hidden: int | None = None,
             matrices: int = GATED, shared_params: int = 0, router_params: int | None = None,
             width: tuple[str, ...] = ("moe_intermediate_size",), **extra) -> _Numbers:
    hidden = d["hidden_size"] if hidden is None else hidden
    e = _need(d, *experts)
    fields = dict(hidden_size=hidden, moe_intermediate_size=_need(d, *width), num_experts=e,
                  top_k=_need(d, *top_k), num_moe_layers=layers, **extra)
    return _Numbers(fields, matrices, shared_params, hidden * e if router_params is None else router_params)


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


def _nemotron_h(d: dict) -> _Numbers:
    """Nemotron-H: ungated experts (up, relu^2, down) on ``moe_latent_size`` (else d), a shared ungated MLP on d, on
    the layers ``layers_block_type`` (config.json: ``hybrid_override_pattern``'s "E") names "moe"."""
    layers = _layers_of_kind(d, "layers_block_type", ("moe",))
    pattern = d.get("hybrid_override_pattern")
    if layers is None and isinstance(pattern, str):
        layers = pattern.count("E")
    latent, hidden = d.get("moe_latent_size"), d["hidden_size"]
    shared = 2 * hidden * _need(d, "moe_shared_expert_intermediate_size") if d.get("n_shared_experts", 1) else 0
    latent_proj = 2 * hidden * latent if latent else 0  # fc1 / fc2 latent projections, counted with the shared MLP
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


_REFUSED_READERS = {"gemma4_text": _gemma4, "diffusion_gemma_text": _gemma4, "zaya": _zaya, "nemotron_h": _nemotron_h,
                    "ergo": _ergo, "inkling2_text": _inkling2, "inkling2_loop_text": _inkling2,
                    "muse_spark_text": _muse_spark, "dbrx": _dbrx, "jetmoe": _jetmoe}

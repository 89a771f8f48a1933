"""The stated model the simulator prices its runs with: by default Mixtral-8x7B's shapes with E and k replaced; a
run routed as a model read from its config.json fields (``--preset`` / ``--config``) states that model's own.

Mixtral-8x7B (``moekit.presets``): hidden 4096, expert intermediate 14336, 32 MoE layers, grouped-query
attention, 32k vocabulary. One expert costs 3·4096·14336 = 176M parameters per layer. The bill is
``moekit.analysis.param_bill`` of that config with ``num_local_experts = E`` and
``num_experts_per_tok = k``; at the lesson's E = 64, k = 2 it gives 362.4B total, 12.9B active, 28.1×
(the lesson's page shows 362.9G / 13.4G / 27.0×; it counts about 0.5B more non-expert parameters).
DeepSeek-V3's own fields give its 671B total, 37.6B active (embedding included).
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.analysis import ParamBill, get_gpu, param_bill
from moekit.analysis.billed import billed_layer
from moekit.analysis.roofline import expert_flops
from moekit.config import hf_layer_fields
from moekit.presets import hf_config_of_preset

PRESET = "mixtral-8x7b"
EP_GPU = "h100"  # the GPU whose dense bf16 peak prices an expert's work in the EP what-if
EP_DTYPE = "bf16"


@dataclass(frozen=True)
class StatedModel:
    """The whole model whose parameters and expert cost a run states."""

    name: str  # "mixtral-8x7b" (the default shapes) or the model_type of the config the run routes as
    fields: dict  # its MoE layers' config.json fields (a VL model's text_config); the default's with E and k replaced


@dataclass
class ParamCounts:
    """Whole-model parameters for the stated shape with E experts and top-k."""

    total: int  # every parameter, all E experts resident
    active: int  # what one token reads: everything but the E - k experts it did not pick
    sparsity: float  # total / active
    shape: str  # the stated shape, in words


def model_config(num_experts: int, top_k: int) -> dict:
    """The preset's config.json fields with E and k replaced."""
    cfg = hf_config_of_preset(PRESET)
    cfg.update(num_local_experts=num_experts, num_experts_per_tok=top_k)
    return cfg


def stated_model(num_experts: int, top_k: int, fields: dict | None = None) -> StatedModel:
    """The model a run of E experts, top-k states: ``fields`` (a config.json's, whose E and k the run's are) as they
    are (a VL / omni model's: its text model's, ``hf_layer_fields``), or without them Mixtral-8x7B's with E and k
    replaced."""
    if fields is None:
        return StatedModel(PRESET, model_config(num_experts, top_k))
    return StatedModel(str(fields.get("model_type", "config")), hf_layer_fields(fields))


def param_counts(num_experts: int, top_k: int, routed_per_token: float | None = None,
                 model: StatedModel | None = None) -> ParamCounts:
    """The bill of ``model`` (default: ``stated_model(E, k)``); ``routed_per_token`` (k·E/(E + Z) with identity
    experts, whose slots read no expert) prices the active experts instead of k. A config whose fields do not make a
    bill (a field the bill reads is missing) is priced at the default shapes, and the shape says so."""
    model = model or stated_model(num_experts, top_k)
    try:
        bill = param_bill(model.fields)
    except KeyError as err:
        counts = param_counts(num_experts, top_k, routed_per_token)
        counts.shape += f" ({model.name}'s config has no field {err} the bill reads)"
        return counts
    active = bill.active
    if routed_per_token is not None and routed_per_token != top_k:
        active -= round(bill.active_routed_experts * (1 - routed_per_token / top_k))
    layer = billed_layer(model.fields).config
    shape = (f"{model.name} shapes (d={layer.hidden_size}, d_ff={layer.moe_intermediate_size}, {_layers(bill)}) "
             f"with E={num_experts}, k={top_k}")
    if routed_per_token is not None and routed_per_token != top_k:
        shape += f" ({routed_per_token:g} of them experts on average)"
    return ParamCounts(total=bill.total, active=active, sparsity=bill.total / active, shape=shape)


def _layers(bill: ParamBill) -> str:
    """The bill's layers in words: an encoder-decoder's decoder (whose parameters a step's active count reads) and
    encoder."""
    layers = f"{bill.num_moe_layers + bill.num_dense_layers} layers"
    if bill.encoder is None:
        return layers
    return f"{layers} in the decoder, {bill.encoder.num_moe_layers + bill.encoder.num_dense_layers} in the encoder"


def seconds_per_assignment(model: StatedModel | None = None) -> float:
    """Cost model of the EP what-if: one routed token-assignment costs 6·d·d_ff FLOPs in one layer
    (w13 and w2, multiply-add; 4·d·d_ff ungated) at the EP GPU's dense peak; 0.36 µs for Mixtral's expert on an
    H100, the default."""
    billed = billed_layer(model.fields if model else hf_config_of_preset(PRESET))
    layer = billed.config
    flops = expert_flops(1, 1, layer.hidden_size, layer.moe_intermediate_size, billed.expert_matrices)
    return flops / get_gpu(EP_GPU).flops_per_s(EP_DTYPE)

"""Per-layer SwiGLU clamps of a transformers config: the one reader of the clamp a given layer's experts apply.

Step-3.7 (``step3p5``) and Bailing-Hybrid give one limit a decoder layer: the routed experts' ``swiglu_limits[i]``
(Bailing-Hybrid's config.json: ``expert_swiglu_limit_list``) and the shared MLP's ``swiglu_limits_shared[i]``
(``share_expert_swiglu_limit_list``), 0 or None meaning no clamp. Both clamp after the activation (their configs'
``limit_after_act``): min(act(gate), L) * up.clamp(-L, L), ``ActivationSpec(limit=L, limit_after_act=True)``. One
``MoEConfig`` describes one layer, so ``MoEConfig.from_hf_config(cfg, layer=i)`` reads layer i's; without a layer the
MoE layers' clamps must agree (the common case: every layer unclamped), else a ValueError names ``layer``;
``layer="typical"`` (what the whole-model tools read: ``moekit simulate`` / ``analyze`` / ``bench --config``) takes
the clamps most MoE layers share (Step-3.7-Flash, by transformers' modeling note: 40 of its 42 unclamped), ties to
the earliest layer.

Which decoder layers hold a MoE block, the other half of ``layer=``: ``mlp_layer_types`` where the config has it
(``moe_layers``, ``check_layer``), else the family reader's rule of its own fields (``count_moe_layers`` leaves a
``MoELayerRule`` on the fields it read: DeepSeek's ``first_k_dense_replace``, Qwen's ``mlp_only_layers``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from moekit.activations import ActivationSpec, activation_from_hf, shared_glu_activation

# MoEConfig field -> the config's spellings of its per-layer list (transformers' attribute, then config.json's)
_LISTS = {"experts": ("swiglu_limits", "expert_swiglu_limit_list"),
          "shared": ("swiglu_limits_shared", "share_expert_swiglu_limit_list")}


@dataclass(frozen=True)
class LayerClamps:
    """One decoder layer's clamps, each applied after the activation; None: that MLP does not clamp."""

    experts: float | None  # the routed experts' limit L: min(act(gate), L) * up.clamp(-L, L)
    shared: float | None  # the shared MLP's limit, the same form


def _limit_list(d: dict, which: str) -> list | None:
    for name in _LISTS[which]:
        value = d.get(name)
        if value is not None:
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"cfg.{name} must be a list (one limit a decoder layer), got {type(value).__name__}")
            return list(value)
    return None


def has_layer_clamps(d: dict) -> bool:
    """Whether ``d`` gives its SwiGLU clamps per layer (a list of either kind)."""
    return any(_limit_list(d, which) is not None for which in _LISTS)


def layer_clamps(d: dict, layer: int) -> LayerClamps:
    """Layer ``layer``'s clamps (a list's entry 0 or None, or no list: None)."""
    limits = {}
    for which in _LISTS:
        values = _limit_list(d, which)
        if values is not None and len(values) <= layer:
            raise ValueError(f"cfg.{_LISTS[which][0]} has {len(values)} entries: no limit for layer {layer}")
        value = None if values is None else values[layer]
        limits[which] = float(value) if value else None
    return LayerClamps(**limits)


def with_layer_clamps(d: dict, clamps: LayerClamps) -> dict:
    """``d`` with every layer clamped as ``clamps`` says (a transformers block's own limits, ``moe_from_hf``)."""
    out = {k: v for k, v in d.items() if k not in _LISTS["experts"] + _LISTS["shared"]}
    layers = int(d.get("num_hidden_layers") or len(_limit_list(d, "experts") or _limit_list(d, "shared")))
    for which, limit in (("experts", clamps.experts), ("shared", clamps.shared)):
        out[_LISTS[which][0]] = [limit or 0.0] * layers
    return out


@dataclass(frozen=True)
class MoELayerRule:
    """Which decoder layers hold a MoE block, by a family's fields (its reader's rule: ``count_moe_layers``)."""

    is_moe: Callable[[int], bool]  # is_moe(i): decoder layer i holds a MoE block
    fields: str  # the fields the rule reads, for the refusal ("mlp_only_layers, decoder_sparse_step")

    def check(self, layer: int) -> None:
        """A ValueError naming ``layer`` where that decoder layer is a dense one."""
        if not self.is_moe(layer):
            raise ValueError(f"layer {layer} is a dense MLP layer (cfg.{self.fields}), not a MoE layer")


def count_moe_layers(d: dict, is_moe, fields: str = "") -> int | None:
    """The MoE layers among the model's ``num_hidden_layers``; None when the config does not say. A config with
    ``mlp_layer_types`` (one "dense" / "sparse" a layer) says it directly. ``fields``: those ``is_moe`` reads, where
    it can say a layer is dense: the rule is left on ``d`` (``config_hf.Fields.moe_layer_rule``)."""
    types = d.get("mlp_layer_types")
    if isinstance(types, (list, tuple)):
        return sum(1 for t in types if t == "sparse")
    if fields and hasattr(d, "moe_layer_rule"):
        d.moe_layer_rule = MoELayerRule(is_moe, fields)
    layers = d.get("num_hidden_layers")
    return None if layers is None else sum(1 for i in range(layers) if is_moe(i))


def with_moe_layers(d: dict, fields: dict) -> dict:
    """A reader's ``fields``, refused where they count no MoE layer: named by the fields the user set (the reader's
    rule, ``Fields.moe_layer_rule``; ``mlp_layer_types``) and the layer count, not MoEConfig's ``num_moe_layers=0``
    (DeepSeek-V3 with ``first_k_dense_replace >= num_hidden_layers``)."""
    if fields.get("num_moe_layers") != 0:
        return fields
    rule = getattr(d, "moe_layer_rule", None)
    names = rule.fields.split(", ") if rule is not None else ["mlp_layer_types"] if d.get("mlp_layer_types") else []
    said = "".join(f"{name}={d.get(name)!r}, " for name in names if name != "num_hidden_layers")
    raise ValueError(f"cfg.{said}num_hidden_layers={d.get('num_hidden_layers')!r}: no decoder layer holds a MoE block "
                     "(a dense model), so there is no MoE layer for moekit to read")


def ernie_moe_layers(d: dict) -> int | None:
    """ERNIE-4.5-MoE's MoE blocks: layers start..end (inclusive; end -1: the last) where (i + 1) % interval == 0."""
    start, interval = d.get("moe_layer_start_index") or 0, d.get("moe_layer_interval") or 1
    end = d.get("moe_layer_end_index")
    end = (d.get("num_hidden_layers") or 0) - 1 if end in (None, -1) else end
    return count_moe_layers(d, lambda i: start <= i <= end and (i + 1) % interval == 0,
                            "moe_layer_start_index, moe_layer_end_index, moe_layer_interval")


MOE_LAYER_KINDS = ("sparse", "moe", "hash_moe")  # mlp_layer_types' MoE layers (DeepSeek-V4: "moe", "hash_moe")


def moe_layers(d: dict) -> list[int]:
    """The decoder layers holding a MoE block: ``mlp_layer_types``' MoE ones where the config says, else all."""
    types = d.get("mlp_layer_types")
    if isinstance(types, (list, tuple)):
        return [i for i, kind in enumerate(types) if kind in MOE_LAYER_KINDS]
    return list(range(int(d.get("num_hidden_layers") or len(_limit_list(d, "experts") or []))))


TYPICAL = "typical"  # from_hf_config's layer: the clamps most MoE layers share


def check_layer(d: dict, layer: Any) -> None:
    """``layer`` is None, ``TYPICAL`` or the index of one of ``d``'s MoE layers; a ValueError / TypeError naming it."""
    if layer is None or layer == TYPICAL:
        return
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int (a decoder layer's index), None or {TYPICAL!r}, got {layer!r}")
    total = d.get("num_hidden_layers")
    if layer < 0 or (total is not None and layer >= total):
        raise ValueError(f"layer must be in [0, {total}) (cfg.num_hidden_layers), got {layer}")
    types = d.get("mlp_layer_types")
    if isinstance(types, (list, tuple)) and layer < len(types) and types[layer] not in MOE_LAYER_KINDS:
        raise ValueError(f"layer {layer} is a {types[layer]!r} MLP layer (cfg.mlp_layer_types), not a MoE layer")


def clamp_fields(d: dict, layer: int | None, fields: dict) -> dict:
    """``fields`` (a reader's ``MoEConfig`` fields) with the experts' and the shared MLP's activation of layer
    ``layer``'s clamps; ``layer=None``: the MoE layers' clamps, which must agree (else a ValueError naming ``layer``
    and the layers that differ); ``TYPICAL``: the clamps most MoE layers share (ties: the earliest layer's)."""
    if layer is None or layer == TYPICAL:
        layers = moe_layers(d)
        found = {i: layer_clamps(d, i) for i in layers}
        distinct = sorted(set(found.values()), key=lambda c: layers.index(next(i for i in layers if found[i] == c)))
        if layer == TYPICAL and distinct:
            distinct = [max(distinct, key=lambda c: sum(found[i] == c for i in layers))]  # max keeps the earliest tie
        if len(distinct) > 1:
            by_clamp = {c: [i for i in layers if found[i] == c] for c in distinct}
            said = "; ".join(f"layers {ls[:4]}{'...' if len(ls) > 4 else ''}: experts {c.experts}, shared {c.shared}"
                             for c, ls in by_clamp.items())
            raise ValueError(f"cfg clamps its MoE layers' SwiGLU per layer ({_LISTS['experts'][0]}, "
                             f"{_LISTS['shared'][0]}) and they differ ({said}): pass layer=i, the layer this "
                             f"MoEConfig describes (or layer={TYPICAL!r}: the clamps most of them share)")
        clamps = distinct[0] if distinct else LayerClamps(None, None)
    else:
        clamps = layer_clamps(d, layer)
    name = activation_from_hf(d.get("hidden_act", "silu"))
    experts = name if clamps.experts is None else ActivationSpec(name, limit=clamps.experts, limit_after_act=True)
    out = dict(fields, activation=experts)
    if fields.get("shared_expert_intermediate_size"):
        out["shared_activation"] = shared_glu_activation(experts, name, clamps.shared, limit_after_act=True)
    return out

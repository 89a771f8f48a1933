"""DeepSeek-V4's reader for ``MoEConfig.from_hf_config`` (split from ``config_hf.py``, which is at its size limit):
its top-k MoE layers, as transformers' ``DeepseekV4TopKRouter`` and ``DeepseekV4SparseMoeBlock`` compute them.

    router: scores = sqrt(softplus(x @ W^T)) [M, E]; top-k of scores + e_score_correction_bias (no groups); weights =
            the chosen unbiased scores / (their sum + 1e-20) (always: norm_topk_prob not read) x routed_scaling_factor
    experts and shared MLP: act(gate.clamp(max=L)) * up.clamp(-L, L) at L = swiglu_limit; one shared MLP of the
            experts' width (moe_intermediate_size; the block builds it whatever n_shared_experts says)

Its first layers (``mlp_layer_types[i] == "hash_moe"``, 3 by default) hash-route (``DeepseekV4HashRouter``): the
experts a token runs are ``tid2eid[input_ids]``, a fixed [vocab_size, k] table of the token's id, weighted by the same
scores gathered there, divided by their sum + 1e-20, times routed_scaling_factor (no correction bias). ``layer=i`` of a
hash layer reads it as ``hash_table_size=vocab_size`` (``moekit.HashMoE``; ``hash_layer_fields``), as does
``layer=None`` for a config whose MoE layers all hash-route; otherwise the top-k layers' config. ``num_moe_layers``
counts both kinds.
"""

from __future__ import annotations

from moekit.activations import ActivationSpec, activation_from_hf

# transformers' renormalisation w / (sum(w) + 1e-20): DeepSeek-V3's router and its copies, DeepSeek-V4's (both routers),
# Mistral-4's, AFMoE's, Hunyuan-V3's (``MoEConfig.renorm_eps``; moekit.routing.hash_route's RENORM_EPS)
HF_RENORM_EPS = 1e-20
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")  # the config's scoring_func: moekit's scoring of one name


def hash_layers(d: dict) -> list[int]:
    """The layers of ``d`` (a DeepSeek-V4 config's fields) that hash-route by input ids."""
    return [i for i, kind in enumerate(d.get("mlp_layer_types") or []) if kind == "hash_moe"]


def hash_layer_fields(d: dict, layer, fields: dict) -> dict:
    """``fields`` (``read_deepseek_v4``'s) for decoder layer ``layer``: a hash layer's where it is one, or where
    ``layer`` is None and every MoE layer of ``d`` hash-routes; else the top-k layers' as read."""
    hashed = hash_layers(d)
    only_hash = bool(hashed) and "moe" not in (d.get("mlp_layer_types") or [])
    if layer in hashed or (layer is None and only_hash):
        return dict(fields, hash_table_size=d["vocab_size"], use_correction_bias=False)
    return fields


def read_deepseek_v4(d: dict) -> dict:
    """The top-k layers' ``MoEConfig`` fields (the module doc); ``d``: a ``Fields`` of the config."""
    types = d.get("mlp_layer_types")
    scoring = d.get("scoring_func") or "sqrtsoftplus"
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"cfg.scoring_func must be one of {sorted(SCORING_FUNCS)} for DeepSeek-V4, got {scoring!r}")
    limit = d.get("swiglu_limit")
    name = activation_from_hf(d.get("hidden_act") or "silu")
    width = d["moe_intermediate_size"]
    return dict(
        hidden_size=d["hidden_size"], moe_intermediate_size=width, num_experts=d["n_routed_experts"],
        top_k=d["num_experts_per_tok"], scoring=scoring, renormalize=True, renorm_eps=HF_RENORM_EPS,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0), use_correction_bias=True,
        shared_expert_intermediate_size=width,
        activation=name if not limit else ActivationSpec(name=name, limit=float(limit)),
        num_moe_layers=sum(1 for t in types if t in ("moe", "hash_moe")) if isinstance(types, (list, tuple)) else None,
    )

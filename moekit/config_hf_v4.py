"""DeepSeek-V4's reader for ``MoEConfig.from_hf_config`` (split from ``config_hf.py``, which is at its size limit):
its top-k MoE layers, as transformers' ``DeepseekV4TopKRouter`` and ``DeepseekV4SparseMoeBlock`` compute them.

    router: scores = sqrt(softplus(x @ W^T)) [M, E]; top-k of scores + e_score_correction_bias (no groups); weights =
            the chosen unbiased scores / their sum (always: norm_topk_prob is not read) x routed_scaling_factor
    experts and shared MLP: act(gate.clamp(max=L)) * up.clamp(-L, L) at L = swiglu_limit; one shared MLP of the
            experts' width (moe_intermediate_size; the block builds it whatever n_shared_experts says)

Its first layers (``mlp_layer_types[i] == "hash_moe"``, 3 by default) hash-route: the experts a token runs are
``tid2eid[input_ids]``, a fixed table of the token's id, weighted by the same scores. moekit's layer sees the hidden
states only, so those layers are not read: ``num_moe_layers`` counts the top-k layers, a config of hash layers alone
is refused, and ``moe_from_hf`` refuses a hash block naming the layers (``hash_layers``).
"""

from __future__ import annotations

from moekit.activations import ActivationSpec, activation_from_hf

SCORING_FUNCS = {"sqrtsoftplus": "sqrtsoftplus", "sigmoid": "sigmoid", "softmax": "softmax"}  # scoring_func -> moekit


def hash_layers(d: dict) -> list[int]:
    """The layers of ``d`` (a DeepSeek-V4 config's fields) that hash-route by input ids."""
    return [i for i, kind in enumerate(d.get("mlp_layer_types") or []) if kind == "hash_moe"]


def hash_refusal(d: dict) -> str:
    """Why moekit does not serve a hash layer, naming the config's hash layers."""
    return (f"DeepSeek-V4's layers {hash_layers(d)} (mlp_layer_types 'hash_moe') choose each token's experts by "
            "tid2eid[input_ids], a fixed table of its token id; moekit's layer routes the hidden states only (serving "
            "them takes the ids threaded through the layer and a routing of given expert ids). Their experts run on "
            "moekit through model.set_experts_implementation('moekit'), which keeps the block's router")


def read_deepseek_v4(d: dict) -> dict:
    """The top-k layers' ``MoEConfig`` fields (the module doc); ``d``: a ``Fields`` of the config."""
    types = d.get("mlp_layer_types")
    if isinstance(types, (list, tuple)) and types and "moe" not in types:
        raise ValueError(f"every MoE layer of this DeepSeek-V4 config hash-routes: {hash_refusal(d)}")
    scoring = d.get("scoring_func") or "sqrtsoftplus"
    if scoring not in SCORING_FUNCS:
        raise ValueError(f"cfg.scoring_func must be one of {sorted(SCORING_FUNCS)} for DeepSeek-V4, got {scoring!r}")
    limit = d.get("swiglu_limit")
    name = activation_from_hf(d.get("hidden_act") or "silu")
    width = d["moe_intermediate_size"]
    return dict(
        hidden_size=d["hidden_size"], moe_intermediate_size=width, num_experts=d["n_routed_experts"],
        top_k=d["num_experts_per_tok"], scoring=SCORING_FUNCS[scoring], renormalize=True,
        routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0), use_correction_bias=True,
        shared_expert_intermediate_size=width,
        activation=name if not limit else ActivationSpec(name=name, limit=float(limit)),
        num_moe_layers=sum(1 for t in types if t == "moe") if isinstance(types, (list, tuple)) else None,
    )

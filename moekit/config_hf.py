"""``MoEConfig.from_hf_config``'s readers: one transformers ``model_type`` -> the ``MoEConfig`` fields of its MoE
layer, each written from the family's router in transformers' modeling file (what it scores, selects, weights).

A reader returns a dict of ``MoEConfig`` fields (``activation`` defaults to the config's ``hidden_act``). A family
moekit's layer does not compute is in ``REFUSED`` with the reason (``config_hf_refused``). The router options of
session 34 (``MoEConfig.changed_router_options``) are read where a family sets them: Laguna's logit soft-cap,
Kolibri's bias on the logits, Mistral-4's and A.X-K2's group rule and fill, Cohere2-MoE's averaged shared expert,
LongCat's identity experts, Llama-4's input-weighted experts, Phi-MoE's sparsemixer, Inkling's weighted shared experts.
"""

from __future__ import annotations

from moekit.activations import ActivationSpec, activation_from_hf, shared_glu_activation
from moekit.config_hf_clamps import MoELayerRule, count_moe_layers, ernie_moe_layers
from moekit.config_hf_fields import Fields, MissingConfigField  # noqa: F401  (re-exported: config.py)
from moekit.config_hf_fields import get_field as _get
from moekit.config_hf_refused import REFUSED, UNSERVED  # noqa: F401  (re-exported: config.py, the tests)
from moekit.config_hf_v4 import HF_RENORM_EPS, read_deepseek_v4


def _oss_spec(d: dict, interleaved: bool) -> ActivationSpec:
    """gpt-oss's clamped SwiGLU, ``(clamp(up) + 1) * glu``: interleaved (gpt-oss) or halves (the privacy filter,
    MiniMax-M3-VL)."""
    return ActivationSpec("silu", interleaved=interleaved, alpha=float(_get(d, "swiglu_alpha", default=1.702)),
                          limit=float(_get(d, "swiglu_limit", default=7.0)), up_shift=1.0)


def _read_mixtral(d: dict) -> dict:
    return dict(
        hidden_size=d["hidden_size"],
        moe_intermediate_size=d["intermediate_size"],
        num_experts=_get(d, "num_local_experts", "num_experts"),
        top_k=_get(d, "num_experts_per_tok", "moe_topk"),
        scoring="softmax",
        renormalize=True,
        num_moe_layers=d.get("num_hidden_layers"),
    )


def _qwen_moe_layers(d: dict) -> int:
    step, dense = d.get("decoder_sparse_step", 1), set(d.get("mlp_only_layers") or [])
    return count_moe_layers(d, lambda i: i not in dense and (i + 1) % step == 0,
                            "mlp_only_layers, decoder_sparse_step")


def _read_qwen3_moe(d: dict) -> dict:
    """Qwen3-MoE, Qwen3-Omni's thinker, Mellum: softmax top-k, renormalised when norm_topk_prob; Qwen3-VL-MoE
    always renormalises (its router has no switch)."""
    always = d["model_type"] == "qwen3_vl_moe_text"
    return dict(
        hidden_size=d["hidden_size"],
        moe_intermediate_size=d["moe_intermediate_size"],
        num_experts=_get(d, "num_experts", "num_local_experts"),
        top_k=d["num_experts_per_tok"],
        scoring="softmax",
        renormalize=always or bool(_get(d, "norm_topk_prob", default=False)),
        num_moe_layers=_qwen_moe_layers(d),
    )


def _read_qwen2_moe(d: dict) -> dict:
    """Qwen2-MoE, Qwen3-Next, Qwen4-Exp, Qwen3.5-MoE (always renormalised), Qwen3-Omni's talker: a shared expert scaled
    by sigmoid(x @ g). The talker's decoder layer builds its MoE block in every layer (it overwrites the choice by
    mlp_only_layers / decoder_sparse_step), and its config class lacks the shared width its checkpoints carry."""
    shared, always = _get(d, "shared_expert_intermediate_size", default=0), d["model_type"] == "qwen3_5_moe_text"
    fields = dict(_read_qwen3_moe(d), shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)
    if d["model_type"] == "qwen3_omni_moe_talker_text":
        fields["num_moe_layers"] = count_moe_layers(d, lambda i: True, "num_hidden_layers")  # the rule above undone
    return dict(fields, renormalize=always or fields["renormalize"])


# DeepSeek-V2's router as transformers writes it (V2, DeepSeek-OCR-2, Unlimited-OCR): softmax top-k times the scaling,
# never renormalised, whatever the config's norm_topk_prob (the field is there; the router does not read it)
_V2_ROUTER = {"deepseek_v2", "deepseek_ocr2_text", "unlimited_ocr_text"}
# DeepSeek-V3's router (sigmoid, a correction bias for the choice, groups by their top-2 biased scores, w / (sum(w) +
# 1e-20), routed scaling), the same computation in each of these families' modeling files
_V3_ROUTER = {"deepseek_v3", "kimi_k2", "glm4_moe", "glm4_moe_lite", "glm4v_moe_text", "glm5_next_text", "glm_moe_dsa",
              "deepseek_v32", "hy_v4", "hy_v4_vl_text", "solar_open", "minicpm5_moe", "exaone_moe", "dots3_note_text",
              "mimo_v2_flash", "beam", "axk2", "axk1", "dots1",
              "sarvam_moe", "param2moe", "sarvam_mla"}  # config classes over Glm4MoeForCausalLM / DeepseekV3ForCausalLM


def _read_deepseek(d: dict) -> dict:
    """DeepSeek-V2/V3 (and DeepSeek-OCR-2's and Unlimited-OCR's V2 router), and the families of ``_V3_ROUTER``.
    Beam scales the routed output after the combine, which is the same; Dots-3's shared experts have their own
    width; A.X-K1's block norms its output after the layer (``post_mlp_layernorm``: the block's, not the layer's)."""
    v3 = d["model_type"] in _V3_ROUTER
    method = _get(d, "topk_method", default="noaux_tc" if v3 else "greedy")
    grouped = method in ("group_limited_greedy", "noaux_tc")
    # transformers' DeepSeek-V2/V3 (and GLM-4.5's) decoder layer: a MoE block where layer_idx >= first_k_dense_replace;
    # moe_layer_freq (DeepSeek's remote code) is not read there (A.X-K1/K2 turn it into mlp_layer_types)
    first_dense = _get(d, "first_k_dense_replace", default=0)
    scoring = _get(d, "scoring_func", default="sigmoid" if v3 else "softmax")
    shared_width = _get(d, "shared_experts_intermediate_size", default=d["moe_intermediate_size"])
    return dict(
        hidden_size=d["hidden_size"],
        moe_intermediate_size=d["moe_intermediate_size"],
        num_experts=_get(d, "n_routed_experts", "num_local_experts", "num_experts"),
        top_k=d["num_experts_per_tok"],
        scoring=scoring,
        renormalize=d["model_type"] not in _V2_ROUTER and bool(_get(d, "norm_topk_prob", default=False)),
        renorm_eps=HF_RENORM_EPS if v3 else 0.0,  # V3's router: w / (sum + 1e-20)
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
        n_group=_get(d, "n_group", default=1) if grouped else 1,
        topk_group=_get(d, "topk_group", default=1) if grouped else 1,
        use_correction_bias=method == "noaux_tc",
        shared_expert_intermediate_size=_get(d, "n_shared_experts", "num_shared_experts", default=0) * shared_width,
        num_moe_layers=count_moe_layers(d, lambda i: i >= first_dense, "first_k_dense_replace"),
    )


# Experts computing silu(gate.clamp(max=L)) * up.clamp(-L, L) at the config's swiglu_limit L whatever its hidden_act
# (their _apply_gate), DeepSeek-V3's router; the shared MLP's act_fn(gate) * up clamped at L too (True: GLM-5-Next's
# forward clamps) or not (HY-V4's plain MLP)
_SWIGLU_LIMIT_SHARED_CLAMPED = {"hy_v4": False, "hy_v4_vl_text": False, "glm5_next_text": True}


def _read_swiglu_limit(d: dict) -> dict:
    """HY-V4, HY-V4-VL (text), GLM-5-Next (text): ``_read_deepseek``'s router, the experts' clamped SwiGLU and the
    shared MLP's own activation (``activations.shared_glu_activation``, the rule ``moe_from_hf`` applies to the
    block's modules). transformers' default limit is 10."""
    limit = float(_get(d, "swiglu_limit", default=10.0))
    experts = ActivationSpec("silu", limit=limit)
    fields = dict(_read_deepseek(d), activation=experts)
    if fields["shared_expert_intermediate_size"]:
        shared_limit = limit if _SWIGLU_LIMIT_SHARED_CLAMPED[d["model_type"]] else None
        fields["shared_activation"] = shared_glu_activation(experts, activation_from_hf(d.get("hidden_act", "silu")),
                                                            shared_limit)
    return fields


def _read_axk2(d: dict) -> dict:
    """A.X-K2: DeepSeek-V3's router; without groups in its light checkpoints, with groups it fills the dropped
    groups' choice scores with 0, not -inf (a biased score below 0 then loses to them)."""
    fields = _read_deepseek(d)
    if fields["n_group"] == 1:
        return fields
    return dict(fields, group_score="top2_sum", dropped_group_fill="zero")


def _read_mistral4(d: dict) -> dict:
    """Mistral-4 / Mistral-Large-4 (always renormalised): softmax, no bias, routed scaling; with groups (its
    router always runs them: one group by default) a group scores the sum of its top-2 softmax scores and the
    dropped groups' experts score 0 for the choice."""
    fields = _read_deepseek(d)
    n_group, always = _get(d, "n_group", default=1), d["model_type"] == "mistral_large4_text"
    fields = dict(fields, scoring="softmax", use_correction_bias=False, renormalize=always or fields["renormalize"],
                  renorm_eps=HF_RENORM_EPS)
    if n_group == 1:
        return fields
    return dict(fields, n_group=n_group, topk_group=_get(d, "topk_group", default=1), group_score="top2_sum",
                dropped_group_fill="zero")


def _read_kolibri(d: dict) -> dict:
    """Kolibri-1 / 1.1: sigmoid, the correction bias added to the raw logits for the choice, the chosen logits'
    sigmoids renormalised when norm_topk_prob, an ungated shared expert (Kolibri-1.1's mlp_only_layers dense;
    its post-MLP norm sits on the decoder layer, after the block); its gate GEMM in float32 (x and the weight cast)."""
    return dict(_read_qwen3_moe(d), scoring="sigmoid", use_correction_bias=True, correction_bias_on="logits",
                shared_expert_intermediate_size=_get(d, "shared_expert_intermediate_size", default=0),
                router_dtype="float32")


def _read_gpt_oss(d: dict) -> dict:
    """gpt-oss: top-k of the biased logits, then a softmax over the k. That is moekit's softmax over all E
    then renormalised over the k: exp(l_i) / sum_{j in top-k} exp(l_j) either way, and the top-k of the
    logits is the top-k of their softmax (a monotone map). The privacy filter: the same, its weights divided
    by k in the router and its output multiplied by k in the block, and the clamped SwiGLU on halves."""
    interleaved = d["model_type"] == "gpt_oss"  # the privacy filter's gate GEMM in float32 (x and the weight cast)
    return dict(_read_mixtral(d), router_bias=True, expert_bias=True, activation=_oss_spec(d, interleaved),
                router_dtype=None if interleaved else "float32")


_RENORMALISED = ("granitemoe", "granitemoeshared", "granitemoehybrid", "granitemoe_swa", "minimax", "hunyuan_v1_moe")


def _read_softmax_topk(d: dict) -> dict:
    """OLMoE, FlexOlmo, Jamba (softmax, top-k, renormalised when norm_topk_prob), Granite-MoE (top-k of the
    logits then softmax over the k: renormalised, as gpt-oss), MiniMax and Hunyuan (renormalised)."""
    renorm = d["model_type"] in _RENORMALISED
    shared = 0
    if d["model_type"] in ("granitemoeshared", "granitemoehybrid"):  # on the decoder layer, not the block
        shared = _get(d, "shared_intermediate_size", default=0)
    if d["model_type"] == "hunyuan_v1_moe" and _get(d, "use_mixed_mlp_moe", default=True):
        shared = d["intermediate_size"] * _get(d, "num_shared_expert", default=1)
    fields = dict(_read_mixtral(d), renormalize=renorm or bool(_get(d, "norm_topk_prob", default=False)),
                  shared_expert_intermediate_size=shared)
    if d["model_type"] == "jamba":  # a MoE block on every expert_layer_period-th layer, a dense MLP between
        period, offset = _get(d, "expert_layer_period", default=2), _get(d, "expert_layer_offset", default=1)
        fields["num_moe_layers"] = count_moe_layers(d, lambda i: i % period == offset,
                                                    "expert_layer_period, expert_layer_offset")
    return fields


def _read_minimax_m2(d: dict) -> dict:
    """MiniMax-M2: sigmoid scores, a correction bias for the choice, renormalised, no groups. MiniMax-M3-VL: the
    same router, the routed output scaled by routed_scaling_factor, a shared expert, the clamped SwiGLU."""
    fields = dict(_read_mixtral(d), scoring="sigmoid", use_correction_bias=True)
    if d["model_type"] != "minimax_m3_vl_text":
        return fields
    return dict(fields, routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
                shared_expert_intermediate_size=_get(d, "shared_intermediate_size", default=0),
                activation=_oss_spec(d, interleaved=False), num_moe_layers=count_moe_layers(d, lambda i: True))


def _read_sigmoid_topk(d: dict) -> dict:
    """Sigmoid scores, top-k (of the scores plus a correction bias where the family has one), the k renormalised,
    routed scaling, and an ungated shared expert, under each family's own field names: Step-3.5/3.7, Hunyuan-V3,
    Laguna (its logits soft-capped when moe_router_logit_softcapping > 0), AFMoE (bias, always renormalised);
    LFM2-MoE (bias when use_expert_bias, renormalised when norm_topk_prob); Flint (no bias). AFMoE and Hunyuan-V3
    divide by sum(w) + 1e-20, LFM2-MoE by sum(w) + 1e-6, the others by sum(w) alone (0/0 where all underflow)."""
    kind, width = d["model_type"], d["moe_intermediate_size"]
    shared = {"step3p5": _get(d, "share_expert_dim", default=0),
              "hy_v3": width * _get(d, "num_shared_experts", default=0),
              "afmoe": width * _get(d, "num_shared_experts", default=0)}.get(kind)
    first_dense = _get(d, "num_dense_layers", default=0)
    renorm = kind not in ("lfm2_moe", "flint") or bool(_get(d, "norm_topk_prob", default=False))
    return dict(
        hidden_size=d["hidden_size"], moe_intermediate_size=width,
        num_experts=_get(d, "num_experts", "n_routed_experts", "num_local_experts"), top_k=d["num_experts_per_tok"],
        scoring="sigmoid", renormalize=renorm,
        renorm_eps={"afmoe": HF_RENORM_EPS, "hy_v3": HF_RENORM_EPS, "lfm2_moe": 1e-6}.get(kind, 0.0),
        routed_scaling_factor=float(_get(d, "moe_router_scaling_factor", "router_scaling_factor",
                                         "moe_routed_scaling_factor", "route_scale", "routed_scaling_factor",
                                         default=1.0)),
        use_correction_bias=kind != "flint" and (kind != "lfm2_moe" or bool(_get(d, "use_expert_bias", default=True))),
        shared_expert_intermediate_size=_get(d, "shared_expert_intermediate_size", default=0) if shared is None
        else shared,
        router_logit_softcap=float(_get(d, "moe_router_logit_softcapping", default=0.0)),
        num_moe_layers=_qwen_moe_layers(d) if kind == "flint"
        else count_moe_layers(d, lambda i: i >= first_dense, "num_dense_layers"),
    )


def _read_softmax_shared(d: dict) -> dict:
    """Softmax top-k with an ungated shared expert: Lara-Mini (fp32 GEMM, renormalised when norm_topk_prob),
    Aria (top-k of the logits, softmax over the k: renormalised), Cohere2-MoE (softmax over the top-k logits,
    or their sigmoids renormalised when norm_topk_prob; its shared expert summed, or averaged with the routed
    output: shared_expert_combination_strategy)."""
    kind = d["model_type"]
    if kind == "lara_mini":
        return dict(_read_qwen3_moe(d), shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
                    router_dtype="float32")
    width, shared = d["intermediate_size"], _get(d, "moe_num_shared_experts", "num_shared_experts", default=0)
    fields = dict(hidden_size=d["hidden_size"], moe_intermediate_size=width,
                  num_experts=_get(d, "moe_num_experts", "num_experts"),
                  top_k=_get(d, "moe_topk", "num_experts_per_tok"), scoring="softmax", renormalize=True,
                  shared_expert_intermediate_size=width * shared, num_moe_layers=count_moe_layers(d, lambda i: True))
    if kind != "cohere2_moe":
        return fields
    strategy = _get(d, "shared_expert_combination_strategy", default="sum")
    if strategy not in ("sum", "average"):
        raise ValueError(f"cfg.model_type 'cohere2_moe' with shared_expert_combination_strategy={strategy!r}: "
                         "its block takes 'sum' or 'average'")
    if shared:  # without a shared expert the block has nothing to average
        fields.update(shared_expert_combine=strategy)
    if _get(d, "expert_selection_fn", default="softmax") == "sigmoid":
        fields.update(scoring="sigmoid", renormalize=bool(_get(d, "norm_topk_prob", default=False)))
    return fields


def _read_ernie(d: dict) -> dict:
    """ERNIE-4.5-MoE: softmax, a correction bias (``moe_statics``) for the choice, renormalised as w / clamp(sum(w),
    min=moe_norm_min) (``renorm_clamp``: rows whose chosen scores sum below it weigh their scores / moe_norm_min)."""
    shared = _get(d, "moe_num_shared_experts", default=0) * d["moe_intermediate_size"]
    return dict(hidden_size=d["hidden_size"], moe_intermediate_size=d["moe_intermediate_size"],
                num_experts=_get(d, "moe_num_experts", "num_experts"), top_k=_get(d, "moe_k", "num_experts_per_tok"),
                renormalize=True, renorm_clamp=float(_get(d, "moe_norm_min", default=1e-12)), use_correction_bias=True,
                shared_expert_intermediate_size=shared, num_moe_layers=ernie_moe_layers(d))


def _read_ernie_vl(d: dict) -> dict:
    """ERNIE-4.5-VL (its text config): ERNIE-4.5-MoE's router, in float32 as its router, in each sparse block; the
    text experts' width, the first of moe_intermediate_size [text, vision] (moe_from_hf takes a vision block's from
    its experts); its shared experts (text width) sit on the modality block, outside the sparse blocks."""
    widths = d["moe_intermediate_size"]
    text = Fields(d, moe_intermediate_size=widths[0] if isinstance(widths, (list, tuple)) else widths)
    return dict(_read_ernie(text), router_dtype="float32", num_moe_layers=count_moe_layers(d, lambda i: True))


def _read_dots3_vision(d: dict) -> dict:
    """Dots-3-Note's vision tower, a pyramid of MoE layers (each sparse layer's ``per_layer_config`` gives its own
    num_local_experts, which its experts' config carries): sigmoid, the block's correction bias for the choice, w /
    (sum(w) + 1e-20) always, times router_scaling_factor; no groups, no shared expert."""
    return dict(hidden_size=d["hidden_size"], moe_intermediate_size=d["moe_intermediate_size"],
                num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"], scoring="sigmoid", renormalize=True,
                renorm_eps=HF_RENORM_EPS, routed_scaling_factor=float(_get(d, "router_scaling_factor", default=1.0)),
                use_correction_bias=True, num_moe_layers=count_moe_layers(d, lambda i: True))


def _read_kimi_linear(d: dict) -> dict:
    """Kimi-Linear and Bailing-Hybrid (Ling): DeepSeek-V3's router (grouped sigmoid, correction bias, routed
    scaling) under their own field names, and shared experts."""
    n_dim = d["moe_intermediate_size"]
    fields = dict(
        hidden_size=d["hidden_size"], moe_intermediate_size=n_dim,
        num_experts=_get(d, "num_experts", "num_local_experts"),
        top_k=_get(d, "num_experts_per_token", "num_experts_per_tok"),
        scoring="sigmoid", renormalize=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
        renorm_eps=HF_RENORM_EPS, routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
        n_group=_get(d, "num_expert_group", "n_group", default=1), topk_group=_get(d, "topk_group", default=1),
        use_correction_bias=True, shared_expert_intermediate_size=_get(d, "num_shared_experts", "n_shared_experts",
                                                                        default=0) * n_dim,
    )
    return fields if d.get("mlp_layer_types") is None else dict(fields, num_moe_layers=count_moe_layers(d, None))


def _read_llama4(d: dict) -> dict:
    """Llama-4 (text): top-k of the logits, each chosen expert run on sigmoid(its logit) x token (its input, not
    its output: ``expert_weight_on="input"``), no renormalisation, a shared expert of the experts' width always
    added; the MoE layers are the config's moe_layers."""
    layers = d.get("moe_layers")
    if isinstance(layers, (list, tuple)) and isinstance(d, Fields):
        d.moe_layer_rule = MoELayerRule(set(layers).__contains__, "moe_layers")
    return dict(_read_mixtral(d), scoring="sigmoid", renormalize=False, expert_weight_on="input",
                shared_expert_intermediate_size=d["intermediate_size"],
                num_moe_layers=len(layers) if isinstance(layers, (list, tuple)) else d.get("num_hidden_layers"))


def _read_longcat(d: dict) -> dict:
    """LongCat-Flash: softmax over the E routed and Z zero-computation experts, a correction bias for the choice
    (its router always has one), no renormalisation, routed scaling (identity slots too); its router reads the
    classifier's weight alone (a router_bias=True config's bias is never added), x and it cast to float32; its
    num_layers decoder layers hold one MoE block each."""
    return dict(hidden_size=d["hidden_size"], moe_intermediate_size=_get(d, "expert_ffn_hidden_size",
                                                                         "moe_intermediate_size"),
                num_experts=_get(d, "n_routed_experts", "num_local_experts"),
                top_k=_get(d, "moe_topk", "num_experts_per_tok"), scoring="softmax", renormalize=False,
                routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)), use_correction_bias=True,
                num_identity_experts=_get(d, "zero_expert_num", default=0), num_moe_layers=d.get("num_layers"),
                router_dtype="float32")


def _read_phimoe(d: dict) -> dict:
    """Phi-MoE (Phi-3.5-MoE): sparsemixer over the logits, two experts a token whatever num_experts_per_tok (its
    router always runs two rounds), each weighted by a softmax over the logits within 2 * router_jitter_noise of
    its round's max (``sparsemixer_jitter_eps``), not renormalised. At inference only: in training its router samples
    (Gumbel noise, a random 1/3 weight) and its block jitters its input, which moekit refuses."""
    return dict(_read_mixtral(d), top_k=2, renormalize=False,
                sparsemixer_jitter_eps=float(_get(d, "router_jitter_noise", default=0.01)))


def _read_inkling(d: dict) -> dict:
    """Inkling: sigmoid scores, top-k of them plus the correction bias; the router's last n_shared_experts logits
    weight the shared experts (``shared_expert_combine="router"``): the k chosen and the S shared sigmoids
    renormalised together, times route_scale (the router's learned global_scale: moe_from_hf multiplies it in); the
    routing in float32, as its router."""
    shared = _get(d, "n_shared_experts", default=0)
    if not shared:
        raise ValueError("cfg.model_type 'inkling_text' with n_shared_experts=0: its router reads its shared logits as "
                         "the last n_shared_experts columns, which it needs >= 1 of")
    return dict(hidden_size=d["hidden_size"], moe_intermediate_size=d["moe_intermediate_size"],
                num_experts=d["n_routed_experts"], top_k=d["num_experts_per_tok"], scoring="sigmoid",
                renormalize=True, use_correction_bias=True,
                routed_scaling_factor=float(_get(d, "route_scale", default=1.0)),
                shared_expert_intermediate_size=shared * d["moe_intermediate_size"], shared_expert_combine="router",
                router_dtype="float32", num_moe_layers=count_moe_layers(d, lambda i: True))


HF_READERS = {
    "mixtral": _read_mixtral,
    "qwen2_moe": _read_qwen2_moe, "qwen3_next": _read_qwen2_moe, "qwen4_exp_text": _read_qwen2_moe,
    "qwen3_5_moe_text": _read_qwen2_moe, "qwen3_omni_moe_talker_text": _read_qwen2_moe,
    "qwen3_moe": _read_qwen3_moe, "qwen3_omni_moe_text": _read_qwen3_moe, "qwen3_vl_moe_text": _read_qwen3_moe,
    "mellum": _read_qwen3_moe,
    **{name: _read_deepseek for name in sorted(_V2_ROUTER)},
    **{name: _read_deepseek for name in sorted(_V3_ROUTER - {"axk2"} - set(_SWIGLU_LIMIT_SHARED_CLAMPED))},
    **{name: _read_swiglu_limit for name in _SWIGLU_LIMIT_SHARED_CLAMPED},
    "axk2": _read_axk2,
    "mistral4": _read_mistral4, "mistral_large4_text": _read_mistral4,
    "kimi_linear": _read_kimi_linear, "bailing_hybrid": _read_kimi_linear,
    "gpt_oss": _read_gpt_oss, "openai_privacy_filter": _read_gpt_oss,
    **{name: _read_softmax_topk for name in ("olmoe", "flex_olmo", "jamba") + _RENORMALISED},
    "minimax_m2": _read_minimax_m2, "minimax_m3_vl_text": _read_minimax_m2,
    **{name: _read_sigmoid_topk for name in ("step3p5", "hy_v3", "laguna", "afmoe", "lfm2_moe", "flint")},
    **{name: _read_softmax_shared for name in ("lara_mini", "aria_text", "cohere2_moe")},
    "ernie4_5_moe": _read_ernie, "ernie4_5_vl_moe_text": _read_ernie_vl,
    "dots3_note_vision_encoder": _read_dots3_vision,
    "kolibri1": _read_kolibri, "kolibri1_1": _read_kolibri, "longcat_flash": _read_longcat,
    "llama4_text": _read_llama4, "phimoe": _read_phimoe, "inkling_text": _read_inkling,
    "deepseek_v4": read_deepseek_v4,  # top-k layers; hash layers by from_hf_config(cfg, layer=i) (config_hf_v4.py)
}

"""``MoEConfig``: the shapes and router settings of one MoE layer.

Shape legend used across moekit:
    M = tokens, K = hidden size (d), N = one expert's intermediate size (d_ff),
    E = routed experts, k = experts per token, S = shared-expert slots.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from moekit._checks import check_bool, check_choice, check_int, check_positive_finite, check_renorm
from moekit.activations import ActivationSpec, activation_from_hf, as_spec
from moekit.config_hf import HF_READERS, REFUSED, UNSERVED, Fields, MissingConfigField  # noqa: F401 (re-exported)
from moekit.config_hf_fields import in_file_words
from moekit.config_hf_refused import model_type_error
from moekit.config_hf_clamps import check_layer, clamp_fields, has_layer_clamps, with_moe_layers
from moekit.config_hf_v4 import hash_layer_fields
from moekit.presets import hf_config_of_preset

Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus"]  # sqrtsoftplus: sqrt(softplus(logits)) (DeepSeek-V4)
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
NonFinitePolicy = Literal["raise", "mask"]
RouterDtype = Literal["float32", "float64", "bfloat16", "float16"]
ROUTER_DTYPES = ("float32", "float64", "bfloat16", "float16")
# The router's and the block's options (session 34), each a value of a real family; the first is the default.
BiasOn = Literal["scores", "logits"]  # where the correction bias is added for the choice (Kolibri: logits)
GroupScore = Literal["auto", "max", "top2_sum"]  # a group's score ("auto": top2_sum with a bias, max without)
GroupFill = Literal["-inf", "zero"]  # what a dropped group's experts score for the choice (A.X-K2, Mistral-4: zero)
# routed + shared, their average (Cohere2-MoE), or each shared slot weighted by the router (Inkling)
SharedCombine = Literal["sum", "average", "router"]
WeightOn = Literal["output", "input"]  # a slot's weight scales its expert's output, or its input (Llama-4)
ROUTER_OPTIONS = ("correction_bias_on", "group_score", "dropped_group_fill", "router_logit_softcap",
                  "shared_expert_combine", "num_identity_experts", "expert_weight_on", "sparsemixer_jitter_eps",
                  "renorm_clamp")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer. Every field is checked in ``__post_init__``.

    ``shared_expert_intermediate_size`` is the total width of the always-on shared MLP (0 = none).
    When it is a multiple of ``moe_intermediate_size`` the shared MLP splits exactly into
    ``num_shared_slots`` experts of the routed width, which is what lets it run as extra routed slots (only when
    ``shared_activation`` is None or the experts' own: the slots run the experts' activation).
    """

    hidden_size: int  # K
    moe_intermediate_size: int  # N
    num_experts: int  # E, routed experts
    top_k: int  # k
    scoring: Scoring = "softmax"
    renormalize: bool = True
    # eps > 0: renormalise as w / (sum(w) + eps), the family's formula (DeepSeek-V3's 1e-20: a row whose chosen scores
    # all underflow weighs ~0); 0: the exact w / sum(w), finite for every finite row (moekit.routing.route)
    renorm_eps: float = 0.0
    renorm_clamp: float = 0.0  # c > 0: w / max(sum(w), c), ERNIE-4.5's moe_norm_min (``route``; fused: router="fused")
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    use_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
    correction_bias_on: BiasOn = "scores"  # the bias shifts the scores (DeepSeek-V3), or the logits (Kolibri)
    group_score: GroupScore = "auto"  # a group scores its max or its top-2 sum (Mistral-4: top2_sum, no bias)
    dropped_group_fill: GroupFill = "-inf"  # "zero": a dropped group's experts can still win at score 0
    router_logit_softcap: float = 0.0  # c > 0: logits -> c * tanh(logits / c) before scoring (Laguna); 0: none
    # eps >= 0: Phi-MoE's sparsemixer at inference (k argmax rounds, each weighted by a softmax over the logits
    # within 2 eps of its max, relatively); None: top-k of the scores. Sampled in training: the layer refuses that
    sparsemixer_jitter_eps: float | None = None
    # V > 0: the experts of a token are a fixed table's row, tid2eid[token id] [V, k] (DeepSeek-V4's hash layers:
    # moekit.HashMoE, whose forward takes the token ids); the scores only weight them. None: top-k of the scores
    hash_table_size: int | None = None
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(x @ g)
    # "average": (routed + shared) / 2 (Cohere2-MoE); "router": the router's logits [M, E + S] end with one per
    # shared slot, whose sigmoids join the k chosen ones' renormalisation and weight the slots (Inkling)
    shared_expert_combine: SharedCombine = "sum"
    # Z zero-computation experts (LongCat-Flash): router ids E..E+Z-1 return their input times their weight
    num_identity_experts: int = 0
    expert_weight_on: WeightOn = "output"  # "input": each slot's expert runs on weight x token (Llama-4)
    activation: str | ActivationSpec = "silu"  # a name, or a spec (gpt-oss: clamped SwiGLU, interleaved)
    # the shared MLP's own (HY-V4: a plain silu beside its clamped experts); None: the experts' activation
    shared_activation: str | ActivationSpec | None = None
    router_bias: bool = False  # gpt-oss: the router Linear has a bias [E]
    expert_bias: bool = False  # gpt-oss: b13 [E, 2N] after the gate-up GEMM, b2 [E, K] after the down GEMM
    nonfinite: NonFinitePolicy = "raise"  # NaN/inf router logits: raise, or mask the expert out
    num_moe_layers: int | None = None  # MoE layers in the whole model, when known
    # Training (issue #17): MoE.forward(return_aux_loss=True).aux_loss (no host read; or return_stats=True's) =
    # the sum of coefficient x loss of moekit.losses (load_balancing_loss, sequence_balance_loss, z_loss); None
    # when all three are 0.
    aux_loss_coef: float = 0.0  # Switch/GShard load balance (Mixtral, Qwen: router_aux_loss_coef 0.001)
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance factor alpha (0.0001)
    z_loss_coef: float = 0.0  # ST-MoE router z-loss (0.001)
    # The gate GEMM and the routing in this dtype ("float32", "float64"), as Megatron's moe_router_dtype:
    # x and the gate weight are cast for the GEMM, the weight parameter keeps its own dtype. None: the
    # gate weight's dtype.
    router_dtype: RouterDtype | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
            check_int(name, getattr(self, name))
        check_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size, minimum=0)
        check_int("num_identity_experts", self.num_identity_experts, minimum=0)
        if self.num_identity_experts and self.n_group > 1:
            raise ValueError(f"num_identity_experts > 0 routes without expert groups, got n_group={self.n_group}")
        if self.num_moe_layers is not None:
            check_int("num_moe_layers", self.num_moe_layers)
        for name in ("renormalize", "use_correction_bias", "shared_expert_gate", "router_bias", "expert_bias"):
            check_bool(name, getattr(self, name))
        check_positive_finite("routed_scaling_factor", self.routed_scaling_factor)
        check_renorm(self.renorm_eps, self.renorm_clamp, self.renormalize)
        if self.top_k > self.choice_width:
            what = "num_experts" if not self.num_identity_experts else "num_experts + num_identity_experts"
            raise ValueError(f"top_k must be <= {what} ({self.choice_width}), got {self.top_k}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.num_experts % self.n_group != 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group must be <= n_group ({self.n_group}), got {self.topk_group}")
        if self.n_group > 1 and self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the experts in the topk_group={self.topk_group} kept groups "
                f"({self.topk_group * (self.num_experts // self.n_group)})"
            )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate=True needs shared_expert_intermediate_size > 0")
        self._check_options()
        spec = as_spec(self.activation)  # raises, naming the argument, for an unknown one
        if not spec.gated:
            raise ValueError("activation must be gated: the MoE layer holds w13 [E, 2N, K] (an ungated spec "
                             "runs through moekit.experts and moekit.hf, not the layer)")
        self._check_shared_activation()
        if self.nonfinite not in ("raise", "mask"):
            raise ValueError(f"nonfinite must be 'raise' or 'mask', got {self.nonfinite!r}")
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.router_dtype is not None and self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype must be None or one of {ROUTER_DTYPES}, got {self.router_dtype!r}")

    def _check_shared_activation(self) -> None:
        if self.shared_activation is None:
            return
        try:
            spec = as_spec(self.shared_activation)
        except (TypeError, ValueError) as err:
            raise type(err)(f"shared_activation must be None (the experts' activation), a name or an ActivationSpec: "
                            f"{err}") from None
        if not spec.gated:
            raise ValueError("shared_activation must be gated: the shared MLP holds w13 [2SN, K]")
        if not self.shared_expert_intermediate_size:
            raise ValueError("shared_activation needs shared_expert_intermediate_size > 0")

    def _check_options(self) -> None:
        """The session-34 options: each one of its values, and the combinations a family can have."""
        for name, allowed in (("correction_bias_on", BiasOn), ("group_score", GroupScore),
                              ("dropped_group_fill", GroupFill), ("shared_expert_combine", SharedCombine),
                              ("expert_weight_on", WeightOn)):
            check_choice(name, getattr(self, name), get_args(allowed))
        cap = self.router_logit_softcap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 <= cap < float("inf"):
            raise ValueError(f"router_logit_softcap must be a finite number >= 0 (0: none), got {cap!r}")
        if self.group_score == "top2_sum" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError(f"group_score='top2_sum' needs >= 2 experts a group, got num_experts="
                             f"{self.num_experts} over n_group={self.n_group}")
        if self.shared_expert_combine == "average" and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_combine='average' needs shared_expert_intermediate_size > 0")
        if self.sparsemixer_jitter_eps is not None:
            self._check_sparsemixer()
        if self.shared_expert_combine == "router":
            self._check_router_weighted_shared()
        if self.hash_table_size is not None:
            self._check_hash_routed()

    def _check_hash_routed(self) -> None:
        """A token-id table chooses the experts (``moekit.routing.hash_route``): nothing of the top-k choice (bias,
        groups, identity experts, sparsemixer, router-weighted shared slots, masking) composes with it."""
        check_int("hash_table_size", self.hash_table_size)
        clashing = {name: getattr(self, name) for name, plain in (
            ("use_correction_bias", False), ("n_group", 1), ("num_identity_experts", 0),
            ("sparsemixer_jitter_eps", None), ("shared_expert_combine", "sum"), ("nonfinite", "raise"),
            ("expert_weight_on", "output"), ("renorm_clamp", 0.0)) if getattr(self, name) != plain}
        if clashing:
            raise ValueError(f"hash_table_size routes by a token-id table: no correction bias, n_group=1, no identity "
                             f"experts, no sparsemixer, shared_expert_combine='sum', nonfinite='raise', "
                             f"expert_weight_on='output' and renorm_clamp=0 (V4's hash layers), got {clashing}")

    def _check_router_weighted_shared(self) -> None:
        """Inkling's router-weighted shared slots: S = num_shared_slots logits after the E routed ones, renormalised
        with the k chosen sigmoids; no groups, identity experts, shared gate, input weighting or masking with it."""
        if not self.num_shared_slots:
            raise ValueError("shared_expert_combine='router' needs shared_expert_intermediate_size, a multiple of "
                             "moe_intermediate_size (one router logit a shared slot)")
        clashing = {name: getattr(self, name) for name, plain in (
            ("scoring", "sigmoid"), ("renormalize", True), ("n_group", 1), ("num_identity_experts", 0),
            ("shared_expert_gate", False), ("expert_weight_on", "output"), ("nonfinite", "raise"), ("renorm_eps", 0.0),
            ("renorm_clamp", 0.0)) if getattr(self, name) != plain}
        if clashing:
            raise ValueError(f"shared_expert_combine='router' routes with scoring='sigmoid', renormalize=True, "
                             f"n_group=1, no identity experts, no shared gate, expert_weight_on='output', "
                             f"nonfinite='raise' and renorm_eps = renorm_clamp = 0 (as Inkling: exact), got {clashing}")

    def _check_sparsemixer(self) -> None:
        """Phi-MoE's sparsemixer weights each round by its own softmax: no scoring rule, bias, groups or
        renormalisation of the usual top-k composes with it."""
        eps = self.sparsemixer_jitter_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
            raise ValueError(f"sparsemixer_jitter_eps must be None or a finite number >= 0, got {eps!r}")
        clashing = {name: getattr(self, name) for name, plain in (("scoring", "softmax"), ("renormalize", False),
                    ("use_correction_bias", False), ("n_group", 1), ("num_identity_experts", 0))
                    if getattr(self, name) != plain}
        if clashing:
            raise ValueError(f"sparsemixer_jitter_eps routes with scoring='softmax', renormalize=False, no correction "
                             f"bias, n_group=1 and no identity experts (as Phi-MoE), got {clashing}")

    def changed_router_options(self) -> dict:
        """The session-34 options (``ROUTER_OPTIONS``) not at their defaults, name -> value. Empty: the routers of
        session 33 (the fused Triton router, the one gate + router launch, the decode fast path) compute this
        config; else ``route`` does, and the fused router where it computes them (``moekit.routing.fused.computes``,
        ``supports``)."""
        return {name: getattr(self, name) for name in ROUTER_OPTIONS
                if getattr(self, name) != MoEConfig.__dataclass_fields__[name].default}

    @property
    def router_width(self) -> int:
        """Columns of the router's logits: E routed experts, then Z identity experts (ids E..E+Z-1), or the S shared
        slots' logits (``shared_expert_combine="router"``: Inkling)."""
        shared = self.num_shared_slots if self.shared_expert_combine == "router" else 0
        return self.num_experts + self.num_identity_experts + shared

    @property
    def choice_width(self) -> int:
        """The experts the router chooses from (the correction bias's width): E, + Z identity experts."""
        return self.num_experts + self.num_identity_experts

    @property
    def routed_slots_per_token(self) -> float:
        """The routed experts a token runs on average under uniform routing: k, or k·E / (E + Z) with Z identity
        experts (their slots run none: LongCat-Flash's "dynamic computation"). The byte model's k."""
        return self.top_k if not self.num_identity_experts else self.top_k * self.num_experts / self.router_width

    @property
    def routed_weight_scale(self) -> float:
        """What the routed weights are multiplied by: ``routed_scaling_factor``, halved where the shared expert
        is averaged in (a power of 2: (a + b) / 2 == a / 2 + b / 2 exactly, barring subnormals)."""
        return self.routed_scaling_factor * self.shared_weight

    @property
    def shared_weight(self) -> float:
        """The shared expert's weight in the output: 1, or 0.5 with ``shared_expert_combine="average"`` (with
        "router" each token's own, ``Routing.shared_weights``)."""
        return 0.5 if self.shared_expert_combine == "average" else 1.0

    @property
    def shared_mlp_activation(self) -> str | ActivationSpec:
        """What the shared MLP computes: ``shared_activation``, or the experts' ``activation`` where it is None."""
        return self.activation if self.shared_activation is None else self.shared_activation

    @property
    def shared_fusable(self) -> bool:
        """Whether the shared MLP can run as routed slots: its activation is the experts' (the slots run theirs)."""
        return as_spec(self.shared_mlp_activation) == as_spec(self.activation)

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def num_shared_slots(self) -> int:
        """S: routed-width slots the shared MLP splits into, or 0 when it has none or cannot split."""
        width, n = self.shared_expert_intermediate_size, self.moe_intermediate_size
        return width // n if width and width % n == 0 else 0

    def replace(self, **changes: Any) -> "MoEConfig":
        """A copy with ``changes`` (each checked as the constructor checks it); an unknown name is a
        ``TypeError`` naming the closest field (dataclasses' own said only "unexpected keyword argument")."""
        fields = [f.name for f in dataclasses.fields(self) if f.init]
        unknown = [name for name in changes if name not in fields]
        if unknown:
            close = difflib.get_close_matches(unknown[0], fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f"; the fields: {fields}"
            raise TypeError(f"MoEConfig has no field {unknown[0]!r}{hint}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "MoEConfig":
        """The real shapes of a published model: see ``moekit.presets.preset_names()``."""
        return cls.from_hf_config(hf_config_of_preset(name))

    @classmethod
    def from_hf_config(cls, cfg: Any, layer: int | str | None = None) -> "MoEConfig":
        """Read a config (transformers object or dict) of a family in ``moekit.config_hf.HF_READERS`` (71 model
        types; a VL / omni model's MoE layer is read from its text config, the one its experts carry, also when
        given the top-level config):
        Mixtral, Qwen2/3-MoE, Qwen3-Next, DeepSeek-V2/V3, Kimi-K2, Kimi-Linear, GLM-4.5, gpt-oss, OLMoE,
        Granite-MoE, Jamba, MiniMax(-M2), ERNIE-4.5-MoE, Hunyuan-MoE, and (session 33) afmoe, aria_text, axk2,
        bailing_hybrid, beam, cohere2_moe, deepseek_ocr2_text, deepseek_v32, dots3_note_text, exaone_moe,
        flex_olmo, flint, glm4_moe_lite, glm4v_moe_text, glm5_next_text, glm_moe_dsa, granitemoe_swa,
        granitemoehybrid, hy_v3, hy_v4, hy_v4_vl_text, laguna, lara_mini, lfm2_moe, mellum, mimo_v2_flash,
        minicpm5_moe, minimax_m3_vl_text, mistral4, mistral_large4_text, openai_privacy_filter, qwen3_5_moe_text,
        qwen3_omni_moe_text, qwen3_vl_moe_text, qwen4_exp_text, solar_open, step3p5, unlimited_ocr_text, and
        (session 34) kolibri1, kolibri1_1, longcat_flash, llama4_text, phimoe, inkling_text, axk1 (its block's
        output norm is the block's: ``moe_from_hf``), ernie4_5_vl_moe_text (the text experts' width). The router
        options of session 34 (``changed_router_options``) are read where a family's config switches them on: Laguna's
        ``moe_router_logit_softcapping`` (``router_logit_softcap``), Kolibri's bias on the logits
        (``correction_bias_on="logits"``), grouped Mistral-4 and A.X-K2 (``group_score="top2_sum"``,
        ``dropped_group_fill="zero"``), Cohere2-MoE's ``shared_expert_combination_strategy="average"``
        (``shared_expert_combine``), LongCat-Flash's zero-computation experts (``num_identity_experts``),
        Llama-4's input-scaled experts (``expert_weight_on="input"``), Phi-MoE's sparsemixer at inference
        (``sparsemixer_jitter_eps``: router_jitter_noise), Inkling's router-weighted shared experts
        (``shared_expert_combine="router"``). A family whose router, experts or combine moekit's layer does not
        compute (``REFUSED``: ZAYA's MLP router, Gemma-4's scaled one, ungated or soft-capped experts, ...) is
        refused, naming why (its experts still run on "moekit").

        ``layer``: the decoder layer this config describes, for a family that clamps its SwiGLU per layer (Step-3.7's
        and Bailing-Hybrid's ``swiglu_limits`` / ``swiglu_limits_shared``, clamped after the activation:
        ``moekit.config_hf_clamps``); None reads the MoE layers' common clamp, and raises a ValueError naming
        ``layer`` where they differ; ``"typical"`` reads the clamps most MoE layers share (the whole-model
        tools'). Any other family has one MoE layer config: ``layer`` is only checked (an index
        of a MoE layer: a dense one is refused by the family's own rule, ``mlp_layer_types``,
        ``first_k_dense_replace``, ``mlp_only_layers`` / ``decoder_sparse_step``,
        ``num_dense_layers`` or Llama-4's ``moe_layers``: ``Fields.moe_layer_rule``).

        A field the layer needs that is absent raises ``MissingConfigField`` (a ``KeyError``) naming it, a bad value
        an error naming the config's key (``in_file_words``); without ``num_hidden_layers``: ``num_moe_layers=None``."""
        if not isinstance(cfg, dict) and not hasattr(cfg, "to_dict"):
            path = ""  # a config.json's path: what `moekit analyze --config` takes, so a user tries one here
            if isinstance(cfg, (str, os.PathLike)):
                path = " (a path?): read it first, MoEConfig.from_hf_config(json.load(open(path)))"
            raise TypeError(f"cfg must be a transformers config or a dict of its fields, got {type(cfg).__name__}"
                            f"{path}")
        # a VL / omni model's top-level config: its MoE layer is the text model's
        d = Fields(hf_layer_fields(cfg if isinstance(cfg, dict) else cfg.to_dict()))
        model_type = d.get("model_type")
        if model_type in REFUSED or model_type in UNSERVED or model_type not in HF_READERS:  # one line saying why
            raise model_type_error(model_type, d, HF_READERS)
        reader = HF_READERS[model_type]
        check_layer(d, layer)
        with in_file_words(d):  # a bad value named by the key the config holds it under, not moekit's field
            fields = with_moe_layers(d, reader(d))  # none: refused naming the fields that say so
            if isinstance(layer, int) and d.moe_layer_rule is not None:  # check_layer passed it: an int in range
                d.moe_layer_rule.check(layer)
            if model_type == "deepseek_v4":  # its hash layers route by a token-id table (moekit.config_hf_v4)
                fields = hash_layer_fields(d, layer, fields)
            fields.setdefault("activation", activation_from_hf(d.get("hidden_act", "silu")))
            if has_layer_clamps(d):
                fields = clamp_fields(d, layer, fields)
            return cls(**fields)


def hf_layer_fields(d: dict) -> dict:
    """The config fields that describe the model's MoE layers: ``d`` where its ``model_type`` is read (``HF_READERS``)
    or refused, else its ``text_config`` where that one's is (a VL / omni model's top-level config.json: Qwen3-VL-MoE,
    Llama-4, HY-V4-VL, whose experts carry the text config), or Qwen3-Omni's ``thinker_config.text_config``, else
    ``d``. The one lookup of ``from_hf_config``, the whole-model bills (``moekit.analysis``) and the simulator's
    stated model."""
    known = set(HF_READERS) | set(REFUSED)
    if d.get("model_type") in known:
        return d
    thinker = d.get("thinker_config")  # Qwen3-Omni: the thinker's text model (its talker is a smaller MoE of its own)
    for text in (d.get("text_config"), thinker.get("text_config") if isinstance(thinker, dict) else None):
        if isinstance(text, dict) and text.get("model_type") in known:
            return text
    return d


def check_layer_args(config, fuse_shared, capacity_factor, drop_policy, stats_block_size, num_local_experts,
                     dtype, eager_graph_rows, layer_cls: type) -> None:
    """``moekit.MoE.__init__``'s arguments besides the config's own fields (``layer_cls``: the class built): a clear
    error naming the one that cannot be honoured."""
    if eager_graph_rows is not None:
        check_int("eager_graph_rows", eager_graph_rows, minimum=1)
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if (config.hash_table_size is not None) != getattr(layer_cls, "takes_token_ids", False):
        raise TypeError(f"config.hash_table_size={config.hash_table_size}: a layer routed by a token-id table is "
                        "moekit.HashMoE (its forward takes token_ids; expert-parallel: moekit.parallel.EPHashMoE; "
                        "offloaded: OffloadedMoE.from_moe of a HashMoE), a top-k one moekit.MoE; got "
                        f"{layer_cls.__name__}")
    check_bool("fuse_shared", fuse_shared)
    if capacity_factor is not None:
        try:
            check_positive_finite("capacity_factor", capacity_factor)
        except ValueError as err:
            raise ValueError(f"{err} (None = dropless)") from None
    if drop_policy not in ("position", "weight"):
        raise ValueError(f"drop_policy must be 'position' or 'weight', got {drop_policy!r}")
    check_int("stats_block_size", stats_block_size)
    if num_local_experts is not None:
        check_int("num_local_experts", num_local_experts, minimum=0)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")

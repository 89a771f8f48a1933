"""``MoEConfig``: the shapes and router settings of one MoE layer.

Shape legend used across moekit:
    M = tokens, K = hidden size (d), N = one expert's intermediate size (d_ff),
    E = routed experts, k = experts per token, S = shared-expert slots.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from moekit._checks import check_bool, check_int, check_positive_finite
from moekit.activations import ActivationSpec, activation_from_hf, as_spec
from moekit.presets import hf_config_of_preset

Scoring = Literal["softmax", "sigmoid"]
NonFinitePolicy = Literal["raise", "mask"]
RouterDtype = Literal["float32", "float64", "bfloat16", "float16"]
ROUTER_DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer. Every field is checked in ``__post_init__``.

    ``shared_expert_intermediate_size`` is the total width of the always-on shared MLP (0 = none).
    When it is a multiple of ``moe_intermediate_size`` the shared MLP splits exactly into
    ``num_shared_slots`` experts of the routed width, which is what lets it run as extra routed slots.
    """

    hidden_size: int  # K
    moe_intermediate_size: int  # N
    num_experts: int  # E, routed experts
    top_k: int  # k
    scoring: Scoring = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    use_correction_bias: bool = False  # DeepSeek-V3's e_score_correction_bias (selection only)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: shared output scaled by sigmoid(x @ g)
    activation: str | ActivationSpec = "silu"  # a name, or a spec (gpt-oss: clamped SwiGLU, interleaved)
    router_bias: bool = False  # gpt-oss: the router Linear has a bias [E]
    expert_bias: bool = False  # gpt-oss: b13 [E, 2N] after the gate-up GEMM, b2 [E, K] after the down GEMM
    nonfinite: NonFinitePolicy = "raise"  # NaN/inf router logits: raise, or mask the expert out
    num_moe_layers: int | None = None  # MoE layers in the whole model, when known
    # Training (issue #17): MoE.forward(return_stats=True).aux_loss = the sum of coefficient x loss of
    # moekit.losses (load_balancing_loss, sequence_balance_loss, z_loss); None when all three are 0.
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
        if self.num_moe_layers is not None:
            check_int("num_moe_layers", self.num_moe_layers)
        for name in ("renormalize", "use_correction_bias", "shared_expert_gate", "router_bias", "expert_bias"):
            check_bool(name, getattr(self, name))
        check_positive_finite("routed_scaling_factor", self.routed_scaling_factor)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts ({self.num_experts}), got {self.top_k}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.num_experts % self.n_group != 0:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group must be <= n_group ({self.n_group}), got {self.topk_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"top_k ({self.top_k}) exceeds the experts in the topk_group={self.topk_group} kept groups "
                f"({self.topk_group * (self.num_experts // self.n_group)})"
            )
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate=True needs shared_expert_intermediate_size > 0")
        spec = as_spec(self.activation)  # raises, naming the argument, for an unknown one
        if not spec.gated:
            raise ValueError("activation must be gated: the MoE layer holds w13 [E, 2N, K] (an ungated spec "
                             "runs through moekit.experts and moekit.hf, not the layer)")
        if self.nonfinite not in ("raise", "mask"):
            raise ValueError(f"nonfinite must be 'raise' or 'mask', got {self.nonfinite!r}")
        for name in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.router_dtype is not None and self.router_dtype not in ROUTER_DTYPES:
            raise ValueError(f"router_dtype must be None or one of {ROUTER_DTYPES}, got {self.router_dtype!r}")

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def num_shared_slots(self) -> int:
        """S: routed-width slots the shared MLP splits into, or 0 when it has none or cannot split."""
        width, n = self.shared_expert_intermediate_size, self.moe_intermediate_size
        return width // n if width and width % n == 0 else 0

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "MoEConfig":
        """The real shapes of a published model: see ``moekit.presets.preset_names()``."""
        return cls.from_hf_config(hf_config_of_preset(name))

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "MoEConfig":
        """Read a config (transformers object or dict) of a family in ``_HF_READERS``: Mixtral, Qwen2/3-MoE,
        Qwen3-Next, DeepSeek-V2/V3, Kimi-K2, Kimi-Linear, GLM-4.5, gpt-oss, OLMoE, Granite-MoE, Jamba, MiniMax(-M2),
        ERNIE-4.5-MoE, Hunyuan-MoE. Families whose router moekit does not compute (Phi-MoE's sparsemixer,
        Llama-4's input-scaled top-1) are refused, naming why (their experts still run on "moekit").

        A field the layer needs that is absent raises ``MissingConfigField`` (a ``KeyError``) naming it;
        without ``num_hidden_layers`` the layer is still read, with ``num_moe_layers=None``."""
        if not isinstance(cfg, dict) and not hasattr(cfg, "to_dict"):
            raise TypeError(f"cfg must be a transformers config or a dict of its fields, got {type(cfg).__name__}")
        d = _Fields(cfg if isinstance(cfg, dict) else cfg.to_dict())
        model_type = d.get("model_type")
        if model_type in _REFUSED:
            raise ValueError(f"cfg.model_type {model_type!r}: {_REFUSED[model_type]}")
        reader = _HF_READERS.get(model_type)
        if reader is None:
            raise ValueError(f"cfg.model_type must be one of {sorted(_HF_READERS)}, got {model_type!r}")
        fields = reader(d)
        fields.setdefault("activation", activation_from_hf(d.get("hidden_act", "silu")))
        return cls(**fields)


class MissingConfigField(KeyError):
    """A config lacks a field the layer's reader needs. ``fields`` are the accepted spellings."""

    def __init__(self, fields: tuple[str, ...], model_type: Any):
        super().__init__(fields[0])
        self.fields, self.model_type = fields, model_type

    def __str__(self) -> str:
        return self.message()

    def message(self, source: str = "config") -> str:
        """The sentence, with ``source`` saying which config (``config.json at PATH``)."""
        others = "".join(f" (or {name!r})" for name in self.fields[1:])
        return f"{source} has no {self.fields[0]!r}{others}: a {self.model_type} MoE layer needs it"


class _Fields(dict):
    """A config dict whose missing field raises ``MissingConfigField`` naming it, not a bare KeyError."""

    def __missing__(self, name: str) -> Any:
        raise MissingConfigField((name,), self.get("model_type"))


def _get(d: dict, *names: str, default: Any = KeyError) -> Any:
    """The first of ``names`` present (and not None) in d: config.json and transformers' own
    ``to_dict()`` spell some fields differently (Qwen3's num_experts vs num_local_experts)."""
    for name in names:
        if d.get(name) is not None:
            return d[name]
    if default is KeyError:
        raise MissingConfigField(names, d.get("model_type"))
    return default


def _count_layers(d: dict, is_moe) -> int | None:
    """The MoE layers among the model's ``num_hidden_layers``; None when the config does not say."""
    layers = d.get("num_hidden_layers")
    return None if layers is None else sum(1 for i in range(layers) if is_moe(i))


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
    return _count_layers(d, lambda i: i not in dense and (i + 1) % step == 0)


def _read_qwen3_moe(d: dict) -> dict:
    return dict(
        hidden_size=d["hidden_size"],
        moe_intermediate_size=d["moe_intermediate_size"],
        num_experts=_get(d, "num_experts", "num_local_experts"),
        top_k=d["num_experts_per_tok"],
        scoring="softmax",
        renormalize=bool(_get(d, "norm_topk_prob", default=False)),
        num_moe_layers=_qwen_moe_layers(d),
    )


def _read_qwen2_moe(d: dict) -> dict:
    shared = _get(d, "shared_expert_intermediate_size", default=0)
    return dict(_read_qwen3_moe(d), shared_expert_intermediate_size=shared, shared_expert_gate=shared > 0)


def _read_deepseek(d: dict) -> dict:
    """DeepSeek-V2/V3 and the families that share V3's router (Kimi-K2, GLM-4.5: grouped sigmoid with
    a correction bias)."""
    v3 = d["model_type"] in ("deepseek_v3", "kimi_k2", "glm4_moe")
    method = _get(d, "topk_method", default="noaux_tc" if v3 else "greedy")
    grouped = method in ("group_limited_greedy", "noaux_tc")
    first_dense, freq = _get(d, "first_k_dense_replace", default=0), _get(d, "moe_layer_freq", default=1)
    scoring = _get(d, "scoring_func", default="sigmoid" if v3 else "softmax")
    return dict(
        hidden_size=d["hidden_size"],
        moe_intermediate_size=d["moe_intermediate_size"],
        num_experts=_get(d, "n_routed_experts", "num_local_experts"),
        top_k=d["num_experts_per_tok"],
        scoring=scoring,
        renormalize=bool(_get(d, "norm_topk_prob", default=False)),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
        n_group=_get(d, "n_group", default=1) if grouped else 1,
        topk_group=_get(d, "topk_group", default=1) if grouped else 1,
        use_correction_bias=method == "noaux_tc",
        shared_expert_intermediate_size=_get(d, "n_shared_experts", default=0) * d["moe_intermediate_size"],
        num_moe_layers=_count_layers(d, lambda i: i >= first_dense and i % freq == 0),
    )


def _read_gpt_oss(d: dict) -> dict:
    """gpt-oss: top-k of the biased logits, then a softmax over the k. That is moekit's softmax over all E
    then renormalised over the k: exp(l_i) / sum_{j in top-k} exp(l_j) either way, and the top-k of the
    logits is the top-k of their softmax (a monotone map)."""
    spec = ActivationSpec("silu", interleaved=True, alpha=float(_get(d, "swiglu_alpha", default=1.702)),
                          limit=float(_get(d, "swiglu_limit", default=7.0)), up_shift=1.0)
    return dict(_read_mixtral(d), router_bias=True, expert_bias=True, activation=spec)


def _read_softmax_topk(d: dict) -> dict:
    """OLMoE, Jamba (softmax, top-k, renormalised when norm_topk_prob), Granite-MoE (top-k of the logits
    then softmax over the k: renormalised, as gpt-oss), MiniMax and Hunyuan (renormalised)."""
    renorm = d["model_type"] in ("granitemoe", "granitemoeshared", "granitemoehybrid", "minimax", "hunyuan_v1_moe")
    shared = _get(d, "shared_intermediate_size", default=0) if d["model_type"] == "granitemoeshared" else 0
    if d["model_type"] == "hunyuan_v1_moe" and _get(d, "use_mixed_mlp_moe", default=True):
        shared = d["intermediate_size"] * _get(d, "num_shared_expert", default=1)
    return dict(_read_mixtral(d), renormalize=renorm or bool(_get(d, "norm_topk_prob", default=False)),
                shared_expert_intermediate_size=shared)


def _read_minimax_m2(d: dict) -> dict:
    """MiniMax-M2: sigmoid scores, a correction bias for the choice, renormalised, no groups."""
    return dict(_read_mixtral(d), scoring="sigmoid", use_correction_bias=True)


def _read_ernie(d: dict) -> dict:
    """ERNIE-4.5-MoE: softmax, a correction bias (``moe_statics``) for the choice, renormalised (the
    clamp at moe_norm_min only guards 0/0)."""
    shared = _get(d, "moe_num_shared_experts", default=0) * d["moe_intermediate_size"]
    return dict(hidden_size=d["hidden_size"], moe_intermediate_size=d["moe_intermediate_size"],
                num_experts=_get(d, "moe_num_experts", "num_experts"), top_k=_get(d, "moe_k", "num_experts_per_tok"),
                renormalize=True, use_correction_bias=True, shared_expert_intermediate_size=shared)


def _read_kimi_linear(d: dict) -> dict:
    """Kimi-Linear: DeepSeek-V3's router (grouped sigmoid, correction bias, routed scaling) under its own
    field names, and shared experts."""
    n_dim = d["moe_intermediate_size"]
    return dict(
        hidden_size=d["hidden_size"], moe_intermediate_size=n_dim,
        num_experts=_get(d, "num_experts", "num_local_experts"),
        top_k=_get(d, "num_experts_per_token", "num_experts_per_tok"),
        scoring="sigmoid", renormalize=bool(_get(d, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", default=1.0)),
        n_group=_get(d, "num_expert_group", "n_group", default=1), topk_group=_get(d, "topk_group", default=1),
        use_correction_bias=True, shared_expert_intermediate_size=_get(d, "num_shared_experts", "n_shared_experts",
                                                                        default=0) * n_dim,
    )


def _read_qwen3_next(d: dict) -> dict:
    """Qwen3-Next: softmax top-k as Qwen3-MoE, and a shared expert scaled by sigmoid(x @ g)."""
    return _read_qwen2_moe(d)


_HF_READERS = {
    "mixtral": _read_mixtral,
    "qwen2_moe": _read_qwen2_moe,
    "qwen3_moe": _read_qwen3_moe,
    "qwen3_next": _read_qwen3_next,
    "deepseek_v2": _read_deepseek,
    "deepseek_v3": _read_deepseek,
    "kimi_k2": _read_deepseek,
    "glm4_moe": _read_deepseek,
    "kimi_linear": _read_kimi_linear,
    "gpt_oss": _read_gpt_oss,
    "olmoe": _read_softmax_topk,
    "jamba": _read_softmax_topk,
    "granitemoe": _read_softmax_topk,
    "granitemoeshared": _read_softmax_topk,
    "minimax": _read_softmax_topk,
    "hunyuan_v1_moe": _read_softmax_topk,
    "minimax_m2": _read_minimax_m2,
    "ernie4_5_moe": _read_ernie,
}
# Routers moekit does not compute: read them and the layer would route differently, so refuse.
_REFUSED = {
    "phimoe": "Phi-MoE routes with sparsemixer (top-1 by argmax, a softmax over the logits within "
              "2*router_jitter_noise of the max, then the same for the second expert), not a softmax top-k; "
              "moekit's router does not implement it. Its experts run on moekit through "
              "model.set_experts_implementation('moekit'), which keeps transformers' router",
    "llama4_text": "Llama-4 scales the expert's input by sigmoid(top-1 logit), not its output; moekit's layer "
                   "weights outputs",
}


def check_layer_args(config, fuse_shared, capacity_factor, drop_policy, stats_block_size, num_local_experts,
                     dtype) -> None:
    """``moekit.MoE.__init__``'s arguments besides the config's own fields: a clear error naming the one that
    cannot be honoured."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
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

"""Random valid layers from a seed, for ``test_fuzz_layer`` and ``benchmarks/fuzz_layer.py``: a config drawn over
every router option, the layer's own options (backend options, capacity, fused or separate shared expert, router,
dtype, quantization) and inputs (M = 0, 1, odd; NaN gate rows under ``nonfinite="mask"``).

Fields are drawn freely, so some draws are combinations ``MoEConfig`` refuses: each refusal must name one of the
fields the draw changed (``Refusal``), then the next draw of the same seed is tried. A case is reproduced from its
seed alone (``draw_case(seed)``).

Shapes: M tokens, K hidden, N expert intermediate, E routed experts, k = top_k, Z identity experts.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import torch

from moekit import HashMoE, MoE, MoEConfig
from moekit.activations import ActivationSpec

from _fuzz_newest import hash_fields, hash_table, with_newest

GPT_OSS = ActivationSpec(name="silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
SCHEMES = ("fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4")
CPU_GEMMS = ("auto", "onednn_packed_split", "onednn_packed", "onednn_fused", "onednn_loop", "mm_loop", "grouped_mm")
LAYOUTS = ("auto", "contiguous", "masked_measured_cap")


@dataclass
class Refusal:
    """A draw ``MoEConfig`` refused: the fields changed from the defaults and the message."""

    fields: dict
    message: str

    def names_a_field(self) -> bool:
        return any(name in self.message for name in self.fields)


@dataclass
class FuzzCase:
    seed: int
    fields: dict  # MoEConfig(**fields)
    dtype: torch.dtype
    m: int  # tokens
    fuse_shared: bool
    capacity_factor: float | None
    drop_policy: str
    router: str  # "torch", or "fused" (the Triton router, interpreted on the CPU)
    grouped_mm_options: dict  # backend_options of grouped_mm (cpu_gemm, layout, memory_budget_bytes)
    scheme: str | None  # moe.quantize_(scheme, **scheme_options)
    scheme_options: dict
    nan_gate_rows: list[int]  # gate rows made NaN (nonfinite="mask": those experts masked)
    tied_gate_rows: list[tuple[int, int]]  # (a, b): gate row b a copy of row a, so experts a and b tie exactly
    x_scale: float  # x ~ N(0, x_scale^2): 4 saturates sigmoids and reaches the activation's clamp
    refusals: list[Refusal] = field(default_factory=list)
    hash_table: list[list[int]] | None = None  # [V][k]: a hash layer's tid2eid (HashMoE), None: top-k routing
    token_ids: list[int] | None = None  # [M] a hash layer's token ids

    @property
    def config(self) -> MoEConfig:
        return MoEConfig(**self.fields)

    def describe(self) -> str:
        """Everything that reproduces the case, on one line (a failure prints it)."""
        layer = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("fields",
                                                                                                   "refusals")}
        return f"seed={self.seed} config={self.fields} layer={layer}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def draw_fields(rng: random.Random) -> dict:
    """MoEConfig fields drawn independently (a draw may break a rule of MoEConfig)."""
    e = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
    n = rng.choice([4, 6, 8, 16])
    f = dict(hidden_size=rng.choice([8, 16, 24, 40]), moe_intermediate_size=n, num_experts=e)
    f["n_group"] = rng.choice(_divisors(e)) if rng.random() < 0.4 else 1
    f["topk_group"] = rng.randint(1, f["n_group"])
    pick = {"scoring": ["softmax", "sigmoid"], "renormalize": [True, False], "routed_scaling_factor": [1.0, 2.5, 0.7],
            "use_correction_bias": [False, True], "correction_bias_on": ["scores", "logits"],
            "group_score": ["auto", "max", "top2_sum"], "dropped_group_fill": ["-inf", "zero"],
            "router_logit_softcap": [0.0, 1.5, 6.0], "shared_expert_gate": [False, True],
            "shared_expert_combine": ["sum", "average", "router"], "expert_weight_on": ["output", "input"],
            "router_bias": [False, True], "expert_bias": [False, True], "nonfinite": ["raise", "mask"],
            "router_dtype": [None, "float32", "float64", "bfloat16"]}
    for name, values in pick.items():
        if rng.random() < 0.35:
            f[name] = rng.choice(values)
    f["shared_expert_intermediate_size"] = rng.choice([0, 0, n, 2 * n, n + 2])
    f["num_identity_experts"] = rng.choice([0, 0, 0, 1, 3])
    f["sparsemixer_jitter_eps"] = rng.choice([None] * 5 + [0.01, 0.3])
    f["activation"] = rng.choice(["silu", "silu", "gelu", "gelu_tanh", "relu", "relu2", GPT_OSS,
                                  ActivationSpec(name="gelu", limit=1.0, up_shift=0.5),
                                  ActivationSpec(name="relu2", gated=False)])  # ungated: refused, naming it
    choice = e + f["num_identity_experts"]
    f["top_k"] = rng.choice([1, rng.randint(1, choice), choice, min(2, choice)])
    # session 49's field, from the draw so far, not the generator: every seed's other fields stay what they were
    f["renorm_eps"] = (0.0, 0.0, 0.0, 1e-20, 1e-6)[(f["hidden_size"] + n + e + f["top_k"]) % 5]
    return f


def _fit(f: dict, rng: random.Random) -> dict:
    """Most draws nudged towards validity (the rules of the families), so that every option is reached."""
    f = dict(f)
    if f.get("sparsemixer_jitter_eps") is not None and rng.random() < 0.8:
        f.update(scoring="softmax", renormalize=False, use_correction_bias=False, n_group=1, topk_group=1,
                 num_identity_experts=0)
        if f.get("shared_expert_combine") == "router":
            f["shared_expert_combine"] = "sum"
    if f.get("shared_expert_combine") == "router" and rng.random() < 0.8:
        f.update(scoring="sigmoid", renormalize=True, n_group=1, topk_group=1, num_identity_experts=0,
                 shared_expert_gate=False, expert_weight_on="output", nonfinite="raise", renorm_eps=0.0,
                 shared_expert_intermediate_size=f["moe_intermediate_size"] * rng.choice([1, 2]))
    if f["num_identity_experts"] and rng.random() < 0.8:
        f.update(n_group=1, topk_group=1)
    groups = f["n_group"]
    if groups > 1 and rng.random() < 0.8:
        size = f["num_experts"] // groups
        f["top_k"] = min(f["top_k"], f["topk_group"] * size)
        if size < 2 and f.get("group_score") == "top2_sum":
            f["group_score"] = "auto"
    f["top_k"] = min(f["top_k"], f["num_experts"] + f["num_identity_experts"]) if rng.random() < 0.9 else f["top_k"]
    if f.get("shared_expert_gate") and not f["shared_expert_intermediate_size"] and rng.random() < 0.8:
        f["shared_expert_gate"] = False
    if f.get("shared_expert_combine") == "average" and not f["shared_expert_intermediate_size"]:
        f["shared_expert_combine"] = "sum" if rng.random() < 0.8 else "average"
    return f


def _changed(f: dict) -> dict:
    defaults = {x.name: x.default for x in dataclasses.fields(MoEConfig)}
    return {k: v for k, v in f.items() if k not in defaults or v != defaults[k]}


def valid_fields(rng: random.Random) -> tuple[dict, list[Refusal]]:
    """A config MoEConfig accepts, and the refusals met on the way (each checked to name a changed field)."""
    refusals = []
    while True:
        f = _fit(draw_fields(rng), rng)
        try:
            MoEConfig(**f)
        except (ValueError, TypeError) as err:
            refusals.append(Refusal(_changed(f), str(err)))
            continue
        return f, refusals


DTYPES = (torch.float32, torch.float32, torch.bfloat16, torch.float64, torch.float16)  # float32 twice as often


def draw_case(seed: int, dtypes=DTYPES) -> FuzzCase:
    """The case of ``seed``: a valid config, the layer's options, M and what to poison."""
    rng = random.Random(seed)
    f, refusals = valid_fields(rng)
    f, newest = with_newest(f, random.Random(f"newest{seed}"))
    return _layer_case(seed, rng, f, refusals + [Refusal(*r) for r in newest], dtypes)


def draw_hash_case(seed: int, dtypes=DTYPES) -> FuzzCase:
    """A hash layer's case (``HashMoE``, DeepSeek-V4): a config drawn as ``draw_case``'s and made a hash one
    (``_fuzz_newest.hash_fields``), the layer's options, its table and the tokens' ids; its own stream of seeds."""
    rng = random.Random(f"hash{seed}")
    refusals = []
    while True:
        f = hash_fields(_fit(draw_fields(rng), rng), rng)
        try:
            MoEConfig(**f)
        except (ValueError, TypeError) as err:
            refusals.append(Refusal(_changed(f), str(err)))
            continue
        break
    f, newest = with_newest(f, rng)
    case = _layer_case(seed, rng, f, refusals + [Refusal(*r) for r in newest], dtypes)
    cfg = case.config
    return dataclasses.replace(case, hash_table=hash_table(cfg, rng),
                               token_ids=[rng.randrange(cfg.hash_table_size) for _ in range(case.m)])


def _layer_case(seed: int, rng: random.Random, f: dict, refusals: list[Refusal], dtypes) -> FuzzCase:
    """The layer's options, M and what to poison, drawn from ``rng`` for the valid config fields ``f``."""
    cfg = MoEConfig(**f)
    scheme = rng.choice(SCHEMES) if rng.random() < 0.2 else None
    options = {}
    if scheme == "int4_w4a16":
        options = dict(group_size=rng.choice([32, 64, 128]), symmetric=rng.random() < 0.5)
    if scheme == "fp8_block":
        options = dict(block_shape=rng.choice([(128, 128), (16, 16), (8, 32)]))
    gmm = {}
    if rng.random() < 0.6:
        gmm["cpu_gemm"] = rng.choice(CPU_GEMMS)
    if rng.random() < 0.4:
        gmm["layout"] = rng.choice(LAYOUTS)
    if rng.random() < 0.25:
        gmm["memory_budget_bytes"] = rng.choice([2048, 8192, 65536])
    nan_rows = []
    if cfg.nonfinite == "mask" and rng.random() < 0.7:
        nan_rows = sorted(rng.sample(range(cfg.router_width), rng.randint(1, cfg.router_width)))
    width = cfg.router_width
    tied = [tuple(rng.sample(range(width), 2)) for _ in range(rng.choice([0, 0, 1, 2]))] if width > 1 else []
    return FuzzCase(seed=seed, fields=f, dtype=rng.choice(dtypes), m=rng.choice([0, 1, 1, 2, 3, 5, 7, 8, 13, 33]),
                    fuse_shared=rng.random() < 0.6 and scheme is None,
                    capacity_factor=rng.choice([None, None, None, 0.5, 1.0, 1.7]),
                    drop_policy=rng.choice(["position", "weight"]), router=rng.choice(["torch", "torch", "fused"]),
                    grouped_mm_options=gmm, scheme=scheme, scheme_options=options, nan_gate_rows=nan_rows,
                    tied_gate_rows=tied, x_scale=rng.choice([1.0, 1.0, 4.0]), refusals=refusals)


def token_ids(case: FuzzCase, *shape: int) -> dict:
    """A call's keyword arguments for the case's token ids viewed as ``shape`` (x's without K): {} unless a hash
    layer's."""
    return {} if case.token_ids is None else {"token_ids": torch.tensor(case.token_ids, dtype=torch.long).view(shape)}


def build(case: FuzzCase, backend: str = "reference") -> tuple[MoE, torch.Tensor]:
    """The case's layer (random weights: logits spread to O(3), biases that matter) in eval mode, and x [M, K]."""
    g = torch.Generator().manual_seed(case.seed)
    cfg = case.config
    kind = MoE if case.hash_table is None else HashMoE
    layer = kind(cfg, backend=backend, fuse_shared=case.fuse_shared, capacity_factor=case.capacity_factor,
                 drop_policy=case.drop_policy, dtype=case.dtype).eval()
    if case.hash_table is not None:
        layer.load_table_(torch.tensor(case.hash_table))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            std = 2.0 if name.startswith("gate.") else (0.3 if name in ("b13", "b2") else 1.0)
            fan_in = p.shape[-1] if p.dim() > 1 else 1  # a matrix: O(1) outputs at any width
            p.copy_(torch.randn(p.shape, generator=g) * std / fan_in**0.5)
        for bias in (layer.b13, layer.b2):  # the fused shared slots' rows stay 0: the shared MLP has no bias
            if bias is not None:
                bias[cfg.num_experts:] = 0.0
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.copy_(torch.randn(cfg.choice_width, generator=g) * 0.5 - 0.3)
        for a, b in case.tied_gate_rows:
            layer.gate.weight[b] = layer.gate.weight[a]
            if layer.gate.bias is not None:
                layer.gate.bias[b] = layer.gate.bias[a]
        for row in case.nan_gate_rows:
            layer.gate.weight[row] = float("nan")
    if case.scheme is not None:
        layer.quantize_(case.scheme, **case.scheme_options)
    x = (torch.randn(case.m, cfg.hidden_size, generator=g) * case.x_scale).to(case.dtype)
    return layer, x

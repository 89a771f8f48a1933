"""Random real-client cases from a seed, for ``test_hf_fuzz`` and ``benchmarks/fuzz_hf.py``: a family of the
installed transformers (``_hf_fuzz_models.fuzz_families``), that family's MoE config fields drawn among the ones its
config has (expert count, top-k from 1 to E, norm_topk_prob, expert groups, routed scaling, shared experts and their
width, dense first layers, MoE layer frequency, odd expert widths, the activation), the batch (padding mask or
none), the dtype and what else the seed checks (gradients in float32 / float64, ``moe_from_hf`` on a block, every
block swapped, quantized blocks, ``torch.compile``).

A draw the family's config or model refuses (its validation, a shape its code cannot take, no MoE layer left) is
not moekit's to pass: it is counted (``FuzzCase.rejected``) and the seed's next draw is tried. A case is reproduced
from its seed alone (``draw_case(seed)``).

Shapes: B sequences of S tokens, K hidden 32, E routed experts, k experts a token, N an expert's width.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import torch

from _hf_fuzz_fills import family_fields
from _hf_fuzz_models import FuzzFamily, build_model, family_keys, family_of, model_output, tiny_config

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts")
TOP_KS = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "top_k_experts")
GROUPS = ("n_group", "num_expert_group")
SHARED_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
WIDTHS = ("moe_intermediate_size", "expert_intermediate_size", "moe_ffn_hidden_size", "expert_ffn_hidden_size",
          "expert_hidden_size", "moe_hidden_size")
SHARED_WIDTHS = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                 "shared_intermediate_size", "shared_experts_intermediate_size")
SCALINGS = ("routed_scaling_factor", "route_scale", "moe_routed_scaling_factor")
SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu", "swish", "gelu_new", "sigmoid")  # hidden_act values
DRAWS = 8  # draws a seed tries before it falls back to the family's tiny default config


@dataclass
class FuzzCase:
    seed: int
    fam: FuzzFamily
    fields: dict  # the drawn config fields, on tiny_config's
    dtype: torch.dtype
    batch: int  # B
    seq: int  # S
    padded: bool  # an attention mask with the first tokens of row 1 padded (left padding)
    backends: tuple[str, ...]  # moekit.hf.HF_BACKEND values compared with transformers' eager
    grad: bool  # also the input embeddings' and the experts' gradients
    block: bool  # also moe_from_hf on one MoE block against the block's forward
    fuse_shared: bool  # moe_from_hf's fuse_shared
    scheme: str | None  # also use_moekit_blocks(quant=scheme) against the dequantized float64 twin
    swap: bool  # also use_moekit_blocks (every block moekit's whole layer, fuse_shared) against eager
    compiled: bool  # also torch.compile of the model on "moekit" against eager
    rejected: list[str] = field(default_factory=list)  # the draws the family refused, with why

    def describe(self) -> str:
        extra = [n for n, on in (("grad", self.grad), ("block", self.block), ("swap", self.swap),
                                 ("compiled", self.compiled)) if on]
        extra += ["fuse_shared"] * ((self.block or self.swap) and self.fuse_shared)
        extra += [f"quant={self.scheme}"] * bool(self.scheme)
        return (f"seed {self.seed}: {self.fam.key} {self.fields} {str(self.dtype).removeprefix('torch.')} "
                f"B={self.batch} S={self.seq}{' padded' if self.padded else ''} backends={'/'.join(self.backends)} "
                f"{' '.join(extra)}".rstrip())

    def config(self):
        return tiny_config(self.fam, self.fields)

    def model(self, dtype: torch.dtype | None = None) -> torch.nn.Module:
        return build_model(self.fam, self.config(), self.seed, dtype or self.dtype)

    def inputs(self) -> dict:
        """input_ids [B, S] (and attention_mask [B, S] with row 1's first tokens 0 where padded)."""
        g = torch.Generator().manual_seed(self.seed)
        ids = torch.randint(0, self.config().vocab_size, (self.batch, self.seq), generator=g)
        if not self.padded:
            return {"input_ids": ids}
        mask = torch.ones(self.batch, self.seq, dtype=torch.long)
        mask[1, : self.seq // 2] = 0
        return {"input_ids": ids, "attention_mask": mask}


def draw_fields(rng: random.Random, default) -> dict:
    """The MoE fields ``default`` (the family's tiny config) has, drawn within what they mean."""
    fields = {}
    has = [n for n in EXPERT_COUNTS if isinstance(getattr(default, n, None), int)]
    e = rng.choice([2, 3, 4, 5, 6, 8]) if rng.random() < 0.9 else 1
    fields |= {n: e for n in has}
    e = e if has else 6
    k = rng.choice([1, e, *range(1, e + 1)])
    fields |= {n: k for n in TOP_KS if isinstance(getattr(default, n, None), int)}
    if isinstance(getattr(default, "norm_topk_prob", None), bool):
        fields["norm_topk_prob"] = rng.random() < 0.5
    groups = [n for n in GROUPS if isinstance(getattr(default, n, None), int)]
    if groups:
        g = rng.choice([d for d in range(1, e + 1) if e % d == 0])
        per = e // g
        topk_group = rng.choice([t for t in range(1, g + 1) if t * per >= k])
        fields |= {n: g for n in groups} | ({"topk_group": topk_group} if hasattr(default, "topk_group") else {})
    for name in SCALINGS:
        if isinstance(getattr(default, name, None), float) and rng.random() < 0.7:
            fields[name] = rng.choice([1.0, 0.5, 2.5, round(rng.uniform(0.3, 3.0), 3)])
    for name in SHARED_COUNTS:
        if isinstance(getattr(default, name, None), int) and rng.random() < 0.6:
            fields[name] = rng.choice([0, 1, 2])
    for name in WIDTHS + SHARED_WIDTHS:
        if type(getattr(default, name, None)) is int and rng.random() < 0.6:
            fields[name] = rng.choice([1, 3, 5, 7, 8, 13, 16, 24])
    if isinstance(getattr(default, "hidden_act", None), str) and rng.random() < 0.3:  # experts and shared MLP
        fields["hidden_act"] = rng.choice(ACTIVATIONS)
    layers = default.num_hidden_layers
    if type(getattr(default, "first_k_dense_replace", None)) is int:
        fields["first_k_dense_replace"] = rng.choice([0, 0, 1, 2])
    if type(getattr(default, "decoder_sparse_step", None)) is int:
        fields["decoder_sparse_step"] = rng.choice([1, 1, 2])
    if isinstance(getattr(default, "mlp_only_layers", None), list):
        fields["mlp_only_layers"] = sorted(rng.sample(range(layers), rng.choice([0, 0, 1, layers - 1])))
    if type(getattr(default, "moe_layer_freq", None)) is int:
        fields["moe_layer_freq"] = rng.choice([1, 2])
    kinds = getattr(default, "mlp_layer_types", None)
    if isinstance(kinds, list) and set(kinds) <= {"dense", "sparse"}:
        fields["mlp_layer_types"] = [rng.choice(["dense", "sparse"]) for _ in range(layers - 1)] + ["sparse"]
    return fields


def draw_family(rng: random.Random, keys: tuple[str, ...]) -> FuzzFamily:
    """A family among ``keys`` whose tiny model builds (one that does not is drawn again)."""
    keys = list(keys)
    while keys:
        found = family_of(keys.pop(rng.randrange(len(keys))))
        if isinstance(found, FuzzFamily):
            return found
    raise LookupError("no family of the installed transformers builds a tiny model")


def draw_case(seed: int, *, keys: tuple[str, ...] | None = None, triton: bool = False, compile_rate: float = 0.05,
              quant_rate: float = 0.1) -> FuzzCase:
    """``keys``: the families to draw from (default: every one of the walk)."""
    rng = random.Random(seed)
    fam = draw_family(rng, keys or family_keys())
    backends = ("reference", "grouped_mm") + (("triton",) if triton else ())
    padded = rng.random() < 0.5
    case = FuzzCase(
        seed=seed, fam=fam, fields={},
        dtype=rng.choices([torch.float32, torch.float64, torch.bfloat16], [0.6, 0.25, 0.15])[0],
        batch=rng.choice([2, 3]) if padded else rng.choice([1, 2, 3]), seq=rng.choice([1, 2, 5, 8]) + padded,
        padded=padded, backends=tuple(rng.sample(backends, rng.choice(range(1, len(backends) + 1)))),
        grad=rng.random() < 0.3, block=rng.random() < 0.4, fuse_shared=rng.random() < 0.5,
        scheme=rng.choice(SCHEMES) if rng.random() < quant_rate else None, compiled=rng.random() < compile_rate,
        swap=random.Random(f"swap {seed}").random() < 0.3)  # its own stream: the draws above as before it
    case.grad = case.grad and case.dtype != torch.bfloat16
    case.swap = case.swap and case.dtype != torch.bfloat16  # its tie oracle is float32 against float64
    if triton and "triton" in case.backends:  # the interpreter: the tiniest shapes only; no float64 kernels
        case.batch, case.seq, case.padded, case.dtype = 1, min(case.seq, 3), False, torch.float32
    default, fixed = tiny_config(fam), family_fields(fam.key)
    for _ in range(DRAWS):
        fields = {n: v for n, v in draw_fields(rng, default).items() if n not in fixed}
        why = _refused(fam, fields, seed)
        if why is None:
            case.fields = fields
            break
        case.rejected.append(f"{fields}: {why}")
    return case


def _refused(fam: FuzzFamily, fields: dict, seed: int) -> str | None:
    """Why the family's config or model refuses ``fields`` (None: it builds, has a MoE layer and runs eager)."""
    from moekit.hf.set_check import is_interface_experts

    try:
        model = build_model(fam, tiny_config(fam, fields), seed, torch.float32)
        if not any(is_interface_experts(m) for m in model.modules()):
            return "no MoE layer"
        model.set_experts_implementation("eager")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model_output(model(input_ids=torch.arange(6).reshape(2, 3)))
    except Exception as err:  # noqa: BLE001 (the family's own code refusing the draw, whatever it raises)
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
    return None

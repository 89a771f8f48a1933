"""The walk over the installed transformers: every experts class wrapped by transformers'
``use_experts_implementation``, and a small instance of each built from its own config class.

Run as a script (``PYTHONPATH=. python tests/_hf_families.py``) it prints the coverage table of docs/hf.md
and the issue quote: family, flags, fused/composed, rel. L2 error of "moekit" against "eager".
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch

import transformers
import transformers.models

FLAG_NAMES = ("has_gate", "has_bias", "is_concatenated", "is_transposed", "has_post_expert_norm")
FLAG_DEFAULTS = {"has_gate": True, "has_bias": False, "is_concatenated": True, "is_transposed": False,
                 "has_post_expert_norm": False}
# Small sizes for every size field a family's config may use; hidden 32, one expert's width 16.
SMALL = {
    "hidden_size": 32, "intermediate_size": 16, "moe_intermediate_size": 16, "expert_intermediate_size": 16,
    "moe_ffn_hidden_size": 16, "ffn_hidden_size": 16, "expert_hidden_size": 16, "moe_hidden_size": 16,
    "num_experts": 6, "num_local_experts": 6, "n_routed_experts": 6, "moe_num_experts": 6, "n_experts": 6,
    "num_experts_per_tok": 2, "moe_k": 2, "top_k": 2, "moe_topk": 2,
}
MAX_PARAMS = 200_000  # an experts module bigger than this kept a size field SMALL does not know


@dataclass
class Family:
    """One experts class found in the installed transformers."""

    family: str  # the models/ directory, e.g. "gpt_oss"
    cls: type  # the wrapped experts class
    flags: dict = field(default_factory=dict)  # the decorator's flags that differ from their defaults
    apply_gate_overridden: bool = False


def walk() -> list[Family]:
    """Every class in ``transformers.models.*.modeling_*`` that ``use_experts_implementation`` wrapped:
    its ``forward`` closes over ``experts_interface`` and its ``__init__`` over the flags."""
    from transformers.integrations import moe

    default_gate = getattr(moe, "_default_apply_gate", None)  # None on a transformers before _apply_gate

    root = Path(transformers.models.__path__[0])
    found = []
    for path in sorted(root.glob("*/modeling_*.py")):
        if "use_experts_implementation" not in path.read_text():
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        for cls in vars(module).values():
            forward = inspect.isclass(cls) and cls.__module__ == module.__name__ and cls.__dict__.get("forward")
            if not forward or "experts_interface" not in getattr(forward, "__code__", _NO_CODE).co_freevars:
                continue
            init = cls.__init__
            cells = dict(zip(init.__code__.co_freevars, (c.cell_contents for c in init.__closure__)))
            flags = {k: cells[k] for k in FLAG_NAMES if cells.get(k, FLAG_DEFAULTS[k]) != FLAG_DEFAULTS[k]}
            found.append(Family(path.parent.name, cls, flags, getattr(cls, "_apply_gate", None) is not default_gate))
    return found


class _NoCode:
    co_freevars = ()


_NO_CODE = _NoCode()


def config_class(fam: Family) -> type:
    """The config class the experts take: the ``config`` annotation, else the family's config whose name
    is the experts class's prefix (Qwen3VLMoeTextExperts -> Qwen3VLMoeTextConfig), else its main one."""
    annotation = inspect.signature(fam.cls.__init__).parameters["config"].annotation
    if isinstance(annotation, str):  # postponed annotations: the name, looked up where the class lives
        annotation = vars(importlib.import_module(fam.cls.__module__)).get(annotation)
    if inspect.isclass(annotation) and annotation is not inspect.Parameter.empty:
        return annotation
    configs = importlib.import_module(f"transformers.models.{fam.family}.configuration_{fam.family}")
    classes = {n: c for n, c in vars(configs).items() if inspect.isclass(c) and n.endswith("Config")
               and c.__module__ == configs.__name__}
    prefix = fam.cls.__name__.removesuffix("Experts")
    for name in (prefix + "Config", prefix.removesuffix("Text") + "TextConfig", prefix + "TextConfig"):
        if name in classes:
            return classes[name]
    texts = [c for n, c in classes.items() if n.endswith("TextConfig")]
    return (texts or list(classes.values()))[0]


def small_config(fam: Family):
    """The family's (text) config with every known size field made small: ints, per-modality lists and
    the None of a family whose MoE is off by default (Gemma-4)."""
    cfg = config_class(fam)()
    text = cfg.get_text_config()
    if not hasattr(cfg, "hidden_size") or (hasattr(text, "hidden_size") and text is not cfg):
        cfg = text
    for name, value in SMALL.items():
        current = getattr(cfg, name, 0.5)
        if current is None or isinstance(current, int):
            setattr(cfg, name, value)
        elif isinstance(current, list):  # one size per modality (ERNIE-4.5-VL)
            setattr(cfg, name, [value] * len(current))
    return cfg


def build_experts(fam: Family, seed: int = 0) -> torch.nn.Module:
    """A small instance with random weights and random non-zero biases (float32)."""
    cfg = small_config(fam)
    # ERNIE-4.5-VL's experts take their width as an argument (one per modality); Bailing-Hybrid's and Step-3.7's
    # their layer index (which picks the layer's SwiGLU clamp: none in the default configs)
    params = inspect.signature(fam.cls.__init__).parameters
    kwargs = {"intermediate_size": 16} if "intermediate_size" in params else {}
    kwargs |= {"layer_idx": 0} if "layer_idx" in params else {}
    with torch.device("meta"):
        size = sum(p.numel() for p in fam.cls(cfg, **kwargs).parameters())
    if size > MAX_PARAMS:
        raise RuntimeError(f"{fam.cls.__name__} still has {size} parameters: a size field SMALL lacks")
    torch.manual_seed(seed)
    module = fam.cls(cfg, **kwargs).float()
    with torch.no_grad():
        for name, p in module.named_parameters():
            fan_in = p.shape[-1] if "bias" not in name else 4
            p.copy_(torch.randn_like(p) * (1.0 if "norm" in name else fan_in**-0.5) + ("norm" in name))
    return module


@dataclass
class Case:
    """One experts module's call: inputs and transformers' eager output."""

    module: torch.nn.Module
    x: torch.Tensor  # [M, K]
    ids: torch.Tensor  # [M, k] int64; k distinct experts per token; row 0's last slot is the EP sentinel E
    weights: torch.Tensor  # [M, k] float32; 0 on the sentinel slot
    eager: torch.Tensor  # [M, K]: the module's own eager forward, the sentinel slot sent to expert 0 instead


# Experts classes whose caller hands them one route a row with unit weight: the eager forward reads [R, 1] ids and
# never scales by the weights (Ergo's projections, its routes normalised outside); called with k = 1 and weights 1
ROUTE_ROWS = {"ErgoExpertProjections"}


def make_case(fam: Family, tokens: int = 9, top_k: int = 2, seed: int = 1) -> Case:
    module = build_experts(fam)
    route_rows = fam.cls.__name__ in ROUTE_ROWS
    top_k = 1 if route_rows else top_k
    e = module.down_proj.shape[0]
    hidden = module.down_proj.shape[2 if getattr(module, "is_transposed", False) else 1]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.ones(tokens, top_k) if route_rows else torch.rand(tokens, top_k, generator=g)
    weights[0, -1] = 0.0
    if route_rows:  # its eager forward skips ids >= E itself and ignores the weights: the sentinel goes in as is
        ids[0, -1] = e
    module.config._experts_implementation = "eager"
    with torch.no_grad():  # some eager forwards (gpt-oss, Nemotron-H) cannot take the sentinel: weight 0 instead
        eager = module(x, ids, weights)
    ids[0, -1] = e  # transformers' expert-parallel sentinel (an id >= E): moekit skips it
    return Case(module, x, ids, weights, eager)


def run_moekit(case: Case) -> torch.Tensor:
    case.module.config._experts_implementation = "moekit"
    try:
        with torch.no_grad():
            return case.module(case.x, case.ids, case.weights)
    finally:
        case.module.config._experts_implementation = "eager"


def coverage_rows() -> list[str]:
    """docs/hf.md's coverage table: one row per experts class."""
    import warnings

    from moekit.hf.variants import ComposedPathWarning, experts_plan

    rows = ["| family | class | flags | `_apply_gate` | path | activation | rel. L2 |", "|---|---|---|---|---|---|---|"]
    for fam in walk():
        case = make_case(fam)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ComposedPathWarning)
            plan = experts_plan(case.module)
            out = run_moekit(case)
        err = float((out - case.eager).norm() / case.eager.norm())
        flags = ", ".join(f"{k}={v}" for k, v in fam.flags.items()) or "-"
        path = "fused" if plan.fused else f"composed ({plan.reason.split(' (')[0].split(':')[0]})"
        rows.append(f"| {fam.family} | {fam.cls.__name__} | {flags} | {'own' if fam.apply_gate_overridden else '-'} "
                    f"| {path} | {describe(plan.activation) if plan.fused else '-'} | {err:.1e} |")
    return rows


def describe(activation) -> str:
    """An activation (name or spec) in a few words: "silu, interleaved, alpha 1.702, limit 7, up+1"."""
    if isinstance(activation, str):
        return activation
    words = [activation.name] + ["ungated"] * (not activation.gated) + ["interleaved"] * activation.interleaved
    words += [f"alpha {activation.alpha:g}"] * (activation.alpha != 1.0)
    if activation.limit is not None:
        words.append(f"limit {activation.limit:g}")
    words += [f"up+{activation.up_shift:g}"] * (activation.up_shift != 0.0)
    return ", ".join(words)


if __name__ == "__main__":
    import moekit.hf  # noqa: F401  (registers "moekit")

    print("\n".join(coverage_rows()))

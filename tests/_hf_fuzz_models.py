"""The hf fuzzer's families: every MoE family the installed transformers ships, found by the experts walk
(``_hf_families.walk``), each with the whole-model class of its text config and a tiny config built through the
config's own constructor (so its derived fields follow: DeepSeek's head_dim from its rope dims, hybrid layer
lists). A family whose tiny model cannot be built or run is skipped with the error as its reason
(``family_of``, ``fuzz_families``), so a new transformers family is fuzzed, or listed, without editing this file.

Shapes: V vocabulary 64, K hidden 32, 4 query heads of 8, L decoder layers (3, or one per distinct hybrid layer kind).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from dataclasses import dataclass

import torch
import transformers

from _hf_families import Family, config_class, walk
from _hf_fuzz_fills import UNFUZZABLE, fills

VOCAB = 64
LAYERS = 3
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=24, max_position_embeddings=128)
# Of every other int size field above 16 (attention ranks, linear-attention / mamba widths, head dims): 16, the rope
# part of a split head 8; head counts above 4: 4
SIZE_SUFFIXES = ("rank", "_dim", "_size")  # rank: qwen4_exp's hc_lowrank too
NOT_SIZES = ("vocab", "position", "window", "chunk", "batch")
MAX_PARAMS = 400_000  # a tiny model bigger than this kept a size field the rules above do not know


@dataclass(frozen=True)
class FuzzFamily:
    """One experts class of the walk and the model that holds it."""

    key: str  # "family:ExpertsClass"
    family: Family
    config_cls: type  # the text config the model class takes
    model_cls: type  # *ForCausalLM where there is one (logits), else the text model (last hidden state)


@dataclass(frozen=True)
class Skipped:
    key: str
    reason: str  # the build or run error of the family's tiny default model


def model_class(config_cls: type, module) -> type | None:
    """The family's ``*ForCausalLM`` taking ``config_cls``, else its text ``*Model``; None where it has neither."""
    found = [c for n, c in vars(module).items() if inspect.isclass(c) and c.__module__ == module.__name__
             and issubclass(c, transformers.PreTrainedModel) and getattr(c, "config_class", None) is config_cls
             and "PreTrained" not in n and (n.endswith("ForCausalLM") or n.endswith("Model"))]
    found.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"), c.__name__))
    return found[0] if found else None


def tiny_config(fam: FuzzFamily, fields: dict | None = None):
    """The family's config at tiny sizes, ``fields`` (the drawn MoE fields) on top, built by its constructor."""
    from _hf_families import SMALL

    default = fam.config_cls()
    if getattr(default, "is_heterogeneous", False):  # per-layer attributes: read the global values, cut each layer's
        default.allow_global_per_layer_attribute_access = True
    kw = cut_sizes(vars(default))
    for name, value in {**SMALL, **COMMON}.items():
        current = getattr(default, name, 0.5)
        if current is None or type(current) is int:
            kw[name] = value
        elif isinstance(current, list):  # one size per modality
            kw[name] = [value] * len(current)
    if getattr(default, "kv_lora_rank", None):  # MLA: as many kv heads as query heads
        kw.update(num_key_value_heads=COMMON["num_attention_heads"])
        kw.pop("head_dim", None)
    if hasattr(default, "qk_head_dim"):  # derived: the nope and rope parts of a query head
        kw["qk_head_dim"] = kw.get("qk_nope_head_dim", default.qk_nope_head_dim) + kw.get(
            "qk_rope_head_dim", default.qk_rope_head_dim)
    if getattr(default, "n_group", None):  # the default expert groups do not divide the tiny expert count
        kw.update(n_group=1, topk_group=1)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if type(getattr(default, name, None)) is int and getattr(default, name) >= VOCAB:
            kw[name] = 0
    kw.update(_layer_lists(default))
    kw.update(_per_layer(default, kw))
    kw.update(fills(default, kw, fam.key))
    kw.update(fields or {})
    return fam.config_cls(**kw)


def cut_sizes(values: dict) -> dict:
    """The tiny value of each size field of ``values`` (name -> default value) the rules above cut."""
    kw = {}
    for name, value in values.items():
        if (name.endswith("vocab_size") or name.startswith("vocab_size")) and type(value) is int and value > VOCAB:
            # inkling2's unpadded_vocab_size, gemma4's vocab_size_per_layer_input
            kw[name] = VOCAB
        if name.startswith("_") or type(value) is not int or any(w in name for w in NOT_SIZES):
            continue
        if name.endswith(SIZE_SUFFIXES) and value > 16:
            kw[name] = 8 if "rope" in name else 16
        elif name.endswith("_heads") and value > 4:
            kw[name] = 4
        elif name.endswith("_layer_period") and value > 2:  # Jamba: an attention / MoE layer within the L layers
            kw |= {name: 2, name.replace("period", "offset"): 1}
    return kw


def _per_layer(default, kw: dict) -> dict:
    """A heterogeneous config's per-layer overrides (gemma4's full-attention head_dim, dots3_note's sliding MLA
    sizes) cut like the global fields, each tiny layer taking those of the first layer of its kind (layer_types);
    the last tiny layer is the default's last (gemma4's config forces a full-attention last layer)."""
    spec = getattr(default, "_heterogeneity_spec", None)
    if spec is None or not spec.per_layer_overrides:
        return {}
    kinds, layers = default.layer_types, kw["num_hidden_layers"]
    tiny_kinds = list(kw.get("layer_types") or kinds[:layers])
    tiny_kinds[-1] = kinds[-1]
    out = {}
    for i in range(layers):
        source = len(kinds) - 1 if i == layers - 1 else kinds.index(tiny_kinds[i])
        layer = dict(spec.per_layer_overrides.get(source, {}))
        layer |= cut_sizes(layer)
        if "qk_nope_head_dim" in layer:  # MLA: a head is its nope and rope parts
            layer["head_dim"] = layer["qk_nope_head_dim"] + layer.get("qk_rope_head_dim", kw.get(
                "qk_rope_head_dim", default.qk_rope_head_dim))
        if layer:
            out[i] = layer
    return {"per_layer_config": out, "layer_types": tiny_kinds}


def _layer_lists(default) -> dict:
    """Per-layer lists (layer_types, mlp_layer_types, ...) cut to L layers keeping every kind they hold (a hybrid
    model keeps an attention layer), and num_hidden_layers = L."""
    total = getattr(default, "num_hidden_layers", None)
    lists = {n: v for n, v in vars(default).items() if isinstance(v, list) and total and len(v) == total}
    kinds = {n: list(dict.fromkeys(map(repr, v))) for n, v in lists.items()}
    kinds = {n: k for n, k in kinds.items() if len(k) <= 4}  # more: per-layer indices, cut to a prefix
    layers = max([LAYERS] + [len(k) for k in kinds.values()])
    out = {"num_hidden_layers": layers}
    for name, values in lists.items():
        if name not in kinds:
            out[name] = values[:layers]
            continue
        firsts = [next(v for v in values if repr(v) == k) for k in kinds[name]]
        out[name] = [firsts[i % len(firsts)] for i in range(layers)]
    return out


def build_model(fam: FuzzFamily, config, seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The model (eval mode) with seeded random weights: every bias and correction bias random and non-zero (a
    family's init leaves them zero, which would hide a bias read in the wrong place), every token-id routing table
    (DeepSeek-V4's ``tid2eid``, built all zero: every token on expert 0) random experts."""
    with torch.device("meta"):
        size = sum(p.numel() for p in fam.model_cls(config).parameters())
    if size > MAX_PARAMS:
        raise RuntimeError(f"{fam.model_cls.__name__} has {size} parameters at the tiny sizes: a size field the "
                           "rules of tiny_config do not know")
    torch.manual_seed(seed)
    model = fam.model_cls(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("_bias", "router.bias", "gate.bias")) and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * (0.1 if "correction" in name else 0.5))
            if name.endswith("tid2eid"):  # [vocab, k] of the router's num_experts
                experts = model.get_submodule(name.rsplit(".", 1)[0]).num_experts
                t.copy_(torch.randint(0, experts, t.shape, generator=g))
    return _keep_float32(model.to(dtype))


def _keep_float32(model: torch.nn.Module) -> torch.nn.Module:
    """The weights the model class keeps in float32 (``_keep_in_fp32_modules_strict``: routers, correction biases)
    back in float32 in a bfloat16 model, as ``from_pretrained`` loads them, and in a float64 one: inkling2's router
    computes ``hidden.float()`` against its weight, so its model runs in float64 only so (from_pretrained leaves
    float64 alone: that model would raise)."""
    keep = getattr(model, "_keep_in_fp32_modules_strict", None) or ()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.dtype in (torch.bfloat16, torch.float64) and any(k in name for k in keep):
            t.data = t.data.float()
    return model


def model_output(out) -> torch.Tensor:
    """Logits of a causal LM, else the text model's last hidden state."""
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def fuzz_families() -> tuple[tuple[FuzzFamily, ...], tuple[Skipped, ...]]:
    """(the families whose tiny default model builds and runs, the others with their reason); a few seconds a
    family the first time (``family_of``)."""
    found = [family_of(key) for key in family_keys()]
    return (tuple(f for f in found if isinstance(f, FuzzFamily)), tuple(f for f in found if isinstance(f, Skipped)))


@functools.cache
def family_keys() -> tuple[str, ...]:
    """Every experts class of the walk, as "family:ExpertsClass"."""
    return tuple(_walked())


@functools.cache
def _walked() -> dict[str, Family]:
    return {f"{fam.family}:{fam.cls.__name__}": fam for fam in walk()}


@functools.cache
def family_of(key: str) -> FuzzFamily | Skipped:
    """The family of ``key`` if its tiny default model builds and runs eager, else why not."""
    fam = _walked()[key]
    if key in UNFUZZABLE:
        return Skipped(key, UNFUZZABLE[key])
    try:
        config_cls = type(config_class(fam)().get_text_config())
        model_cls = model_class(config_cls, importlib.import_module(fam.cls.__module__))
        if model_cls is None:
            raise LookupError(f"no *ForCausalLM or *Model class takes {config_cls.__name__}")
        found = FuzzFamily(key, fam, config_cls, model_cls)
        _smoke(found)
        return found
    except Exception as err:  # noqa: BLE001 (any failure: the family is listed as skipped with it)
        return Skipped(key, f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}")


def _smoke(fam: FuzzFamily) -> None:
    """The tiny default model builds and runs transformers' eager experts on 2 x 5 tokens."""
    model = build_model(fam, tiny_config(fam), 0, torch.float32)
    model.set_experts_implementation("eager")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model_output(model(input_ids=torch.arange(10).reshape(2, 5) % VOCAB))

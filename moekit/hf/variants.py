"""Which variant of transformers' experts interface a module is, decided once per module by behaviour.

    [transformers experts module] -> [ExpertsPlan: weights to read, ActivationSpec or composed] -> moekit.hf forward

transformers describes an experts class by flags (``has_gate``, ``has_bias``, ``is_transposed``,
``is_concatenated``, ``has_post_expert_norm``) plus code: its ``act_fn`` and an optional ``_apply_gate``
override. Flags are read as data; code is recognised by what it computes. ``act_fn`` is compared with
every activation moekit has on a probe tensor, and ``_apply_gate`` (the default one or an override, e.g.
gpt-oss's clamped SwiGLU) with the ``ActivationSpec`` candidates its flags and attributes suggest
(``alpha``/``swiglu_alpha``, ``limit``/``swiglu_limit``, clamping before the activation or after it). A module
whose code matches no spec, or that has a post-expert norm, runs composed: moekit's grouped GEMMs with the
module's own functions between them (``moekit.hf.composed``), and one ``ComposedPathWarning`` per class says so.

Shapes: E experts, K hidden, N intermediate; w13 is [E, 2N, K] gated, [E, N, K] ungated.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from moekit.activations import ACTIVATIONS, ActivationSpec, apply_glu

PLAN_ATTR = "_moekit_plan"  # where the plan is cached on the module (an instance attribute)
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")
_LIMIT_ATTRS = ("limit", "swiglu_limit")
# Probe tolerance: an _apply_gate/act_fn that computes in float32 (Beam's upcast on a float64 probe is a
# downcast) differs from the float64 definition by ~1e-7; distinct activations differ by >= 1e-4
# (gelu vs gelu_tanh at x = -2), clamps and alphas by O(1). A float32 candidate is held to float32's bound: torch's
# own float32 gelu on a CPU with AVX-512 is 6e-7 off in the negative tail (x = -3.36: -0.0013149 against -0.0013155)
# on contiguous input and exact on a strided view, 5e-6 after Beam's product with up.
_RTOL, _ATOL = 1e-6, 1e-6
_TOL32 = 1e-5


class ComposedPathWarning(UserWarning):
    """An experts class runs through moekit's composed path (correct, not fused); said once per class."""


@dataclass(frozen=True)
class ExpertsPlan:
    """How the "moekit" implementation runs one transformers experts module (no tensors held)."""

    up_name: str  # "gate_up_proj" (gated) or "up_proj" (has_gate=False)
    transposed: bool  # weights stored [E, K, 2N] / [E, N, K]: read through transpose(1, 2) views
    has_bias: bool  # b13 = f"{up_name}_bias" [E, 2N] or [E, N], b2 = down_proj_bias [E, K]
    gated: bool
    activation: ActivationSpec | str | None  # fused: what the backend gets (a str for a plain spec); None: composed
    reason: str = ""  # composed only: what moekit does not fuse

    @property
    def fused(self) -> bool:
        return self.activation is not None


_WARNED: set[type] = set()


def experts_plan(module: nn.Module) -> ExpertsPlan:
    """The module's plan, built on its first eager call and cached on it (``PLAN_ATTR``).

    Probing cannot be traced: a module that ``torch.compile`` meets before any eager call gets the
    composed plan from its flags alone (correct, not fused, not cached); run one eager forward or
    ``moekit.hf.prepare(model)`` before compiling to trace the fused path."""
    plan = module.__dict__.get(PLAN_ATTR)
    if plan is not None:
        return plan
    if torch.compiler.is_compiling():
        return ExpertsPlan(activation=None, reason="compiled before its first eager call", **_flag_fields(module))
    _refuse_scaleless_fp8(module)
    plan = module.__dict__[PLAN_ATTR] = build_plan(module)
    if not plan.fused and type(module) not in _WARNED:
        _WARNED.add(type(module))
        warnings.warn(f"moekit: {type(module).__name__} runs composed (moekit grouped GEMMs with the module's "
                      f"own functions between them), not fused: {plan.reason}", ComposedPathWarning, stacklevel=3)
    return plan


def _refuse_scaleless_fp8(module: nn.Module) -> None:
    """TypeError where an experts weight is fp8 without the ``*_scale_inv`` beside it: transformers 5.25 loads a
    fine-grained fp8 checkpoint on a machine without a GPU (or with ``dequantize=True``) "dequantized to bf16" but
    leaves the experts' e4m3 weights as stored and their scales unread (its load report: UNEXPECTED), so its own eager
    fails too; moekit's backends said only that x and the weights differ in dtype."""
    for name in ("gate_up_proj", "up_proj", "down_proj"):
        w = getattr(module, name, None)
        if isinstance(w, torch.Tensor) and w.dtype in _FP8 and getattr(module, name + "_scale_inv", None) is None:
            raise TypeError(f"{type(module).__name__}.{name} is {w.dtype} without its {name}_scale_inv: a fine-grained "
                            "fp8 checkpoint loaded without transformers' FP8Experts (on a machine without a GPU, or "
                            "with FineGrainedFP8Config(dequantize=True), transformers leaves the experts' fp8 weights "
                            "as stored and drops their scales); load it on a GPU, without dequantize")


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Experts classes outside transformers' experts interface (no flags) whose weights are stored transposed: Llama-4's
# bmm layout, gate_up_proj [E, K, 2N] (gate columns, then up) and down_proj [E, N, K]
_TRANSPOSED_WITHOUT_FLAG = {"Llama4TextExperts"}


def _flag_fields(module: nn.Module) -> dict:
    """The plan's fields that transformers' flags decide (``has_gate``, ``is_transposed``, ``has_bias``)."""
    gated = bool(getattr(module, "has_gate", True))
    transposed = bool(getattr(module, "is_transposed", type(module).__name__ in _TRANSPOSED_WITHOUT_FLAG))
    has_bias = bool(getattr(module, "has_bias", False))
    return dict(up_name="gate_up_proj" if gated else "up_proj", gated=gated, transposed=transposed, has_bias=has_bias)


def stores_transposed(module: nn.Module) -> bool:
    """Whether the experts module stores its weights [E, K, 2N] / [E, N, K] (gpt-oss), read off its flags alone (no
    weight touched: they may be on the meta device)."""
    return _flag_fields(module)["transposed"]


def build_plan(module: nn.Module) -> ExpertsPlan:
    """Read the flags and recognise the module's activation code (see the module docstring)."""
    base = _flag_fields(module)
    gated, up_name, transposed = base["gated"], base["up_name"], base["transposed"]
    weight = getattr(module, up_name, None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise TypeError(f"{type(module).__name__} must hold {up_name} [E, *, *] (transformers' experts interface)")
    if getattr(module, "has_post_expert_norm", False):
        return ExpertsPlan(activation=None, reason="a post-expert norm between the down projection and the "
                           "routed weight", **base)
    width = weight.shape[2] if transposed else weight.shape[1]  # 2N gated, N ungated
    spec = _recognise_gate(module, width, weight.device) if gated else _recognise_act(module, weight.device)
    if spec is None:
        code = "_apply_gate" if gated else "act_fn"
        return ExpertsPlan(activation=None, reason=f"its {code} computes no activation moekit implements "
                           f"({sorted(ACTIVATIONS)}, with alpha/limit/up_shift for a gated one)", **base)
    return ExpertsPlan(activation=spec.name if spec.plain else spec, **base)


def identify_activation(act_fn, device: torch.device) -> str | None:
    """The name of the moekit activation ``act_fn`` computes (probed in float64), or None."""
    if act_fn is None:
        return None
    gen = torch.Generator().manual_seed(0)
    # device="cpu" throughout: the CPU generator's values, also under a default device (``with torch.device("cuda")``)
    probe = torch.cat([torch.linspace(-12, 12, 241, dtype=torch.float64, device="cpu"),
                       torch.randn(64, generator=gen, dtype=torch.float64, device="cpu")])
    probe = probe.to(device)
    try:
        with torch.no_grad():
            got = act_fn(probe.clone()).to(torch.float64)
    except Exception:  # noqa: BLE001 (any failure means: not recognised, run composed)
        return None
    for name, activation in ACTIVATIONS.items():
        if got.shape == probe.shape and torch.allclose(got, activation.fn(probe), rtol=_RTOL, atol=_ATOL):
            return name
    return None


def _recognise_act(module: nn.Module, device: torch.device) -> ActivationSpec | None:
    name = identify_activation(getattr(module, "act_fn", None), device)
    return None if name is None else ActivationSpec(name=name, gated=False)


def _recognise_gate(module: nn.Module, width: int, device: torch.device) -> ActivationSpec | None:
    """The first candidate spec whose ``apply_glu`` equals ``module._apply_gate`` on a probe [R, 2N]."""
    alphas = _attr_values(module, _ALPHA_ATTRS)
    limits = _attr_values(module, _LIMIT_ATTRS)
    probe = _gate_probe(width, limits, device)
    try:
        with torch.no_grad():
            target = apply_module_gate(module, probe.clone()).to(torch.float64)
    except Exception:  # noqa: BLE001 (an _apply_gate that cannot run on the probe: composed)
        return None
    for spec in _candidates(module, alphas, limits, device):
        # also in float32: an _apply_gate that computes in float32 whatever its input (Beam's act(gate.float()) *
        # up.float(): its gelu on the probe is 1.9e-6 off float64's, past the bound, its silu within it)
        for dtype, tol in ((torch.float64, _RTOL), (torch.float32, _TOL32)):
            with torch.no_grad():
                got = apply_glu(probe.to(dtype), spec).to(torch.float64)
            if got.shape == target.shape and torch.allclose(got, target, rtol=tol, atol=tol):
                return spec
    return None


def apply_module_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """The module's gating, [.., 2N] -> [.., N]: its ``_apply_gate``, or on a transformers that predates
    ``_apply_gate`` the interface's default then, act_fn(gate) * up."""
    gate_fn = getattr(module, "_apply_gate", None)
    if gate_fn is not None:
        return gate_fn(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _candidates(module: nn.Module, alphas: list[float], limits: list[float], device: torch.device):
    """ActivationSpecs to try, the flags' and attributes' suggestion first."""
    known = identify_activation(getattr(module, "act_fn", None), device)
    names = [known] * (known is not None) + [n for n in ACTIVATIONS if n != known]
    interleaved = not getattr(module, "is_concatenated", True)
    first = bool(getattr(module, "limit_after_act", False))  # Step-3.7, Bailing-Hybrid: min(act(gate), limit)
    for name, inter, alpha, limit, shift, after in itertools.product(
        names, (interleaved, not interleaved), alphas + [1.0], limits + [None], (0.0, 1.0), (first, not first)
    ):
        if (alpha == 1.0 or name == "silu") and (limit is not None or not after):
            yield ActivationSpec(name=name, interleaved=inter, alpha=alpha, limit=limit, up_shift=shift,
                                 limit_after_act=after)


def _attr_values(module: nn.Module, names: tuple[str, ...]) -> list[float]:
    values = []
    for name in names:
        value = _positive_finite(getattr(module, name, None))
        if value is not None and value not in values:
            values.append(value)
    return values


def module_limit(module: nn.Module | None) -> float | None:
    """The SwiGLU clamp a transformers module holds as ``.limit``, or None where it clamps nothing: no module, no
    ``limit``, 0, or an infinite one (transformers 5.17's Step-3.7 experts and shared MLP hold ``float("inf")`` on
    their unclamped layers, and clamp with it: a no-op)."""
    return _positive_finite(getattr(module, "limit", None))


def _positive_finite(value) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value):
        return float(value)
    return None


def _gate_probe(width: int, limits: list[float], device: torch.device) -> torch.Tensor:
    """[R, width] float64: normal values, plus rows sweeping +-2x each candidate limit so clamps show."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(8, width, generator=gen, dtype=torch.float64, device="cpu") * 3]  # the CPU generator's values
    for limit in limits:
        sweep = torch.linspace(-2 * limit, 2 * limit, width, dtype=torch.float64, device="cpu")
        rows.append(torch.stack([sweep, sweep.flip(0), sweep[torch.randperm(width, generator=gen, device="cpu")]]))
    return torch.cat(rows).to(device)


def clamps_before_act(mlp: nn.Module, limit: float, name: str) -> bool:
    """Whether a gated MLP with a ``limit`` computes ``down(act(gate.clamp(max=L)) * up.clamp(-L, L))`` (DeepSeek-V4's
    shared MLP: moekit's clamped SwiGLU), not a clamp after the activation (Step-3.7's: silu(g).clamp(max=10) is
    silu(g.clamp(max=10)) within 5e-5, so the probe runs a float64 copy, 16 rows whose gates reach 3 L, at 1e-9)."""
    weights = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(w, nn.Linear) and w.bias is None for w in weights):
        return False
    twin = copy.deepcopy(mlp).to(torch.float64)
    gate, up, down = (getattr(twin, n).weight.detach() for n in ("gate_proj", "up_proj", "down_proj"))
    x = torch.randn(16, gate.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64, device="cpu")
    x = x.to(gate.device)
    x = x * 3 * limit / (x @ gate.T).abs().max().clamp_min(1e-30)  # [16, K]
    with torch.no_grad():
        got = twin(x)
    ref = apply_glu(torch.cat([x @ gate.T, x @ up.T], -1), ActivationSpec(name=name, limit=float(limit))) @ down.T
    return bool(((got - ref).norm() <= 1e-9 * ref.norm()).item())

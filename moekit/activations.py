"""Expert activations: the activation spec every experts backend reads, and its torch definition.

The one place activations are named: ``MoEConfig.activation``, every experts backend's
``activation=``, transformers' ``hidden_act`` and the Triton kernel's ``ACT`` id all resolve here.
A variant is data: ``ActivationSpec`` says gated or not, the gate/up row order, and the clamped-SwiGLU
parameters (gpt-oss); ``apply_glu`` is its torch definition, [.., 2N] (gated) or [.., N] -> [.., N].
Only torch is imported, so ``moekit.config`` can read the names without pulling in any backend.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Activation:
    name: str  # moekit's spelling, the only one used inside the package
    fn: Callable[[torch.Tensor], torch.Tensor]  # the torch definition every backend is held to
    kernel_id: int  # the ACT constexpr of the Triton gate-up kernel (``_kernels/gemm.py::_activation``)


def _relu_squared(t: torch.Tensor) -> torch.Tensor:
    return F.relu(t).square()


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("silu", F.silu, 0),
        Activation("gelu", F.gelu, 1),
        Activation("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"), 2),
        Activation("relu", F.relu, 3),
        Activation("relu2", _relu_squared, 4),  # relu(x)**2 (Nemotron-H's ungated experts)
    )
}
ACTIVATION_NAMES = tuple(ACTIVATIONS)

# transformers' hidden_act names -> moekit's names (every name the MoE families' experts use).
_HF_NAMES = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",
}


@dataclass(frozen=True)
class ActivationSpec:
    """What the experts compute between their two GEMMs; a plain str ``s`` means ``ActivationSpec(name=s)``.

    gated:  glu = act(gate) * (up + up_shift), gate and up clamped by ``limit`` when set; w13 is [E, 2N, K]
    ungated: glu = act(h); w13 is [E, N, K] (an up projection only)
    ``limit_after_act``: the gate's clamp applies to act(gate), not gate: min(act(gate), limit) * up.clamp(-limit,
    limit) (Step-3.7, Bailing-Hybrid: transformers' ``limit_after_act``); every backend computes it (the Triton
    kernels' ``LIMIT_AFTER`` constexpr, ``glu_constexprs``).
    """

    name: str = "silu"  # one of ACTIVATIONS
    gated: bool = True  # False: w13 [E, N, K] and h = act(w13 x + b13)
    interleaved: bool = False  # gated only: row 2i of w13 (and b13) is gate i, row 2i+1 up i (gpt-oss)
    alpha: float = 1.0  # silu only: act(g) = g * sigmoid(alpha * g) (gpt-oss: 1.702)
    limit: float | None = None  # gated only: gate.clamp(max=limit), up.clamp(-limit, limit) (gpt-oss: 7.0)
    up_shift: float = 0.0  # gated only: act(gate) * (up + up_shift) (gpt-oss: 1.0)
    limit_after_act: bool = False  # with a limit: min(act(gate), limit), not act(gate.clamp(max=limit)) (Step-3.7)

    def __post_init__(self) -> None:
        if self.name not in ACTIVATIONS:
            raise ValueError(f"activation.name must be one of {ACTIVATION_NAMES}, got {self.name!r}")
        for field in ("gated", "interleaved", "limit_after_act"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"activation.{field} must be a bool, got {getattr(self, field)!r}")
        _check_finite("alpha", self.alpha)
        _check_finite("up_shift", self.up_shift)
        if self.alpha != 1.0 and self.name != "silu":
            raise ValueError(f"activation.alpha applies to silu only, got alpha={self.alpha} with {self.name!r}")
        if self.limit is not None:
            _check_finite("limit", self.limit)
            if self.limit <= 0:
                raise ValueError(f"activation.limit must be > 0 or None, got {self.limit}")
        if self.limit_after_act and self.limit is None:
            raise ValueError("activation.limit_after_act needs a limit (it says where the limit clamps)")
        if not self.gated:
            extras = {"interleaved": self.interleaved, "limit": self.limit is not None,
                      "up_shift": self.up_shift != 0.0}
            used = [name for name, on in extras.items() if on]
            if used:
                raise ValueError(f"activation.{used[0]} needs gated=True (an ungated activation has no gate/up pair)")
        # kept as a bool: under torch.compile(dynamic=True) dynamo traces a float field read from a global spec
        # as a symbolic float, and comparing it specialises it and restarts the whole trace (twice the compile)
        plain = (self.gated and not self.interleaved and self.alpha == 1.0 and self.limit is None
                 and self.up_shift == 0.0)
        object.__setattr__(self, "_plain", plain)

    @property
    def kernel_id(self) -> int:
        """The Triton kernel's ``ACT`` constexpr for ``name``."""
        return ACTIVATIONS[self.name].kernel_id

    @property
    def plain(self) -> bool:
        """Gated, gate rows first, no alpha/limit/up_shift: act(gate) * up (what ``act_and_mul`` computes)."""
        return self._plain


def _check_finite(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"activation.{field} must be a finite float, got {value!r}")


# name -> its default spec, built once: ``as_spec`` on a str is a dictionary lookup.
_NAMED_SPECS = {name: ActivationSpec(name=name) for name in ACTIVATIONS}


def as_spec(activation: str | ActivationSpec) -> ActivationSpec:
    """``activation`` as a spec: a str names a plain gated activation; a clear error for anything else."""
    if isinstance(activation, ActivationSpec):
        return activation
    if isinstance(activation, str):
        spec = _NAMED_SPECS.get(activation)
        if spec is None:
            raise ValueError(f"activation must be one of {ACTIVATION_NAMES} or an ActivationSpec, got {activation!r}")
        return spec
    raise TypeError(f"activation must be a str or an ActivationSpec, got {type(activation).__name__}")


def spec_fields(activation: str | ActivationSpec) -> tuple[str, bool, bool, float, float | None, float, bool]:
    """``activation`` as plain values (name, gated, interleaved, alpha, limit, up_shift, limit_after_act), the way
    a spec crosses a ``torch.library`` custom op's schema (which takes no dataclasses); ``ActivationSpec(*fields)``
    rebuilds it. A known name (the common case) costs one dictionary test: a call's host time."""
    if activation.__class__ is str and activation in _NAMED_SPECS:
        return activation, True, False, 1.0, None, 0.0, False
    spec = as_spec(activation)  # a clear error for a wrong type or name
    limit = None if spec.limit is None else float(spec.limit)
    return (spec.name, spec.gated, spec.interleaved, float(spec.alpha), limit, float(spec.up_shift),
            spec.limit_after_act)


def glu_constexprs(spec: ActivationSpec) -> dict:
    """The clamped SwiGLU's constexprs of ``spec`` as the Triton kernels name them (``_kernels/gemm._glu``: ALPHA,
    LIMIT, UP_SHIFT, LIMIT_AFTER); a plain spec's are the kernels' defaults. LIMIT_AFTER is always passed, so two
    specs differing only in ``limit_after_act`` never share a compiled kernel."""
    return dict(ALPHA=float(spec.alpha), LIMIT=None if spec.limit is None else float(spec.limit),
                UP_SHIFT=float(spec.up_shift), LIMIT_AFTER=spec.limit_after_act)


@functools.lru_cache(maxsize=256)
def plan_activation(name: str, gated: bool = True, interleaved: bool = False, alpha: float = 1.0,
                    limit: float | None = None, up_shift: float = 0.0,
                    limit_after_act: bool = False) -> str | ActivationSpec:
    """``spec_fields``' values as what the kernels' plans are keyed by: the name for a plain spec (so an op's call
    and a direct eager "silu" call share one plan), else the spec. Built once per set of values."""
    spec = ActivationSpec(name, gated, interleaved, alpha, limit, up_shift, limit_after_act)
    return name if spec.plain else spec


def get_activation(name: str) -> Activation:
    """The activation called ``name``; a ValueError naming the argument for an unknown one."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATION_NAMES}, got {name!r}")
    return ACTIVATIONS[name]


def activation_from_hf(hidden_act: str) -> str:
    """moekit's activation name for a transformers ``hidden_act``; a clear error for one it lacks."""
    if hidden_act not in _HF_NAMES:
        raise ValueError(f"cfg.hidden_act must be one of {sorted(_HF_NAMES)}, got {hidden_act!r}")
    return _HF_NAMES[hidden_act]


def shared_glu_activation(experts: str | ActivationSpec, name: str, limit: float | None = None,
                          limit_after_act: bool = False) -> str | ActivationSpec | None:
    """``MoEConfig.shared_activation`` of a shared MLP computing ``act(gate) * up`` (``name``), gate and up clamped
    at ``limit`` where set (before the activation, or after it with ``limit_after_act``: Step-3.7), beside experts
    computing ``experts``: None where the two compute the same (the experts' spec then serves both), else the name
    or a clamped spec. The one rule ``MoEConfig.from_hf_config`` (a config's fields) and ``moekit.hf.moe_from_hf``
    (the block's modules) both apply."""
    spec = as_spec(experts)
    after = limit_after_act and limit is not None
    if (name == spec.name and limit == spec.limit and after == spec.limit_after_act and spec.alpha == 1.0
            and not spec.up_shift):
        return None
    return name if limit is None else ActivationSpec(name=name, limit=float(limit), limit_after_act=after)


def apply_glu(h: torch.Tensor, activation: str | ActivationSpec) -> torch.Tensor:
    """The spec's torch definition: h [.., 2N] (gated) or [.., N] (ungated) -> [.., N], in h's dtype."""
    spec = as_spec(activation)
    if spec.plain:  # reads no float field (see ActivationSpec.__post_init__)
        return act_and_mul(h, spec.name)
    if not spec.gated:
        return _act(h, spec)
    if spec.interleaved:
        gate, up = h[..., 0::2], h[..., 1::2]  # [.., N] each
    else:
        gate, up = h.chunk(2, dim=-1)  # [.., N] each
    if spec.limit_after_act:  # min(act(gate), limit) * up.clamp(-limit, limit)
        act, up = _act(gate, spec).clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
    else:
        if spec.limit is not None:
            gate, up = gate.clamp(max=spec.limit), up.clamp(-spec.limit, spec.limit)
        act = _act(gate, spec)
    return act * (up + spec.up_shift) if spec.up_shift != 0.0 else act * up


def glu_rows(gate: torch.Tensor, up: torch.Tensor, activation: str | ActivationSpec) -> torch.Tensor:
    """A gated MLP's gate [N, K] and up [N, K] rows as its w13 [2N, K] in the order ``apply_glu`` reads for the
    spec: gate rows then up rows, or interleaved (row 2i gate i, 2i + 1 up i: gpt-oss's)."""
    if as_spec(activation).interleaved:
        return torch.stack([gate, up], dim=1).flatten(0, 1)  # [2N, K]
    return torch.cat([gate, up])  # [2N, K]


def _act(t: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """The spec's activation alone: ``ACTIVATIONS[name].fn``, or silu with its ``alpha``."""
    if spec.alpha != 1.0:
        return t * torch.sigmoid(spec.alpha * t)
    return ACTIVATIONS[spec.name].fn(t)


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[.., 2N] -> [.., N]: act(gate_up[.., :N]) * gate_up[.., N:] (``apply_glu`` of a plain name)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return get_activation(activation).fn(gate) * up

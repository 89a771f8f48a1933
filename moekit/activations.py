"""Gated activations: act(gate) * up, over the [.., 2N] output of the gate-up GEMM (gate half first).

The one place activations are named: ``MoEConfig.activation``, every experts backend's
``activation=``, transformers' ``hidden_act`` and the Triton kernel's ``ACT`` id all resolve here.
Only torch is imported, so ``moekit.config`` can read the names without pulling in any backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Activation:
    name: str  # moekit's spelling, the only one used inside the package
    fn: Callable[[torch.Tensor], torch.Tensor]  # the torch definition every backend is held to
    kernel_id: int  # the ACT constexpr of the Triton gate-up kernel (``_kernels/gemm.py::_activation``)


ACTIVATIONS: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("silu", F.silu, 0),
        Activation("gelu", F.gelu, 1),
        Activation("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"), 2),
        Activation("relu", F.relu, 3),
    )
}
ACTIVATION_NAMES = tuple(ACTIVATIONS)

# transformers' hidden_act names -> moekit's names.
_HF_NAMES = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "relu": "relu",
}


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


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[.., 2N] -> [.., N]: act(gate_up[.., :N]) * gate_up[.., N:]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return get_activation(activation).fn(gate) * up

"""Gated activations: act(gate) * up, over the [.., 2N] output of the gate-up GEMM (gate half first)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


def act_and_mul(gate_up: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """[.., 2N] -> [.., N]: act(gate_up[.., :N]) * gate_up[.., N:]."""
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {sorted(_ACTS)}, got {activation!r}")
    gate, up = gate_up.chunk(2, dim=-1)
    return _ACTS[activation](gate) * up

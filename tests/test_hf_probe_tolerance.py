"""The activation probe (``moekit.hf.variants.build_plan``) against an ``_apply_gate`` that computes in float32 with
a float32 gelu a little off in its tail: torch's own CPU gelu is, where the CPU has AVX-512 (6e-7 at x = -3.36 on
contiguous input, exact on a strided view), and Beam's block was refused there ("computes no activation moekit
implements", ``test_hf_fuzz::test_beam_gelu_experts_convert``). A float32 candidate is held to float32's bound; an
activation really different (gelu_tanh, or gelu scaled by 1 + 1e-3) is still told apart."""

import math

import pytest
import torch
from torch import nn

from moekit.hf.variants import build_plan


def _gelu64(t: torch.Tensor) -> torch.Tensor:
    """gelu by its definition, x * Phi(x), element by element in Python floats."""
    flat = [x * 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in t.double().flatten().tolist()]
    return torch.tensor(flat, dtype=torch.float64).reshape(t.shape)


class _Float32GateExperts(nn.Module):
    """transformers' experts interface (gate_up_proj [E, 2N, K], down_proj [E, K, N]) with Beam's float32 gate:
    gelu(gate) + ``tail`` where gate < -3 (the AVX-512 kernel's error), times ``1 + rel``, times up."""

    def __init__(self, tail: float = 0.0, rel: float = 0.0, tanh: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 2 * 16, 8))
        self.down_proj = nn.Parameter(torch.zeros(2, 8, 16))
        self.tail, self.rel, self.tanh = tail, rel, tanh

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        g32 = gate.to(torch.float32)
        act = torch.nn.functional.gelu(g32, approximate="tanh") if self.tanh else _gelu64(g32).to(torch.float32)
        act = torch.where(g32 < -3.0, act + self.tail, act) * (1.0 + self.rel)
        return (act * up.to(torch.float32)).to(gate.dtype)


@pytest.mark.parametrize("tail", [0.0, 6e-7, -6e-7])
def test_a_float32_gelu_off_in_its_tail_is_still_gelu(tail):
    assert build_plan(_Float32GateExperts(tail=tail)).activation == "gelu"


def test_a_different_activation_is_not_taken_for_gelu():
    assert build_plan(_Float32GateExperts(tanh=True)).activation == "gelu_tanh"
    plan = build_plan(_Float32GateExperts(rel=1e-3))
    assert plan.activation is None and "computes no activation" in plan.reason

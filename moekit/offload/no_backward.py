"""``OffloadedMoE`` computes forward only: its experts' weights are cache slots that later fetches overwrite (the
next layer's, this layer's next round), so autograd cannot keep what a backward would read. A forward recorded by
autograd returns its output through ``no_backward``, whose backward says so, instead of autograd's "modified by an
inplace operation" about a slot it saved.

    out [M, K] (requires grad) --no_backward--> the same values; backward: RuntimeError naming the layer
"""

from __future__ import annotations

import torch

MESSAGE = ("OffloadedMoE has no backward: its experts are cache slots that later fetches overwrite, so autograd "
           "cannot keep them; train the plain moekit.MoE, and run offloaded layers under torch.no_grad() or "
           "torch.inference_mode()")


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(MESSAGE)


def no_backward(out: torch.Tensor) -> torch.Tensor:
    """``out`` [M, K] as it is where autograd records nothing; else a view whose backward raises ``MESSAGE``."""
    return _NoBackward.apply(out) if out.requires_grad else out

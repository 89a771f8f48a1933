"""The clamp after the activation (Step-3.7, Bailing-Hybrid: ``ActivationSpec.limit_after_act``) written out in
float64 for the kernel tests, apart from moekit: min(act(gate), L) * (clamp(up, -L, L) + up_shift), or the clamp
before (gpt-oss's) act(min(gate, L)) * (clamp(up, -L, L) + up_shift); act = g sigmoid(alpha g) (silu). The loop also
counts the values each clamp cut, so a test can check that its limit bites.

Shapes: x [M, K], w13 [E, 2N, K], w2 [E, K, N], ids / weights [M, k], b13 [E, 2N], b2 [E, K].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.activations import ActivationSpec


@dataclass
class Bites:
    """How many values each clamp cut over the loop's (token, slot) pairs."""

    gate: int = 0  # act(gate) > L (after) or gate > L (before)
    up: int = 0  # |up| > L


def glu64(h: torch.Tensor, spec: ActivationSpec, bites: Bites) -> torch.Tensor:
    """h [2N] float64 -> [N]: the spec's glu, silu with alpha, the clamp where ``limit_after_act`` says."""
    n, limit = h.shape[0] // 2, spec.limit
    gate, up = (h[0::2], h[1::2]) if spec.interleaved else (h[:n], h[n:])
    bites.up += int((up.abs() > limit).sum())
    up = up.clamp(-limit, limit)
    if not spec.limit_after_act:
        bites.gate += int((gate > limit).sum())
        gate = gate.clamp(max=limit)
    act = gate * torch.sigmoid(spec.alpha * gate)
    if spec.limit_after_act:
        bites.gate += int((act > limit).sum())
        act = act.clamp(max=limit)
    return act * (up + spec.up_shift)


def loop64(x, w13, w2, ids, weights, spec: ActivationSpec, b13=None, b2=None) -> tuple[torch.Tensor, Bites]:
    """(out [M, K] float64, the clamps' cuts): sum over the slots (id in [0, E)) of w * (w2[e] glu(w13[e] x + b13[e])
    + b2[e]), one slot at a time; w13 / w2 already dequantized where quantized."""
    bites, out = Bites(), torch.zeros(x.shape, dtype=torch.float64)
    w13, w2 = w13.double(), w2.double()
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ x[t].double() + (0.0 if b13 is None else b13[e].double())
            y = w2[e] @ glu64(h, spec, bites) + (0.0 if b2 is None else b2[e].double())
            out[t] += float(weights[t, j]) * y
    return out, bites


def both(spec: ActivationSpec) -> tuple[ActivationSpec, ActivationSpec]:
    """(spec clamping before the activation, the same clamping after it)."""
    return (ActivationSpec(spec.name, spec.gated, spec.interleaved, spec.alpha, spec.limit, spec.up_shift, False),
            ActivationSpec(spec.name, spec.gated, spec.interleaved, spec.alpha, spec.limit, spec.up_shift, True))


def want(x, w13, w2, ids, weights, spec: ActivationSpec, b13=None, b2=None) -> torch.Tensor:
    """The float64 loop's out, with the checks that make a test of ``spec`` able to fail: both clamps cut values,
    and the other clamp placement gives another answer."""
    out, bites = loop64(x, w13, w2, ids, weights, spec, b13, b2)
    assert bites.gate > 0 and bites.up > 0, bites
    other = both(spec)[0 if spec.limit_after_act else 1]
    out_other, _ = loop64(x, w13, w2, ids, weights, other, b13, b2)
    assert ((out - out_other).norm() / out.norm()).item() > 0.01  # the placement shows in the output
    return out

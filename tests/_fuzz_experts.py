"""The experts and the shared MLP of the float64 loop (``_fuzz_reference``), one token at a time, from the spec and
``ActivationSpec``'s documented fields: the activation (``glu``), a routed expert, and ``combine``, which weights the
chosen experts and adds the shared MLP. The weights may be floats or float64 tensors that carry a gradient
(``_fuzz_grad``): torch ops only on their paths.

Shapes: M tokens, K hidden, N expert intermediate, k = top_k, S shared slots.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from _quant_refs import fake_fp8_rows

if TYPE_CHECKING:
    from _fuzz_reference import LayerWeights, TokenRoute

# ---------------------------------------------------------------------------------------------------------------
# The activation, from ActivationSpec's documented fields
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    name: str
    interleaved: bool = False
    alpha: float = 1.0
    limit: float | None = None
    up_shift: float = 0.0
    limit_after_act: bool = False


def activation_spec(activation) -> _Spec:
    if isinstance(activation, str):
        return _Spec(activation)
    return _Spec(activation.name, activation.interleaved, activation.alpha, activation.limit, activation.up_shift,
                 activation.limit_after_act)


def _act(t: torch.Tensor, spec: _Spec) -> torch.Tensor:
    if spec.name == "silu":
        return t / (1 + torch.exp(-spec.alpha * t))
    if spec.name == "gelu":
        return 0.5 * t * (1 + torch.erf(t / math.sqrt(2)))
    if spec.name == "gelu_tanh":
        return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3)))
    if spec.name == "relu":
        return t.clamp(min=0)
    if spec.name == "relu2":
        return t.clamp(min=0) ** 2
    raise ValueError(f"no reference for activation {spec.name!r}")


# Where set (``rounded_gate_up``), a clamped activation reads w13 @ x rounded to this dtype (``_product``):
# the layer's gate-up product is rounded to its dtype before the clamp on some paths (grouped_mm's), so an element the
# float64 product puts within a rounding of the clamp's kink may sit on its other side there, with a gradient that is 0
# on one side only (hash seed 499, fp16: one |up| 2.2e-4 from the limit 0.5, slot 6's w13 gradient 26% off). The
# separate shared MLP (``routing.shared.shared_mlp``: torch ops in the layer's dtype, as transformers' eager) also
# clamps against the limit rounded to that dtype (``_dtype_limit``): bf16's 0.8 is 0.80078125, so a gate-up value of
# 0.80078125 stays unclamped there, its gradient passed (torch's clamp passes x <= max), where the loop's 0.8 clamps it
# (gradient 0): a subgradient at the kink either way (seeds 60515 and 60707, bf16 gelu clamped at 0.8: 6.3e-2, 19%).
_GATE_UP_DTYPE: torch.dtype | None = None


@contextlib.contextmanager
def rounded_gate_up(dtype: torch.dtype):
    """The loop's clamped activations read their gate-up products rounded to ``dtype`` while this is open."""
    global _GATE_UP_DTYPE
    _GATE_UP_DTYPE = dtype
    try:
        yield
    finally:
        _GATE_UP_DTYPE = None


def glu(h: torch.Tensor, activation) -> torch.Tensor:
    """h [2n] (gate-up product of one token) -> [n]: act(gate) * (up + shift), clamped by the limit: the gate before
    the activation, or (``limit_after_act``, Step-3.7) act(gate) after it: min(act(gate), limit); up in [-limit, limit]
    either way."""
    spec = activation_spec(activation)
    n = h.shape[-1] // 2
    gate, up = (h[0::2], h[1::2]) if spec.interleaved else (h[:n], h[n:])
    if spec.limit is None:
        return _act(gate, spec) * (up + spec.up_shift)
    up = up.clamp(-spec.limit, spec.limit)
    if spec.limit_after_act:
        return torch.minimum(_act(gate, spec), torch.full_like(gate, spec.limit)) * (up + spec.up_shift)
    return _act(gate.clamp(max=spec.limit), spec) * (up + spec.up_shift)



def _product(w13: torch.Tensor, x: torch.Tensor, activation) -> torch.Tensor:
    """w13 @ x [2n], rounded to ``_GATE_UP_DTYPE`` (its value; the product's gradient) where that is set and the
    activation clamps: the layer's GEMM output, before the bias (added in float32) and the clamp."""
    h = w13 @ x
    if _GATE_UP_DTYPE is None or activation_spec(activation).limit is None:
        return h
    return h + (h.to(_GATE_UP_DTYPE).to(h.dtype) - h).detach()


def _expert(x: torch.Tensor, w: LayerWeights, e: int, activation) -> torch.Tensor:
    """Routed expert e on one token x [K] -> [K]."""
    h = _product(w.w13[e], x, activation) + (w.b13[e] if w.b13 is not None else 0.0)
    y = w.w2[e] @ glu(h, activation)
    return y + (w.b2[e] if w.b2 is not None else 0.0)


def _expert_fp8(x: torch.Tensor, w: LayerWeights, e: int, activation, block: int) -> torch.Tensor:
    """fp8_block's recipe: the activations fake-quantized to e4m3 per 1 x ``block`` before each GEMM."""
    h = w.w13[e] @ fake_fp8_rows(x[None], block)[0] + (w.b13[e] if w.b13 is not None else 0.0)
    y = w.w2[e] @ fake_fp8_rows(glu(h, activation)[None], block)[0]
    return y + (w.b2[e] if w.b2 is not None else 0.0)


def combine(x: torch.Tensor, w: LayerWeights, cfg, routes: list[TokenRoute], keep: list[list[bool]], weights: list,
            shared_weights: list, fp8_block: int | None = None, round_to: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] through the chosen experts (``routes``' ids, ``keep`` after capacity) weighted by ``weights`` [M][k]
    and the shared MLP (``shared_weights`` [M][S] or None each) -> [M, K]. The weights are floats (the routes'
    own) or float64 tensors that carry a gradient (``_fuzz_grad``): torch ops only on their paths. ``round_to``: the
    layer's dtype, to which it rounds weight x token before input-weighted experts (``weighting.input_weighted``;
    under fp8_block's e4m3 steps the rounding shows: seed 15, bf16, 6e-2 without it, 3e-3 with it)."""
    e = cfg.num_experts
    out = torch.zeros_like(x)  # [M, K]
    for t, r in enumerate(routes):
        for j, (expert, weight) in enumerate(zip(r.ids, weights[t])):
            if expert >= e:  # an identity expert: its weight times the token
                out[t] += weight * x[t]
                continue
            if not keep[t][j]:
                continue
            if cfg.expert_weight_on == "input":  # Llama-4: the expert runs on weight x token
                if r.weights[j] != 0.0:  # a weight-0 slot (a masked expert) adds nothing, as in the dense form
                    weighted = weight * x[t] if round_to is None else (weight * x[t]).to(round_to).to(x.dtype)
                    out[t] += _run(weighted, w, expert, cfg.activation, fp8_block)
            else:
                out[t] += weight * _run(x[t], w, expert, cfg.activation, fp8_block)
        out[t] += _shared(x[t], w, cfg, shared_weights[t])
    return out


def _run(x, w, expert, activation, fp8_block):
    return _expert(x, w, expert, activation) if fp8_block is None else _expert_fp8(x, w, expert, activation, fp8_block)


def _shared(x: torch.Tensor, w: LayerWeights, cfg, weights) -> torch.Tensor:
    """The shared MLP on one token, in ``shared_activation`` where set (else the experts' activation): each slot times
    its weight (``weights`` [S], the router's: Inkling; 1/2: average; sigmoid gate)."""
    y = torch.zeros_like(x)
    activation = cfg.activation if cfg.shared_activation is None else cfg.shared_activation  # HY-V4: its own
    if w.shared_separate:
        activation = _dtype_limit(activation)
    for s, slot in enumerate(w.shared):
        weight = weights[s] if weights is not None else 1.0
        y = y + weight * (slot.w2 @ glu(_product(slot.w13, x, activation), activation))
    if w.shared_gate is not None:
        y = y * torch.sigmoid(w.shared_gate @ x)
    return y * (0.5 if cfg.shared_expert_combine == "average" else 1.0)


def _dtype_limit(activation):
    """``activation`` with its limit rounded to ``_GATE_UP_DTYPE`` where that is set (a torch clamp in that dtype
    compares against the rounded limit); else as it is."""
    spec = activation_spec(activation)
    if _GATE_UP_DTYPE is None or spec.limit is None:
        return activation
    return replace(spec, limit=torch.tensor(spec.limit, dtype=_GATE_UP_DTYPE).item())

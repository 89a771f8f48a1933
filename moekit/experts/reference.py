"""The oracle: a per-expert loop with float32 accumulation. Slow, obvious, and what every other
backend is held to.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate, R = 2N (gated) or N (ungated) w13 rows.
"""

from __future__ import annotations

import torch

from moekit.activations import ActivationSpec, apply_glu
from moekit.layouts.grouping import to_local_ids
from moekit.quant import QuantizedWeight, run_quantized


def experts_reference(
    x: torch.Tensor,  # [M, K]
    w13: torch.Tensor,  # [E, R, K], any strides
    w2: torch.Tensor,  # [E, K, N], any strides
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    *,
    activation: str | ActivationSpec = "silu",
    expert_map: torch.Tensor | None = None,
    b13: torch.Tensor | None = None,  # [E, R]
    b2: torch.Tensor | None = None,  # [E, K]
) -> torch.Tensor:
    """sum_j w[t, j] * (w2[e] @ glu(w13[e] @ x_t + b13[e]) + b2[e]) for e = ids[t, j], accumulated in
    float32 (float64 for float64 inputs); returns x.dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    if isinstance(w13, QuantizedWeight) or isinstance(w2, QuantizedWeight):  # exact: moekit.quant.run_quantized
        return run_quantized(experts_reference, x, w13, w2, topk_ids, topk_weights, activation=activation,
                             expert_map=expert_map, b13=b13, b2=b2, weight_dtype=acc)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    local = to_local_ids(topk_ids, num_experts, expert_map).view(num_tokens, top_k)  # [M, k]
    if torch.compiler.is_compiling():
        return _dense_masked(x, w13, w2, local, topk_weights, activation, b13, b2, acc).to(x.dtype)
    out = torch.zeros(num_tokens, x.shape[1], dtype=acc, device=x.device)  # [M, K]
    for expert in range(num_experts):
        tokens, slots = (local == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        h = x[tokens].to(acc) @ w13[expert].to(acc).t()  # [m, R]
        if b13 is not None:
            h = h + b13[expert].to(acc)
        y = apply_glu(h, activation) @ w2[expert].to(acc).t()  # [m, K]
        if b2 is not None:
            y = y + b2[expert].to(acc)
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(acc))
    return out.to(x.dtype)


def _dense_masked(x, w13, w2, local, topk_weights, activation, b13, b2, acc: torch.dtype) -> torch.Tensor:
    """The same sum with no data-dependent size, for ``torch.compile`` (the loop's ``nonzero`` makes one, and
    its empty-expert test a guard on it): every token through every expert, kept where routed there, weighted
    by the sum of its slots' weights on it. E times the loop's rows: the oracle stays obvious, not fast.
    local [M, k] (E where not routed) -> [M, K] in ``acc``."""
    xs = x.to(acc)  # [M, K]
    weights = topk_weights.to(acc)  # [M, k]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=acc, device=x.device)  # [M, K]
    for expert in range(w13.shape[0]):
        hit = local == expert  # [M, k]
        h = xs @ w13[expert].to(acc).t()  # [M, R]
        if b13 is not None:
            h = h + b13[expert].to(acc)
        y = apply_glu(h, activation) @ w2[expert].to(acc).t()  # [M, K]
        if b2 is not None:
            y = y + b2[expert].to(acc)
        weight = torch.where(hit, weights, 0).sum(1, keepdim=True)  # [M, 1]
        # an unrouted row adds 0, even if y is not finite
        out = out + torch.where(hit.any(1, keepdim=True), y * weight, 0)
    return out

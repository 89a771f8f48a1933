"""The oracle: a per-expert loop with float32 accumulation. Slow, obvious, and what every other
backend is held to.

Shapes: M tokens, k slots, E experts, K hidden, N intermediate, R = 2N (gated) or N (ungated) w13 rows.
"""

from __future__ import annotations

import torch

from moekit.activations import ActivationSpec, apply_glu
from moekit.layouts.grouping import to_local_ids


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
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    local = to_local_ids(topk_ids, num_experts, expert_map).view(num_tokens, top_k)  # [M, k]
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

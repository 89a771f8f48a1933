"""Slot weights that do more than scale their expert's output: identity (zero-computation) experts, LongCat-Flash's,
whose router ids E..E+Z-1 return the token itself times their weight (no GEMM, no expert row); and input-weighted
experts, Llama-4's, each run on its weight times the token.

    Route (over E + Z) -> [Identity: those slots out, their weights summed] -> Capacity -> Shared slots -> Group
      -> Experts (input-weighted: one call per slot, on w_j x, weight 1) -> Combine (+ identity weight x token)

Shapes: M tokens, K hidden, E routed experts, Z identity experts, k slots.
"""

from __future__ import annotations

from typing import Callable

import torch

from moekit.config import MoEConfig
from moekit.routing.route import Routing


def identity_weights(routing: Routing, config: MoEConfig) -> torch.Tensor:
    """[M, 1] in the weights' dtype: each token's summed weight over its identity slots (ids >= E), what the
    layer adds times the token (LongCat-Flash's ``identity_output``)."""
    ids, weights = routing.topk_ids, routing.topk_weights  # [M, k]
    return torch.where(ids >= config.num_experts, weights, 0.0).sum(dim=1, keepdim=True)  # [M, 1]


def without_identity(routing: Routing, config: MoEConfig) -> Routing:
    """The routing with its identity slots skipped (id -1, weight 0): what the experts run."""
    identity = routing.topk_ids >= config.num_experts  # [M, k] bool
    return Routing(topk_ids=routing.topk_ids.masked_fill(identity, -1),
                   topk_weights=routing.topk_weights.masked_fill(identity, 0.0), masked_tokens=routing.masked_tokens)


def input_weighted(run: Callable[[torch.Tensor, Routing], torch.Tensor], x2d: torch.Tensor,
                   routing: Routing) -> torch.Tensor:
    """Llama-4's experts: sum_j expert_{ids[:, j]}(w[:, j] x) for x2d [M, K] -> [M, K], through ``run(x, routing)``
    (the layer's experts step) once per slot with weight 1. A skipped slot (-1) runs nothing, and so does a slot of
    weight 0 (a masked expert, ``nonfinite="mask"``), as in Llama-4's dense form, where the weights 0 of the
    experts not chosen add nothing: with expert biases (b13, b2) expert(0 x) is not 0. k calls: EPMoE, which
    dispatches once a forward, takes k = 1 only (Llama-4's)."""
    ids, weights = routing.topk_ids, routing.topk_weights  # [M, k]
    ids = ids.masked_fill(weights == 0, -1)  # [M, k]: weight 0 runs nothing
    ones = torch.ones_like(weights[:, :1])  # [M, 1]
    out = None
    for j in range(ids.shape[1]):
        slot = Routing(topk_ids=ids[:, j:j + 1].contiguous(), topk_weights=ones, masked_tokens=routing.masked_tokens)
        y = run((x2d * weights[:, j:j + 1]).to(x2d.dtype), slot)  # [M, K]
        out = y if out is None else out + y
    return out

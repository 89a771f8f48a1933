"""Identity (zero-computation) experts, LongCat-Flash's: router ids E..E+Z-1 return the token itself times
their weight, so they run no GEMM and take no expert row.

    Route (over E + Z) -> [Identity: those slots out, their weights summed] -> Capacity -> Shared slots -> Group
      -> Experts -> Combine (+ identity weight x token)

Shapes: M tokens, E routed experts, Z identity experts, k slots.
"""

from __future__ import annotations

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

"""Capacity-factor dropping (GShard / Switch training style). Opt-in: moekit is dropless by default.

Each routed expert keeps at most C = ceil(capacity_factor * M * k / E) assignments; the rest are
dropped (their id becomes -1 and their weight 0, so they contribute nothing and the token passes on
its residual). The number dropped is always returned.

    Route -> [Capacity (opt-in)] -> Shared slots -> Group -> Experts -> Combine

Shapes: M tokens, k routed slots, E routed experts. Apply it before appending shared-expert slots
(``append_shared_slots``); ids outside [0, E) are never dropped nor counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from moekit._checks import check_int, check_positive_finite
from moekit.layouts.grouping import rank_within_groups
from moekit.routing.route import Routing

DropPolicy = Literal["position", "weight"]


@dataclass
class CapacityResult:
    """A routing with over-capacity assignments removed, and the account of what was removed."""

    routing: Routing  # dropped slots have topk_ids -1 and topk_weights 0
    capacity: int  # C: assignments each routed expert may keep
    dropped_mask: torch.Tensor  # [M, k] bool; True where an assignment was dropped
    dropped: torch.Tensor  # [] int64; dropped_mask.sum(): the number of dropped assignments
    kept_counts: torch.Tensor  # [E] int32; assignments each expert kept; each <= C


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * M * k / E)."""
    check_positive_finite("capacity_factor", capacity_factor)
    check_int("num_experts", num_experts)
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def apply_capacity(
    routing: Routing, num_experts: int, capacity_factor: float, policy: DropPolicy = "position"
) -> CapacityResult:
    """Drop the assignments past each expert's capacity.

    Policies, deciding which assignments an over-full expert keeps:
    - ``"position"`` (GShard): first choices before second choices, and within a choice rank the
      earlier token first; i.e. priority order (slot j, token t).
    - ``"weight"``: the highest router weights first; equal weights fall back to the position order.
    """
    if policy not in ("position", "weight"):
        raise ValueError(f"policy must be 'position' or 'weight', got {policy!r}")
    ids, weights = routing.topk_ids, routing.topk_weights
    num_tokens, top_k = ids.shape
    capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)

    prio_ids = ids.t().reshape(-1).long()  # [k*M] in priority order (slot-major)
    routed = (prio_ids >= 0) & (prio_ids < num_experts)
    key = torch.where(routed, prio_ids, num_experts)  # [k*M]; E = not routed, never dropped
    keep_first = torch.arange(key.numel(), device=ids.device)  # [k*M] the order an expert keeps them in
    if policy == "weight":
        keep_first = torch.sort(-weights.t().reshape(-1), stable=True).indices  # heaviest first, ties by position
    groups = rank_within_groups(key[keep_first], num_experts)
    rank = torch.empty_like(groups.rank).scatter_(0, keep_first, groups.rank)  # [k*M] rank within its expert
    drop_prio = routed & (rank >= capacity)
    dropped_mask = drop_prio.view(top_k, num_tokens).t()  # [M, k]

    kept_ids = torch.where(dropped_mask, torch.full_like(ids, -1), ids)
    kept_weights = torch.where(dropped_mask, torch.zeros_like(weights), weights)
    kept_counts = torch.clamp(groups.counts, max=capacity).to(torch.int32)
    return CapacityResult(
        routing=Routing(topk_ids=kept_ids, topk_weights=kept_weights, masked_tokens=routing.masked_tokens,
                        shared_weights=routing.shared_weights),
        capacity=capacity,
        dropped_mask=dropped_mask,
        dropped=dropped_mask.sum(),
        kept_counts=kept_counts,
    )

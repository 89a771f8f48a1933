"""The shared core of every grouping: where each (token, slot) assignment lands when assignments are
grouped by expert and each expert's run is rounded up to a multiple of ``align`` rows.

Shapes: M tokens, k slots, A = M*k assignments (a = t*k + j), E local experts.
All of it runs as device ops with no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AlignedPositions:
    """Where every assignment goes in an expert-grouped, ``align``-padded row space."""

    local_ids: torch.Tensor  # [A] int64; local expert of each assignment, E where it is not routed here
    dst: torch.Tensor  # [A] int64; destination row of each assignment, -1 where it is not routed here
    counts: torch.Tensor  # [E] int32; real rows of each expert; sums to the routed assignments
    offsets: torch.Tensor  # [E+1] int64; padded start row of each expert; offsets[E] = rows used


def to_local_ids(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Flatten ids [M, k] to local expert ids [A] (int64), with ``num_experts`` for "not here".

    An id < 0 (skipped or dropped), an id >= the map's length, and a map entry of -1 all mean
    "not here"; none of them is ever wrapped onto a valid expert.
    """
    flat = topk_ids.reshape(-1).long()  # [A]
    if expert_map is not None:
        table = torch.cat([expert_map.long(), expert_map.new_full((1,), -1).long()])  # [E_global + 1]
        safe = torch.where((flat >= 0) & (flat < expert_map.numel()), flat, expert_map.numel())
        flat = table[safe]  # [A]
    routed = (flat >= 0) & (flat < num_experts)
    return torch.where(routed, flat, num_experts)


def aligned_positions(
    topk_ids: torch.Tensor, num_experts: int, align: int, expert_map: torch.Tensor | None = None
) -> AlignedPositions:
    local = to_local_ids(topk_ids, num_experts, expert_map)  # [A]
    num_assignments = local.numel()
    counts_all = torch.zeros(num_experts + 1, dtype=torch.int64, device=local.device)
    counts_all.scatter_add_(0, local, torch.ones_like(local))
    counts = counts_all[:num_experts]  # [E]
    padded = (counts + align - 1) // align * align  # [E]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=local.device)
    offsets[1:] = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts_all, 0) - counts_all  # [E+1] unpadded start of each key's run

    order = torch.sort(local, stable=True).indices  # [A] assignments grouped by expert, in a-order
    sorted_local = local[order]  # [A]
    rank = torch.arange(num_assignments, device=local.device) - starts[sorted_local]  # [A] rank within expert
    offsets_ext = torch.cat([offsets, offsets.new_full((1,), -1)])  # [E+2]; key E -> -1 (not routed)
    dst_sorted = torch.where(sorted_local < num_experts, offsets_ext[sorted_local] + rank, -1)  # [A]
    dst = torch.empty_like(dst_sorted).scatter_(0, order, dst_sorted)  # [A]
    return AlignedPositions(local_ids=local, dst=dst, counts=counts.to(torch.int32), offsets=offsets)


def scatter_to_rows(values: torch.Tensor, dst: torch.Tensor, num_rows: int, fill: int | float) -> torch.Tensor:
    """rows[dst[a]] = values[a] for dst[a] >= 0; every other row of the [num_rows, ...] result is ``fill``."""
    rows = values.new_full((num_rows + 1, *values.shape[1:]), fill)  # the extra row absorbs dst = -1
    index = torch.where(dst >= 0, dst, num_rows)
    rows[index] = values
    return rows[:num_rows]

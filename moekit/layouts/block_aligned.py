"""Block-aligned index layout (vLLM's ``moe_align_block_size``): activations are never copied; a
kernel walks ``sorted_ids`` block by block, each block belonging to one expert, and gathers its rows
through ``sorted_ids // top_k``.

Shapes: M tokens, k slots, A = M*k assignments (a = t*k + j), E local experts, B = block_size,
R = max_padded rows (the buffer bound), R/B blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._checks import check_int
from moekit.layouts.grouping import aligned_positions, max_padded_rows, scatter_to_rows, to_local_ids

# vLLM's shortcut condition: with A*4 <= E tokens are spread so thin that sorting is pure overhead.
NAIVE_SPARSITY_FACTOR = 4


@dataclass
class BlockAlignedLayout:
    """Assignments grouped by expert, each expert's run padded to a whole block."""

    sorted_ids: torch.Tensor  # [R] int32; assignment id a of each row, grouped by expert; padding = sentinel A
    expert_ids: torch.Tensor  # [R // B] int32; local expert of each block; -1 for blocks past num_padded
    num_padded: torch.Tensor  # [1] int32; rows in use (a multiple of B); rows from here on are unused
    counts: torch.Tensor  # [E] int32; real rows per local expert; sums to the assignments routed here
    block_size: int  # B
    top_k: int  # k: a row's token is sorted_ids // k
    num_assignments: int  # A = M*k; also the padding sentinel
    naive: bool  # tiny-batch shortcut: block i holds assignment i alone, in its first row; nothing sorted

    @property
    def max_padded(self) -> int:
        """R: the buffer bound, A + min(E, A)*(B-1) (A*B for the naive shortcut)."""
        return self.sorted_ids.numel()

    def padding_factor(self) -> float:
        """Padded rows / real rows (syncs with the host)."""
        real = int(self.counts.sum())
        return int(self.num_padded) / real if real else 0.0


def use_naive(num_assignments: int, num_experts: int, expert_map: torch.Tensor | None) -> bool:
    """vLLM's tiny-batch shortcut condition: no expert map and A*4 <= E."""
    return expert_map is None and num_assignments * NAIVE_SPARSITY_FACTOR <= num_experts


def align_block(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_map: torch.Tensor | None = None,
    allow_naive: bool = True,
) -> BlockAlignedLayout:
    """Build the block-aligned layout of ``topk_ids`` [M, k] for ``num_experts`` local experts.

    ``expert_map`` [E_global] maps global ids to local ones, -1 = not on this device; such assignments
    (and ids < 0) are left out and never read. With ``allow_naive`` and no map, a batch with
    A*4 <= E takes the shortcut: one assignment per block, in assignment order, no sort.
    No host synchronisation.
    """
    check_align_args(topk_ids, num_experts, block_size, expert_map)
    num_tokens, top_k = topk_ids.shape
    num_assignments = num_tokens * top_k
    if allow_naive and use_naive(num_assignments, num_experts, expert_map):
        return _naive_layout(topk_ids, num_experts, block_size)

    pos = aligned_positions(topk_ids, num_experts, block_size, expert_map)
    max_padded = max_padded_rows(num_assignments, num_experts, block_size)
    assignment = torch.arange(num_assignments, device=topk_ids.device, dtype=torch.int32)
    sorted_ids = scatter_to_rows(assignment, pos.dst, max_padded, fill=num_assignments)  # [R]
    block_start = torch.arange(0, max_padded, block_size, device=topk_ids.device)  # [R/B]
    expert_of_block = torch.searchsorted(pos.offsets[1:], block_start, right=True)  # [R/B]
    num_padded = pos.offsets[-1:]
    expert_ids = torch.where(block_start < num_padded, expert_of_block, -1).to(torch.int32)
    return BlockAlignedLayout(
        sorted_ids=sorted_ids,
        expert_ids=expert_ids,
        num_padded=num_padded.to(torch.int32),
        counts=pos.counts,
        block_size=block_size,
        top_k=top_k,
        num_assignments=num_assignments,
        naive=False,
    )


def _naive_layout(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> BlockAlignedLayout:
    num_tokens, top_k = topk_ids.shape
    num_assignments = num_tokens * top_k
    local = to_local_ids(topk_ids, num_experts, None)  # [A]
    routed = local < num_experts
    sorted_ids = topk_ids.new_full((num_assignments, block_size), num_assignments, dtype=torch.int32)
    sorted_ids[:, 0] = torch.where(routed, torch.arange(num_assignments, device=local.device), num_assignments).int()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=local.device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    return BlockAlignedLayout(
        sorted_ids=sorted_ids.reshape(-1),  # [A*B]
        expert_ids=torch.where(routed, local, -1).to(torch.int32),  # [A]
        num_padded=torch.full((1,), num_assignments * block_size, dtype=torch.int32, device=local.device),
        counts=counts[:num_experts].to(torch.int32),
        block_size=block_size,
        top_k=top_k,
        num_assignments=num_assignments,
        naive=True,
    )


def gather_rows(x: torch.Tensor, layout: BlockAlignedLayout, fill: float = 0.0) -> torch.Tensor:
    """The rows a kernel reads: [R, K] with row r = x[sorted_ids[r] // k], and ``fill`` on padding rows."""
    real = layout.sorted_ids < layout.num_assignments  # [R]
    token = torch.where(real, layout.sorted_ids // layout.top_k, 0).long()  # [R]
    return torch.where(real[:, None], x[token], torch.full_like(x[:1], fill))  # [R, K]


def scatter_rows(rows: torch.Tensor, layout: BlockAlignedLayout) -> torch.Tensor:
    """The inverse of the grouping: [R, D] rows -> [A, D] in assignment order; 0 for assignments not routed here."""
    real = layout.sorted_ids < layout.num_assignments  # [R]
    out = rows.new_zeros((layout.num_assignments + 1, rows.shape[1]))  # extra row absorbs padding
    out[torch.where(real, layout.sorted_ids, layout.num_assignments).long()] = rows
    return out[: layout.num_assignments]  # [A, D]


def check_align_args(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                     expert_map: torch.Tensor | None) -> None:
    """Raise a clear error naming the argument that does not fit."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must have shape [M, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    check_int("num_experts", num_experts)
    check_int("block_size", block_size)
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.device != topk_ids.device):
        raise ValueError(
            f"expert_map must be 1-D on {topk_ids.device}, got shape {tuple(expert_map.shape)} on {expert_map.device}"
        )

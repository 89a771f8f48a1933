"""Contiguous permuted layout (DeepGEMM's grouped-contiguous input): rows are physically copied into
per-expert segments, each starting on an ``align``-row boundary, so a grouped GEMM sees dense tiles.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, T total rows of the permuted buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._checks import check_int
from moekit.layouts.grouping import (
    aligned_positions, assignments_of_rows, combine_rows, gather_assigned_rows, max_padded_rows,
)

DEFAULT_ALIGN = 128  # DeepGEMM's block-M for its contiguous grouped GEMM


@dataclass
class ContiguousLayout:
    """Rows grouped by expert into ``align``-aligned segments of one packed buffer."""

    x_perm: torch.Tensor  # [T, K]; row dst holds x[t] for the assignment whose src_to_dst is dst; padding = fill
    segment_ids: torch.Tensor  # [T] int32; local expert of each row; -1 on padding rows (the GEMM skips them)
    src_of_row: torch.Tensor  # [T] int64; assignment a = t*k + j each row holds; A (= M*k) on padding rows
    src_to_dst: torch.Tensor  # [M, k] int32; row of x_perm holding assignment (t, j); -1 when not routed here
    counts: torch.Tensor  # [E] int32; real rows per local expert
    offsets: torch.Tensor  # [E+1] int64; segment starts (multiples of align); offsets[E] = rows used
    align: int

    @property
    def total_rows(self) -> int:
        return self.x_perm.shape[0]

    def padding_factor(self) -> float:
        """Rows of the buffer / real rows (syncs with the host)."""
        real = int(self.counts.sum())
        return self.total_rows / real if real else 0.0


def permute_contiguous(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    align: int = DEFAULT_ALIGN,
    expert_map: torch.Tensor | None = None,
    static_rows: int | None = None,
    fill: float = 0.0,
) -> ContiguousLayout:
    """Copy x [M, K] into expert segments.

    ``static_rows=None`` sizes the buffer to exactly the rows used, which reads that size back to the
    host (a sync). Pass ``static_rows`` (at least ``max_padded_rows(M*k, E, align)``) for a fixed shape
    with no sync: the spare rows trail the last segment with ``segment_ids`` -1. A smaller value raises
    rather than risk losing a token.
    """
    if x.dim() != 2 or topk_ids.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x [M, K] and topk_ids [M, k] must agree on M, got {tuple(x.shape)} and "
                         f"{tuple(topk_ids.shape)}")
    num_tokens, top_k = topk_ids.shape
    pos = aligned_positions(topk_ids, num_experts, align, expert_map)  # checks num_experts and align
    if static_rows is not None:
        check_int("static_rows", static_rows, minimum=0)
    if static_rows is None:
        total = int(pos.offsets[-1])  # host sync: the exact size is data-dependent
    else:
        bound = max_padded_rows(num_tokens * top_k, num_experts, align)
        if static_rows < bound:
            raise ValueError(f"static_rows must be >= {bound} (A + min(E, A)*(align-1)) to hold any routing, got "
                             f"{static_rows}")
        total = static_rows
    # A gather, not gather + scatter: only the A row indices are scattered, then x's rows are read once.
    # Measured at Qwen3-30B-A3B shapes (K=2048, k=8), see `moekit bench --cpu-experts`.
    src_of_row = assignments_of_rows(pos.dst, total)  # [T]
    local_ext = torch.cat([pos.local_ids, pos.local_ids.new_full((1,), -1)])  # [A+1]; padding -> -1
    return ContiguousLayout(
        x_perm=gather_assigned_rows(x, src_of_row, top_k, fill),  # [T, K]
        segment_ids=local_ext[src_of_row].to(torch.int32),  # [T]
        src_of_row=src_of_row,
        src_to_dst=pos.dst.view(num_tokens, top_k).to(torch.int32),
        counts=pos.counts,
        offsets=pos.offsets,
        align=align,
    )


def unpermute_contiguous(y_perm: torch.Tensor, layout: ContiguousLayout) -> torch.Tensor:
    """The exact inverse: y_perm [T, D] -> [M, k, D]; 0 for assignments not routed here. Padding rows are never read."""
    dst = layout.src_to_dst.long()  # [M, k]
    rows = y_perm[torch.where(dst >= 0, dst, 0)]  # [M, k, D]
    return torch.where((dst >= 0)[..., None], rows, torch.zeros_like(rows))


def combine_contiguous(y_perm: torch.Tensor, layout: ContiguousLayout, topk_weights: torch.Tensor) -> torch.Tensor:
    """The inverse and the weighted sum over the k slots in one: y_perm [T, D], topk_weights [M, k] ->
    [M, D] (float32 accumulation; float64 for float64), equal to
    ``(unpermute_contiguous(y_perm, layout) * topk_weights[..., None]).sum(1)`` without materialising
    [M, k, D]. Padding rows are never added, whatever they hold."""
    return combine_rows(y_perm, layout.src_of_row, topk_weights)

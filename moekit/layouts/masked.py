"""Masked per-expert layout (DeepGEMM's grouped-masked input): every expert gets a rectangle of
``m_max`` rows and a count of how many are real.

Shapes: M tokens, k slots, A = M*k, E local experts, K hidden, m_max rows per expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit._checks import check_int
from moekit.layouts.grouping import aligned_positions, assignments_of_rows, combine_rows, gather_assigned_rows


@dataclass
class MaskedLayout:
    """One [m_max, K] rectangle per local expert; rows past ``counts[e]`` are padding."""

    x_masked: torch.Tensor  # [E, m_max, K]; x_masked[e, i] = x[t] of expert e's i-th assignment; padding = fill
    counts: torch.Tensor  # [E] int32; real rows in each rectangle (DeepGEMM's masked_m); each <= m_max
    src_to_dst: torch.Tensor  # [M, k] int64; flat row e*m_max + i of assignment (t, j); -1 when not routed here
    src_of_row: torch.Tensor  # [E*m_max] int64; assignment a = t*k + j of each flat row; A (= M*k) on padding

    @property
    def m_max(self) -> int:
        return self.x_masked.shape[1]

    def padding_factor(self) -> float:
        """Rows allocated / real rows (syncs with the host)."""
        real = int(self.counts.sum())
        return self.x_masked.shape[0] * self.m_max / real if real else 0.0


def masked_layout(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    m_max: int | None = None,
    expert_map: torch.Tensor | None = None,
    fill: float = 0.0,
) -> MaskedLayout:
    """Uncapped masked layout: every assignment gets its own row, a token routed twice to one expert
    included. ``m_max`` defaults to A = M*k, which holds any routing; M is enough when ids are
    distinct within a token (``route`` guarantees it) and saves a factor k of memory.

    An explicit ``m_max`` below A is checked against the counts: a ``ValueError`` on the CPU, a
    device-side assert elsewhere (no host synchronisation on either path).
    """
    num_assignments = topk_ids.numel()
    if m_max is None:
        m_max = max(num_assignments, 1)
    else:
        check_int("m_max", m_max)
    return _build(x, topk_ids, num_experts, m_max, expert_map, fill, check=m_max < num_assignments)


def masked_layout_measured_cap_syncs(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    round_to: int = 64,
    expert_map: torch.Tensor | None = None,
    fill: float = 0.0,
) -> MaskedLayout:
    """Masked layout with the measured cap: m_max = max per-expert count rounded up to ``round_to``.

    SYNCHRONISES WITH THE HOST (it reads the largest count back), so it cannot be captured in a CUDA
    graph. It allocates E * m_cap rows instead of E * M*k.
    """
    check_int("round_to", round_to)
    pos = aligned_positions(topk_ids, num_experts, 1, expert_map)
    biggest = int(pos.counts.max()) if pos.counts.numel() else 0  # host sync
    m_max = max(round_to, (biggest + round_to - 1) // round_to * round_to)
    return _build(x, topk_ids, num_experts, m_max, expert_map, fill, check=False)


def _build(x, topk_ids, num_experts, m_max, expert_map, fill, check: bool) -> MaskedLayout:
    if x.dim() != 2 or x.shape[0] != topk_ids.shape[0]:
        raise ValueError(f"x [M, K] and topk_ids [M, k] must agree on M, got {tuple(x.shape)} and "
                         f"{tuple(topk_ids.shape)}")
    num_tokens, top_k = topk_ids.shape
    pos = aligned_positions(topk_ids, num_experts, 1, expert_map)  # align 1: offsets are the unpadded starts
    if check and pos.counts.numel():
        _check_cap(pos.counts, m_max)
    routed = pos.dst >= 0
    local = torch.where(routed, pos.local_ids, 0)
    rank = pos.dst - pos.offsets[local]  # [A] row within the expert's rectangle
    flat_dst = torch.where(routed, local * m_max + rank, -1)  # [A]
    src_of_row = assignments_of_rows(flat_dst, num_experts * m_max)  # [E*m_max]
    rows = gather_assigned_rows(x, src_of_row, top_k, fill)  # [E*m_max, K]; one gather, as in contiguous
    return MaskedLayout(
        x_masked=rows.view(num_experts, m_max, x.shape[1]),
        counts=pos.counts,
        src_to_dst=flat_dst.view(num_tokens, top_k),
        src_of_row=src_of_row,
    )


def _check_cap(counts: torch.Tensor, m_max: int) -> None:
    fits = counts.max() <= m_max
    if counts.device.type != "cpu" or torch.compiler.is_compiling():
        torch._assert_async(fits, "masked_layout: m_max is smaller than the busiest expert's rows")  # no host sync
    elif not bool(fits):
        raise ValueError(f"m_max={m_max} is smaller than the busiest expert's {int(counts.max())} rows")


def unmask(y_masked: torch.Tensor, layout: MaskedLayout) -> torch.Tensor:
    """The exact inverse: y_masked [E, m_max, D] -> [M, k, D]; 0 for assignments not routed here."""
    flat = y_masked.reshape(-1, y_masked.shape[-1])  # [E*m_max, D]
    dst = layout.src_to_dst
    rows = flat[torch.where(dst >= 0, dst, 0)]  # [M, k, D]
    return torch.where((dst >= 0)[..., None], rows, torch.zeros_like(rows))


def combine_masked(y_masked: torch.Tensor, layout: MaskedLayout, topk_weights: torch.Tensor) -> torch.Tensor:
    """The inverse and the weighted sum over the k slots in one: y_masked [E, m_max, D], topk_weights
    [M, k] -> [M, D] (float32 accumulation; float64 for float64), equal to
    ``(unmask(y_masked, layout) * topk_weights[..., None]).sum(1)``. Padding rows are never added."""
    return combine_rows(y_masked.reshape(-1, y_masked.shape[-1]), layout.src_of_row, topk_weights)

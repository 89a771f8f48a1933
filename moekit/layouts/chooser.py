"""Pick a token grouping by memory budget (SGLang's masked-vs-compact choice, generalised).

Cost is the rows the expert GEMMs process, padding included (the tensor-core bill); the cheapest
layout whose peak activation bytes fit the budget wins, and the choice says why.

Shapes: M tokens, k slots, A = M*k, E experts, K hidden, N expert intermediate size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moekit.layouts.grouping import max_padded_rows

LAYOUT_NAMES = ("block_aligned", "contiguous", "masked", "masked_measured_cap")


@dataclass
class LayoutEstimate:
    name: str
    rows: int  # rows the GEMMs process, padding included
    peak_bytes: int  # activation buffers alive at the peak (weights excluded)
    syncs: bool  # True when building it reads a size back to the host


@dataclass
class LayoutChoice:
    name: str  # the chosen layout's name, or "none" when nothing fits
    reason: str
    estimates: list[LayoutEstimate] = field(default_factory=list)  # every candidate, cheapest first


def choose_layout(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    dtype_bytes: int,
    memory_budget_bytes: int,
    counts: list[int] | None = None,
    block_size: int = 64,
    align: int = 128,
    allow_sync: bool = True,
    candidates: tuple[str, ...] = LAYOUT_NAMES,
    cap_round_to: int = 64,
) -> LayoutChoice:
    """Choose among ``candidates`` (default all of ``block_aligned``, ``contiguous``, ``masked`` and
    ``masked_measured_cap``; a backend passes the ones it implements).

    ``cap_round_to``: the measured cap's rounding (``masked_layout_measured_cap_syncs``' ``round_to``).
    ``counts`` are the per-expert assignment counts if known; without them every expert is taken to
    hold its mean A/E (rounded up). ``allow_sync=False`` excludes layouts that read sizes back to the host.
    """
    unknown = set(candidates) - set(LAYOUT_NAMES)
    if not candidates or unknown:
        raise ValueError(f"candidates must be a non-empty subset of {LAYOUT_NAMES}, got {candidates!r}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if counts is None:
        counts = [math.ceil(num_tokens * top_k / num_experts)] * num_experts
    elif len(counts) != num_experts:
        raise ValueError(f"counts must have num_experts={num_experts} entries, got {len(counts)}")
    estimates = _estimates(num_tokens, top_k, num_experts, hidden_size, intermediate_size, dtype_bytes, counts,
                           block_size, align, cap_round_to)
    estimates = sorted((e for e in estimates if e.name in candidates), key=lambda e: (e.rows, e.peak_bytes))
    for est in estimates:
        if est.peak_bytes <= memory_budget_bytes and (allow_sync or not est.syncs):
            others = ", ".join(f"{e.name} {e.rows} rows/{e.peak_bytes / 2**20:.1f} MiB" for e in estimates
                               if e is not est)
            return LayoutChoice(
                est.name,
                f"{est.name}: fewest GEMM rows ({est.rows}) among layouts whose peak {est.peak_bytes / 2**20:.1f} MiB "
                f"fits the {memory_budget_bytes / 2**20:.1f} MiB budget" + (f" (others: {others})" if others else ""),
                estimates,
            )
    smallest = min(estimates, key=lambda e: e.peak_bytes)
    return LayoutChoice(
        "none",
        f"no layout fits {size_text(memory_budget_bytes)}; the smallest, {smallest.name}, needs "
        f"{size_text(smallest.peak_bytes)}: process the batch in chunks",
        estimates,
    )


def size_text(nbytes: int) -> str:
    """A size for an error message: MiB from 0.1 MiB on, else bytes (a budget of a few KB printed as "0.0 MiB"
    said nothing of what was missing)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes} bytes"


def grouped_row_bytes(hidden_size: int, intermediate_size: int, dtype_bytes: int) -> int:
    """Activation bytes of one row of a layout that materialises every stage (contiguous, masked): its x
    row [K], the w13 output [2N], the activation [N] and the w2 output [K]. Plain arithmetic, so it also
    takes the symbolic sizes of a ``torch.compile`` trace."""
    return (2 * hidden_size + 3 * intermediate_size) * dtype_bytes


def _estimates(m, k, e, hidden, inter, b, counts, block, align, round_to) -> list[LayoutEstimate]:
    a = m * k
    row = grouped_row_bytes(hidden, inter, b)
    block_rows = sum(math.ceil(c / block) * block for c in counts)
    contig_rows = sum(math.ceil(c / align) * align for c in counts)
    cap = max(round_to, math.ceil(max(counts, default=0) / round_to) * round_to)
    # The block-aligned path gathers x in place and fuses the activation: [A, N] and [A, K] only.
    block_bytes = a * (inter + hidden) * b + max_padded_rows(a, e, block) * 4  # + sorted_ids [R] int32
    return [
        LayoutEstimate("block_aligned", block_rows, block_bytes, syncs=False),
        LayoutEstimate("contiguous", contig_rows, contig_rows * row, syncs=False),
        # masked_layout(m_max=M): enough for route()'s ids, distinct within a token (the default, A, is k times more)
        LayoutEstimate("masked", e * m, e * m * row, syncs=False),
        LayoutEstimate("masked_measured_cap", e * cap, e * cap * row, syncs=True),
    ]

"""Token groupings: how the M*k (token, expert) assignments are laid out for the grouped GEMMs.

Each layout is a dataclass built by one function, with its exact inverse beside it:
``align_block``/``scatter_rows``, ``permute_contiguous``/``unpermute_contiguous``,
``masked_layout``/``unmask``; ``combine_contiguous``/``combine_masked`` are those inverses fused with
the weighted sum over the k slots (the combine stage); ``choose_layout`` picks a layout by memory
budget. ``grouping`` is the core they share (and routing's capacity and expert parallelism's replica choice):
``rank_within_groups``.
"""

from moekit.layouts.block_aligned import BlockAlignedLayout, align_block, gather_rows, scatter_rows
from moekit.layouts.chooser import LayoutChoice, LayoutEstimate, choose_layout, grouped_row_bytes, size_text
from moekit.layouts.contiguous import ContiguousLayout, combine_contiguous, permute_contiguous, unpermute_contiguous
from moekit.layouts.grouping import GroupRanks, max_padded_rows, rank_within_groups, to_local_ids
from moekit.layouts.masked import MaskedLayout, combine_masked, masked_layout, masked_layout_measured_cap_syncs, unmask

__all__ = [
    "BlockAlignedLayout", "align_block", "gather_rows", "scatter_rows",
    "LayoutChoice", "LayoutEstimate", "choose_layout", "grouped_row_bytes", "size_text",
    "ContiguousLayout", "combine_contiguous", "permute_contiguous", "unpermute_contiguous",
    "GroupRanks", "max_padded_rows", "rank_within_groups", "to_local_ids",
    "MaskedLayout", "combine_masked", "masked_layout", "masked_layout_measured_cap_syncs", "unmask",
]

"""Block alignment on the device: the launchers of ``_kernels/align.py`` and the custom op
``torch.ops.moekit.align_block_triton``. No host sync: every size comes from shapes.

Torch twin: ``moekit.layouts.block_aligned.align_block``; the layouts are equal element for element.

Shapes: A = M*k assignments, E local experts, EP = next_pow2(E + 1) histogram bins, B = block size,
R = rows of sorted_ids, R/B blocks.
"""

from __future__ import annotations

from typing import Optional

import torch

from moekit.experts.triton_launch import ALIGN_CHUNK, LaunchOptions, cdiv, kernels, next_pow2, resolve_launch_options
from moekit.layouts.block_aligned import BlockAlignedLayout, check_align_args, use_naive
from moekit.layouts.grouping import max_padded_rows


def align_into(topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map: torch.Tensor | None,
               num_rows: int, options: LaunchOptions) -> BlockAlignedLayout:
    """The sorted layout of ``topk_ids`` [M, k] (contiguous) with ``num_rows`` rows of sorted_ids
    (>= R; the rest are padding). ``options``: resolved for the device by the caller."""
    ids = topk_ids.reshape(-1)  # [A]
    i32 = dict(dtype=torch.int32, device=ids.device)
    layout = BlockAlignedLayout(
        sorted_ids=torch.empty(num_rows, **i32), expert_ids=torch.empty(cdiv(num_rows, block_size), **i32),
        num_padded=torch.empty(1, **i32), counts=torch.empty(num_experts, **i32),
        block_size=block_size, top_k=topk_ids.shape[1], num_assignments=ids.numel(), naive=False,
    )
    e_pad = next_pow2(num_experts + 1)
    if 0 < ids.numel() <= options.align_small_max and e_pad <= options.align_small_max_bins:
        _launch_small(ids, expert_map, num_experts, layout, options)
    else:
        _launch_chunked(ids, expert_map, num_experts, layout, options)
    return layout


def _launch_small(ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int,
                  layout: BlockAlignedLayout, options: LaunchOptions) -> None:
    """One program for all of it (A <= one chunk)."""
    e_pad, num_blocks = next_pow2(num_experts + 1), layout.expert_ids.numel()
    kernels("align").align_small_kernel[(1,)](
        ids, expert_map if expert_map is not None else ids, layout.sorted_ids, layout.expert_ids, layout.counts,
        layout.num_padded, ids.numel(), num_experts, expert_map.numel() if expert_map is not None else 0,
        layout.block_size, layout.max_padded, num_blocks,
        CHUNK=ALIGN_CHUNK, E_PAD=e_pad, BLOCKS_PER_ITER=max(1, min(next_pow2(num_blocks), 4096 // e_pad)),
        BLOCK_PAD=next_pow2(layout.block_size), HAS_MAP=expert_map is not None, **options.pdl_kwargs(),
    )


def _launch_chunked(ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int,
                    layout: BlockAlignedLayout, options: LaunchOptions) -> None:
    """Histogram per chunk, one scan, then the scatter (``_kernels/align.py`` explains the three)."""
    k, launch, has_map = kernels("align"), options.pdl_kwargs(), expert_map is not None
    map_arg, num_global = (expert_map, expert_map.numel()) if has_map else (ids, 0)
    num_assignments, e_pad = ids.numel(), next_pow2(num_experts + 1)
    num_chunks, num_blocks = cdiv(num_assignments, ALIGN_CHUNK), layout.expert_ids.numel()
    hist = torch.empty(max(num_chunks, 1), e_pad, dtype=torch.int32, device=ids.device)  # [chunks, EP]
    chunk_base = torch.empty_like(hist)  # [chunks, EP]
    offsets = torch.empty(e_pad, dtype=torch.int32, device=ids.device)  # [EP]; offsets[E] = rows used
    if num_chunks:
        k.align_hist_kernel[(num_chunks,)](
            ids, map_arg, hist, num_assignments, num_experts, num_global,
            CHUNK=ALIGN_CHUNK, E_PAD=e_pad, HAS_MAP=has_map, **launch,
        )
    k.align_scan_kernel[(1,)](
        hist, chunk_base, layout.counts, offsets, layout.num_padded, num_chunks, num_experts, layout.block_size,
        CHUNK_ROWS=max(1, min(next_pow2(max(num_chunks, 1)), 8192 // e_pad)), E_PAD=e_pad, **launch,
    )
    blocks_per_program = max(1, min(next_pow2(max(num_blocks, 1)), 4096 // e_pad))
    grid = num_chunks + cdiv(num_blocks, blocks_per_program)
    if grid:
        k.align_scatter_kernel[(grid,)](
            ids, map_arg, chunk_base, offsets, layout.counts, layout.num_padded, layout.sorted_ids,
            layout.expert_ids, num_assignments, num_experts, num_global, layout.block_size, layout.max_padded,
            num_blocks, num_chunks, CHUNK=ALIGN_CHUNK, E_PAD=e_pad, BLOCKS_PER_PROGRAM=blocks_per_program,
            BLOCK_PAD=next_pow2(layout.block_size), HAS_MAP=has_map, **launch,
        )


def _align_naive(topk_ids: torch.Tensor, num_experts: int, block_size: int,
                 options: LaunchOptions) -> BlockAlignedLayout:
    """The tiny-batch shortcut (``use_naive``): block a holds assignment a alone, in its first row."""
    ids = topk_ids.reshape(-1)  # [A]
    num_assignments = ids.numel()
    i32 = dict(dtype=torch.int32, device=ids.device)
    layout = BlockAlignedLayout(
        sorted_ids=torch.empty(num_assignments * block_size, **i32), expert_ids=torch.empty(num_assignments, **i32),
        num_padded=torch.empty(1, **i32), counts=torch.empty(num_experts, **i32),
        block_size=block_size, top_k=topk_ids.shape[1], num_assignments=num_assignments, naive=True,
    )
    kernels("align").align_naive_kernel[(1,)](
        ids, layout.sorted_ids, layout.expert_ids, layout.counts, layout.num_padded, num_assignments, num_experts,
        block_size, A_PAD=next_pow2(max(num_assignments, 1)), E_PAD=next_pow2(num_experts + 1),
        BLOCK_PAD=next_pow2(block_size), **options.pdl_kwargs(),
    )
    return layout


# The op takes the alignment's launch options as three primitive arguments (a custom op's schema has no
# dataclasses): a compiled caller picks them like an eager one, and they are resolved inside the op.
@torch.library.custom_op("moekit::align_block_triton", mutates_args=())
def _align_op(
    topk_ids: torch.Tensor, num_experts: int, block_size: int, expert_map: Optional[torch.Tensor], allow_naive: bool,
    dependent_launch: bool, align_small_max: int, align_small_max_bins: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = resolve_launch_options(
        LaunchOptions(dependent_launch=dependent_launch, align_small_max=align_small_max,
                      align_small_max_bins=align_small_max_bins), topk_ids.device)
    topk_ids = topk_ids.contiguous()
    num_assignments = topk_ids.numel()
    if allow_naive and use_naive(num_assignments, num_experts, expert_map):
        layout = _align_naive(topk_ids, num_experts, block_size, options)
    else:
        num_rows = max_padded_rows(num_assignments, num_experts, block_size)
        layout = align_into(topk_ids, num_experts, block_size, expert_map, num_rows, options)
    return layout.sorted_ids, layout.expert_ids, layout.num_padded, layout.counts


@_align_op.register_fake
def _align_fake(topk_ids, num_experts, block_size, expert_map, allow_naive,
                dependent_launch, align_small_max, align_small_max_bins):
    num_assignments = topk_ids.numel()
    if allow_naive and use_naive(num_assignments, num_experts, expert_map):
        rows, blocks = num_assignments * block_size, num_assignments
    else:
        rows = max_padded_rows(num_assignments, num_experts, block_size)
        blocks = cdiv(rows, block_size)
    new = dict(dtype=torch.int32, device=topk_ids.device)
    return (torch.empty(rows, **new), torch.empty(blocks, **new), torch.empty(1, **new),
            torch.empty(num_experts, **new))


def align_block_triton(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_size: int,
    expert_map: torch.Tensor | None = None,
    allow_naive: bool = True,
    *,
    options: LaunchOptions = LaunchOptions(),
) -> BlockAlignedLayout:
    """``align_block`` on the device (Triton kernels, no host sync); equal to it element for element.
    ``options``: its dependent_launch and align_small_* fields apply."""
    check_align_args(topk_ids, num_experts, block_size, expert_map)
    sorted_ids, expert_ids, num_padded, counts = torch.ops.moekit.align_block_triton(
        topk_ids, num_experts, block_size, expert_map, allow_naive,
        options.dependent_launch, options.align_small_max, options.align_small_max_bins,
    )
    num_assignments = topk_ids.numel()
    return BlockAlignedLayout(
        sorted_ids=sorted_ids, expert_ids=expert_ids, num_padded=num_padded, counts=counts,
        block_size=block_size, top_k=topk_ids.shape[1], num_assignments=num_assignments,
        naive=allow_naive and use_naive(num_assignments, num_experts, expert_map),
    )

"""The bf16 Gluon GEMMs' persistent tile walk, in torch (the twin of ``_kernels/gluon_gemm._tile_at``), and the
per-expert segment offsets its expert-aligned order reads.

Tile t of a GEMM over ``num_row_blocks`` 128-row blocks and ``num_col_blocks`` column blocks is (row block, column
block). The GROUP_M order (the default): groups of GROUP_M consecutive row blocks, each group's column blocks in
turn, its row blocks fastest. The expert order (``GluonTile.expert_order``, issue 19 at prefill): a group is one
expert's row blocks, at most GROUP_M of them counted from its first block, so a group never holds two experts'
blocks: CTAs running at once read one expert's weight tile for all its row blocks (with GROUP_M = 8 and DeepSeek-V3's
4-5 blocks an expert at M = 16384, an expert's blocks fell into two groups, its weight tiles streamed once each).
"""

from __future__ import annotations

import torch


def segment_offsets(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """offsets [E + 1] int32: the first row of each expert's segment in the block-aligned layout (counts [E] real
    rows each, padded to ``block_m``); offsets[E] = rows in use. On counts' device, no host sync."""
    padded = (counts.to(torch.int64) + block_m - 1) // block_m * block_m  # [E]
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    out[1:] = torch.cumsum(padded, 0)
    return out.to(torch.int32)


def tile_order(block_experts: torch.Tensor, offsets: torch.Tensor, rows_used: int, num_col_blocks: int,
               group_m: int, expert_order: bool, block_m: int = 128) -> torch.Tensor:
    """[tiles, 2] int64 (row block, column block) of tiles 0, 1, ...: the kernel's arithmetic, tile by tile."""
    num_row_blocks = rows_used // block_m
    t = torch.arange(num_row_blocks * num_col_blocks, dtype=torch.int64)
    if expert_order:
        rb0 = t // num_col_blocks
        expert = block_experts.cpu().to(torch.int64)[rb0]
        offs = offsets.cpu().to(torch.int64)
        first, end = offs[expert] // block_m, offs[expert + 1] // block_m
        start = first + (rb0 - first) // group_m * group_m
        rows_here = torch.minimum(end - start, torch.full_like(start, group_m))
        local = t - start * num_col_blocks
        return torch.stack((start + local % rows_here, local // rows_here), 1)
    per_group = group_m * num_col_blocks
    first = t // per_group * group_m
    rows_here = torch.clamp(num_row_blocks - first, max=group_m)
    return torch.stack((first + (t % per_group) % rows_here, (t % per_group) // rows_here), 1)

"""The bf16 Gluon gate-up GEMM whose tile covers up to 256 rows of one expert, skipping padding in 64-row steps
(``_kernels/gluon_gemm_blk256.py``, ``GluonTile.blk256``; issue 19 at the ridge and small prefill).

``live_subtiles`` is the kernel's tile list in torch (per 128-row block of the 128-aligned layout: 0 where the block
starts no tile, else the tile's live 64-row sub-tiles, 1-4); ``launch_blk256_gemm`` launches the kernel;
``blk256_gemm_twin`` is its arithmetic in torch (rows it leaves unwritten stay as they were), the stand-in the CPU
tests run in its place.
"""

from __future__ import annotations

import importlib

import torch

from moekit.experts.triton_gluon_launch import _KERNELS, BLOCK_M, GluonTile, check_tile, gluon_descriptor, num_sms
from moekit.triton_bind import COMPILE_OPTIONS

SUB_M = 64  # rows of a sub-tile: the step in which padding costs tensor work (m64 wgmmas at n128, full rate)
TILE_M = 4 * SUB_M  # rows of a tile: two consumer warpgroups, 128 rows each
CONSUMER_WARPS = 4  # the default partition (consumer 0); consumer 1 (4 warps) and the loader (1 warp) added
# Registers a thread at launch (12 warps: the loader's one padded to a warpgroup; 12 x 32 x 160 of the SM's 64K),
# then CONSUMER_REGS for consumer 1, 24 for the loader, the rest (3 x 160 - 24 - 224 = 232) for consumer 0: the fp8
# Gluon GEMM's split, whose consumers hold the same [128-row, 128] float32 accumulators' worth (128 a thread).
MAX_REGISTERS, CONSUMER_REGS = 160, 224


def out_cols(tile: GluonTile) -> int:
    """Output columns of one tile (and weight rows of one descriptor block): a stage's 128 weight rows are 64 gate
    + 64 up rows."""
    return tile.block_n // 2


def live_subtiles(block_experts: torch.Tensor, sorted_ids: torch.Tensor, rows_used: int,
                  num_assignments: int) -> torch.Tensor:
    """[R // BLOCK_M] int32: per 128-row block, 0 where it starts no tile (an odd block from its expert's first), else
    the live 64-row sub-tiles of the tile it starts (inside the expert's segment, first row real: sorted_ids <
    num_assignments). block_experts [R // BLOCK_M] int32, sorted by expert up to rows_used (a multiple of 128)."""
    nrb = rows_used // BLOCK_M
    out = torch.zeros(block_experts.numel(), dtype=torch.int32, device=block_experts.device)
    e = block_experts[:nrb].long()  # [nrb]
    if nrb == 0:
        return out
    first = torch.searchsorted(e, e)  # [nrb] each block's expert's first block (e ascending)
    head = (torch.arange(nrb, device=e.device) - first) % 2 == 0
    same = torch.zeros(nrb, dtype=torch.bool, device=e.device)
    same[:-1] = e[1:] == e[:-1]  # block b + 1 is the same expert's
    row = torch.arange(nrb, device=e.device) * BLOCK_M
    real = sorted_ids.long() < num_assignments  # [R]
    second = real[row + SUB_M].int()
    fourth = real[torch.clamp(row + 3 * SUB_M, max=real.numel() - 1)].int()
    live = torch.where(same, 3 + fourth, 1 + second)  # b + 1 the same expert's: b full, b + 1's first row real
    out[:nrb] = torch.where(head, live, 0).int()
    return out


def launch_blk256_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                       sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, tile: GluonTile,
                       w_rows: int, gate_offset: int) -> None:
    """out [T, N] = silu(a [T, K] @ w[e, :N]^T) * (a @ w[e, N:]^T) on the live sub-tiles (``live_subtiles``), other
    rows unwritten; w [E*w_rows, K] (contiguous 2-D view), gate rows c.., up rows gate_offset + c..; block_experts
    [T // 128] int32; sorted_ids [T] int32 (>= num_assignments: padding); rows_used: a 1-element integer tensor (a
    multiple of 128)."""
    check_tile(tile, True)
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm_blk256").blk256_gemm_kernel
    cols = out_cols(tile)
    a_desc = gluon_descriptor(a, [SUB_M, tile.block_k])
    w_desc = gluon_descriptor(w, [cols, tile.block_k])
    c_desc = gluon_descriptor(out, [SUB_M, cols])
    num_col_blocks = out.shape[1] // cols
    num_row_blocks = -(-a.shape[0] // BLOCK_M)
    grid = (max(1, min(num_sms(a.device), num_row_blocks * num_col_blocks)),)
    kernel[grid](a_desc, w_desc, c_desc, block_experts, rows_used, sorted_ids, num_assignments, a.shape[1],
                 num_col_blocks, W_ROWS=w_rows, GATE_OFFSET=gate_offset, STAGES=tile.stages, GROUP_M=tile.group_m,
                 SEARCH_STEPS=search_steps(num_row_blocks), CONSUMER_REGS=CONSUMER_REGS, num_warps=CONSUMER_WARPS,
                 maxnreg=MAX_REGISTERS, **COMPILE_OPTIONS)


def search_steps(num_row_blocks: int) -> int:
    """Halvings of the kernel's binary search for an expert's first block among ``num_row_blocks``."""
    return max(1, num_row_blocks.bit_length())


def blk256_gemm_twin(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                     sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, w_rows: int,
                     gate_offset: int) -> None:
    """``launch_blk256_gemm`` in torch (float32 products rounded to out's dtype): the rows the kernel writes, the
    others untouched. Syncs (reads rows_used)."""
    used = int(rows_used.reshape(-1)[0])
    live = live_subtiles(block_experts, sorted_ids, used, num_assignments).tolist()
    cols = out.shape[1]
    for b, n in enumerate(live):
        if n == 0:
            continue
        rows, first = slice(b * BLOCK_M, b * BLOCK_M + n * SUB_M), int(block_experts[b]) * w_rows
        gate = a[rows].float() @ w[first:first + cols].float().t()  # [n * 64, N]
        up = a[rows].float() @ w[first + gate_offset:first + gate_offset + cols].float().t()
        out[rows] = (torch.nn.functional.silu(gate) * up).to(out.dtype)

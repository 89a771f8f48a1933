"""The padding tax at prefill (issue 19): which row blocks of the 128-aligned layout are an expert's mostly empty
last block, and the bf16 Gluon down GEMM that folds such a block into the tiles of the block before it
(``_kernels/gluon_gemm_tail.py``; the route takes it where ``triton_gluon_launch.wants_tail``).

``merged_blocks`` is the kernel's predicate in torch (the oracle of the CPU tests and what the device check counts);
``launch_tail_down`` launches the kernel; ``tail_down_twin`` is its arithmetic in torch (rows it leaves unwritten
stay as they were), the stand-in the CPU tests run in its place.
"""

from __future__ import annotations

import importlib

import torch

from moekit.experts.triton_gluon_launch import (
    _KERNELS, BLOCK_M, MAX_REGISTERS, NUM_WARPS, GluonTile, check_tile, gluon_descriptor, num_sms,
)
from moekit.triton_bind import COMPILE_OPTIONS

TAIL = 64  # the rows of a last block the tile before it takes (m64 MMAs, the warpgroups splitting the columns)


def merged_blocks(block_experts: torch.Tensor, sorted_ids: torch.Tensor, rows_used: int,
                  num_assignments: int) -> torch.Tensor:
    """[R // BLOCK_M] bool: block b takes block b + 1 into its tiles (b + 1 is the same expert's last block, with at
    most TAIL real rows); block b + 1's own tiles are then skipped. block_experts [R // BLOCK_M] int32, sorted_ids
    [R] int32 (>= num_assignments: padding), rows_used a multiple of BLOCK_M."""
    nrb = rows_used // BLOCK_M
    out = torch.zeros(block_experts.numel(), dtype=torch.bool, device=block_experts.device)
    if nrb < 2:
        return out
    e = block_experts[:nrb].long()  # [nrb]
    nxt_same = e[1:] == e[:-1]  # [nrb - 1]: b + 1 the same expert
    after = torch.cat([e[2:] != e[:-2], torch.ones(1, dtype=torch.bool, device=e.device)])  # b + 1 its last block
    rows = torch.arange(1, nrb, device=e.device) * BLOCK_M + TAIL  # row TAIL of block b + 1
    ok = nxt_same & after & (sorted_ids[rows].long() >= num_assignments)
    out[:nrb - 1] = ok
    return out


def launch_tail_down(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                     sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, tile: GluonTile,
                     w_rows: int) -> None:
    """out [T, C] = h [T, R] @ w[e]^T per row block, merged blocks' tiles computing the next block's first TAIL rows
    (``merged_blocks``); w [E*w_rows, R] (contiguous 2-D view of w2); rows of out past a merged tail unwritten."""
    if tile.tail != TAIL:
        raise ValueError(f"tile={tile}: tail {TAIL} expected")
    check_tile(tile, gated=False)
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm_tail").tail_down_kernel
    a_desc = gluon_descriptor(h, [BLOCK_M, tile.block_k])
    t_desc = gluon_descriptor(h, [TAIL, tile.block_k])
    w_desc = gluon_descriptor(w, [tile.block_n, tile.block_k])
    c_desc = gluon_descriptor(out, [BLOCK_M, tile.block_n])
    ct_desc = gluon_descriptor(out, [TAIL, tile.block_n])
    num_col_blocks = out.shape[1] // tile.block_n
    grid = (max(1, min(num_sms(h.device), -(-h.shape[0] // BLOCK_M) * num_col_blocks)),)
    kernel[grid](a_desc, t_desc, w_desc, c_desc, ct_desc, block_experts, sorted_ids, rows_used, num_assignments,
                 h.shape[1], num_col_blocks, W_ROWS=w_rows, STAGES=tile.stages, GROUP_M=tile.group_m,
                 num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS, **COMPILE_OPTIONS)


def tail_down_twin(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                   sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, w_rows: int) -> None:
    """``launch_tail_down`` in torch (float32 products rounded to out's dtype): the rows the kernel writes, the
    others untouched. Syncs (reads rows_used)."""
    used = int(rows_used.reshape(-1)[0])
    merged = merged_blocks(block_experts, sorted_ids, used, num_assignments)
    skipped = torch.zeros_like(merged)
    skipped[1:] = merged[:-1]
    for b in range(used // BLOCK_M):
        if bool(skipped[b]):
            continue
        e = int(block_experts[b])
        rows = BLOCK_M + (TAIL if bool(merged[b]) else 0)
        lo = b * BLOCK_M
        out[lo:lo + rows] = (h[lo:lo + rows].float() @ w[e * w_rows:(e + 1) * w_rows].float().t()).to(out.dtype)

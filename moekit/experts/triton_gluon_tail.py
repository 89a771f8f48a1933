"""The padding tax at prefill (issue 19): which row blocks of the 128-aligned layout are an expert's mostly empty
last block, and the bf16 Gluon GEMMs that fold such a block into the tiles of the block before it
(``_kernels/gluon_gemm_tail.py``).

``merged_blocks`` is the kernels' predicate in torch (the oracle of the CPU tests and what the device check counts);
``launch_tail_gemm`` launches a kernel; ``tail_gemm_twin`` is its arithmetic in torch (rows it leaves unwritten
stay as they were), the stand-in the CPU tests run in its place.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import torch

from moekit.experts.triton_gluon_launch import (
    _KERNELS, BLOCK_M, MAX_REGISTERS, NUM_WARPS, GluonTile, check_tile, gluon_descriptor, num_sms,
)

TAILS = (64, 128)  # the rows of a last block the tile before it takes: m64 MMAs (columns split) or a second 128-row one


def merged_blocks(block_experts: torch.Tensor, sorted_ids: torch.Tensor, rows_used: int, num_assignments: int,
                  tail: int) -> torch.Tensor:
    """[R // BLOCK_M] bool: block b takes block b + 1 into its tiles (b + 1 is the same expert's last block, with at
    most ``tail`` real rows); block b + 1's own tiles are then skipped. block_experts [R // BLOCK_M] int32, sorted_ids
    [R] int32 (>= num_assignments: padding), rows_used a multiple of BLOCK_M."""
    if tail not in TAILS:
        raise ValueError(f"tail={tail}: one of {TAILS}")
    nrb = rows_used // BLOCK_M
    out = torch.zeros(block_experts.numel(), dtype=torch.bool, device=block_experts.device)
    if nrb < 2:
        return out
    e = block_experts[:nrb].long()  # [nrb]
    nxt_same = e[1:] == e[:-1]  # [nrb - 1]: b + 1 the same expert
    after = torch.cat([e[2:] != e[:-2], torch.ones(1, dtype=torch.bool, device=e.device)])  # b + 1 its last block
    ok = nxt_same & after
    if tail < BLOCK_M:
        rows = torch.arange(1, nrb, device=e.device) * BLOCK_M + tail  # row `tail` of block b + 1
        ok = ok & (sorted_ids[rows].long() >= num_assignments)
    out[:nrb - 1] = ok
    return out


def with_tail(tile: GluonTile, tail: int, gated: bool) -> GluonTile:
    """``tile`` with ``tail`` and the most stages (at most its own) that fit sm_90 (``check_tile``): the plan's
    gate-up tile 3 stages with tail 64 (3 x 56 KB ring + 48 KB out), the down tile 4 (tail 64) or 3 (tail 128)."""
    for stages in range(tile.stages, 1, -1):
        candidate = replace(tile, tail=tail, stages=stages)
        try:
            check_tile(candidate, gated)
        except ValueError:
            continue
        return candidate
    raise ValueError(f"tile={tile} with tail={tail} ({'gate-up' if gated else 'down'}): no stage count fits")


def launch_tail_gemm(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                     sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, tile: GluonTile,
                     w_rows: int, gated: bool = False, gate_offset: int = 0) -> None:
    """out [T, C] = act(h [T, R] @ w[e]^T) per row block (gated: silu(gate) * up, gate rows c, up rows gate_offset
    + c), merged blocks' tiles computing the next block's first ``tile.tail`` rows (``merged_blocks``); w
    [E*w_rows, R] (contiguous 2-D view of w13 or w2); rows of out past a merged tail unwritten."""
    if tile.tail not in TAILS or (gated and tile.tail != 64):
        raise ValueError(f"tile={tile} ({'gate-up' if gated else 'down'}): tail one of {TAILS}, 64 on the gate-up")
    check_tile(tile, gated)
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm_tail").tail_gemm_kernel
    a_desc = gluon_descriptor(h, [BLOCK_M, tile.block_k])
    t_desc = gluon_descriptor(h, [tile.tail, tile.block_k])
    w_desc = gluon_descriptor(w, [tile.block_n, tile.block_k])
    c_desc = gluon_descriptor(out, [BLOCK_M, tile.block_n])
    ct_desc = gluon_descriptor(out, [tile.tail, tile.block_n])
    num_col_blocks = out.shape[1] // tile.block_n
    grid = (max(1, min(num_sms(h.device), -(-h.shape[0] // BLOCK_M) * num_col_blocks)),)
    kernel[grid](a_desc, t_desc, w_desc, c_desc, ct_desc, block_experts, sorted_ids, rows_used, num_assignments,
                 h.shape[1], num_col_blocks, W_ROWS=w_rows, GATE_OFFSET=gate_offset, GATED=gated, STAGES=tile.stages,
                 GROUP_M=tile.group_m, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS)


def tail_gemm_twin(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                   sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, tile: GluonTile,
                   w_rows: int, gated: bool = False, gate_offset: int = 0) -> None:
    """``launch_tail_gemm`` in torch (float32 products, silu(gate) * up when gated, rounded to out's dtype): the rows
    the kernel writes, the others untouched. Syncs (reads rows_used)."""
    used = int(rows_used.reshape(-1)[0])
    tail = tile.tail
    merged = merged_blocks(block_experts, sorted_ids, used, num_assignments, tail)
    skipped = torch.zeros_like(merged)
    skipped[1:] = merged[:-1]
    for b in range(used // BLOCK_M):
        if bool(skipped[b]):
            continue
        e = int(block_experts[b])
        rows = BLOCK_M + (tail if bool(merged[b]) else 0)
        lo = b * BLOCK_M
        prod = h[lo:lo + rows].float() @ w[e * w_rows:(e + 1) * w_rows].float().t()  # [rows, w_rows]
        if gated:
            prod = torch.nn.functional.silu(prod[:, :out.shape[1]]) * prod[:, gate_offset:gate_offset + out.shape[1]]
        out[lo:lo + rows] = prod.to(out.dtype)

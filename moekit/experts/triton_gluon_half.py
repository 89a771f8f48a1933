"""The padding tax at the ridge (issue 19, 8 <= M <= 1024): which row blocks of the 128-aligned layout run as 64-row
tiles, and the bf16 Gluon GEMM that runs them so (``_kernels/gluon_gemm_half.py``; ``GluonTile.halves``).

``half_blocks`` is the kernel's predicate in torch (the oracle of the CPU tests and what the device check counts);
``launch_half_gemm`` launches the kernel (either GEMM); ``half_gemm_twin`` is its arithmetic in torch (the rows it
writes with their values; rows 64-127 of a half block, which the kernel fills with stale values, left as they were),
the stand-in the CPU tests run in its place.
"""

from __future__ import annotations

import importlib

import torch

from moekit.experts.triton_gluon_launch import (
    _KERNELS, BLOCK_M, MAX_REGISTERS, NUM_WARPS, GluonTile, check_tile, gluon_descriptor, num_sms,
)

HALF = BLOCK_M // 2  # the rows of a half tile (m64 MMAs, the warpgroups splitting the columns)


def half_blocks(sorted_ids: torch.Tensor, rows_used: int, num_assignments: int) -> torch.Tensor:
    """[R // BLOCK_M] bool: block b runs a 64-row tile (its row 64 is padding: sorted_ids[b * 128 + 64] >= A; an
    expert's real rows come first in its segment, so rows 64-127 are all padding). Blocks past rows_used: False.
    sorted_ids [R] int32, rows_used a multiple of BLOCK_M."""
    out = torch.zeros(sorted_ids.numel() // BLOCK_M, dtype=torch.bool, device=sorted_ids.device)
    used = rows_used // BLOCK_M
    out[:used] = sorted_ids[HALF:used * BLOCK_M:BLOCK_M].long() >= num_assignments
    return out


def launch_half_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                     sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, tile: GluonTile,
                     gated: bool, w_rows: int, gate_offset: int = 0) -> None:
    """out [T, C] = act(a [T, R] @ w[e]^T) per row block, ``half_blocks`` as 64-row tiles (rows 64-127 of those get
    stale values); w [E*w_rows, R] (contiguous 2-D view); the other arguments as ``launch_gemm``'s."""
    if not tile.halves:
        raise ValueError(f"tile={tile}: halves expected")
    check_tile(tile, gated)
    kernel = importlib.import_module(f"{_KERNELS}.gluon_gemm_half").half_gemm_kernel
    a_desc = gluon_descriptor(a, [BLOCK_M, tile.block_k])
    w_desc = gluon_descriptor(w, [tile.block_n, tile.block_k])
    c_desc = gluon_descriptor(out, [BLOCK_M, tile.block_n])
    num_col_blocks = out.shape[1] // tile.block_n
    grid = (max(1, min(num_sms(a.device), -(-a.shape[0] // BLOCK_M) * num_col_blocks)),)
    kernel[grid](a_desc, w_desc, c_desc, block_experts, sorted_ids, rows_used, num_assignments, a.shape[1],
                 num_col_blocks, W_ROWS=w_rows, GATE_OFFSET=gate_offset, GATED=gated, STAGES=tile.stages,
                 GROUP_M=tile.group_m, num_warps=NUM_WARPS, maxnreg=MAX_REGISTERS)


def half_gemm_twin(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, block_experts: torch.Tensor,
                   sorted_ids: torch.Tensor, rows_used: torch.Tensor, num_assignments: int, gated: bool, w_rows: int,
                   gate_offset: int = 0) -> None:
    """``launch_half_gemm`` in torch (float32 products, silu(gate) * up when ``gated``, rounded to out's dtype): the
    rows the kernel writes with their values, rows 64-127 of a half block untouched. Syncs (reads rows_used)."""
    used = int(rows_used.reshape(-1)[0])
    halves = half_blocks(sorted_ids, used, num_assignments)
    cols = out.shape[1]
    for b in range(used // BLOCK_M):
        first = int(block_experts[b]) * w_rows
        rows = slice(b * BLOCK_M, b * BLOCK_M + (HALF if bool(halves[b]) else BLOCK_M))
        product = a[rows].float() @ w[first:first + cols].float().t()  # [rows, C]
        if gated:
            up = a[rows].float() @ w[first + gate_offset:first + gate_offset + cols].float().t()
            product = torch.nn.functional.silu(product) * up
        out[rows] = product.to(out.dtype)

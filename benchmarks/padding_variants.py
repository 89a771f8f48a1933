"""The calls ``padding_device_check.py`` times (issue 19, the padding tax at prefill): the route, the fused kernels,
the lean bf16 Gluon launch with the plan's plain tiles ("lean g128") and with the down GEMM folding an expert's mostly
empty last row block into the tiles of the block before it ("lean down t64", ``triton_gluon_tail``; bit-equal to lean
g128: the same products on every row the combine reads). Also the tax itself: the GEMMs on subsets of the layout's
row blocks (the mostly empty last blocks alone, the others alone) next to the whole layout and a balanced routing.
Run 1 (raw/...-1008e29-prefill5-ck1.log) also timed, and the code is removed: both GEMMs with the tail (the gate-up
at 3 stages: 0.69-0.95x), a 128-row tail (0.84-0.95x), the fp8 down GEMM with a third consumer for the tail (1.01x
at DeepSeek-V3 4096, 0.97x at Qwen3 4096), the tails on the plain (not lean) launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    call: Callable  # (x, topk_ids, topk_weights) -> out [M, K]
    same_as: str | None = None  # the variant whose output this one must equal bit for bit


@dataclass
class Buffers:
    """One layout and its intermediates (uninitialised: rows no GEMM writes are never read), made once for the GEMMs
    alone."""

    lay: object  # GluonLayout (gather-kernel x_perm)
    h: torch.Tensor  # [R, N]
    y: torch.Tensor  # [R, K]
    num_assignments: int


def buffers(x, ids, num_experts: int, inter: int, hidden: int) -> Buffers:
    from moekit.experts.triton_gluon import gluon_layout

    lay = gluon_layout(x, ids, num_experts)
    rows = lay.x_perm.shape[0]
    return Buffers(lay, x.new_empty(rows, inter), x.new_empty(rows, hidden), ids.numel())


def gate_up(b: Buffers, w13, tile) -> None:
    from moekit.experts.triton_gluon_launch import launch_gemm

    num_experts, two_n, hidden = w13.shape
    lay = b.lay
    launch_gemm(lay.x_perm, w13.view(num_experts * two_n, hidden), b.h, lay.block_experts, lay.rows_used, tile, True,
                two_n, two_n // 2)


def down(b: Buffers, w2, tile) -> None:
    """The down GEMM with ``tile`` (a tail tile: the folding kernel, reading the layout's sorted_ids)."""
    from moekit.experts.triton_gluon_launch import launch_gemm

    num_experts, hidden, inter = w2.shape
    lay = b.lay
    launch_gemm(b.h, w2.view(num_experts * hidden, inter), b.y, lay.block_experts, lay.rows_used, tile, False, hidden,
                sorted_ids=lay.sorted_ids, num_assignments=b.num_assignments)


def variants(w13, w2) -> list[Variant]:
    """route (merged main: the lean Gluon launch with the down GEMM's tail where ``wants_tail``); fused (the route
    before it at DeepSeek-V3 4096); the lean Gluon launch with the plan's plain tiles ("lean g128": the route before
    it where Gluon was taken) and with the down GEMM's tail ("lean down t64", forced at every cell)."""
    from moekit.experts import run_experts
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile
    from moekit.experts.triton_gluon_lean import run_lean

    inter = w2.shape[2]

    def lean(tail: bool):
        return lambda x, i, r: run_lean(x, w13, w2, i, r, None, UP_TILE, down_tile(inter, tail))

    return [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("fused", lambda x, i, r: fused_experts(x, w13, w2, i, r)),
            Variant("lean g128", lean(False)),
            Variant("lean down t64", lean(True), "lean g128")]


def block_classes(b: Buffers) -> dict:
    """Host-side counts of the layout's row blocks (syncs): used blocks, the mostly empty last blocks (the ones the
    tail kernel folds), rows per real row."""
    from moekit.experts.triton_gluon_launch import BLOCK_M
    from moekit.experts.triton_gluon_tail import merged_blocks

    used = int(b.lay.rows_used.item())
    m = merged_blocks(b.lay.block_experts, b.lay.sorted_ids, used, b.num_assignments)
    return {"blocks": used // BLOCK_M, "padded_rows_per_row": used / b.num_assignments, "folded_t64": int(m.sum())}


def subset(b: Buffers, blocks: torch.Tensor) -> Buffers:
    """The layout's row blocks ``blocks`` (indices) alone, in order, as a layout of their own (copies)."""
    from moekit.experts.triton_gluon import GluonLayout
    from moekit.experts.triton_gluon_launch import BLOCK_M

    lay = b.lay
    k, whole = lay.x_perm.shape[1], lay.x_perm.shape[0] // BLOCK_M * BLOCK_M
    x_sub = lay.x_perm[:whole].view(-1, BLOCK_M, k)[blocks].reshape(-1, k)  # [S*128, K]
    sorted_sub = lay.sorted_ids[:whole].view(-1, BLOCK_M)[blocks].reshape(-1)
    used = torch.tensor([blocks.numel() * BLOCK_M], dtype=torch.int32, device=x_sub.device)
    sub = GluonLayout(x_sub, lay.block_experts[blocks].contiguous(), used, lay.src_to_dst, sorted_sub)
    return Buffers(sub, b.h.new_empty(x_sub.shape[0], b.h.shape[1]), b.y.new_empty(x_sub.shape[0], b.y.shape[1]),
                   b.num_assignments)


def tail_subsets(b: Buffers) -> dict:
    """{"last blocks": the mostly empty last blocks (those tail 64 folds), "other blocks": the rest} as layouts."""
    from moekit.experts.triton_gluon_launch import BLOCK_M
    from moekit.experts.triton_gluon_tail import merged_blocks

    used = int(b.lay.rows_used.item())
    m = merged_blocks(b.lay.block_experts, b.lay.sorted_ids, used, b.num_assignments)[:used // BLOCK_M]
    last = torch.zeros_like(m)
    last[1:] = m[:-1]
    idx = torch.arange(m.numel(), device=m.device)
    return {"last blocks": subset(b, idx[last]), "other blocks": subset(b, idx[~last])}

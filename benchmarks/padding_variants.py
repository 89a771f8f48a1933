"""The calls ``padding_device_check.py`` times (issue 19, the padding tax at prefill): the bf16 Gluon path on the
128-aligned layout (plain launches, the gather kernel's x_perm: "g128", the base) and the same path with an expert's
mostly empty last row block folded into the tiles of the block before it (``triton_gluon_tail``): the down GEMM
with tail 64 (m64 MMAs, the warpgroups splitting the columns) or tail 128 (a second 128-row MMA on the same weight
stage), and both GEMMs with tail 64. Each must equal "g128" bit for bit (the same products on every row the combine
reads). Also the tax itself: the GEMMs on subsets of the layout's row blocks (the mostly empty last blocks alone,
the others alone) next to the whole layout and a balanced routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    call: Callable  # (x, topk_ids, topk_weights) -> out [M, K]
    up_tail: int = 0  # the gate-up GEMM's tail (0: the plain kernel)
    down_tail: int = 0  # the down GEMM's tail
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


def gate_up(b: Buffers, w13, tile, tail: int) -> None:
    from moekit.experts.triton_gluon_launch import launch_gemm
    from moekit.experts.triton_gluon_tail import launch_tail_gemm, with_tail

    num_experts, two_n, hidden = w13.shape
    w = w13.view(num_experts * two_n, hidden)
    lay = b.lay
    if tail:
        launch_tail_gemm(lay.x_perm, w, b.h, lay.block_experts, lay.sorted_ids, lay.rows_used, b.num_assignments,
                         with_tail(tile, tail, True), two_n, gated=True, gate_offset=two_n // 2)
    else:
        launch_gemm(lay.x_perm, w, b.h, lay.block_experts, lay.rows_used, tile, True, two_n, two_n // 2)


def down(b: Buffers, w2, tile, tail: int) -> None:
    from moekit.experts.triton_gluon_launch import launch_gemm
    from moekit.experts.triton_gluon_tail import launch_tail_gemm, with_tail

    num_experts, hidden, inter = w2.shape
    w = w2.view(num_experts * hidden, inter)
    lay = b.lay
    if tail:
        launch_tail_gemm(b.h, w, b.y, lay.block_experts, lay.sorted_ids, lay.rows_used, b.num_assignments,
                         with_tail(tile, tail, False), hidden)
    else:
        launch_gemm(b.h, w, b.y, lay.block_experts, lay.rows_used, tile, False, hidden)


def whole_call(x, w13, w2, ids, rw, up_tail: int, down_tail: int) -> torch.Tensor:
    """The Gluon path, plain launches, the gate-up and down GEMMs with the tails given (0: the plain kernels)."""
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile, launch_contiguous_sum

    num_experts, hidden, inter = w2.shape
    b = buffers(x, ids, num_experts, inter, hidden)
    gate_up(b, w13, UP_TILE, up_tail)
    down(b, w2, down_tile(inter), down_tail)
    out = torch.empty_like(x)
    launch_contiguous_sum(b.y, b.lay.src_to_dst, rw.contiguous(), out)
    return out


def variants(w13, w2) -> list[Variant]:
    """route; g128 (plain launches, the base); the tails on plain launches; the lean launch (what a route with tail
    tiles would run: "lean down t64" keeps the in-loader gather where the route takes it, Qwen3)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile
    from moekit.experts.triton_gluon_lean import run_lean
    from moekit.experts.triton_gluon_tail import with_tail

    def gluon(up_tail, down_tail):
        return lambda x, i, r: whole_call(x, w13, w2, i, r, up_tail, down_tail)

    def lean(up_tail, down_tail):
        up = with_tail(UP_TILE, up_tail, True) if up_tail else UP_TILE
        down = with_tail(down_tile(w2.shape[2]), down_tail, False) if down_tail else down_tile(w2.shape[2])
        return lambda x, i, r: run_lean(x, w13, w2, i, r, None, up, down)

    return [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("g128", gluon(0, 0)),
            Variant("down t64", gluon(0, 64), 0, 64, "g128"),
            Variant("down t128", gluon(0, 128), 0, 128, "g128"),
            Variant("both t64", gluon(64, 64), 64, 64, "g128"),
            Variant("lean down t64", lean(0, 64), 0, 64, "g128"),
            Variant("lean both t64", lean(64, 64), 64, 64, "g128")]


def fp8_variants(q: tuple) -> list[Variant]:
    """q = (w13_q, w13_scale, w2_q, w2_scale): the route (the fp8 Gluon path's lean launch at these cells), the lean
    launch with the plan's pipelines ("gf8", the base) and with the down GEMM's tail consumer ("gf8 down t64")."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, DOWN_TILE_T64, UP_TILE
    from moekit.experts.triton_gluon_lean import run_lean
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))

    def lean(down):
        return lambda x, i, r: run_lean(x, q[0], q[2], i, r, None, UP_TILE, down, q[1], q[3])

    return [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("gf8", lean(DOWN_TILE)),
            Variant("gf8 down t64", lean(DOWN_TILE_T64), 0, 64, "gf8")]


def fp8_down_pair(x, ids, q) -> tuple:
    """(plain down launch, tail down launch, rows_used) on x's quantized layout under ``ids`` (h from the gate-up
    GEMM, run once here)."""
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, DOWN_TILE_T64, UP_TILE, launch_gemm_fp8

    w13_q, w13_s, w2_q, w2_s = q
    num_experts, hidden, inter = w2_q.shape
    lay = gluon_fp8_layout(x, ids, num_experts)
    rows = lay.x_q.shape[0]
    h_q = torch.empty(rows, inter, device=x.device, dtype=torch.float8_e4m3fn)  # [R, N]
    h_s = torch.empty(rows, inter // 128, device=x.device, dtype=torch.float32)
    y = x.new_empty(rows, hidden)  # [R, K]
    launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, h_q, h_s, lay.block_experts, lay.rows_used, UP_TILE, True, inter)

    def down(tile):
        return lambda: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y, None, lay.block_experts, lay.rows_used, tile, False,
                                       sorted_ids=lay.sorted_ids, num_assignments=ids.numel())

    return down(DOWN_TILE), down(DOWN_TILE_T64), lay.rows_used


def block_classes(b: Buffers) -> dict:
    """Host-side counts of the layout's row blocks (syncs): used blocks, the mostly empty last blocks (tail 64, the
    ones the tail-64 kernels fold), any last block after another (tail 128), rows per real row."""
    from moekit.experts.triton_gluon_launch import BLOCK_M
    from moekit.experts.triton_gluon_tail import merged_blocks

    used = int(b.lay.rows_used.item())
    out = {"blocks": used // BLOCK_M, "padded_rows_per_row": used / b.num_assignments}
    for tail in (64, 128):
        m = merged_blocks(b.lay.block_experts, b.lay.sorted_ids, used, b.num_assignments, tail)
        out[f"folded_t{tail}"] = int(m.sum())
    return out


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
    m = merged_blocks(b.lay.block_experts, b.lay.sorted_ids, used, b.num_assignments, 64)[:used // BLOCK_M]
    last = torch.zeros_like(m)
    last[1:] = m[:-1]
    idx = torch.arange(m.numel(), device=m.device)
    return {"last blocks": subset(b, idx[last]), "other blocks": subset(b, idx[~last])}

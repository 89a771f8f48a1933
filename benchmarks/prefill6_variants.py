"""What ``prefill6_device_check.py`` runs at issue 19's prefill cells (bf16, M >= 4096): the route's plan in words,
the whole-call variants against it, the kernels it can time alone (each GEMM with and without a late store, the
k-slot combine at other program tiles), and cuBLAS on the same two GEMM shapes with no MoE (what a dense GEMM of that
short K reaches in the same run).

Variants (each checked against the Gluon path's torch twin, and bit for bit where the products and sums keep their
order):
- "route": ``run_experts(backend="triton")``, today's default;
- "plain": the lean Gluon launch (what the route runs where ``GluonChoice`` takes Gluon) with the plan's tiles and
  no late store; "late up" / "late down" / "late both": the gate-up / down / both GEMMs storing each tile's product
  under the next tile's first MMAs (``GluonTile.late_store``); where the plan's down GEMM folds tails (DeepSeek-V3
  4096) the late down GEMM has none, so "untailed" (the plain down GEMM) is the base of those two there;
- "fused": the fused Triton kernels (the route below ``GluonChoice``'s thresholds), at Qwen3 4096 only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    call: Callable  # (x, topk_ids, topk_weights) -> out [M, K]
    same_as: str | None = None  # the variant whose output this one must equal bit for bit


@dataclass(frozen=True)
class Plan:
    """What the route does with one call, read from the library's own choices (no kernel run)."""

    gluon: bool  # the Gluon path (else the fused Triton kernels)
    in_loader: bool  # the gate-up GEMM gathers x's rows in its loader (else a gather kernel + TMA reads)
    up: object  # gate-up GluonTile
    down: object  # down GluonTile (its tail / late_store fields)
    rows: int  # the layout's static rows (max_padded_rows)

    def words(self) -> str:
        if not self.gluon:
            return "fused Triton kernels (align, gate-up, down, k-sum)"
        gather = "in-loader gather gate-up" if self.in_loader else "gather kernel + TMA gate-up"
        return (f"Gluon lean: align, {gather} {self.up}, down {self.down}, combine; static rows {self.rows}")


def route_plan(x, w13, w2, ids, rw) -> Plan:
    from moekit.experts.triton_gluon import DEFAULT_CHOICE, gluon_takes
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile, wants_loader_gather, wants_tail
    from moekit.layouts.grouping import max_padded_rows

    num_experts, _, inter = w2.shape
    m, top_k = ids.shape
    tail = wants_tail(m, top_k, num_experts, inter)
    return Plan(gluon_takes(x, w13, w2, rw, "silu", None, None, DEFAULT_CHOICE), wants_loader_gather(x, inter),
                UP_TILE, down_tile(inter, tail), max_padded_rows(m * top_k, num_experts, 128))


def layout_counts(x, ids, num_experts: int) -> dict:
    """Rows in use, row blocks, padding rows per real row, and the mostly empty last blocks (<= 64 real rows after a
    block of the same expert: what the tail folds) of the route's 128-aligned layout for this routing."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_tail import merged_blocks

    lay = gluon_layout(x, ids, num_experts, in_loader=True)
    used = int(lay.rows_used.item())
    folded = merged_blocks(lay.block_experts, lay.sorted_ids, used, ids.numel())
    return {"rows_used": used, "blocks": used // 128, "rows_per_real_row": used / ids.numel(),
            "mostly_empty_last_blocks": int(folded.sum().item())}


def whole_call_variants(w13, w2, plan: Plan, with_fused: bool) -> list[Variant]:
    """The route, then the lean launch with the plan's tiles at each late-store choice (set explicitly, whatever the
    plan's defaults): "plain", "late up", "late down", "late both"; where the plan's down GEMM folds tails
    (DeepSeek-V3 4096) "plain" and "late up" keep it and "untailed" is the plain down GEMM, the late down GEMMs' base.
    Every Gluon variant equals the route bit for bit (the same products and sums in the same order)."""
    from moekit.experts import run_experts
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_gluon_launch import down_tile
    from moekit.experts.triton_gluon_lean import run_lean

    out = [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))]

    def lean(name: str, up, down) -> Variant:
        return Variant(name, lambda x, i, r: run_lean(x, w13, w2, i, r, None, up, down), "route")

    if plan.gluon:
        up, up_late = replace(plan.up, late_store=False), replace(plan.up, late_store=True)
        down = replace(plan.down, late_store=False)
        out += [lean("plain", up, down), lean("late up", up_late, down)]
        if down.tail:  # the late store has no tail: the late down GEMMs' base is the plain down GEMM
            down = down_tile(w2.shape[2])
            out.append(lean("untailed", up, down))
        down_late = replace(down, late_store=True)
        out += [lean("late down", up, down_late), lean("late both", up_late, down_late)]
    if with_fused:
        out.append(Variant("fused", lambda x, i, r: fused_experts(x, w13, w2, i, r)))
    return out


@dataclass(frozen=True)
class SumTile:
    """A program tile of the k-slot combine (``launch_contiguous_sum``): tokens, columns, warps."""

    block_t: int
    block_k: int
    num_warps: int

    def label(self) -> str:
        return f"{self.block_t}x{self.block_k} w{self.num_warps}"


SUM_TILES = (SumTile(16, 256, 4), SumTile(8, 512, 4), SumTile(32, 256, 8), SumTile(16, 512, 8), SumTile(8, 1024, 8),
             SumTile(4, 2048, 8), SumTile(32, 128, 4), SumTile(64, 128, 8))  # the first: the default


def combine_inputs(x, ids, rw, num_experts: int) -> tuple:
    """(y, dst, weights) of a real layout: y [R, K] random bf16 rows where the route's down GEMM writes, dst [M, k]
    from the gather kernel (-1: not routed here)."""
    from moekit.experts.triton_gluon import gluon_layout

    lay = gluon_layout(x, ids, num_experts)
    y = torch.randn(lay.sorted_ids.numel(), x.shape[1], device=x.device, dtype=x.dtype)
    return y, lay.src_to_dst, rw.contiguous()


def combine_call(y, dst, weights, out, tile: SumTile) -> Callable:
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum

    return lambda: launch_contiguous_sum(y, dst, weights, out, tile.block_t, tile.block_k, tile.num_warps)


def gemms_alone(x, ids, w13, w2, up, down, in_loader: bool) -> tuple[Callable, Callable]:
    """(gate-up, down): each GEMM alone with tiles ``up`` / ``down`` on x's layout (``in_loader``: the gate-up GEMM
    gathering x's rows; h written once by the gate-up GEMM before the down GEMM is timed)."""
    from prefill_variants import bf16_gemm_pair

    pair = bf16_gemm_pair(x, ids, w13, w2, up, down, in_loader=in_loader)
    pair.up()
    return pair.up, pair.down


def dense_refs(m: int, top_k: int, inter: int, hidden: int, dev) -> dict:
    """cuBLAS bf16 on the two GEMMs' shapes without MoE: (A = M*k rows) [A, K] x [K, 2N] and [A, N] x [N, K]."""
    from moekit.bench.timing import time_calls

    rows = m * top_k
    out = {}
    for name, (k, n) in (("gate-up", (hidden, 2 * inter)), ("down", (inter, hidden))):
        a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        us = time_calls([lambda: a @ b], dev, budget_s=0.1)
        out[name] = {"us": us, "TFLOPs": 2 * rows * k * n / (us * 1e-6) / 1e12}
        del a, b
    return out

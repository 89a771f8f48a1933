"""What ``prefill6_device_check.py`` runs at issue 19's prefill cells (bf16, M >= 4096): the route's plan in words,
the whole-call variants against it, the kernels it can time alone (each Gluon GEMM under uniform and balanced
routing, the gate-up GEMM with the other way of reading x's rows, the k-slot combine at other program tiles), and
cuBLAS on the same two GEMM shapes with no MoE (what a dense GEMM of that short K reaches in the same run).

Variants (each checked against the Gluon path's torch twin, and bit for bit where the products and sums keep their
order):
- "route": ``run_experts(backend="triton")``, today's default;
- "lean": the lean Gluon launch with the plan's tiles: the route's kernels (its spread against the route is noise);
- "fused": the fused Triton kernels (the route below ``GluonChoice``'s thresholds), at Qwen3 4096 only.
Measured with it and removed (session 26, raw/NVIDIA_H200-2026-12-04-9b15964-pre6-ck1.log, ...-b32c0fb-pre6-merged.log):
the GEMMs' late store (each tile's product kept in registers and stored under the next tile's first two K steps:
alone 0.87-0.98x), the combine at 32 x 128 as the route's (whole calls >= 3% in at most 4 of 7 rounds on merged main).
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


@dataclass(frozen=True)
class Plan:
    """What the route does with one call, read from the library's own choices (no kernel run)."""

    gluon: bool  # the Gluon path (else the fused Triton kernels)
    in_loader: bool  # the gate-up GEMM gathers x's rows in its loader (else a gather kernel + TMA reads)
    up: object  # gate-up GluonTile
    down: object  # down GluonTile (its tail field)
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
    """The route; on the Gluon path the lean launch with the plan's tiles ("lean": the route's own kernels, equal to
    it bit for bit, so its spread against the route is the run's noise); the fused Triton kernels where
    ``with_fused``."""
    from moekit.experts import run_experts
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_gluon_lean import run_lean

    up, down = plan.up, plan.down
    out = [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))]
    if plan.gluon:
        out.append(Variant("lean", lambda x, i, r: run_lean(x, w13, w2, i, r, None, up, down), "route"))
    if with_fused:
        out.append(Variant("fused", lambda x, i, r: fused_experts(x, w13, w2, i, r)))
    return out


def sum_tiles():
    """The combine tiles timed alone: today's default first, then the ones session 26 timed (8 warps lost)."""
    from moekit.experts.triton_gluon_launch import SUM_TILE, SumTile

    return (SUM_TILE, SumTile(32, 128, 4), SumTile(16, 128, 4), SumTile(4, 2048, 8), SumTile(64, 64, 4),
            SumTile(32, 64, 4), SumTile(64, 128, 4), SumTile(32, 128, 2))


def combine_inputs(x, ids, rw, num_experts: int) -> tuple:
    """(y, dst, weights) of a real layout: y [R, K] random bf16 rows where the route's down GEMM writes, dst [M, k]
    from the gather kernel (-1: not routed here)."""
    from moekit.experts.triton_gluon import gluon_layout

    lay = gluon_layout(x, ids, num_experts)
    y = torch.randn(lay.sorted_ids.numel(), x.shape[1], device=x.device, dtype=x.dtype)
    return y, lay.src_to_dst, rw.contiguous()


def gather_call(x, ids, num_experts: int) -> Callable:
    """The gather kernel alone (x_perm [R, K] and dst from x and the layout): what the TMA-fed gate-up GEMM needs
    before it and the in-loader gather does inside the GEMM."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import launch_gather_rows

    lay = gluon_layout(x, ids, num_experts)
    dst = lay.src_to_dst.view(-1)
    return lambda: launch_gather_rows(x, lay.sorted_ids, ids.shape[1], lay.x_perm, dst)


def combine_call(y, dst, weights, out, tile) -> Callable:
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum

    return lambda: launch_contiguous_sum(y, dst, weights, out, tile)


def tile_label(tile) -> str:
    return f"{tile.block_t}x{tile.block_k} w{tile.num_warps}"


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

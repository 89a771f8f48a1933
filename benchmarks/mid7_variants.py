"""The calls ``mid7_device_check.py`` times at issue 19's ridge cells (Mixtral-8x7B and Qwen3-30B-A3B at M = 512 /
1024, bf16): whole calls, each GEMM alone, the probes, cuBLAS references.

Whole calls (``whole_variants``):
  - route: ``run_experts(backend="triton")`` (Mixtral: the lean Gluon launch, the down GEMM folding tails at 512;
    Qwen3: the fused Triton kernels);
  - g128: the route's Gluon tiles through the plain launches (the lean launch's kernels, launched per call);
  - no tail (where the route's down GEMM folds tails): g128 with the plain down GEMM; tail (where it does not): g128
    with the down GEMM folding an expert's last block of <= 64 rows (``GluonTile.tail``).
(wide / wide tail up / wide down256 / wide tail / wide tails, halves up / halves and their lean launches: 0.74-1.04x
the route at checkpoints 1, 1b, 1c, never >= 3% faster in more than 2 of 5 rounds; removed after the merged run.)
Parts (``part_calls``; each on set 0's layout): each GEMM alone at g128 (the down GEMM also without its tail where
the route's folds), at g128 under balanced routing
(M*k/E rows an expert: no padding rows at these cells), the probes (``mid7_probes``: loads only, MMAs only), the
layout (alignment + gather), the combine, and cuBLAS ``bmm`` on [E, M*k/E, K] x [E, K, 2N] / [E, M*k/E, N] x [E, N, K]
(each expert's rows, balanced, no padding: the vendor's grouped GEMM at the same bytes and FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    call: Callable  # (x, topk_ids, topk_weights) -> out [M, K]
    tolerance: float  # rel L2 against the Gluon twin (Gluon calls: 5e-3; measured 1.0e-3 at Mixtral 512 / 1024 on the
    # H200, 4e-3 at a 4-expert K = 128 shape with the CPU stand-ins; a wrong row block reads O(1))


def route_tiles(m: int, top_k: int, num_experts: int, inter: int) -> tuple:
    """(gate-up, down) GluonTile of the route's Gluon plan at this call (the down GEMM's tail where it folds)."""
    from moekit.experts.triton_gluon_launch import down_tile, up_tile, wants_tail

    return up_tile(m, top_k, num_experts, inter), down_tile(inter, wants_tail(m, top_k, num_experts, inter))


def gluon_call(x, w13, w2, ids, rw, up, down) -> torch.Tensor:
    """The bf16 Gluon path with tiles (up, down), plain launches (the gather kernel + TMA-fed gate-up GEMM)."""
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum, launch_gemm

    lay, h, y = layout_buffers(x, ids, w2)
    num_experts, hidden, inter = w2.shape
    a = ids.numel()
    launch_gemm(lay.x_perm, w13.view(num_experts * 2 * inter, hidden), h, lay.block_experts, lay.rows_used, up,
                gated=True, w_rows=2 * inter, gate_offset=inter, sorted_ids=lay.sorted_ids, num_assignments=a)
    launch_gemm(h, w2.view(num_experts * hidden, inter), y, lay.block_experts, lay.rows_used, down, gated=False,
                w_rows=hidden, sorted_ids=lay.sorted_ids, num_assignments=a)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, lay.src_to_dst, rw.contiguous(), out)
    return out


def layout_buffers(x, ids, w2) -> tuple:
    """(GluonLayout with x_perm, h [R, N], y [R, K]) of this routing."""
    from moekit.experts.triton_gluon import gluon_layout

    num_experts, hidden, inter = w2.shape
    lay = gluon_layout(x, ids, num_experts)
    rows = lay.sorted_ids.numel()
    return lay, x.new_zeros(rows, inter), x.new_zeros(rows, hidden)


def whole_variants(w13, w2, m: int, top_k: int) -> list[Variant]:
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_launch import down_tile, with_tail

    num_experts, _, inter = w2.shape
    route_up, route_down = route_tiles(m, top_k, num_experts, inter)
    tiles = {"g128": (route_up, route_down)}
    if route_down.tail:
        tiles["no tail"] = (route_up, down_tile(inter))
    else:
        tiles["tail"] = (route_up, with_tail(route_down))
    out = [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"), 1e-2)]
    for name, (up, down) in tiles.items():
        out.append(Variant(name, lambda x, i, r, u=up, d=down: gluon_call(x, w13, w2, i, r, u, d), 5e-3))
    return out


def gemm_calls(x, ids, w13, w2, up, down) -> tuple[Callable, Callable]:
    """(gate-up, down) alone with tiles (up, down) on the layout of ``ids`` (the down GEMM reads an h of unit normal
    values: no kernel runs before the calls, so a worker's log names any that hangs)."""
    from moekit.experts.triton_gluon_launch import launch_gemm

    lay, h, y = layout_buffers(x, ids, w2)
    num_experts, hidden, inter = w2.shape
    a = ids.numel()
    w13_2d, w2_2d = w13.view(num_experts * 2 * inter, hidden), w2.view(num_experts * hidden, inter)

    def up_call():
        launch_gemm(lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used, up, True, 2 * inter, inter,
                    lay.sorted_ids, a)

    h.normal_()
    return up_call, lambda: launch_gemm(h, w2_2d, y, lay.block_experts, lay.rows_used, down, False, hidden, 0,
                                        lay.sorted_ids, a)


def probe_calls(x, ids, w13, w2) -> dict:
    """{name: call}: each GEMM's loads only and MMAs only (``mid7_probes``) at the plan's plain tiles."""
    from mid7_probes import launch_probe

    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile

    lay, h, y = layout_buffers(x, ids, w2)
    num_experts, hidden, inter = w2.shape
    w13_2d, w2_2d = w13.view(num_experts * 2 * inter, hidden), w2.view(num_experts * hidden, inter)
    down = down_tile(inter)
    out = {}
    for kind in ("stream", "mma"):
        out[f"up {kind}"] = lambda k=kind: launch_probe(k, lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used,
                                                        UP_TILE, True, 2 * inter, inter)
        out[f"down {kind}"] = lambda k=kind: launch_probe(k, h, w2_2d, y, lay.block_experts, lay.rows_used, down,
                                                          False, hidden)
    return out


def bmm_calls(m: int, top_k: int, w13, w2) -> dict:
    """cuBLAS bmm over the experts, M*k/E rows each (balanced, no padding): {"up bmm": call, "down bmm": call}."""
    num_experts, hidden, inter = w2.shape
    rows = max(1, m * top_k // num_experts)
    xe = torch.randn(num_experts, rows, hidden, device=w2.device, dtype=w2.dtype)  # [E, A/E, K]
    he = torch.randn(num_experts, rows, inter, device=w2.device, dtype=w2.dtype)  # [E, A/E, N]
    return {"up bmm": lambda: torch.bmm(xe, w13.transpose(1, 2)),  # [E, A/E, 2N]
            "down bmm": lambda: torch.bmm(he, w2.transpose(1, 2))}  # [E, A/E, K]


def part_calls(x, ids, rw, w13, w2, m: int, top_k: int, balanced_ids) -> dict:
    """{name: call} of every part timed alone (module docstring)."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import down_tile, launch_contiguous_sum

    num_experts, _, inter = w2.shape
    g_up, g_down = route_tiles(m, top_k, num_experts, inter)
    plain_down = down_tile(inter)
    out = {}
    out["up g128"], out["down route"] = gemm_calls(x, ids, w13, w2, g_up, g_down)
    if g_down.tail:
        out["down plain"] = gemm_calls(x, ids, w13, w2, g_up, plain_down)[1]
    out["up balanced"], out["down balanced"] = gemm_calls(x, balanced_ids, w13, w2, g_up, plain_down)
    out.update(probe_calls(x, ids, w13, w2))
    out["layout"] = lambda: gluon_layout(x, ids, num_experts)
    lay, _, y = layout_buffers(x, ids, w2)
    res = torch.empty_like(x)
    out["combine"] = lambda: launch_contiguous_sum(y, lay.src_to_dst, rw.contiguous(), res)
    out.update(bmm_calls(m, top_k, w13, w2))
    return out

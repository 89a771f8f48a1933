"""The calls ``blk256_device_check.py`` times: the route, its Gluon tiles through the plain launches, and the 256-row
tiles that skip padding in 64-row steps (``GluonTile.blk256``, issue 19), whole and each GEMM alone.

Whole calls (``whole_variants``): route (``run_experts(backend="triton")``), g128 (the route's Gluon tiles, plain
launches: the gather kernel + the TMA-fed GEMMs), b256 up (the gate-up GEMM on 256-row tiles, the route's down GEMM),
b256 (both GEMMs on 256-row tiles), and their lean launches (lean b256 up, lean b256).
Parts (``part_calls``): each GEMM alone at the route's tile and at blk256, under the cell's uniform routing and under
balanced routing (M*k/E rows an expert: no padding at these cells), the down GEMM's 256-row tile in 32-deep steps
(``BLK256_DOWN_K32``: twice the stages), and cuBLAS ``bmm`` on each expert's M*k/E rows
(``mid7_variants.bmm_calls``: the vendor's grouped GEMM at the same bytes and FLOPs, no padding).
"""

from __future__ import annotations

from typing import Callable

import torch

from mid7_variants import Variant, bmm_calls, gemm_calls, gluon_call, layout_buffers, route_tiles

from moekit.experts.triton_gluon_launch import GluonTile


# the down GEMM's 256-row tile in 32-deep steps: 6 stages (6 x 24 KB + 2 x 32 KB out) where 64-deep ones fit 3
BLK256_DOWN_K32 = GluonTile(block_n=128, block_k=32, stages=6, group_m=1, blk256=True)


def blk256_tiles() -> tuple:
    """(gate-up, down) GluonTile of the 256-row GEMMs."""
    from moekit.experts.triton_gluon_launch import BLK256_DOWN_TILE, BLK256_UP_TILE

    return BLK256_UP_TILE, BLK256_DOWN_TILE


def lean_call(x, w13, w2, ids, rw, up, down) -> torch.Tensor:
    """The lean launch (``triton_gluon_lean.run_lean``) with tiles (up, down)."""
    from moekit.experts.triton_gluon_lean import run_lean

    return run_lean(x, w13, w2, ids, rw, None, up, down)


def whole_variants(w13, w2, m: int, top_k: int) -> list[Variant]:
    from moekit.experts import run_experts

    num_experts, _, inter = w2.shape
    route_up, route_down = route_tiles(m, top_k, num_experts, inter)
    b_up, b_down = blk256_tiles()
    tiles = {"g128": (route_up, route_down), "b256 up": (b_up, route_down), "b256": (b_up, b_down)}
    out = [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"), 1e-2)]
    for name, (up, down) in tiles.items():
        out.append(Variant(name, lambda x, i, r, u=up, d=down: gluon_call(x, w13, w2, i, r, u, d), 5e-3))
    for name in ("b256 up", "b256"):
        up, down = tiles[name]
        out.append(Variant(f"lean {name}", lambda x, i, r, u=up, d=down: lean_call(x, w13, w2, i, r, u, d), 5e-3))
    return out


def part_calls(x, ids, w13, w2, m: int, top_k: int, balanced_ids) -> dict:
    """{name: call} of each GEMM alone (module docstring)."""
    from moekit.experts.triton_gluon_launch import down_tile

    num_experts, _, inter = w2.shape
    g_up, g_down = route_tiles(m, top_k, num_experts, inter)
    b_up, b_down = blk256_tiles()
    out = {}
    out["up g128"], out["down route"] = gemm_calls(x, ids, w13, w2, g_up, g_down)
    out["up b256"], out["down b256"] = gemm_calls(x, ids, w13, w2, b_up, b_down)
    out["up g128 balanced"], out["down g128 balanced"] = gemm_calls(x, balanced_ids, w13, w2, g_up, down_tile(inter))
    out["up b256 balanced"], out["down b256 balanced"] = gemm_calls(x, balanced_ids, w13, w2, b_up, b_down)
    out["down b256 k32"] = gemm_calls(x, ids, w13, w2, b_up, BLK256_DOWN_K32)[1]
    out.update(bmm_calls(m, top_k, w13, w2))
    return out


def h_check(x, ids, w13, w2) -> dict:
    """The gate-up GEMM's h at g128 and at blk256 on one layout, compared on the real rows (the rows the combine
    reads): {"equal": bit for bit, "rel_l2": float, "rows": real rows, "b256_rows": rows blk256 multiplies}."""
    from moekit.experts.triton_gluon_blk256 import SUB_M, live_subtiles
    from moekit.experts.triton_gluon_launch import UP_TILE, launch_gemm

    lay, h, _ = layout_buffers(x, ids, w2)
    num_experts, hidden, inter = w2.shape
    w13_2d, a = w13.view(num_experts * 2 * inter, hidden), ids.numel()
    h_b = torch.full_like(h, float("nan"))  # rows blk256 skips stay NaN: a real row left unwritten shows
    for tile, dst in ((UP_TILE, h), (blk256_tiles()[0], h_b)):
        launch_gemm(lay.x_perm, w13_2d, dst, lay.block_experts, lay.rows_used, tile, True, 2 * inter, inter,
                    lay.sorted_ids, a)
    real = lay.sorted_ids < a  # [R]
    ref, got = h[real].float(), h_b[real].float()
    err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item() if torch.isfinite(got).all() else float("inf")
    used = int(lay.rows_used[0])
    b_rows = int(live_subtiles(lay.block_experts, lay.sorted_ids, used, a).sum()) * SUB_M
    return {"equal": bool(torch.equal(got, ref)), "rel_l2": err, "rows": int(real.sum()), "b256_rows": b_rows,
            "g128_rows": used}


def calls_for(c: dict) -> tuple[list, dict]:
    """(whole-call variants, {part: call}) of a cell's inputs (``blk256_device_check.cell_inputs``)."""
    s0, w = c["sets"][0], c["w"]
    parts: dict[str, Callable] = part_calls(s0.x, s0.topk_ids, w.w13, w.w2, c["m"], c["s"].top_k, c["balanced"])
    return whole_variants(w.w13, w.w2, c["m"], c["s"].top_k), parts

"""The calls ``blk256_device_check.py`` times: the route, its Gluon tiles, and the gate-up GEMM on 256-row tiles that
skip padding in 64-row steps (``GluonTile.blk256``, issue 19), whole and alone.

Whole calls (``whole_variants``): route (``run_experts(backend="triton")``: since CK1 of session 28 the gate-up GEMM
on 256-row tiles at Mixtral M = 512, ``triton_gluon_launch.up_tile``), g128 (the 128-row gate-up tile and the route's
down GEMM through the plain launches: the correctness reference), lean g128 (the same through the lean launch: the
route before CK1), and the lean launch with each gate-up tile of ``UP_VARIANTS`` and the route's down GEMM.
Parts (``part_calls``): the gate-up GEMM alone at 128-row tiles and each 256-row tile under the cell's uniform routing,
at 128 / 256-row tiles under balanced routing (M*k/E rows an expert: no padding at these cells), the route's down
GEMM, and cuBLAS ``bmm`` on each expert's M*k/E rows (``mid7_variants.bmm_calls``: the vendor's grouped GEMM at the
same bytes and FLOPs, no padding). CK1 also timed both GEMMs on 256-row tiles (``BLK256_DOWN_TILE``; in 32-deep
steps too): the down one 1.15-2x slower alone at every cell (3 stages); it and the spread gate-up form (a tile of
<= 128 rows on both consumers, lost in both runs) were removed after session 28 (history: 5d589df).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from mid7_variants import Variant, bmm_calls, gemm_calls, gluon_call, layout_buffers, route_tiles

from moekit.experts.triton_gluon_launch import BLK256_UP_TILE, UP_TILE

# the gate-up tiles on 256 rows: as CK1 measured it; GROUP_M = 4 (two tiles of an expert over 256 rows share a
# column block, so its weight tiles are read once for both while they run)
UP_VARIANTS = {"b256 up": BLK256_UP_TILE, "b256 up gm4": replace(BLK256_UP_TILE, group_m=4)}


def lean_call(x, w13, w2, ids, rw, up, down) -> torch.Tensor:
    """The lean launch (``triton_gluon_lean.run_lean``) with tiles (up, down)."""
    from moekit.experts.triton_gluon_lean import run_lean

    return run_lean(x, w13, w2, ids, rw, None, up, down)


def whole_variants(w13, w2, m: int, top_k: int) -> list[Variant]:
    from moekit.experts import run_experts

    num_experts, _, inter = w2.shape
    route_down = route_tiles(m, top_k, num_experts, inter)[1]
    out = [Variant("route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"), 1e-2),
           Variant("g128", lambda x, i, r: gluon_call(x, w13, w2, i, r, UP_TILE, route_down), 5e-3)]
    for name, up in {"g128": UP_TILE, **UP_VARIANTS}.items():
        out.append(Variant(f"lean {name}", lambda x, i, r, u=up: lean_call(x, w13, w2, i, r, u, route_down), 5e-3))
    return out


def part_calls(x, ids, w13, w2, m: int, top_k: int, balanced_ids) -> dict:
    """{name: call} of each GEMM alone (module docstring)."""
    num_experts, _, inter = w2.shape
    route_down = route_tiles(m, top_k, num_experts, inter)[1]
    out = {}
    out["up g128"], out["down route"] = gemm_calls(x, ids, w13, w2, UP_TILE, route_down)
    for name, up in UP_VARIANTS.items():
        out[name.replace("b256 up", "up b256")] = gemm_calls(x, ids, w13, w2, up, route_down)[0]
    for name, up in (("g128", UP_TILE), ("b256", BLK256_UP_TILE)):
        out[f"up {name} balanced"] = gemm_calls(x, balanced_ids, w13, w2, up, route_down)[0]
    out["up bmm"] = bmm_calls(m, top_k, w13, w2)["up bmm"]
    return out


def h_check(x, ids, w13, w2) -> dict:
    """The gate-up GEMM's h at g128 and at each 256-row tile of ``UP_VARIANTS`` on one layout, compared on the real
    rows (the rows the combine reads): {variant: {"equal": bit for bit, "rel_l2": float}}, "rows": real rows,
    "b256_rows": rows the 256-row tiles multiply, "g128_rows"}."""
    from moekit.experts.triton_gluon_blk256 import SUB_M, live_subtiles
    from moekit.experts.triton_gluon_launch import launch_gemm

    lay, h, _ = layout_buffers(x, ids, w2)
    num_experts, hidden, inter = w2.shape
    w13_2d, a = w13.view(num_experts * 2 * inter, hidden), ids.numel()
    launch_gemm(lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used, UP_TILE, True, 2 * inter, inter,
                lay.sorted_ids, a)
    real = lay.sorted_ids < a  # [R]
    ref = h[real].float()
    used = int(lay.rows_used[0])
    out = {"rows": int(real.sum()), "g128_rows": used,
           "b256_rows": int(live_subtiles(lay.block_experts, lay.sorted_ids, used, a).sum()) * SUB_M}
    for name, tile in UP_VARIANTS.items():
        h_b = torch.full_like(h, float("nan"))  # rows the tile skips stay NaN: a real row left unwritten shows
        launch_gemm(lay.x_perm, w13_2d, h_b, lay.block_experts, lay.rows_used, tile, True, 2 * inter, inter,
                    lay.sorted_ids, a)
        got = h_b[real].float()
        err = ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item() if torch.isfinite(got).all() else float("inf")
        out[name] = {"equal": bool(torch.equal(got, ref)), "rel_l2": err}
    return out


def calls_for(c: dict) -> tuple[list, dict]:
    """(whole-call variants, {part: call}) of a cell's inputs (``blk256_device_check.cell_inputs``)."""
    s0, w = c["sets"][0], c["w"]
    parts: dict[str, Callable] = part_calls(s0.x, s0.topk_ids, w.w13, w.w2, c["m"], c["s"].top_k, c["balanced"])
    return whole_variants(w.w13, w.w2, c["m"], c["s"].top_k), parts

"""The calls ``ridge_device_check.py`` times at issue 19/15's ridge cells (M = 512 / 1024): the route of today
(``run_experts(backend="triton")``), the fused Triton kernels forced, and the Gluon paths with tiles the route
does not ship, bf16 and fp8_block.

bf16 Gluon variants (``GluonTile``):
  - g128: the plan's tiles (gate-up 128x128x64 4 stages, down 128x128x64 6 stages, GROUP_M 1 for narrow experts);
  - (h128 / h128 skip, the halves kernel: removed in session 20, benchmarks/triton-notes.md);
  - g128 down256: the down GEMM 256 wide (one [128, 256] accumulator, 3 stages);
  - (g64, g64 w4, g64 up256, g64 down128: 64-row tiles, one or two consumer warpgroups; removed in session 20);
  - g128 gm32: the plan's tiles with GROUP_M 32 in both GEMMs (more row blocks share each weight tile).
Measured before and not repeated (``benchmarks/triton-notes.md``): BLOCK_K 128 (2-3 stages), GROUP_M at
prefill, gate-up BLOCK_N 256 (two [*, 256] accumulators leave 2 stages). Every tile passes ``check_tile``.
fp8 Gluon variants (``Fp8GluonTile``; the tile is fixed at [128, 128] x 128 by the scale blocks): the plan's
pipelines (SKIP_PADDING: removed in session 20, benchmarks/triton-notes.md); one stage more in each GEMM,
GROUP_M 1 and 32 (the down GEMM's ping-pong and consumer 1 staggered: removed after session 28, history 35ce296).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "route" (today's default), "fused" (Triton kernels), "gluon" (a Gluon path with these tiles)
    call: Callable  # (x, topk_ids, topk_weights) -> out [M, K]


def bf16_gluon_tiles(inter: int) -> dict:
    """name -> (gate-up GluonTile, down GluonTile) for experts ``inter`` (N) wide."""
    from moekit.experts.triton_gluon_launch import UP_TILE, check_tile, down_tile

    down = down_tile(inter)
    tiles = {  # in the order they run (a cell's budget may cut the last)
        "g128": (UP_TILE, down),
        "g128 down256": (UP_TILE, replace(down, block_n=256, stages=3)),
        "g128 gm32": (replace(UP_TILE, group_m=32), replace(down, group_m=32)),
    }
    for up, dn in tiles.values():
        check_tile(up, gated=True)
        check_tile(dn, gated=False)
    return tiles


def fp8_gluon_tiles() -> dict:
    """name -> (gate-up Fp8GluonTile, down Fp8GluonTile)."""
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE

    return {
        "gf8": (UP_TILE, DOWN_TILE),
        "gf8 +1 stage": (replace(UP_TILE, stages=UP_TILE.stages + 1), replace(DOWN_TILE, stages=DOWN_TILE.stages + 1)),
        "gf8 gm1": (replace(UP_TILE, group_m=1), replace(DOWN_TILE, group_m=1)),
        "gf8 gm32": (replace(UP_TILE, group_m=32), replace(DOWN_TILE, group_m=32)),
    }


def gluon_bf16_call(x, w13, w2, ids, rw, up, down) -> torch.Tensor:
    """The bf16 Gluon path with the tiles given (plain launches)."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum, launch_gemm

    num_experts, hidden, inter = w2.shape
    lay = gluon_layout(x, ids, num_experts)
    rows = lay.x_perm.shape[0]
    h = x.new_empty(rows, inter)  # [R, N]
    launch_gemm(lay.x_perm, w13.view(num_experts * 2 * inter, hidden), h, lay.block_experts, lay.rows_used, up,
                gated=True, w_rows=2 * inter, gate_offset=inter)
    y = x.new_empty(rows, hidden)  # [R, K]
    launch_gemm(h, w2.view(num_experts * hidden, inter), y, lay.block_experts, lay.rows_used, down, gated=False,
                w_rows=hidden)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, lay.src_to_dst, rw.contiguous(), out)
    return out


def bf16_variants(w13, w2, gluon: bool, smoke_config=None, names: tuple | None = None) -> list[Variant]:
    """Today's route, the fused kernels with their tuned config, and (``gluon``) the Gluon tiles (``names``: a
    subset). ``smoke_config``: the fused kernels' config under the interpreter (small tiles)."""
    from moekit.experts import run_experts
    from moekit.experts.triton import fused_experts

    out = [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
           Variant("fused", "fused", lambda x, i, r: fused_experts(x, w13, w2, i, r, config=smoke_config))]
    if gluon:
        for name, (up, down) in bf16_gluon_tiles(w2.shape[2]).items():
            if names is None or name in names:
                out.append(Variant(name, "gluon", lambda x, i, r, u=up,
                                   d=down: gluon_bf16_call(x, w13, w2, i, r, u, d)))
    return out


def fp8_variants(q: tuple, gluon: bool, smoke_config=None, names: tuple | None = None) -> list[Variant]:
    """q = (w13_q, w13_scale, w2_q, w2_scale): the route (fp8_block weights through the ``triton`` backend), the
    Triton fp8 kernels forced, and (``gluon``) the fp8 Gluon pipelines (``names``: a subset)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    out = [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
           Variant("triton fp8", "fused", lambda x, i, r: fused_experts_fp8_launch(x, *q, i, r, config=smoke_config))]
    if gluon:
        for name, (up, down) in fp8_gluon_tiles().items():
            if names is None or name in names:
                out.append(Variant(name, "gluon", lambda x, i, r, u=up, d=down: experts_gluon_fp8(
                    x, *q, i, r, up=u, down=d, lean=False)))
    return out

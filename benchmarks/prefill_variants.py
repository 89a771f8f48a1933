"""The calls ``prefill_device_check.py`` times at issues 19 / 15's prefill cells (M = 4096 / 16384, Qwen3-30B-A3B and
DeepSeek-V3), bf16 and fp8_block: today's route, the fused Triton kernels, the Gluon paths with the plan's tiles and
with the candidates the notes have not ruled out at prefill, and each Gluon GEMM alone (uniform routing against a
balanced one: what the 128-row padding costs).

bf16 Gluon tiles (``GluonTile``; measured before at prefill and not repeated: GROUP_M 1 / 32, 3 stages, BLOCK_K 128,
gate-up BLOCK_N 256, benchmarks/triton-notes.md "Gluon warp-specialized GEMMs"):
  - g128: the plan's tiles;
  - g128 down pp: the down GEMM on the ping-pong kernel (``_kernels/gluon_gemm_pingpong.py``: two 4-warp consumers
    taking whole tiles in turn, one's epilogue under the other's MMAs), 5 stages.
fp8 Gluon pipelines (``Fp8GluonTile``; stages measured at M = 4096 in e30386d): the plan's; SKIP_PADDING in both
GEMMs (a 64-row half that is all padding runs no MMA; measured and removed at Mixtral 512 / 1024, 1.2-1.25 rows per
real row there; DeepSeek-V3 M = 4096 pads ~1.5x).
Run 1 (8966c03) also timed, and run 2 drops: the down GEMM 256 wide (3 stages) and the fp8 down GEMM's pingpong
(Qwen3 M = 4096 0.99x, every round).
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
    tiles: tuple | None = None  # (gate-up tile, down tile) of a Gluon variant


def balanced_routing(num_tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert gets exactly M*k/E assignments (a multiple of 128 at the cells timed: no padding rows):
    token t picks experts (t*k + j) mod E, j < k (distinct since k <= E). Weights: a fixed softmax."""
    t = torch.arange(num_tokens, device=device)[:, None]  # [M, 1]
    ids = ((t * top_k + torch.arange(top_k, device=device)[None, :]) % num_experts).int()  # [M, k]
    g = torch.Generator(device=device).manual_seed(7)
    weights = torch.softmax(torch.rand(num_tokens, top_k, device=device, generator=g), dim=1)  # [M, k]
    return ids, weights


def bf16_gluon_tiles(inter: int) -> dict:
    """name -> (gate-up GluonTile, down GluonTile) for experts ``inter`` (N) wide."""
    from moekit.experts.triton_gluon_launch import UP_TILE, check_tile, down_tile

    down = down_tile(inter)
    tiles = {"g128": (UP_TILE, down), "g128 down pp": (UP_TILE, replace(down, pingpong=True, stages=5))}
    for up, dn in tiles.values():
        check_tile(up, gated=True)
        check_tile(dn, gated=False)
    return tiles


def fp8_gluon_tiles() -> dict:
    """name -> (gate-up Fp8GluonTile, down Fp8GluonTile)."""
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE

    return {"gf8": (UP_TILE, DOWN_TILE),
            "gf8 skip": (replace(UP_TILE, skip_padding=True), replace(DOWN_TILE, skip_padding=True))}


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


@dataclass
class GemmPair:
    """The two Gluon GEMMs of one layout, each a zero-argument launch on buffers made once (h written by the
    gate-up GEMM and read by the down GEMM: run ``up`` once before timing ``down``)."""

    up: Callable
    down: Callable
    rows_used: torch.Tensor  # [1] int32


def bf16_gemm_pair(x, ids, w13, w2, up, down) -> GemmPair:
    """The bf16 Gluon GEMMs with tiles (up, down) on x's layout under routing ``ids``."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import launch_gemm

    num_experts, hidden, inter = w2.shape
    lay = gluon_layout(x, ids, num_experts)
    rows = lay.x_perm.shape[0]
    h = x.new_zeros(rows, inter)  # [R, N]
    y = x.new_empty(rows, hidden)  # [R, K]
    w13_2d, w2_2d = w13.view(num_experts * 2 * inter, hidden), w2.view(num_experts * hidden, inter)
    return GemmPair(
        lambda: launch_gemm(lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used, up, True, 2 * inter, inter),
        lambda: launch_gemm(h, w2_2d, y, lay.block_experts, lay.rows_used, down, False, hidden), lay.rows_used)


def fp8_gemm_pair(x, ids, q, up, down) -> GemmPair:
    """The fp8 Gluon GEMMs with pipelines (up, down) on x's quantized layout under routing ``ids``."""
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import launch_gemm_fp8

    w13_q, w13_s, w2_q, w2_s = q
    num_experts, hidden, inter = w2_q.shape
    lay = gluon_fp8_layout(x, ids, num_experts)
    rows = lay.x_q.shape[0]
    h_q = torch.zeros(rows, inter, device=x.device, dtype=torch.float8_e4m3fn)  # [R, N]
    h_s = torch.ones(rows, inter // 128, device=x.device, dtype=torch.float32)  # [R, N/128]
    y = x.new_empty(rows, hidden)  # [R, K]
    return GemmPair(
        lambda: launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, h_q, h_s, lay.block_experts, lay.rows_used, up,
                                True, inter),
        lambda: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y, None, lay.block_experts, lay.rows_used, down, False),
        lay.rows_used)


def bf16_variants(w13, w2) -> list[Variant]:
    """Today's route, the fused kernels, the Gluon path with the plan's tiles (plain launches), and the lean launch
    (what the route runs where ``GluonChoice`` takes Gluon) with the plan's tiles and with the ping-pong down GEMM."""
    from moekit.experts import run_experts
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_gluon_lean import run_lean

    tiles = bf16_gluon_tiles(w2.shape[2])
    out = [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
           Variant("fused", "fused", lambda x, i, r: fused_experts(x, w13, w2, i, r))]
    up, down = tiles["g128"]
    out.append(Variant("g128", "gluon", lambda x, i, r: gluon_bf16_call(x, w13, w2, i, r, up, down), (up, down)))
    for name in ("g128", "g128 down pp"):
        u, d = tiles[name]
        out.append(Variant(f"lean {name}", "gluon", lambda x, i, r, u=u, d=d: run_lean(x, w13, w2, i, r, None, u, d),
                           (u, d)))
    return out


def fp8_variants(q: tuple) -> list[Variant]:
    """q = (w13_q, w13_scale, w2_q, w2_scale): the route (fp8_block weights through the ``triton`` backend: the fp8
    Gluon path's lean launch at these cells) and the lean launch with SKIP_PADDING."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_lean import run_lean
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    tiles = fp8_gluon_tiles()
    out = [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"), tiles["gf8"])]
    u, d = tiles["gf8 skip"]
    out.append(Variant("lean gf8 skip", "gluon", lambda x, i, r: run_lean(x, q[0], q[2], i, r, None, u, d, q[1], q[3]),
                       (u, d)))
    return out

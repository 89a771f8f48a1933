"""The calls ``prefill_device_check.py`` times at issues 19 / 15's prefill cells (M = 4096 / 8192 / 16384,
Qwen3-30B-A3B, DeepSeek-V3, Mixtral), bf16 and fp8_block: today's route, the fused Triton kernels, the bf16 Gluon path
with the plan's tiles (plain and lean launches: the lean one is what the route runs where ``GluonChoice`` takes Gluon),
and each Gluon GEMM alone under uniform and balanced routing (what the 128-row padding costs).

Measured with it and removed (benchmarks/triton-notes.md, "prefill"): a ping-pong bf16 down GEMM (two 4-warp consumers
taking whole tiles in turn), the down GEMM 256 wide, the fp8 down GEMM's pingpong, the fp8 SKIP_PADDING at prefill.
Session 22 (branch prefill2, raw/NVIDIA_H200-2026-12-03-db430ac-prefill2-ck1.log), measured and removed: a bf16
SKIP_PADDING (a row block whose lower 64 rows are padding runs m64n64 MMAs, the warpgroups splitting the columns:
0.79-0.99x), the fp8 SKIP_PADDING in the down GEMM alone (0.99-1.00x).
Session 23 (branch gather): "lean gather", the lean launch with the gate-up GEMM gathering x's rows in its loader
(cp.async, ``_kernels/gluon_gemm_gather.py``: no gather kernel, no x_perm), against "lean g128" (the gather kernel:
the route for experts wider than ``LOADER_GATHER_MAX_INTER``). Its loader options, timed alone against its default and
removed (raw/...-3867e94-gather-ck2early.log, ...-b89fbea-gather-merged.log; gate-up alone): no proxy fence 0.98-1.01x,
x read evict_last 0.99-1.02x, the next tile's ids prefetched 0.94-0.99x, GROUP_M 4 / 16 0.97-1.01x, 1 / 2 / 8 loader
warps 0.80-0.96x / 0.93-0.96x / 0.96-1.00x (4 kept).
Measured before at prefill and not repeated: GROUP_M 1 / 32, 3 stages, BLOCK_K 128, gate-up BLOCK_N 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from ridge_variants import gluon_bf16_call  # the bf16 Gluon path with given tiles (plain launches)


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "route" (today's default), "fused" (Triton kernels), "gluon" (a Gluon path with these tiles)
    call: Callable  # (x, topk_ids, topk_weights) -> out [M, K]
    tiles: tuple | None = None  # (gate-up tile, down tile) of a Gluon variant
    in_loader: bool = False  # bf16 Gluon: the gather in the gate-up GEMM's loader (its GEMMs alone timed with it)
    same_as: str | None = None  # the variant whose output this one must equal bit for bit


def balanced_routing(num_tokens: int, num_experts: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert gets exactly M*k/E assignments (a multiple of 128 at the cells timed: no padding rows):
    token t picks experts (t*k + j) mod E, j < k (distinct since k <= E). Weights: a fixed softmax."""
    t = torch.arange(num_tokens, device=device)[:, None]  # [M, 1]
    ids = ((t * top_k + torch.arange(top_k, device=device)[None, :]) % num_experts).int()  # [M, k]
    g = torch.Generator(device=device).manual_seed(7)
    weights = torch.softmax(torch.rand(num_tokens, top_k, device=device, generator=g), dim=1)  # [M, k]
    return ids, weights


def bf16_gluon_tiles(inter: int) -> tuple:
    """(gate-up GluonTile, down GluonTile) of the plan for experts ``inter`` (N) wide."""
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile

    return UP_TILE, down_tile(inter)


def fp8_gluon_tiles() -> tuple:
    """(gate-up Fp8GluonTile, down Fp8GluonTile) of the plan."""
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE

    return UP_TILE, DOWN_TILE


@dataclass
class GemmPair:
    """The two Gluon GEMMs of one layout, each a zero-argument launch on buffers made once (h written by the
    gate-up GEMM and read by the down GEMM: run ``up`` once before timing ``down``)."""

    up: Callable
    down: Callable
    rows_used: torch.Tensor  # [1] int32


def bf16_gemm_pair(x, ids, w13, w2, up, down, in_loader: bool = False) -> GemmPair:
    """The bf16 Gluon GEMMs with tiles (up, down) on x's layout under routing ``ids``; ``in_loader``: the gate-up
    GEMM gathering x's rows itself (reads x and sorted_ids, writes dst), else reading the gathered x_perm."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import launch_gather_gemm, launch_gemm

    num_experts, hidden, inter = w2.shape
    lay = gluon_layout(x, ids, num_experts)
    rows = lay.x_perm.shape[0]
    h = x.new_zeros(rows, inter)  # [R, N]
    y = x.new_empty(rows, hidden)  # [R, K]
    w13_2d, w2_2d = w13.view(num_experts * 2 * inter, hidden), w2.view(num_experts * hidden, inter)
    if in_loader:
        def up_call():
            launch_gather_gemm(x, lay.sorted_ids, lay.src_to_dst.view(-1), w13_2d, h, lay.block_experts, lay.rows_used,
                               ids.shape[1], up)
    else:
        def up_call():
            launch_gemm(lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used, up, True, 2 * inter, inter)
    return GemmPair(up_call, lambda: launch_gemm(h, w2_2d, y, lay.block_experts, lay.rows_used, down, False, hidden),
                    lay.rows_used)


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
    """Today's route, the fused kernels, the Gluon path with the plan's tiles (plain launches) and its lean launch."""
    from moekit.experts import run_experts
    from moekit.experts.triton import fused_experts
    from moekit.experts.triton_gluon_lean import run_lean

    up, down = bf16_gluon_tiles(w2.shape[2])
    return [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("fused", "fused", lambda x, i, r: fused_experts(x, w13, w2, i, r)),
            Variant("g128", "gluon", lambda x, i, r: gluon_bf16_call(x, w13, w2, i, r, up, down), (up, down)),
            Variant("lean g128", "gluon", lambda x, i, r: run_lean(x, w13, w2, i, r, None, up, down, in_loader=False),
                    (up, down)),
            Variant("lean gather", "gluon",
                    lambda x, i, r: run_lean(x, w13, w2, i, r, None, up, down, in_loader=True), (up, down), True,
                    "lean g128")]


def fp8_variants(q: tuple) -> list[Variant]:
    """q = (w13_q, w13_scale, w2_q, w2_scale): the route (fp8_block weights through the ``triton`` backend: the fp8
    Gluon path's lean launch at these cells), its GEMMs timed alone with the plan's pipelines."""
    from moekit.experts import run_experts
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    return [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"),
                    fp8_gluon_tiles())]

"""Where a Gluon call's time goes at a ridge cell (``ridge_device_check.py``): the layout (alignment + gather),
the gate-up GEMM, the down GEMM and the k-slot combine, each alone in CUDA-graph replay, for the plan's tiles and
(session 18) their SKIP_PADDING twins; each GEMM's TFLOP/s on the real rows and % of the mm rate of its dtype.

The GEMM inputs are one call's own layout and intermediates (h from that call's gate-up), so each launch reads
what it reads in the call. (bf16's halves kernel and its skip: timed in session 18, removed in session 20.)
"""

from __future__ import annotations

import torch


def _us(fn, dev) -> float:
    from moekit.bench.timing import time_calls

    return time_calls([fn], dev, graph=True, budget_s=0.05, min_reps=5, max_reps=30)


def fp8_parts(x, q, ids, rw, mm_tflops: float | None) -> dict:
    """{part: µs} and {gemm %mm} of the fp8 Gluon call (the plan's pipelines)."""
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE, launch_gemm_fp8
    from moekit.experts.triton_gluon_launch import launch_contiguous_sum

    w13_q, w13_s, w2_q, w2_s = q
    num_experts, hidden, inter = w2_q.shape
    dev = x.device
    lay = gluon_fp8_layout(x, ids, num_experts)
    rows = lay.x_q.shape[0]
    h_q = torch.empty(rows, inter, device=dev, dtype=torch.float8_e4m3fn)  # [R, N]
    h_s = torch.empty(rows, inter // 128, device=dev, dtype=torch.float32)
    y = torch.empty(rows, hidden, device=dev, dtype=x.dtype)  # [R, K]
    out = torch.empty_like(x)
    flops = 2.0 * ids.numel() * inter * hidden  # one GEMM's, down; gate-up twice that
    got = {"layout": _us(lambda: gluon_fp8_layout(x, ids, num_experts), dev),
           "combine": _us(lambda: launch_contiguous_sum(y, lay.src_to_dst, rw, out), dev)}
    launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, h_q, h_s, lay.block_experts, lay.rows_used, UP_TILE, True, inter)
    got["gate-up"] = _us(lambda: launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, h_q, h_s, lay.block_experts,
                                                 lay.rows_used, UP_TILE, True, inter), dev)
    got["down"] = _us(lambda: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y, None, lay.block_experts, lay.rows_used,
                                              DOWN_TILE, False), dev)
    return _with_rates(got, flops, mm_tflops)


def bf16_parts(x, w13, w2, ids, rw, mm_tflops: float) -> dict:
    """{part: µs} and {gemm %mm} of the bf16 Gluon call (the plan's tiles)."""
    from moekit.experts.triton_gluon import gluon_layout
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile, launch_contiguous_sum, launch_gemm

    num_experts, hidden, inter = w2.shape
    dev = x.device
    lay = gluon_layout(x, ids, num_experts)
    rows = lay.x_perm.shape[0]
    h = x.new_empty(rows, inter)  # [R, N]
    y = x.new_empty(rows, hidden)  # [R, K]
    out = torch.empty_like(x)
    w13_2d, w2_2d = w13.view(num_experts * 2 * inter, hidden), w2.view(num_experts * hidden, inter)
    got = {"layout": _us(lambda: gluon_layout(x, ids, num_experts), dev),
           "combine": _us(lambda: launch_contiguous_sum(y, lay.src_to_dst, rw, out), dev)}
    up, down = UP_TILE, down_tile(inter)
    launch_gemm(lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used, up, True, 2 * inter, inter)
    got["gate-up"] = _us(lambda: launch_gemm(lay.x_perm, w13_2d, h, lay.block_experts, lay.rows_used, up, True,
                                             2 * inter, inter), dev)
    got["down"] = _us(lambda: launch_gemm(h, w2_2d, y, lay.block_experts, lay.rows_used, down, False, hidden), dev)
    return _with_rates(got, 2.0 * ids.numel() * inter * hidden, mm_tflops)


def _with_rates(got: dict, down_flops: float, mm_tflops: float | None) -> dict:
    """µs per part, plus '<gemm> %mm' for each GEMM (gate-up: twice the down GEMM's FLOPs)."""
    rates = {}
    for part, us in got.items():
        if part.startswith(("gate-up", "down")) and mm_tflops:
            flops = down_flops * (2 if part.startswith("gate-up") else 1)
            rates[f"{part} %mm"] = 100.0 * flops / (us * 1e-6) / (mm_tflops * 1e12)
    return {**got, **rates}

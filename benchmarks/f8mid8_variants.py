"""What ``f8mid8_device_check.py`` runs per cell (issue 15, fp8_block at the ridge, session 28): the whole calls it
times, and each GEMM of the fp8 Gluon path alone with the probes that split it.

Cells: Mixtral-8x7B M = 512 / 1024 (the route: the fp8 Gluon path, lean launch), Qwen3-30B-A3B M = 1024 / 512 (the
route: the fused Triton fp8 kernels of the tuned entry). Variants: the route; at Mixtral "plain" (the plan's tiles
through the plain launch: the base of any bit check).
Measured against the route and removed, no default taking them (benchmarks/triton-notes.md, "Issue 15, session 28:
fp8_block at the ridge"; the variants as run at 827fb54): Mixtral the down GEMM with the tail consumer (0.95-0.97x;
its kernel removed too), the gate-up ring 4 deep (1.00x), the wide down tile (0.95-0.98x), the down GEMM's
consumers taking turns at the MMA (pingpong 0.99x), consumer 1 one MMA behind (stagger 1.00x), the fused Triton
kernels (0.71-0.75x); Qwen3 the gate-up tile 64 wide on 4 warps (0.62-0.68x), with PAIR_DOT (0.78-0.84x), 32-row
tiles (0.60-0.75x), the Gluon path (0.78-0.92x).
Parts (``gluon_parts``): the Gluon gate-up and down GEMMs on one layout, each GEMM with every scale load on one cache
line ("hot scales": the scales' strides 0, a wrong product at the same work: what the scale loads in the K loop
cost), and the probes of ``f8mid8_probes`` (loads alone, consumers alone, wgmmas alone, the GEMM without the
promotion) for each GEMM.
"""

from __future__ import annotations

import torch
from prefill_variants import Variant

CELLS = ("fp8:mixtral-8x7b:512", "fp8:mixtral-8x7b:1024", "fp8:qwen3-30b-a3b:1024", "fp8:qwen3-30b-a3b:512")
NAMES = {"mixtral-8x7b": ("route", "plain"), "qwen3-30b-a3b": ("route",)}  # ``variants``' names, in its order


def _gluon_call(q: tuple, up, down, lean: bool):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    return lambda x, i, r: experts_gluon_fp8(x, *q, i, r, up=up, down=down, lean=lean)


def variants(preset: str, m: int, q: tuple) -> list[Variant]:
    """The route first, then the cell's other calls (``same_as``: must equal that variant bit for bit)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    route = Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))
    if preset == "mixtral-8x7b":
        return [route, Variant("plain", "gluon", _gluon_call(q, UP_TILE, DOWN_TILE, False))]
    return [route]


def gluon_parts(x: torch.Tensor, ids: torch.Tensor, q: tuple) -> tuple[dict, torch.Tensor]:
    """({name: zero-argument launch}, rows_used [1]) on x's quantized layout under routing ``ids``: the plan's
    gate-up and down GEMMs ("gate-up" writes the h the down GEMMs read: run it first), and each GEMM with hot scales
    and its probes (their own outputs)."""
    from f8mid8_probes import launch_probe

    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE, launch_gemm_fp8

    w13_q, w13_s, w2_q, w2_s = q
    num_experts, hidden, inter = w2_q.shape
    lay = gluon_fp8_layout(x, ids, num_experts)
    rows = lay.x_q.shape[0]
    h_q = torch.zeros(rows, inter, device=x.device, dtype=torch.float8_e4m3fn)  # [R, N]
    h_s = torch.ones(rows, inter // 128, device=x.device, dtype=torch.float32)  # [R, N/128]
    y = x.new_empty(rows, hidden)  # [R, K]
    h2_q, h2_s, y2 = torch.empty_like(h_q), torch.empty_like(h_s), torch.empty_like(y)  # the probes' outputs
    scratch_up, scratch_down = x.new_empty(rows, inter), x.new_empty(rows, hidden)  # the wgmma probes' bf16 tiles
    up_args = (lay.x_q, lay.x_s, w13_q, w13_s)
    down_args = (h_q, h_s, w2_q, w2_s)
    common = (lay.block_experts, lay.rows_used)
    parts = {
        "gate-up": lambda: launch_gemm_fp8(*up_args, h_q, h_s, *common, UP_TILE, True, inter),
        "down": lambda: launch_gemm_fp8(*down_args, y, None, *common, DOWN_TILE, False),
    }
    hot = (lay.x_s[:1].expand_as(lay.x_s), w13_s[:1, :1].expand_as(w13_s),  # every scale load on one line
           h_s[:1].expand_as(h_s), w2_s[:1, :1].expand_as(w2_s))
    parts["gate-up hot scales"] = lambda: launch_gemm_fp8(lay.x_q, hot[0], w13_q, hot[1], h2_q, h2_s, *common, UP_TILE,
                                                          True, inter)
    parts["down hot scales"] = lambda: launch_gemm_fp8(h_q, hot[2], w2_q, hot[3], y2, None, *common, DOWN_TILE, False)
    for kind, label in (("stream", "loads"), ("consumers", "consumers"), ("mma", "wgmmas"),
                        ("unpromoted", "unpromoted")):
        parts[f"gate-up {label}"] = (lambda k=kind: launch_probe(k, *up_args, h2_q, h2_s, *common, UP_TILE, True,
                                                                 inter, scratch_up))
        parts[f"down {label}"] = (lambda k=kind: launch_probe(k, *down_args, y2, None, *common, DOWN_TILE, False, 0,
                                                              scratch_down))
    return parts, lay.rows_used


def zero_weights(preset: str, dev) -> tuple:
    """(w13_q, w13_scale, w2_q, w2_scale) of the preset's shape, zeros and unit scales: for compiling only."""
    from moekit.bench.cells import Shape

    s = Shape.from_preset(preset)
    out = []
    for rows, cols in ((2 * s.n, s.k), (s.k, s.n)):
        out += [torch.zeros(s.num_experts, rows, cols, dtype=torch.float8_e4m3fn, device=dev),
                torch.ones(s.num_experts, rows // 128, cols // 128, device=dev)]
    return tuple(out)

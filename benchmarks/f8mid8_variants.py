"""What ``f8mid8_device_check.py`` runs per cell (issue 15, fp8_block at the ridge, session 28): the whole calls it
times against the route, and each GEMM of the fp8 Gluon path alone with the probes that split it.

Cells: Mixtral-8x7B M = 512 / 1024 (the route: the fp8 Gluon path, lean launch), Qwen3-30B-A3B M = 1024 / 512 (the
route: the fused Triton fp8 kernels of the tuned entry).
- Mixtral: "plain" (the route's kernels through the plain launch: the base of the bit checks), "tail" (the down GEMM
  with the tail consumer, ``DOWN_TILE_T64``: an expert's mostly empty last block folded into the block before it, its
  weights streamed once for up to 192 rows; bit-equal to "plain"), "up4" (the gate-up ring 4 deep, bit-equal),
  "wide" (the [128, 256] down tile, bit-equal), "pp down" (the down GEMM's consumers issuing their MMAs in turn,
  PINGPONG), "stagger" (consumer 1 one MMA behind consumer 0 in both GEMMs, STAGGER): the promotion's overlap
  between the two consumers, bit-equal; "triton" (the fused Triton fp8 kernels, the tuned entry).
- Qwen3: "up64" (the gate-up tile 64 wide on 4 warps: about twice the programs an SM, h in float32 quantized by the
  down GEMM; one program a tile), "up64 pair" (that with gate and up in one dot), "bm32" (32-row tiles on 4 warps:
  less padding, mma.sync), "gluon" (the fp8 Gluon path's lean launch: the warp-specialized GEMMs, 128-row blocks).
Parts (``gluon_parts``): the Gluon gate-up and down GEMMs on one layout, the down GEMM with the tail, each GEMM with
every scale load on one cache line ("hot scales": the scales' strides 0, a wrong product at the same work: whether
the scale loads in the K loop cost the overlap), and the probes of ``f8mid8_probes`` (loads alone, consumers alone,
wgmmas alone, the GEMM without the promotion) for each GEMM.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from prefill_variants import Variant

CELLS = ("fp8:mixtral-8x7b:512", "fp8:mixtral-8x7b:1024", "fp8:qwen3-30b-a3b:1024", "fp8:qwen3-30b-a3b:512")
NAMES = {"mixtral-8x7b": ("route", "plain", "tail", "up4", "wide", "pp down", "stagger", "triton"),  # in order
         "qwen3-30b-a3b": ("route", "up64", "up64 pair", "bm32", "gluon")}


def _triton_call(q: tuple, config=None, pair_dot: bool | None = None):
    """The fused Triton fp8 kernels: the tuned entry (config None) or ``config`` (one program a tile where the plan
    cannot take the entry's persistent GEMMs)."""
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    return lambda x, i, r: fused_experts_fp8_launch(x, *q, i, r, config=config, pair_dot=pair_dot,
                                                    weight_tma=True if pair_dot else None)


def _gluon_call(q: tuple, up, down, lean: bool):
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    return lambda x, i, r: experts_gluon_fp8(x, *q, i, r, up=up, down=down, lean=lean)


def qwen3_configs(m: int, q: tuple) -> dict:
    """name -> the tuned entry's config at M with its gate-up tile 64 wide on 4 warps, or 32-row tiles."""
    from moekit.experts.configs import device_key
    from moekit.experts.triton_fp8_plan import fp8_entry

    num_experts, hidden, inter = q[2].shape
    base = fp8_entry(m, num_experts, inter, hidden, 8, 128, device_key(q[0].device)).config
    return {"up64": replace(base, up=replace(base.up, BLOCK_N=64, num_warps=4)),
            "bm32": replace(base, BLOCK_M=32, up=replace(base.up, num_warps=4), down=replace(base.down, num_warps=4))}


def variants(preset: str, m: int, q: tuple) -> list[Variant]:
    """The route first, then the cell's candidates (``same_as``: must equal that variant bit for bit)."""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, DOWN_TILE_T64, UP_TILE, WIDE_DOWN_TILE
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    route = Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))
    if preset == "mixtral-8x7b":
        up4 = replace(UP_TILE, stages=4)
        return [route,
                Variant("plain", "gluon", _gluon_call(q, UP_TILE, DOWN_TILE, False)),
                Variant("tail", "gluon", _gluon_call(q, UP_TILE, DOWN_TILE_T64, False), same_as="plain"),
                Variant("up4", "gluon", _gluon_call(q, up4, DOWN_TILE, True), same_as="plain"),
                Variant("wide", "gluon", _gluon_call(q, UP_TILE, WIDE_DOWN_TILE, True), same_as="plain"),
                Variant("pp down", "gluon", _gluon_call(q, UP_TILE, replace(DOWN_TILE, pingpong=True), True),
                        same_as="plain"),
                Variant("stagger", "gluon", _gluon_call(q, replace(UP_TILE, stagger=True),
                                                        replace(DOWN_TILE, stagger=True), True), same_as="plain"),
                Variant("triton", "fused", _triton_call(q))]
    configs = qwen3_configs(m, q)
    return [route,
            Variant("up64", "fused", _triton_call(q, configs["up64"])),
            Variant("up64 pair", "fused", _triton_call(q, configs["up64"], pair_dot=True)),
            Variant("bm32", "fused", _triton_call(q, configs["bm32"])),
            Variant("gluon", "gluon", _gluon_call(q, UP_TILE, DOWN_TILE, True))]


def gluon_parts(x: torch.Tensor, ids: torch.Tensor, q: tuple) -> tuple[dict, torch.Tensor]:
    """({name: zero-argument launch}, rows_used [1]) on x's quantized layout under routing ``ids``: the plan's
    gate-up and down GEMMs ("gate-up" writes the h the down GEMMs read: run it first), the down GEMM with the tail,
    and each GEMM's probes (their own outputs)."""
    from f8mid8_probes import launch_probe

    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, DOWN_TILE_T64, UP_TILE, launch_gemm_fp8

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
        "down tail": lambda: launch_gemm_fp8(*down_args, y2, None, *common, DOWN_TILE_T64, False,
                                             sorted_ids=lay.sorted_ids, num_assignments=ids.numel()),
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

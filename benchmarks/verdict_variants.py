"""The ridge calls ``verdict_device_check.py --part ridge`` times (issues #19 / #15): each Gluon option no default
takes against today's route, on the route's own launch path (``triton_gluon_lean.run_lean``), so the only
difference from the route is the option.

bf16 (the tiles of ``ridge_variants.bf16_gluon_tiles``): "lean g128" is the route's plan (equal to "route" but
for the call's entry point); "lean h128" / "lean h128 skip" (the halves kernel and its padding skip: removed
after run 1, dd8bed6: 0.88-1.03x); "lean g64", "lean g64 w4", "lean g64 down128" (64-row tiles, one or two
consumer warpgroups: removed after run 1, 1.05-1.08x at Mixtral 512 there but 0.996-1.017x the plan's tiles in
the two ridge runs, 0.96-1.01x at 1024).
fp8 (``ridge_variants.fp8_gluon_tiles``): "lean gf8" (the route's plan) and the plain launch "gf8" (``lean=False``):
ridge run 2 read gf8 577 µs against the route's 637 at Mixtral 512, run 1 here 616 against the lean 652. (SKIP_PADDING,
"gf8 skip": removed after run 1, 0.95-1.00x.)
"""

from __future__ import annotations

from ridge_variants import Variant, bf16_gluon_tiles, fp8_gluon_tiles

BF16_NAMES = ("g128",)
FP8_NAMES = ("gf8",)


def ridge_calls(w13, w2, q: tuple, dtype: str, gluon: bool) -> list[Variant]:
    """The route first, then (``gluon``: on the H200) the options. q = (w13_q, w13_scale, w2_q, w2_scale)."""
    from moekit.experts import run_experts
    from moekit.quant.fp8_block import Fp8BlockWeight

    if dtype == "bf16":
        out = [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton"))]
        return out + (_bf16_lean(w13, w2) if gluon else [])
    f13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    f2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    out = [Variant("route", "route", lambda x, i, r: run_experts(x, f13, f2, i, r, backend="triton"))]
    return out + (_fp8_calls(q) if gluon else [])


def _bf16_lean(w13, w2) -> list[Variant]:
    from moekit.experts.triton_gluon_lean import run_lean

    tiles = bf16_gluon_tiles(w2.shape[2])
    return [Variant(f"lean {name}", "gluon", lambda x, i, r, u=tiles[name][0], d=tiles[name][1]:
                    run_lean(x, w13, w2, i, r, None, u, d)) for name in BF16_NAMES]


def _fp8_calls(q: tuple) -> list[Variant]:
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

    tiles = fp8_gluon_tiles()
    return [Variant(f"{'lean ' if lean else ''}{name}", "gluon", lambda x, i, r, u=tiles[name][0], d=tiles[name][1],
                    lean=lean: experts_gluon_fp8(x, *q, i, r, up=u, down=d, lean=lean))
            for lean in (True, False) for name in FP8_NAMES]

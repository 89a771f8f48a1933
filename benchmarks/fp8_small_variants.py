"""What ``fp8_small_device_check.py`` measures per cell: the plan's default and its variants.

Variant: tiles (BLOCK_M, GROUP_M, each GEMM's BLOCK_N / warps / stages; BLOCK_K 128), weights through TMA
or pointers, x quantized inside the gate-up GEMM, AHEAD on or off, PREWARM steps, and the route (the Triton
fp8 kernels, the fp8 Gluon path with pipeline changes, or the ``triton`` backend's own choice).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One way to run a cell. tiles: (BLOCK_M, GROUP_M, up (BN, warps, stages), down (BN, warps, stages)),
    BLOCK_K 128; None: the plan's. route: "triton" (``fused_experts_fp8_launch``), "gluon" (the fp8 Gluon
    path; ``gluon``: (GEMM "up" or "down", Fp8GluonTile field, value) changes of its default pipelines),
    "backend" (the ``triton`` backend on Fp8BlockWeight: its own choice of the two)."""

    name: str
    tiles: tuple | None = None
    tma: bool | None = None
    x_in: bool | None = None
    ahead: bool = True
    prewarm: int | None = None  # K-steps prefetched into L2 before the PDL wait (PREWARM); None: the plan's
    route: str = "triton"
    gluon: tuple = ()

    def kernel_config(self):
        from moekit.experts.configs import GemmTile, KernelConfig

        if self.tiles is None:
            return None
        block_m, group_m, up, down = self.tiles
        return KernelConfig(block_m, GemmTile(up[0], 128, group_m, up[1], up[2]),
                            GemmTile(down[0], 128, group_m, down[1], down[2]))


def _t(bm: int, gm: int, up: tuple, down: tuple, tma: bool | None = True, x_in: bool | None = None,
       prewarm: int | None = None) -> Variant:
    name = f"m{bm}g{gm} u{up[0]}/{up[1]}w{up[2]}s d{down[0]}/{down[1]}w{down[2]}s" + ("" if tma else " ptr")
    name += (" x-in" if x_in else "") + (f" prewarm{prewarm}" if prewarm else "")
    return Variant(name, (bm, gm, up, down), tma, x_in, prewarm=prewarm)


def variants(preset: str, m: int) -> list[Variant]:
    """The default first; then per cell what might beat it (the tuned entry named in each comment)."""
    base = [Variant("default"), Variant("default x-in", x_in=True), Variant("default x-in ahead-off", x_in=True,
                                                                             ahead=False)]
    if m == 1 or preset == "deepseek-v3":  # the tiny-batch shortcut: PREWARM applies
        base += [Variant(f"default prewarm{p}", prewarm=p) for p in (4, 8, 16)]
        base += [Variant("default x-in prewarm8", x_in=True, prewarm=8)]
    if preset == "qwen3-30b-a3b" and m == 1:  # tuned: m16 u64/4w4s d128/4w4s tma (h float32: AHEAD in down)
        return base + [Variant("default ahead-off", ahead=False)] + [
            _t(16, 1, (32, 4, 4), (128, 4, 4)), _t(16, 1, (32, 4, 4), (64, 4, 4)), _t(16, 1, (64, 4, 4), (64, 4, 4)),
            _t(16, 1, (64, 4, 4), (32, 4, 4)), _t(16, 1, (64, 4, 3), (128, 4, 3)), _t(16, 1, (64, 4, 4), (128, 4, 4), False),
            _t(16, 1, (128, 4, 4), (128, 4, 4)), _t(16, 1, (128, 4, 4), (64, 4, 4)), _t(16, 1, (32, 4, 3), (64, 4, 3)),
            _t(16, 1, (128, 4, 4), (128, 4, 4), x_in=True), _t(16, 1, (32, 4, 4), (64, 4, 4), x_in=True),
            _t(16, 1, (64, 4, 4), (64, 4, 4), x_in=True), _t(16, 1, (128, 4, 3), (64, 4, 3), x_in=True),
            _t(16, 1, (64, 4, 4), (64, 4, 4), prewarm=8), _t(16, 1, (32, 4, 4), (64, 4, 4), prewarm=8),
            _t(16, 1, (64, 4, 4), (64, 4, 4), x_in=True, prewarm=8)]
    if preset == "qwen3-30b-a3b" and m == 8:  # tuned: m16 u128/4w4s d128/4w4s tma; the alignment folded
        return base + [
            _t(16, 1, (64, 4, 4), (128, 4, 4)), _t(16, 1, (64, 4, 4), (64, 4, 4)), _t(16, 1, (32, 4, 4), (128, 4, 4)),
            _t(16, 1, (128, 4, 4), (64, 4, 4)), _t(16, 1, (128, 4, 3), (128, 4, 3)), _t(16, 1, (128, 4, 4), (128, 4, 4), False),
            _t(16, 1, (64, 4, 4), (128, 4, 4), x_in=True), _t(16, 1, (128, 4, 3), (64, 4, 3), x_in=True),
            _t(16, 1, (128, 4, 2), (128, 4, 2))]
    if preset == "qwen3-30b-a3b" and m == 64:  # tuned: m16 u128/4w4s d128/4w4s tma
        return base + [
            _t(16, 1, (64, 4, 4), (128, 4, 4)), _t(16, 1, (128, 4, 4), (64, 4, 4)), _t(16, 1, (128, 4, 3), (128, 4, 3)),
            _t(32, 1, (128, 4, 4), (128, 4, 4)), _t(32, 8, (128, 4, 4), (128, 4, 4)), _t(32, 8, (128, 4, 4), (128, 4, 4), False),
            _t(16, 1, (128, 4, 4), (128, 4, 4), False), _t(16, 1, (64, 4, 4), (64, 4, 4), x_in=True)]
    if m >= 1024:  # Qwen3 tuned: m64g8 u128/8w4s d128/4w4s tma; Mixtral: m128g8 u128/8w3s d128/8w4s ptr, Gluon by default
        gluon = [Variant(f"gluon {g} {k}={v}", route="gluon", gluon=((g, k, v),)) for g, k, v in (
            ("up", "stages", 4), ("up", "group_m", 4), ("up", "group_m", 16), ("down", "stages", 4),
            ("down", "group_m", 16), ("down", "pingpong", True), ("up", "stagger", True))]
        return [Variant("default"), Variant("backend", route="backend"), Variant("gluon", route="gluon"), *gluon,
                _t(64, 8, (128, 8, 4), (128, 4, 4)), _t(64, 8, (128, 8, 4), (128, 4, 4), False),
                _t(64, 1, (128, 8, 4), (128, 4, 4)), _t(64, 16, (128, 8, 4), (128, 4, 4)),
                _t(64, 32, (128, 8, 4), (128, 4, 4)), _t(64, 8, (128, 8, 3), (128, 4, 3)),
                _t(64, 8, (128, 8, 4), (128, 8, 4)), _t(64, 8, (128, 8, 4), (64, 4, 4)),
                _t(32, 8, (128, 4, 4), (128, 4, 4)), _t(32, 8, (128, 4, 4), (128, 4, 4), False),
                _t(128, 8, (128, 8, 3), (128, 8, 4), False), _t(128, 8, (128, 8, 3), (128, 8, 4)),
                _t(128, 16, (128, 8, 3), (128, 8, 4), False), _t(128, 8, (128, 8, 4), (128, 8, 4), False),
                _t(64, 8, (128, 8, 4), (128, 4, 4), x_in=True)]
    if preset == "deepseek-v3":  # tuned: m16 u128/4w5s d64/4w3s (M=8: d64/4w5s), TMA by the rule
        return base + [
            _t(16, 1, (128, 4, 4), (64, 4, 4)), _t(16, 1, (128, 4, 6), (64, 4, 5)), _t(16, 1, (64, 4, 5), (64, 4, 5)),
            _t(16, 1, (128, 4, 5), (128, 4, 5)), _t(16, 1, (128, 4, 5), (32, 4, 5)), _t(16, 1, (256, 4, 4), (64, 4, 4)),
            _t(16, 1, (128, 4, 5), (64, 4, 5), False), _t(16, 1, (128, 4, 5), (64, 4, 5), x_in=True),
            _t(16, 1, (128, 4, 4), (64, 4, 4), prewarm=8)]
    return base + [  # Mixtral M=1, tuned: m16 u128/4w5s d32/4w5s tma
        _t(16, 1, (64, 4, 5), (32, 4, 5)), _t(16, 1, (32, 4, 5), (32, 4, 5)), _t(16, 1, (128, 4, 6), (32, 4, 6)),
        _t(16, 1, (128, 4, 4), (32, 4, 4)), _t(16, 1, (128, 4, 5), (64, 4, 5)), _t(16, 1, (64, 4, 5), (64, 4, 5)),
        _t(16, 1, (256, 4, 4), (32, 4, 4)), _t(16, 1, (64, 4, 5), (32, 4, 5), x_in=True),
        _t(16, 1, (64, 4, 5), (32, 4, 5), prewarm=8)]

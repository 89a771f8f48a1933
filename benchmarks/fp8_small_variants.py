"""What ``fp8_small_device_check.py`` measures per cell: the plan's default and its variants.

Variant: tiles (BLOCK_M, GROUP_M, each GEMM's BLOCK_N / warps / stages; BLOCK_K 128), weights through TMA
or pointers, x quantized inside the gate-up GEMM, AHEAD on or off, and the route (the Triton fp8 kernels,
the fp8 Gluon path, or the ``triton`` backend's own choice, with the tuned entry's
"x_in_gate_up" or without).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """One way to run a cell. tiles: (BLOCK_M, GROUP_M, up (BN, warps, stages), down (BN, warps, stages)),
    BLOCK_K 128; None: the plan's. route: "triton" (``fused_experts_fp8_launch``), "gluon" (the fp8 Gluon
    path), "backend" (the ``triton`` backend on Fp8BlockWeight: its own choice of the two)."""

    name: str
    tiles: tuple | None = None
    tma: bool | None = None
    x_in: bool | None = None
    ahead: bool = True
    entry_x_in: bool = False  # route "backend" with the tuned entry's "x_in_gate_up" set (a temporary config dir)
    route: str = "triton"

    def kernel_config(self):
        from moekit.experts.configs import GemmTile, KernelConfig

        if self.tiles is None:
            return None
        block_m, group_m, up, down = self.tiles
        return KernelConfig(block_m, GemmTile(up[0], 128, group_m, up[1], up[2]),
                            GemmTile(down[0], 128, group_m, down[1], down[2]))


def _t(bm: int, gm: int, up: tuple, down: tuple, tma: bool | None = True, x_in: bool | None = None,
       ahead: bool = True) -> Variant:
    name = f"m{bm}g{gm} u{up[0]}/{up[1]}w{up[2]}s d{down[0]}/{down[1]}w{down[2]}s" + ("" if tma else " ptr")
    name += (" x-in" if x_in else "") + ("" if ahead else " ahead-off")
    return Variant(name, (bm, gm, up, down), tma, x_in, ahead)


def variants(preset: str, m: int) -> list[Variant]:
    """The default first, again last (the run's noise); between, per cell what might beat it (run 1 at f813571:
    benchmarks/results/raw/NVIDIA_H200-2026-12-02-7190a55-fp8_small.*; the tuned entry in each comment)."""
    again = [Variant("default again")]
    if m >= 1024:  # Qwen3 tuned: m64g8 u128/8w4s d128/4w4s tma; Mixtral: Gluon (the backend), Triton m128g8 ptr
        return [Variant("default"), Variant("backend", route="backend"), Variant("gluon", route="gluon"),
                _t(64, 8, (128, 8, 4), (128, 4, 5)), _t(64, 8, (128, 8, 5), (128, 4, 4)),
                _t(64, 4, (128, 8, 4), (128, 4, 4)), _t(64, 8, (128, 4, 4), (128, 4, 4))] + again
    base = [Variant("default"), Variant("default ahead-off", ahead=False), Variant("default x-in", x_in=True)]
    if m <= 8:  # eager through the backend's lean path, with the tuned entry's "x_in_gate_up" and without
        base += [Variant("backend", route="backend"), Variant("backend entry x-in", route="backend", entry_x_in=True)]
    if preset == "qwen3-30b-a3b" and m == 1:  # tuned: m16 u64/4w4s d128/4w4s tma (h float32: AHEAD in down)
        return base + [
            _t(16, 1, (64, 4, 5), (128, 4, 5)), _t(16, 1, (64, 4, 4), (128, 4, 5)), _t(16, 1, (64, 4, 5), (128, 4, 4)),
            _t(16, 1, (16, 4, 4), (128, 4, 4)), _t(16, 1, (64, 2, 4), (128, 4, 4)), _t(16, 1, (64, 4, 4), (128, 2, 4)),
            _t(16, 1, (32, 4, 4), (128, 4, 4)), _t(16, 1, (64, 4, 4), (128, 4, 4), False)] + again
    if preset == "qwen3-30b-a3b" and m == 8:  # tuned: m16 u32/4w4s d128/4w4s tma (run 1: 77.6 against 84.1 for u128)
        return base + [
            _t(16, 1, (32, 4, 3), (128, 4, 3)), _t(16, 1, (32, 4, 5), (128, 4, 5)), _t(16, 1, (32, 4, 4), (64, 4, 4)),
            _t(16, 1, (16, 4, 4), (128, 4, 4)), _t(16, 1, (32, 2, 4), (128, 4, 4)), _t(16, 1, (32, 4, 4), (128, 4, 5)),
            _t(16, 1, (32, 4, 4), (128, 4, 4), False), _t(16, 1, (128, 4, 4), (128, 4, 4))] + again
    if preset == "qwen3-30b-a3b":  # M=64, tuned: m16 u128/4w4s d128/4w4s tma
        return base + [
            _t(16, 1, (128, 4, 3), (128, 4, 3)), _t(16, 1, (128, 4, 3), (64, 4, 3)), _t(16, 1, (32, 4, 4), (128, 4, 4)),
            _t(16, 1, (32, 4, 3), (128, 4, 3)), _t(16, 1, (64, 4, 3), (128, 4, 3)), _t(16, 1, (128, 4, 5), (128, 4, 5))
        ] + again
    if preset == "deepseek-v3":  # tuned: m16 u128/4w5s d64/4w3s (M=8: d64/4w5s), TMA by the rule
        return base + [
            _t(16, 1, (128, 4, 5), (128, 4, 5)), _t(16, 1, (128, 4, 6), (64, 4, 5)), _t(16, 1, (128, 4, 5), (32, 4, 5)),
            _t(16, 1, (64, 4, 5), (128, 4, 5))] + again
    return base + [  # Mixtral M=1, tuned: m16 u128/4w5s d32/4w5s tma
        _t(16, 1, (128, 4, 5), (64, 4, 5)), _t(16, 1, (128, 4, 6), (64, 4, 6)), _t(16, 1, (128, 4, 5), (16, 4, 5)),
        _t(16, 1, (128, 4, 6), (32, 4, 5))] + again

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
    entry_x_in: bool | None = None  # route "backend" with the tuned entry's "x_in_gate_up" set so (a temporary config dir)
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
    """Run 3 (the installed entries confirmed): the default first, again last (the run's noise), the backend
    (what ``moekit bench`` times; eager through its lean path), and a few neighbours. Runs 1 and 2 swept wider:
    benchmarks/results/raw/NVIDIA_H200-2026-12-02-{7190a55,d235e2d}-fp8_small.*."""
    ends = [Variant("default"), Variant("backend", route="backend")], [Variant("default again")]
    if preset == "qwen3-30b-a3b" and m <= 4:  # tuned M=1: u64/4w4s d128/4w4s, x in gate-up in eager calls (M <= 2)
        extra = [Variant("backend entry no-x-in", route="backend", entry_x_in=False)] if m <= 2 else []
        if m == 1:
            extra += [Variant("default x-in", x_in=True), _t(16, 1, (64, 4, 5), (128, 4, 5))]
        return ends[0] + extra + ends[1]
    if preset == "qwen3-30b-a3b" and m == 8:  # tuned: u32/4w3s d128/4w3s (run 2: 76.8 against 80.4 for 4 stages)
        return ends[0] + [_t(16, 1, (32, 4, 4), (128, 4, 4)), _t(16, 1, (32, 4, 3), (64, 4, 3)),
                          _t(16, 1, (32, 4, 3), (128, 4, 4)), _t(16, 1, (32, 4, 2), (128, 4, 2))] + ends[1]
    if preset == "qwen3-30b-a3b" and m == 64:  # tuned: u128/4w4s d128/4w4s
        return ends[0] + [_t(16, 1, (128, 4, 3), (64, 4, 3)), _t(16, 1, (128, 4, 3), (128, 4, 3))] + ends[1]
    return ends[0] + ends[1]

"""What ``decode_pdl_device_check.py`` measures: its cells and each cell's variants of the tuned default.

The down GEMM's weight tiles loaded before its PDL wait (``KernelConfig.down_preload``: NAIVE layouts only, i.e.
M*k*4 <= E) and the gate-up GEMM's early PDL signal (``up_signal_early``, so the down programs start while gate-up
streams), with the down tiles that keep the preloaded tiles within 128 registers a thread.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moekit.experts.triton_plan import PRELOAD_REGISTERS

Q3, DS, MX = "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"
# (dtype, preset, M, timed): Qwen3-30B-A3B M = 1, 2 are the target; DeepSeek-V3 and Mixtral-8x7B M = 1 must not get
# slower; the rest are checked for correctness only.
CELLS = tuple([(d, Q3, m, True) for m in (1, 2) for d in ("fp8", "bf16")]
              + [(d, p, 1, True) for d in ("fp8", "bf16") for p in (DS, MX)]
              + [("fp8", DS, 8, False)]
              + [(d, p, m, False) for d in ("fp8", "bf16") for p, m in ((Q3, 8), (DS, 2), (MX, 2))])
SMOKE_CELLS = (("bf16", Q3, 1, True), ("fp8", Q3, 1, True))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with the down tile (BLOCK_N, warps), ``down_preload`` (-1: the most tiles within
    PRELOAD_REGISTERS) and ``up_signal_early`` changed (None: kept)."""

    name: str
    preload: int | None = None
    early: bool | None = None
    down_n: int | None = None
    down_warps: int | None = None
    up_n: int | None = None  # the gate-up BLOCK_N (fewer gate-up programs leave SMs to the early down programs)

    @property
    def exact(self) -> bool:
        """Whether its output must equal the default's bit for bit (same tiles: the same sums in the same order)."""
        return self.down_n is None and self.down_warps is None and self.up_n is None

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def config(self, base, itemsize: int):
        config = base
        if self.down_n is not None:
            config = replace(config, down=replace(config.down, BLOCK_N=self.down_n))
        if self.down_warps is not None:
            config = replace(config, down=replace(config.down, num_warps=self.down_warps))
        if self.up_n is not None:
            config = replace(config, up=replace(config.up, BLOCK_N=self.up_n))
        if self.early is not None:
            config = replace(config, up_signal_early=self.early)
        if self.preload is not None:
            down = config.down
            per_tile = down.BLOCK_N * down.BLOCK_K * itemsize // (4 * 32 * down.num_warps)
            config = replace(config, down_preload=self.preload if self.preload >= 0 else PRELOAD_REGISTERS // per_tile)
        return config


def _pre(preload: int, early: bool = True, down_n: int | None = None, down_warps: int | None = None,
         up_n: int | None = None) -> Variant:
    name = ("premax" if preload < 0 else f"pre{preload}") + (" early" if early else " late") + (
        f" d{down_n}" if down_n else "") + (f" w{down_warps}" if down_warps else "") + (f" u{up_n}" if up_n else "")
    return Variant(name, preload, early, down_n, down_warps, up_n)


def variants(dtype: str, preset: str, m: int, timed: bool = True) -> list[Variant]:
    """The default first. Qwen3 (N = 768: 6 steps of 128): the whole slab preloaded, fp8 on [64, 128] tiles (its
    tuned down tile is 128 wide: 192 registers for 6), bf16 on 8 warps or 32-wide tiles; the tile changes alone as
    controls. Elsewhere the most tiles the tuned tile allows, signalled early and late."""
    ends = [Variant("default")]
    if not timed:
        return ends + [_pre(-1)]
    if preset == Q3 and dtype == "fp8":  # tuned: u64 d128 w4, swapped
        return ends + [Variant("early", early=True), Variant("d64", down_n=64), _pre(6, False, 64), _pre(6, True, 64),
                       _pre(6, True, 128, 8), _pre(6, True, 64, up_n=128)]
    if preset == Q3:  # tuned: u64 d64 w4
        return ends + [Variant("early", early=True), Variant("w8", down_warps=8), _pre(6, False, down_warps=8),
                       _pre(6, True, down_warps=8), _pre(6, True, 32)]
    return ends + [Variant("early", early=True), _pre(-1, False), _pre(-1)]

"""What ``decode_q3_device_check.py`` measures: its cells and each cell's variants of the tuned default.

Run 1 (branch at 62cabd5, benchmarks/results/raw/NVIDIA_H200-2026-12-02-62cabd5-decode_q3.log) measured the L2
prefetch of the down weights in three forms and a 7-stage down GEMM (all slower, removed) and fp8 SWAP_AB (faster at
Qwen3 M = 1, 2, now in its tuned entry 1). Run 2: SWAP_AB for bf16, and SWAP_AB's tiles where run 1 lost or did not
reach (Qwen3 fp8 M = 8 with its 32-wide gate-up tile, DeepSeek-V3 / Mixtral fp8).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# (dtype, preset, M): Qwen3-30B-A3B is the target; DeepSeek-V3 and Mixtral-8x7B must not get slower. Qwen3 first
# (timing stops at the deadline).
CELLS = tuple([(d, "qwen3-30b-a3b", m) for d in ("bf16", "fp8") for m in (1, 2, 8)]
              + [(d, p, m) for d in ("fp8", "bf16") for p in ("deepseek-v3", "mixtral-8x7b") for m in (1, 8)])
SMOKE_CELLS = (("bf16", "qwen3-30b-a3b", 1), ("fp8", "qwen3-30b-a3b", 1))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with ``swap_ab`` set (None: kept), the tiles' BLOCK_N and the down GEMM's stages
    changed (None: kept)."""

    name: str
    swap_ab: bool | None = None
    up_n: int | None = None  # the gate-up BLOCK_N
    down_n: int | None = None  # the down BLOCK_N
    down_stages: int | None = None

    @property
    def exact(self) -> bool:
        """Whether its output must equal the default's bit for bit (SWAP_AB sums in another order)."""
        return self.swap_ab is None

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def config(self, base):
        config = base if self.swap_ab is None else replace(base, swap_ab=self.swap_ab)
        if self.up_n is not None:
            config = replace(config, up=replace(config.up, BLOCK_N=self.up_n))
        if self.down_n is not None:
            config = replace(config, down=replace(config.down, BLOCK_N=self.down_n))
        if self.down_stages is not None:
            config = replace(config, down=replace(config.down, num_stages=self.down_stages))
        return config


def _swap(up_n: int | None = None, down_n: int | None = None, down_stages: int | None = None) -> Variant:
    name = "swap" + (f" u{up_n}" if up_n else "") + (f" d{down_n}" if down_n else "") + (
        f" s{down_stages}" if down_stages else "")
    return Variant(name, True, up_n, down_n, down_stages)


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    """The default first. fp8 Qwen3 M <= 2: the default swaps (tuned entry 1), so "noswap" and swap's neighbour tiles;
    elsewhere SWAP_AB with the tuned tiles, and with tiles of >= 64 rows where the tuned ones are narrower (the weight
    tile is wgmma's M side: 64 at least, else Triton falls back to mma.sync)."""
    ends = [Variant("default")]
    if dtype == "bf16":  # the bf16 kernels refuse SWAP_AB (0.999-1.019x: raw/NVIDIA_H200-2026-12-03-dd8bed6-verdict.*)
        return ends
    if dtype == "fp8" and preset == "qwen3-30b-a3b" and m <= 2:  # tuned: u64 d128, swapped
        return ends + [Variant("noswap", False), _swap(down_n=64), _swap(up_n=128), _swap(down_stages=3),
                       _swap(down_stages=5)]
    if preset == "qwen3-30b-a3b" and m == 8:  # tuned: u32 (d128 fp8, d64 bf16)
        return ends + [_swap(), _swap(up_n=64), _swap(up_n=128), _swap(up_n=64, down_n=128)]
    if preset == "mixtral-8x7b" and m == 1:  # tuned down tile 32 wide
        return ends + [_swap(), _swap(down_n=64), _swap(down_n=128)]
    return ends + [_swap()]

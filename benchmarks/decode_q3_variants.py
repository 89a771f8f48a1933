"""What ``decode_q3_device_check.py`` measures: its cells and each cell's variants of the tuned default."""

from __future__ import annotations

from dataclasses import dataclass, replace

# (dtype, preset, M): Qwen3-30B-A3B is the target; DeepSeek-V3 and Mixtral-8x7B must not get slower
# Qwen3 first (timing stops at the deadline)
CELLS = tuple([(d, "qwen3-30b-a3b", m) for d in ("bf16", "fp8") for m in (1, 2, 8)]
              + [(d, p, m) for d in ("bf16", "fp8") for p in ("deepseek-v3", "mixtral-8x7b") for m in (1, 8)])
SMOKE_CELLS = (("bf16", "qwen3-30b-a3b", 1), ("fp8", "qwen3-30b-a3b", 1))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with ``w2_prefetch`` set (None: kept), the down GEMM's stages (None: kept) and
    ``swap_ab`` (the transposed per-step products: wgmma for 16-row tiles)."""

    name: str
    w2_prefetch: str | None = None
    down_stages: int | None = None
    swap_ab: bool = False
    up_n: int | None = None  # the gate-up BLOCK_N (None: kept)
    down_n: int | None = None  # the down BLOCK_N (None: kept)

    @property
    def exact(self) -> bool:
        """Whether its output must equal the default's bit for bit (SWAP_AB sums in another order)."""
        return not self.swap_ab

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def config(self, base):
        config = base if self.w2_prefetch is None else replace(base, w2_prefetch=self.w2_prefetch)
        if self.down_stages is not None:
            config = replace(config, down=replace(config.down, num_stages=self.down_stages))
        if self.up_n is not None:
            config = replace(config, up=replace(config.up, BLOCK_N=self.up_n))
        if self.down_n is not None:
            config = replace(config, down=replace(config.down, BLOCK_N=self.down_n))
        return replace(config, swap_ab=True) if self.swap_ab else config


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    """The default first; SWAP_AB; Qwen3: SWAP_AB with "up" and with the down GEMM's whole slab in flight (N = 768 is
    6 steps of 128: 7 stages), the three prefetch modes, 7 stages; elsewhere "up" (their touched w2 is far past the L2
    at M = 1: expected to lose, measured so the default's rule is known)."""
    ends, swap = [Variant("default")], [Variant("swap", swap_ab=True)]
    if preset == "qwen3-30b-a3b":
        swap += [Variant("swap+up", "up", swap_ab=True), Variant("swap+stages7", None, 7, swap_ab=True)]
        return ends + swap + [Variant("up", "up"), Variant("down", "down"), Variant("down_late", "down_late"),
                              Variant("stages7", None, 7)]
    return ends + swap + [Variant("up", "up")]

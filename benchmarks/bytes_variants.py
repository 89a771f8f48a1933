"""What ``bytes_device_check.py`` measures: the byte-bound cells 8 <= M <= 1024 (issues #19, #15) and each cell's
variants of its tuned entry (``moekit/experts/configs/``): row height (the padding), tile width, BLOCK_K for the down
GEMM's short K (Qwen3: N = 768), stages, warps, GROUP_M, SWAP_AB (fp8).

Run 1 (merged main 392c1c5, raw/NVIDIA_H200-2026-12-04-392c1c5-bytes-merged-bytes.*): every variant PASS, none >= 3%
faster than the tuned default in any round (tables and breakdowns: benchmarks/triton-notes.md, branch `bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# (dtype, preset, M), the brief's cells most wanted first (timing stops at the deadline). DeepSeek-V3 fp8 1024 at
# 88.8% of the floor is a guard as much as a target.
# fp8 Qwen3 M = 512 runs the tuned file's 1024 entry (nearest in log2 of 1, 8, 64, 1024, ...): its neighbour.
CELLS = (("bf16", "qwen3-30b-a3b", 1024), ("fp8", "qwen3-30b-a3b", 1024), ("bf16", "qwen3-30b-a3b", 512),
         ("fp8", "qwen3-30b-a3b", 64), ("fp8", "qwen3-30b-a3b", 512), ("bf16", "qwen3-30b-a3b", 8),
         ("bf16", "deepseek-v3", 8), ("fp8", "deepseek-v3", 1024))
SMOKE_CELLS = (("bf16", "qwen3-30b-a3b", 1024), ("fp8", "qwen3-30b-a3b", 64))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with ``block_m`` / ``swap_ab`` set (None: kept) and the fields of ``up`` / ``down``
    (``GemmTile``'s names: BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) replaced."""

    name: str
    block_m: int | None = None
    swap_ab: bool | None = None
    up: dict = field(default_factory=dict)
    down: dict = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def exact(self) -> bool:
        """Whether its output must equal the default's bit for bit: only the down tile's width, stages and GROUP_M
        change (the row height, BLOCK_K, warps and SWAP_AB can change the MMA form or the order of a row's sums; an
        fp8 gate-up tile narrower than a scale group writes h in float32 for the down GEMM to quantize)."""
        same_order = {"num_stages", "GROUP_M"}
        return (self.swap_ab is None and self.block_m is None and set(self.up) <= same_order
                and set(self.down) <= same_order | {"BLOCK_N"})

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def config(self, base):
        config = base if self.swap_ab is None else replace(base, swap_ab=self.swap_ab)
        if self.block_m is not None:
            config = replace(config, BLOCK_M=self.block_m)
        return replace(config, up=replace(config.up, **self.up), down=replace(config.down, **self.down))


def _v(name: str, block_m: int | None = None, swap_ab: bool | None = None, up: dict | None = None,
       down: dict | None = None) -> Variant:
    return Variant(name, block_m, swap_ab, dict(up or {}), dict(down or {}))


# Qwen3 M=512's tuned tiles (BM 64: up 128 x 64 w8 s5 GM8, down 128 x 64 w4 s4 GM8), for the 1024 cell at 64 rows
_Q3_512_UP = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 5}
_Q3_512_DOWN = {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    """The default first, then the candidates of the cell."""
    ends = [Variant("default")]
    if dtype == "bf16" and preset == "qwen3-30b-a3b" and m >= 1024:  # BM 128 (2.0 rows an assignment; 1.44 at 64)
        return ends + [_v("bm64", 64), _v("bm64 t512", 64, up=_Q3_512_UP, down=_Q3_512_DOWN),
                       _v("bm64 dk128", 64, down={"BLOCK_K": 128, "num_stages": 3}),
                       _v("dk128", down={"BLOCK_K": 128, "num_stages": 3}),
                       _v("bm32 w4", 32, up={"num_warps": 4}, down={"BLOCK_N": 128, "num_warps": 4})]
    if dtype == "bf16" and preset == "qwen3-30b-a3b" and m >= 512:  # BM 64 (4.0 rows an assignment at 128)
        return ends + [_v("bm32 w4", 32, up={"num_warps": 4}),
                       _v("dk128", down={"BLOCK_K": 128, "num_stages": 3}),
                       _v("uk128", up={"BLOCK_K": 128, "num_stages": 3}),
                       _v("d256 w8", down={"BLOCK_N": 256, "num_warps": 8}),
                       _v("gm1", up={"GROUP_M": 1}, down={"GROUP_M": 1})]
    if dtype == "bf16" and m <= 8:  # decode tiles: 16 rows, 32-wide gate-up
        return ends + [_v("u64", up={"BLOCK_N": 64}), _v("u32 s5", up={"num_stages": 5}),
                       _v("d s5", down={"num_stages": 5 if preset == "qwen3-30b-a3b" else 4}),
                       _v("d64", down={"BLOCK_N": 64}) if preset == "deepseek-v3" else _v("d32", down={"BLOCK_N": 32}),
                       _v("u w8", up={"num_warps": 8})]
    if dtype == "fp8" and preset == "qwen3-30b-a3b" and m >= 512:  # the 1024 entry, BM 64 (1.44 rows an assignment)
        return ends + [_v("bm32 w4", 32, up={"num_warps": 4}), _v("bm128", 128, down={"num_warps": 8}),
                       _v("d w8", down={"num_warps": 8}), _v("u w4", up={"num_warps": 4}),
                       _v("s5", up={"num_stages": 5}, down={"num_stages": 5}),
                       _v("gm1", up={"GROUP_M": 1}, down={"GROUP_M": 1}),
                       _v("u s3", up={"num_stages": 3}),
                       _v("d256 w8", down={"BLOCK_N": 256, "num_warps": 8})]
    if dtype == "fp8" and preset == "qwen3-30b-a3b":  # M = 64: BM 16, 128-wide tiles on mma.sync (no e4m3 form)
        return ends + [_v("swap", swap_ab=True), _v("swap u64", swap_ab=True, up={"BLOCK_N": 64}),
                       _v("u64", up={"BLOCK_N": 64}), _v("s5", up={"num_stages": 5}, down={"num_stages": 5}),
                       _v("d64", down={"BLOCK_N": 64})]
    if dtype == "fp8" and preset == "deepseek-v3":  # M = 1024: BM 64 (2 rows an assignment; ~1.5 at 32)
        return ends + [_v("bm32 w4", 32, up={"num_warps": 4})]
    return ends

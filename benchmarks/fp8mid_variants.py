"""What ``fp8mid_device_check.py`` measures (issue #15, fp8_block at 8 <= M <= 1024): the cells and, per cell, the
tuned default against the persistent fp8 GEMMs (``triton_fp8_persistent.Persistent``: programs per SM of gate-up /
down) and config variants of the tuned entry; and how one variant is called.

Run 1 (cb26041, raw/NVIDIA_H200-2026-12-04-cb26041-fp8mid-ck1.*; graph µs x the one-tile default, rounds >= 3% faster
of 5): Qwen3 M = 512 both persistent 0.945 (5), down only 0.965 (4), gate-up only 0.977 (1); M = 1024 down only 0.968
(3), both 1.002, gate-up only 1.039, both unflattened 1.039, down at one program an SM 1.123; M = 64 / 256 (16-row
tiles) gate-up persistent 1.09-1.32 (two an SM 1.012 / 1.090), down only 1.010 / 0.999; DeepSeek-V3 M = 64 / 1024
both 1.028 / 1.024. Taken (the tuned file): entry 1024 the persistent down GEMM, a new entry 512 (entry 1024's tiles)
both; a new entry 256 (entry 64's tiles) keeps M = 256 where it was. Every variant bit-equal to the default.

Run 2 (merged main b32c0fb, raw/NVIDIA_H200-2026-12-04-b32c0fb-fp8mid-merged.*): the new defaults against "one tile"
x1.034 (M = 1024), x1.051 (512), x1.036 (2048), each 5 of 5 rounds >= 3%; M = 256 unchanged (entry 1024's tiles
1.040, with both persistent 0.996); down 3 stages 0.995 / 1.000, down 8 warps 1.214. The M = 8 SWAP_AB variants
(0.981 in run 1) and the flattening switch (unflattened 1.02-1.04 slower) are gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moekit.experts.triton_fp8_persistent import Persistent

# (dtype, preset, M), the brief's cells most wanted first (timing stops at the deadline); DeepSeek-V3 the guards;
# M = 2048 takes entry 1024 too (nearest in log2, ties to the smaller M). "short": the cells whose default changed.
CELLS = (("fp8", "qwen3-30b-a3b", 1024), ("fp8", "qwen3-30b-a3b", 512), ("fp8", "qwen3-30b-a3b", 2048),
         ("fp8", "qwen3-30b-a3b", 256), ("fp8", "qwen3-30b-a3b", 64), ("fp8", "qwen3-30b-a3b", 8),
         ("fp8", "deepseek-v3", 1024), ("fp8", "deepseek-v3", 64))
SHORT_CELLS = CELLS[:4]
SMOKE_CELLS = (("fp8", "qwen3-30b-a3b", 64), ("fp8", "qwen3-30b-a3b", 512))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with ``block_m`` set (None: kept) and fields of ``up`` / ``down``
    (``GemmTile``'s names) replaced, run with ``persistent`` GEMMs (None: one program a tile)."""

    name: str
    persistent: Persistent | None = None
    block_m: int | None = None
    up: dict = field(default_factory=dict)
    down: dict = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def exact(self) -> bool:
        """Whether its output must equal the default's bit for bit: the persistent GEMMs and the down tile's
        width, stages and GROUP_M keep every row's sums in their order; row height, BLOCK_K, warps and SWAP_AB
        may not (another MMA form), and an fp8 gate-up tile narrower than a scale group writes h in float32."""
        same_order = {"num_stages", "GROUP_M"}
        return (self.block_m is None and set(self.up) <= same_order
                and set(self.down) <= same_order | {"BLOCK_N"})

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def config(self, base):
        config = base if self.block_m is None else replace(base, BLOCK_M=self.block_m)
        return replace(config, up=replace(config.up, **self.up), down=replace(config.down, **self.down))


def _p(name: str, up: int, down: int) -> Variant:
    return Variant(name, Persistent(up, down))


# entry 1024's tiles from a 16-row entry (M = 256: entry 256, entry 64's tiles)
_BM64 = dict(block_m=64, up={"GROUP_M": 8, "num_warps": 8}, down={"GROUP_M": 8})


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    """The default first (the tuned entry, its "persistent" included), then the cell's candidates: "one tile" is the
    entry's config with one program a tile (the default before run 1). Programs per SM as the tiles' shared memory
    allows (sm_90 compile, ``fp8mid_compile_cpu``, persistent / one tile a program): gate-up 64 x 128 x 128 at 4
    stages 172 / 164 KB (one an SM), down 107 / 98 KB (two); 16-row tiles at 4 stages: gate-up 107 / 105 KB (two),
    down 57 / 55 KB (three)."""
    ends = [Variant("default")]
    if dtype != "fp8" or m <= 8 or preset != "qwen3-30b-a3b":  # guards: defaults unchanged
        return ends
    if m == 256:  # entry 256 (16-row tiles, one tile a program) against entry 1024's tiles
        return ends + [Variant("bm64", **_BM64), Variant("bm64 pers", Persistent(1, 2), **_BM64)]
    if m < 256:
        return ends + [_p("pers down", 0, 3)]
    one = [Variant("one tile")]
    if m == 512:  # entry 512: both persistent
        return ends + one + [_p("pers down", 0, 2), Variant("pers ds3", Persistent(1, 2), down={"num_stages": 3})]
    if m == 1024:  # entry 1024: the down GEMM persistent
        return ends + one + [_p("pers", 1, 2), Variant("pers down ds3", Persistent(0, 2), down={"num_stages": 3}),
                             Variant("pers down dw8", Persistent(0, 2), down={"num_warps": 8})]
    return ends + one + [_p("pers", 1, 2)]


def run_variant(v: Variant, base, t, w, explicit: bool = False):
    """One call of ``v`` on input set ``t`` with weights ``w`` (two ``Fp8BlockWeight``): the default (config None:
    the tuned entry; ``explicit``: that entry's config passed, for compile workers whose small-E weights find no
    tuned file) or the tuned config changed by ``v``."""
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    config = (base.config if explicit else None) if v.is_default else v.config(base.config)
    tma = None if config is None else base.weight_tma  # a config passed: the entry's weight loads kept
    return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                    config=config, weight_tma=tma, persistent=v.persistent)

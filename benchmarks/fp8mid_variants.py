"""What ``fp8mid_device_check.py`` measures (issue #15, fp8_block at 8 <= M <= 1024): the cells and, per cell, the
tuned default against the persistent fp8 GEMMs (``triton_fp8_persistent.Persistent``: programs per SM of gate-up /
down, the tile and K loops flattened or not) and config variants of the tuned entry; and how one variant is called.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moekit.experts.triton_fp8_persistent import Persistent

# (dtype, preset, M), the brief's cells most wanted first (timing stops at the deadline); DeepSeek-V3 the guards.
CELLS = (("fp8", "qwen3-30b-a3b", 1024), ("fp8", "qwen3-30b-a3b", 512), ("fp8", "qwen3-30b-a3b", 64),
         ("fp8", "qwen3-30b-a3b", 256), ("fp8", "qwen3-30b-a3b", 8), ("fp8", "deepseek-v3", 1024),
         ("fp8", "deepseek-v3", 64))
SMOKE_CELLS = (("fp8", "qwen3-30b-a3b", 64), ("fp8", "qwen3-30b-a3b", 8))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with ``block_m`` / ``swap_ab`` set (None: kept) and fields of ``up`` / ``down``
    (``GemmTile``'s names) replaced, run with ``persistent`` GEMMs (None: one program a tile)."""

    name: str
    persistent: Persistent | None = None
    block_m: int | None = None
    swap_ab: bool | None = None
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


def _p(name: str, up: int, down: int, flatten: bool = True, swap_ab: bool | None = None) -> Variant:
    return Variant(name, Persistent(up, down, flatten), swap_ab=swap_ab)


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    """The default first, then the cell's candidates. Programs per SM as the tiles' shared memory allows (sm_90
    compile, ``fp8mid_compile_cpu``, Qwen3's tuned tiles, persistent / one tile a program): gate-up 64 x 128 x 128
    at 4 stages 172 / 164 KB (one an SM), down 107 / 98 KB (two); 16-row tiles at 4 stages: gate-up 107 / 105 KB
    (two), down 57 / 55 KB (three); swapped (persistent) 141 and 76 KB (one, two)."""
    ends = [Variant("default")]
    if dtype != "fp8":
        return ends
    if preset == "qwen3-30b-a3b" and m <= 8:  # folded alignment and a 32-wide gate-up tile: no persistent GEMM
        return ends + [Variant("swap u64", swap_ab=True, up={"BLOCK_N": 64}),
                       Variant("swap u128", swap_ab=True, up={"BLOCK_N": 128})]
    if preset == "qwen3-30b-a3b" and m <= 256:  # BM 16 (entry 64)
        return ends + [_p("pers", 1, 3), _p("pers noflat", 1, 3, False), _p("pers up", 1, 0), _p("pers down", 0, 3),
                       _p("pers u2", 2, 3), _p("pers swap", 1, 2, swap_ab=True)]
    if preset == "qwen3-30b-a3b":  # BM 64 (entry 1024)
        return ends + [_p("pers", 1, 2), _p("pers noflat", 1, 2, False), _p("pers up", 1, 0), _p("pers down", 0, 2),
                       _p("pers d1", 1, 1)]
    return ends + [_p("pers", 1, 2), _p("pers noflat", 1, 2, False)]


def run_variant(v: Variant, base, t, w, explicit: bool = False):
    """One call of ``v`` on input set ``t`` with weights ``w`` (two ``Fp8BlockWeight``): the default (config None:
    the tuned entry; ``explicit``: that entry's config passed, for compile workers whose small-E weights find no
    tuned file) or the tuned config changed by ``v``."""
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    config = (base.config if explicit else None) if v.is_default else v.config(base.config)
    tma = None if config is None else base.weight_tma  # a config passed: the entry's weight loads kept
    return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                    config=config, weight_tma=tma, persistent=v.persistent)

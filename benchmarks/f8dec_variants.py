"""What ``f8dec_device_check.py`` measures (issue #15, fp8_block at 8 <= M <= 1024, session 27): per Qwen3-30B-A3B
cell the tuned default against the gate-up GEMM with gate and up in one dot a K-step (``gemm_fp8``'s PAIR_DOT:
one [BM, BK] @ [BK, 2BN] product, on Hopper one wgmma waited for a step instead of two), the down GEMM swapped alone
(``swap_down``: its weight tile as wgmma's M side, e4m3 from shared memory, where 16-row tiles otherwise take
mma.sync and convert each weight tile to f16) and config variants of the tuned entry; DeepSeek-V3 as the guard.

Check 1 (df86542, results/f8dec-ck1; copy 4.17 TB/s; x default, rounds >= 3% faster of 5; every output bit-equal to
the default): PAIR_DOT Qwen3 M = 1024 0.987 (0), 512 0.994, 256 0.994, 64 0.999, 8 1.102; DeepSeek-V3 1024 0.991;
M = 256 entry 1024's tiles with PAIR_DOT, both persistent 0.988; M = 8 down 64 wide 1.071, down 4 stages 1.015, up
64 wide 1.086. Check 1b (f71fb8c, results/f8dec-ck1b; copy 4.15): swap_down M = 16 0.969 (4), 8 0.991, 4 0.989 (1),
64 1.001, 256 1.008, DeepSeek-V3 64 0.993; M = 8 both swapped with a 64-wide gate-up 0.981 (0); PAIR_DOT M = 1024
0.981 (0); M = 256 entry 1024's tiles + PAIR_DOT 0.980 (0); two gate-up programs an SM (maxnreg 128, 2 stages) M =
1024 1.053, 512 one-tile 0.997, 512 persistent 1.028. No default changed (none >= 3% in 5 of 5 rounds).
The merged run (check 2) measures the closest ones again, and at M = 4 / 8 / 16 the same calls without programmatic
dependent launch (eager, the swapped down kernel took 15.9 / 38.3 µs against 22.4 / 41.6 at M = 4 / 16; in the graph
the calls moved by 0.5 / 3.6 µs). Run by ``fp8mid_device_check``'s machinery
(``f8dec_device_check.py`` names this module), so the cells, variants and ``run_variant`` have its shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moekit.experts.triton_fp8_persistent import Persistent

NAME = "f8dec"  # the JSON's and the workers' logs' name
# (dtype, preset, M): the brief's cells most wanted first (timing stops at the deadline); DeepSeek-V3 the guard
CELLS = tuple(("fp8", "qwen3-30b-a3b", m) for m in (16, 8, 4, 1, 2, 1024, 256, 512)) + (
    ("fp8", "deepseek-v3", 8), ("fp8", "deepseek-v3", 1024))
SHORT_CELLS = CELLS[:3]
SMOKE_CELLS = (("fp8", "qwen3-30b-a3b", 64), ("fp8", "qwen3-30b-a3b", 512))


@dataclass(frozen=True)
class Variant:
    """The tuned entry's config with ``block_m`` set (None: kept) and fields of ``up`` / ``down`` (``GemmTile``'s
    names) replaced, run with ``persistent`` GEMMs, ``pair_dot``, ``swap_down`` and ``up_registers`` (None: the
    entry's)."""

    name: str
    pair_dot: bool | None = None
    swap_down: bool | None = None
    persistent: Persistent | None = None
    block_m: int | None = None
    swap_ab: bool | None = None  # the config's swap_ab (both GEMMs swapped)
    up_registers: int | None = None  # the gate-up GEMM's maxnreg
    pdl: bool = True  # False: LaunchOptions(dependent_launch=False), each kernel launched after the last (exact)
    up: dict = field(default_factory=dict)
    down: dict = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def exact(self) -> bool:
        """Whether its output must equal the default's bit for bit: the down tile's width and stages keep every
        row's sums in their order. PAIR_DOT multiplies the same products (bit-equal under the interpreter), but a
        wgmma of N = 256 is another instruction: reported, not required."""
        return (self.pair_dot is None and self.swap_down is None and self.block_m is None and self.swap_ab is None
                and self.up_registers is None and not self.up
                and set(self.down) <= {"num_stages", "BLOCK_N"})

    @property
    def is_default(self) -> bool:
        return self.name == "default"

    def config(self, base):
        config = base if self.block_m is None else replace(base, BLOCK_M=self.block_m)
        config = config if self.swap_ab is None else replace(config, swap_ab=self.swap_ab)
        return replace(config, up=replace(config.up, **self.up), down=replace(config.down, **self.down))


_BM64 = dict(block_m=64, up={"GROUP_M": 8, "num_warps": 8}, down={"GROUP_M": 8})  # entry 1024's tiles


def variants(dtype: str, preset: str, m: int) -> list[Variant]:
    """The default first (the tuned entry, its switches included), then the cell's candidates (check 2: the closest
    of checks 1 and 1b again; entry 8 serves M = 3 .. 22; PAIR_DOT on the swapped decode tiles: entry 1 of Qwen3 and
    entry 8 of DeepSeek-V3 swap both GEMMs)."""
    ends = [Variant("default")]
    if m in (4, 8, 16) and preset == "qwen3-30b-a3b":
        swaps = [Variant("swap down", swap_down=True), Variant("no PDL", pdl=False),
                 Variant("swap down no PDL", swap_down=True, pdl=False)]
        both = [Variant("swap both up64", swap_ab=True, up={"BLOCK_N": 64}),
                Variant("swap both up64 pair", swap_ab=True, pair_dot=True, up={"BLOCK_N": 64})]
        return ends + swaps + both
    if m == 256:  # entry 256 (16-row tiles) against entry 1024's tiles with the pair dot, both persistent
        return ends + [Variant("bm64 pair", pair_dot=True, persistent=Persistent(1, 2), **_BM64)]
    return ends + [Variant("pair", pair_dot=True)]


def run_variant(v: Variant, base, t, w, explicit: bool = False):
    """One call of ``v`` on input set ``t`` with weights ``w`` (two ``Fp8BlockWeight``): the default (config None:
    the tuned entry; ``explicit``: that entry's config passed, for compile workers whose small-E weights find no
    tuned file) or the tuned config changed by ``v``; a config passed keeps the entry's weight loads and switches."""
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch
    from moekit.experts.triton_launch import LaunchOptions

    changed = v.block_m is not None or v.swap_ab is not None or v.up or v.down
    config = base.config if explicit or changed else None
    if changed:
        config = v.config(base.config)
    persistent = v.persistent if v.persistent is not None else None if config is None else base.persistent
    pair = v.pair_dot if v.pair_dot is not None else None if config is None else base.pair_dot
    tma = True if pair else None if config is None else base.weight_tma  # the pair dot reads TMA tiles
    swap = v.swap_down if v.swap_down is not None else None if config is None else base.swap_down
    registers = v.up_registers if v.up_registers is not None else None if config is None else base.up_registers
    return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                    config=config, weight_tma=tma, persistent=persistent, pair_dot=pair,
                                    swap_down=swap, up_registers=registers,
                                    options=LaunchOptions(dependent_launch=v.pdl))

"""GPU check of the word MMA decode's gate-up with its gate rows and up rows in separate programs (issue #16 target 1,
session 29, brief dec9: ``WordConfig.halves``, ``gemm_wo_mma.gate_up_halves_wo_mma_kernel``): one accumulator and one
word tile a program, so 256-column (128-byte) int4 steps at 3 stages fit in registers (offline sm_90, Triton 3.6:
184 registers, no spill, 9 programs an SM, against the two-sided kernel's 255 and 104 B spilled), the float32
pre-activation halves activated by the split_glu launch.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/dec9_device_check.py --out $OUT/dec9 --deadline 70   # H200
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/dec9_device_check.py --smoke [--groups 2]    # CPU

Groups (one child process each, weights made once for its Ms; the deadline skips the last), per M: the whole call
(``run_experts_wo``) against the torch twin (rel-L2 < TOL): "pick" (today's chooser and config) and the group's
VARIANTS (the mma decode, 32-row 1-warp tiles): "hBsS" the halves at BLOCK_K B and S stages in both GEMMs with the
split_glu launch, "...u2" the gate-up split in 2 along K too, "...d4" the down GEMM split in 4, "h128w2" 64 rows
in 2 warps, "hg256" / "hd256" 256 columns in the gate-up / the down GEMM only, "kB..." the two-sided gate-up (the
kernel before), "tile64" the tile decode in the 64-row tiles of Mixtral's old M=64 row; beside "rd128B", a pure
read of the touched experts'
words in 32-row 1-warp steps of 128 bytes a row (``dec8_device_check.add_reads``: the geometry's cap). A group runs
in ``dec8_device_check.child`` with this script's GROUPS, ``variants`` and READS: timing, the floor (touched packed
bytes, scales, zeros, x and out over the copy rate measured in the same process), the table and the JSON
(<out>/dec9.json) as ``dec8_device_check``'s; "wins": rounds a variant took <= 0.97 x the pick.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape  # noqa: E402
from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts.triton_wo_winners import tile  # noqa: E402
from bench_run import group_args, run_groups  # noqa: E402
from dec8_device_check import FAILED, child, finish  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    """A mma-decode config: both GEMMs' tiles (rows, BLOCK_K, warps, stages), the gate-up's K splits, its halves
    apart, the down GEMM's splits (0: the plan's), and the Ms it runs at (empty: all)."""

    up: tuple
    down: tuple
    up_split: int = 1
    halves: bool = True
    down_split: int = 0
    ms: tuple = ()

    def config(self) -> WordConfig:
        up, down = (GemmTile(t[0], t[1], 1, *t[2:]) for t in (self.up, self.down))
        return WordConfig(16, up, down, up_split=self.up_split, down_split=self.down_split, halves=self.halves)


K256, K128 = (32, 256, 1, 3), (32, 128, 1, 3)
VARIANTS = {"h256s3": Variant(K256, K256), "h128s3": Variant(K128, K128),
            "h256s3u2": Variant(K256, K256, 2, ms=(1,)), "h256s3d4": Variant(K256, K256, down_split=4, ms=(1,)),
            "k256s3u2": Variant(K256, K256, 2, halves=False, ms=(1,)), "k128": Variant(K128, K128, halves=False),
            "h128s4": Variant((32, 128, 1, 4), K128), "h128w2": Variant((64, 128, 2, 3), K128),
            "hg256": Variant(K256, K128), "hd256": Variant(K128, K256)}
TILE64 = tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4))  # "tile64": Mixtral int4's M=64 winners row before session 29
# (preset, scheme, Ms, variants). CK1 (99118a9) ran Mixtral int4 M=8 / 1 (h256s3, h128s3, h256s3u2, h256s3d4),
# DeepSeek-V3 int4 M=64 / 8 / 1 (h256s3, h128s3, h256s3u2), Mixtral int8 M=1 (k256s3u2, h256s3, h256s3d4, and the
# since removed fold h256s3f: 2.9x) and Mixtral int4 M=64 (h256s3): h128s3 won DeepSeek-V3 M=64. CK1b (fdff4b0): that
# pick against the two-sided "k128" at M = 32 / 64 / 128, "h128s4", "h128w2"; Mixtral M=64 / 16 (k128, h128s3), Qwen3
# M=64 (h128s3), Mixtral M=8 (h128s4, h128w2, hg256, hd256): taken DeepSeek-V3 M=32..128 h128s3, Mixtral M=4..16
# h128w2 (``triton_wo_configs.MMA_HALVES``), Mixtral M=32..127 the mma decode (``triton_wo_winners``). CK2 (merged
# main): the taken picks against what they replaced, and Mixtral M=96 / 16 (covered, not measured before). Run in
# session 31 on merged main 814ebdc: the halves picks held (the two-sided "k128" 1.043 / 1.046 / 1.060x the pick at
# DeepSeek-V3 M=64, Mixtral M=8 / 16, the pick >= 3% faster in 5/5 rounds; "h128s3", the halves on one warp, 1.04x
# Mixtral's 64-row pick, 5/5), and Mixtral M=64 / 96 on the mma decode 473.0 / 647.1 µs against the tile decode's
# 818.4 / 818.5
GROUPS = (("deepseek-v3", "int4_w4a16", (64,), ("k128",)),
          ("mixtral-8x7b", "int4_w4a16", (8, 16), ("k128", "h128s3")),
          ("mixtral-8x7b", "int4_w4a16", (64, 96), ("tile64",)))
READS = {"rd128B": 32}  # name -> words a step (32 rows, 1 warp): the 128-byte geometry's cap
SETS, ROUNDS, REPLAYS = 3, 5, 5
START = time.perf_counter()


def variants(m: int, names: tuple) -> dict:
    """name -> (decode, config): the pick (None, None: the chooser's) and the group's VARIANTS that run at this M."""
    out = {"pick": (None, None)}
    out.update({name: ("tile", TILE64) if name == "tile64" else ("mma", VARIANTS[name].config()) for name in names
                if name == "tile64" or not VARIANTS[name].ms or m in VARIANTS[name].ms})
    return out


def main(argv=None) -> int:
    args = group_args("dec9", argv)
    if args.group is not None:  # smoke: K 512, two 256-column steps
        return child(args, GROUPS, "dec9", Shape("tiny", 8, 128, 512, 2), variants, READS)
    return finish(os.path.join(args.out, "dec9.json"), run_groups(__file__, "dec9", GROUPS, args, START, FAILED))


if __name__ == "__main__":
    sys.exit(main())

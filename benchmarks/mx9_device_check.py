"""GPU check of mxfp4's word MMA decode with the operand placed by one multiply (``wo_mma_values``; issue #16 target 1,
session 29, brief mx9) in other tiles against the picks and the decodes they replaced, at Mixtral and DeepSeek-V3,
beside pure reads of the same bytes in 128-byte row steps (the cap).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/mx9_device_check.py --out $OUT/mx9 --deadline 70 --groups 3 4 0 1
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/mx9_device_check.py --smoke                  # CPU

``dec8_device_check``'s machinery (one child process a group, the weights made once, variants compiled at once,
every call checked against the torch twin, CUDA-graph replay in 5 interleaved rounds, % of the packed floor at the
copy rate measured in the same process, "rd128B" the cap) with this script's GROUPS and VARIANTS, the scales drawn
per group over 2^-10 .. 2^10 of the bench's (every e2m1 code occurs: random bytes). Session 28's placement ("shift")
was compared bit for bit with the multiply's here until session 31 (equal at every call), then removed: the multiply's
exactness is ``tests/test_wo_mxfp4_mul.py``'s (its PTX emulated against a float64 loop). Offline sm_90 SASS (Triton
3.6, ``wo_mma_sass_cpu.py``), instructions a weight, gate-up / down: k128s3 3.27 / 3.70; k256s3 3.22 / 3.61 (session
28's placement: 4.67 / 5.17 with the operand through shared memory, 4.10 / 4.45)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dec8_device_check as dec8  # noqa: E402
from bench_run import group_args, run_groups  # noqa: E402
from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402

# (preset, scheme, Ms, variants), the cells most likely to decide a pick first (~13-18 s a group before its timing).
# CK1 (dd53396: the multiply with the operand through shared memory at BLOCK_K 128): k256s3m won 5/5 at every cell
# timed, taken (5a57359). CK1b (8061049, each group decoded apart): DeepSeek-V3 M = 1 k256s3mu2 104.1 against the
# gemv 144.0, Mixtral M = 8 k128m 336.4 against k256s3m 348.8, taken (bd9908e). "pick" is now those; the session-28
# picks they replaced: "gemv1" / "gemv8" (DeepSeek-V3 M = 1 / 8), "k128" (Mixtral M = 8), "register", "tile".
# CK1c: --groups 0 1 2 (the cells still open: k128m at DeepSeek-V3 M = 64 / 8, Mixtral M = 1 / 64, the split at
# Mixtral M = 1); CK2: --groups 3 4 0 1 (the taken picks against what they replaced). Session 31 (merged main 814ebdc,
# groups 3 4 0 1 and 0 1 2): every pick beat what it replaced (Mixtral M = 8 335.8 against session 28's "k128", the
# shift placement, 566.7 µs); k128m won DeepSeek-V3 M = 64 (2049.5 against 2343.7, 5/5), k256s3mu2 Mixtral M = 1
# (134.4 against 140.4, 5/5). Then "shift" was removed, and "k128" with it
GROUPS = (("deepseek-v3", "mxfp4", (64,), ("register", "k128m")),
          ("mixtral-8x7b", "mxfp4", (1, 64), ("register", "tile", "k128m", "k256s3mu2")),
          ("deepseek-v3", "mxfp4", (8,), ("gemv8", "k128m")),
          ("deepseek-v3", "mxfp4", (1,), ("gemv1", "k256s3m")),
          ("mixtral-8x7b", "mxfp4", (8,), ("k256s3m",)))


def _tile(rows: int, block_k: int, warps: int, stages: int) -> GemmTile:
    return GemmTile(rows, block_k, 1, warps, stages)


def _gemv(up_split: int) -> WordConfig:  # DeepSeek-V3's gemv pick (``triton_wo_word_winners``)
    return WordConfig(1, _tile(32, 128, 2, 1), _tile(32, 128, 2, 1), up_split=up_split, x_tile=True)


# name -> (decode, config, the Ms it runs at or None: all); "...m" the mma decode (the multiply placement), its tiles
# 32 rows in 1 warp ("kB": BLOCK_K B, "s3" 3 stages, "u2" the gate-up split in 2); "gemvN" DeepSeek-V3's gemv pick at
# M = N; "register" / "tile" those decodes at the chooser's config. (CK1b's "k128r64m" 64 rows in 1 warp, "k256s3"
# and "gemv1m" / "gemv8m", the gemv with the multiply, lost: dropped.)
VARIANTS = {"k128m": ("mma", WordConfig(16, _tile(32, 128, 1, 3), _tile(32, 128, 1, 3)), None),
            "k256s3m": ("mma", WordConfig(16, _tile(32, 256, 1, 3), _tile(32, 256, 1, 3)), None),
            "k256s3mu2": ("mma", WordConfig(16, _tile(32, 256, 1, 3), _tile(32, 256, 1, 3), up_split=2), (1,)),
            "gemv1": ("gemv", _gemv(4), (1,)), "gemv8": ("gemv", _gemv(1), (8,)),
            "register": ("register", None, (1, 64)), "tile": ("tile", None, (64,))}
SPREAD = 10  # the scales' exponents drawn in the bench's +- SPREAD, per group


def variants(m: int, names: tuple) -> dict:
    """name -> (decode, config): the pick (None, None: the chooser's) and the group's VARIANTS at this M."""
    return {"pick": (None, None), **{n: VARIANTS[n][:2] for n in names if m in (VARIANTS[n][2] or (m,))}}


def spread_quantized(scheme: str, e: int, r: int, c: int, dev, seed: int | None, group: int | None = None):
    """``wo_device_check.quantized`` with each group's e8m0 scale drawn in its exponent +- SPREAD."""
    w = QUANTIZED(scheme, e, r, c, dev, seed, group)
    if seed is not None and scheme == "mxfp4":
        g = torch.Generator(device=dev).manual_seed(seed + 99)
        shift = torch.randint(-SPREAD, SPREAD + 1, w.scale.shape, generator=g, device=dev, dtype=torch.int16)
        w.scale.copy_((w.scale.to(torch.int16) + shift).to(torch.uint8))
    return w


QUANTIZED = dec8.quantized
dec8.variants, dec8.quantized = variants, spread_quantized


def main(argv=None) -> int:
    args = group_args("mx9", argv)
    if args.group is not None:
        return dec8.child(args, GROUPS, "mx9")
    cells = run_groups(__file__, "mx9", GROUPS, args, dec8.START, dec8.FAILED)
    return dec8.finish(os.path.join(args.out, "mx9.json"), cells)


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of mxfp4's word MMA decode with the operand placed by one multiply (a config's ``mxfp4_place="mul"``,
``wo_mma_values``, the launch's ASM 2; issue #16 target 1, session 29, brief mx9) against session 28's placement
("shift") and the picks, at Mixtral and DeepSeek-V3, beside pure reads of the same bytes in 128-byte row steps (the
cap).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/mx9_device_check.py --out $OUT/mx9 --deadline 70 --groups 3 4 0 1
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/mx9_device_check.py --smoke                  # CPU

``dec8_device_check``'s machinery (one child process a group, the weights made once, variants compiled at once,
every call checked against the torch twin, CUDA-graph replay in 5 interleaved rounds, % of the packed floor at the
copy rate measured in the same process, "rd128B" the cap) with this script's GROUPS and VARIANTS; besides, each
"...m" variant's output must equal its "shift" twin's bit for bit (the same decoded weights into the same dots),
with the scales drawn per group over 2^-10 .. 2^10 of the bench's (every e2m1 code occurs: random bytes).
Offline sm_90 SASS (Triton 3.6, ``wo_mma_sass_cpu.py --place``), instructions a weight, gate-up / down: k128s3
shift 4.67 / 5.17 (the operand through shared memory), mul 3.27 / 3.70; k256s3 shift 4.10 / 4.45, mul 3.22 / 3.61."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dec8_device_check as dec8  # noqa: E402
from bench_run import group_args, run_groups  # noqa: E402
from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_wo import run_experts_wo  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402

# (preset, scheme, Ms, variants), the cells most likely to decide a pick first (~13-18 s a group before its timing).
# CK1 (dd53396: the multiply with the operand through shared memory at BLOCK_K 128): k256s3m won 5/5 at every cell
# timed, taken (5a57359). CK1b (8061049, each group decoded apart): DeepSeek-V3 M = 1 k256s3mu2 104.1 against the
# gemv 144.0, Mixtral M = 8 k128m 336.4 against k256s3m 348.8, taken (bd9908e). "pick" is now those; the session-28
# picks they replaced: "gemv1" / "gemv8" (DeepSeek-V3 M = 1 / 8), "k128" (Mixtral M = 8), "register", "tile".
# CK1c: --groups 0 1 2 (the cells still open: k128m at DeepSeek-V3 M = 64 / 8, Mixtral M = 1 / 64, the split at
# Mixtral M = 1); CK2: --groups 3 4 0 1 (the taken picks against what they replaced)
GROUPS = (("deepseek-v3", "mxfp4", (64,), ("register", "k128m")),
          ("mixtral-8x7b", "mxfp4", (1, 64), ("register", "tile", "k128m", "k256s3mu2")),
          ("deepseek-v3", "mxfp4", (8,), ("gemv8", "k128m")),
          ("deepseek-v3", "mxfp4", (1,), ("gemv1", "k256s3m")),
          ("mixtral-8x7b", "mxfp4", (8,), ("k128", "k256s3m")))


def _tile(rows: int, block_k: int, warps: int, stages: int) -> GemmTile:
    return GemmTile(rows, block_k, 1, warps, stages)


def _gemv(up_split: int, place: str) -> WordConfig:  # DeepSeek-V3's gemv pick (``triton_wo_word_winners``)
    return WordConfig(1, _tile(32, 128, 2, 1), _tile(32, 128, 2, 1), up_split=up_split, x_tile=True,
                      mxfp4_place=place)


# name -> (decode, config, the Ms it runs at or None: all); "...m" the multiply placement, the others session 28's;
# the mma tiles 32 rows in 1 warp ("kB": BLOCK_K B, "s3" 3 stages, "u2" the gate-up split in 2); "gemvN" DeepSeek-V3's
# gemv pick at M = N (session 28's placement); "register" / "tile" those decodes at the chooser's config. (CK1b's
# "k128r64m" 64 rows in 1 warp, "k256s3" and "gemv1m" / "gemv8m", the gemv with the multiply, lost: dropped.)
VARIANTS = {"k128": ("mma", WordConfig(16, _tile(32, 128, 1, 3), _tile(32, 128, 1, 3), mxfp4_place="shift"), None),
            "k128m": ("mma", WordConfig(16, _tile(32, 128, 1, 3), _tile(32, 128, 1, 3), mxfp4_place="mul"), None),
            "k256s3m": ("mma", WordConfig(16, _tile(32, 256, 1, 3), _tile(32, 256, 1, 3), mxfp4_place="mul"), None),
            "k256s3mu2": ("mma", WordConfig(16, _tile(32, 256, 1, 3), _tile(32, 256, 1, 3), up_split=2,
                                            mxfp4_place="mul"), (1,)),
            "gemv1": ("gemv", _gemv(4, "shift"), (1,)), "gemv8": ("gemv", _gemv(1, "shift"), (8,)),
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


def add_calls(cell, graphs, a13, a2, w13, w2, inputs, found, s, dev) -> None:
    """``dec8.add_calls`` (each variant against the twin, its graph), then each "...m" variant against its "shift"
    twin of the same tiles, bit for bit."""
    ADD_CALLS(cell, graphs, a13, a2, w13, w2, inputs, found, s, dev)
    c0 = inputs[0]
    for name, (decode, cfg) in found.items():
        if not isinstance(cfg, WordConfig) or cfg.mxfp4_place != "mul":
            continue
        twin = dataclasses.replace(cfg, mxfp4_place="shift")
        outs = [run_experts_wo(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, cell.scheme, config=k, decode=decode)
                for k in (cfg, twin)]
        same = torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
        differ = int((outs[0].view(torch.int16) != outs[1].view(torch.int16)).sum())
        dec8.check(f"{s.name} {cell.scheme} M={cell.m} {name} bits == shift", same, f"{differ} of {outs[0].numel()}"
                   " outputs differ")


QUANTIZED, ADD_CALLS = dec8.quantized, dec8.add_calls
dec8.variants, dec8.quantized, dec8.add_calls = variants, spread_quantized, add_calls


def main(argv=None) -> int:
    args = group_args("mx9", argv)
    if args.group is not None:
        return dec8.child(args, GROUPS, "mx9")
    cells = run_groups(__file__, "mx9", GROUPS, args, dec8.START, dec8.FAILED)
    return dec8.finish(os.path.join(args.out, "mx9.json"), cells)


if __name__ == "__main__":
    sys.exit(main())

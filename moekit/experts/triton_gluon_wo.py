"""Weight-only experts (int8_w8a16, int4_w4a16 with groups a multiple of 64, mxfp4) on warp-specialized Gluon GEMMs
for Hopper at large batches (issue #16's M >= 1024 target): the bf16 Gluon path's layout and combine (``triton_gluon``),
its GEMMs replaced by ``_kernels/gluon_gemm_wo.py`` (the stored tiles decoded to bf16 in shared memory one step
ahead of the wgmma).

    [align, gather x into 128-aligned expert segments] -> [gate-up GEMM on w13.q (int8: scales in its epilogue;
      int4 / mxfp4: each weight dequantized), silu(gate)*up] -> [down GEMM on w2.q] -> [weighted sum over k slots]

``run_experts_wo_gluon`` runs it (``triton_wo.run_experts_wo`` with ``decode="gluon"``, or without a decode where
``gluon_wo_takes``: the measured cells of GLUON_WO_CELLS, a device's own rows in GLUON_WO_CELLS_BY_DEVICE), each GEMM
in the variant measured for its shape and M (GLUON_WO_OPTIONS: ``GluonWoOptions`` split / fast / slots), through the
lean launch (``triton_gluon_wo_lean``: plan, descriptors, workspace and launches kept; the backend's repeated calls
from ``triton_quant_fast``'s entry) or, with ``lean=False``, the plain launches built per call; ``gluon_wo_unfit``
says why a call cannot take it.
``experts_gluon_wo_twin`` is its arithmetic in torch (the oracle of the tests and the device check).

Shapes: M tokens, k slots, E local experts, K hidden, N intermediate, R rows of the permuted buffer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from moekit.experts.configs import call_device_key
from moekit.experts.triton_gluon import gluon_layout, segment_twin
from moekit.experts.triton_gluon_launch import (
    BLOCK_M, MAX_REGISTERS, NUM_WARPS, SHARED_BYTES, UP_TILE, GluonTile, down_tile, gluon_descriptor, gluon_supported,
    launch_contiguous_sum, num_sms,
)
from moekit.experts.triton_wo import WoWeight, dequantize_wo
from moekit.triton_bind import COMPILE_OPTIONS

GLUON_WO_SCHEMES = {"int8_w8a16": 0, "int4_w4a16": 1, "mxfp4": 2}  # the kernel's SCHEME
PACK = {"int8_w8a16": 1, "int4_w4a16": 8, "mxfp4": 2}  # weights a stored element the kernel reads (int4: int32 words)


@dataclass(frozen=True)
class GluonWoOptions:
    """Session 28's variants of the weight-only Gluon GEMMs (both GEMMs of a call; off: the session-27 kernel).
    ``split``: two MMA partitions of one warpgroup each, each owning half of the tile's columns, decoding only the
    weight rows it multiplies, with barriers of its own (none across the two); ``fast``: the decode in inline PTX on
    int32 words (int4: no mask materialised a code; mxfp4: byte tables and bf16x2, read as words), the same values
    (``_kernels/gluon_wo_fast.py``; int8 unchanged); ``slots``: decoded slots, 3: the decode of step k + 1 overlaps
    two steps of MMAs in flight, not one (32 KB more SMEM a gate-up program: int8's gate-up ring then 3 stages).
    Session 29: ``swap``, the swapped GEMM (``_kernels/gluon_gemm_wo_swap.py``: the codes converted in wgmma's
    register-operand layout, the activations its shared-memory operand; no decoded slots, so the ring takes their
    SMEM: ``swap_stages``), int8 and int4, with ``fast`` (int8: its conversion in inline PTX, a K pair) and ``split``
    (a partition a warpgroup, each owning half of the tile's weight rows), no third slot."""

    split: bool = False
    fast: bool = False
    slots: int = 2
    swap: bool = False

    def __post_init__(self):
        if self.slots not in (2, 3):
            raise ValueError(f"slots={self.slots}: 2 or 3")
        if self.swap and self.slots != 2:
            raise ValueError(f"{self}: swap takes no third slot")


@dataclass(frozen=True)
class GluonWoGemms:
    """Each GEMM's variant: the gate-up GEMM's and the down GEMM's (checkpoint 1 of session 28: a third slot won on
    the down GEMM and lost on the gate-up one, splitting won on the 4-bit gate-up)."""

    up: GluonWoOptions = GluonWoOptions()
    down: GluonWoOptions = GluonWoOptions()


# (scheme, E, N, K) -> [lo, hi): the tokens for which a call without ``decode`` takes this path (``gluon_wo_takes``):
# around the M where the H200 measured it >= 3% faster than the chooser's pick in 5 of 5 rounds and its eager calls
# (``moekit bench``'s loop: 16 back to back, wall a call) no slower, every output PASS against the twin and the
# reference: the measured M up to twice it, down to the measured M below where that lost. Session 27 (wol7, checkpoint
# 1b at c67cbe0, graph µs, this path / the pick / bf16): Mixtral int8 1024 and DeepSeek-V3 4096; its plain launches
# cost ~1 ms of host a call, so no Qwen3 cell was taken (eager M = 1024 int8: 1307 µs against the tile decode's 458).
# Session 28 (wolean_device_check.py at 35115f8, raw/NVIDIA_H200-2026-12-04-35115f8-wolean-ck1.*; graph µs median of 5
# interleaved rounds, the lean launch / the pick; eager wall µs a call lean / pick): the lean launch
# (``triton_gluon_wo_lean``, 38-68 µs of host a call) takes Qwen3 and DeepSeek-V3 int8 2048. Lost (not taken):
# Qwen3 int4 1024 468.8 / tile 483.8 (2/5), int4 4096 1144 / scratch 1125, mxfp4 4096 1210 / scratch 1115, Mixtral
# int4 / mxfp4 1024 2613 / 2592, 2677 / 2559, DeepSeek-V3 int8 1024 5859 / tile 5099.
# Session 38 (benchmarks/wo38_device_check.py at d4f6eeb4, ONE H100 80GB, torch 2.11, Triton 3.6; graph µs, median of
# 5 settled rounds, PASS against the twin; the shape's GLUON_WO_OPTIONS / the pick, >= 3% faster in 5/5 rounds):
# Mixtral int4 M=128 / 256 / 384 / 512 764.4 / 763.3 / 771.1 / 1110.8 against tile m64 817.3, tile m128 1417.5 /
# 1410.6, scratch 2609.5; mxfp4 M=256 / 384 / 512 883.8 / 902.0 / 1294.0 against tile m128 1513.8 / 1524.2, scratch
# 2593.8 (M=128: 895.2 against 833.9, lost: the mma decode there, ``triton_wo_configs.MMA_CONFIGS``); int8 M=256 / 512
# 656.9 / 919.5 against tile m128 978.9 / 1515.1 (int8 M=128 not measured). Graph µs only: the lean launch's 38-68 µs
# of host a call lies well under these calls' GPU time. Not taken: DeepSeek-V3 int4 / int8 M=1024 5569.2 / 5568.8
# against tile m64 6036.3 / 6005.2 (5/5 each; the swapped GEMMs' options start at 4096 there, GLUON_WO_OPTIONS).
# Session 39 (the same check at 38ead07c, ONE H100 80GB, as above; raw/NVIDIA_H100-2026-12-06-38ead07-wo39r2a.*): the
# shape's swapped GEMMs at DeepSeek-V3 int4 M=1448 / 2048 5721.0 / 5984.6 against tile m64 6377.9 / tile m128 9347.3
# (the session-27 GEMMs 8335.8 / 8490.2), int8 M=1448 5512.6 against tile m64 6156.1 (session-27 GEMMs 6515.1); Mixtral
# int8 M=128 648.1 against tile m64 783.9 (session-27 GEMMs 719.2); 5/5 each. So DeepSeek-V3 int4 / int8 from 1024
# (measured there in session 38) with the swapped GEMMs, Mixtral int8 from 128. The second call (raw/
# NVIDIA_H100-2026-12-06-22a0d8b-wo39b.log, the H200's packaged tables under the H100's name): DeepSeek-V3 mxfp4 M=2048
# with the shape's GEMMs 7018.8 against tile m128n256 9858.6 (5/5; the session-27 GEMMs 8019.1); at M=1448 the path lost
# (6768.1 against tile m64 6192.0), so mxfp4 from 2048
GLUON_WO_CELLS: dict[tuple[str, int, int, int], tuple[int, int]] = {
    # Mixtral M=1024: 1913 / tile 2414 / 1333; M=2048 (session 31, the swapped GEMMs below): 3172.8 / tile 3833.1;
    # M=256 / 512: session 38, M=128: session 39 (above)
    ("int8_w8a16", 8, 14336, 4096): (128, 4096),
    # Qwen3 M=1024 / 2048 / 4096: 370.5 / 539.6 / 896.4 against tile 427.4 / 663.3 / 1100.2; eager 377 / 549 / 911
    # against 433 / 671 / 1109
    ("int8_w8a16", 128, 768, 2048): (1024, 8192),
    ("int4_w4a16", 128, 768, 2048): (2048, 4096),  # Qwen3 M=2048: 685.9 / scratch 857.4; eager 698 / 868
    # Qwen3 M=1024 / 2048: 494.9 / 725.4 against tile 525.3 / scratch 850.6; eager 500 / 734 against 531 / 863
    ("mxfp4", 128, 768, 2048): (1024, 4096),
    # DeepSeek-V3 M=2048: 6126 / tile 7916, eager 6366 / 7896; 4096 (session 27): 8972 / tile 12783 / 7353; M=1024 /
    # 1448: sessions 38 / 39 (above)
    ("int8_w8a16", 256, 2048, 7168): (1024, 8192),
    # DeepSeek-V3 M=4096: 11670 / tile 14848 (CK1: 12049 / 14565); M=1024 / 1448 / 2048: sessions 38 / 39 (above)
    ("int4_w4a16", 256, 2048, 7168): (1024, 8192),
    ("mxfp4", 256, 2048, 7168): (2048, 8192),  # DeepSeek-V3 M=4096: 11856 / tile 14878; M=2048: session 39 (above)
    # session 28 (wo8_device_check.py, checkpoint 1c at f83b663, graph µs: this path with GLUON_WO_OPTIONS' variant /
    # the pick / bf16; 5 of 5 rounds >= 3% faster than the pick; the session-27 kernel through the lean launch lost
    # here, above): the 4-bit Mixtral cells at M = 1024
    ("int4_w4a16", 8, 14336, 4096): (128, 2048),  # Mixtral M=1024: 2320 / scratch 2586 / 1349; M=128-512: session 38
    ("mxfp4", 8, 14336, 4096): (256, 2048),  # Mixtral M=1024: 2273 / scratch 2547 / 1349; M=256-512: session 38
}
# device key (``configs.device_key``) -> rows that replace GLUON_WO_CELLS' row of their shape on that device only,
# where that device measured otherwise than the rows above (which stay every device's default). The H100 (session 40,
# benchmarks/wo38_device_check.py at df634c8, ONE H100 80GB HBM3, torch 2.11, Triton 3.6, graph µs, median of 5
# settled rounds, every line PASS; raw/NVIDIA_H100-2026-12-06-df634c8-wo38-prefill.*): at Qwen3 M=4096 the
# session-27 GEMMs (GLUON_WO_OPTIONS has no row for these shapes) beat the route's scratch decode, int4 1161.6 against
# 1342.9 (x1.156, 5/5 rounds >= 3%), mxfp4 1210.2 against 1335.4 (x1.103, 5/5), where the H200 measured the opposite
# in session 28 (int4 1144 / scratch 1125, mxfp4 1210 / 1115): the scratch decode writes and re-reads a bf16 copy of
# every expert, at 3.0 TB/s on the H100 against the H200's 4.26. Graph µs only, as session 38's H100 rows: the lean
# launch's 38-68 µs of host a call lies well under 1.2 ms. Each row keeps the H200's range below 4096 (not measured
# on the H100) and adds 4096 up to twice it, the measured M's span.
GLUON_WO_CELLS_BY_DEVICE: dict[str, dict[tuple[str, int, int, int], tuple[int, int]]] = {
    "NVIDIA_H100_80GB_HBM3": {
        ("int4_w4a16", 128, 768, 2048): (2048, 8192),  # the H200's 2048..4095, the H100's 4096..8191
        ("mxfp4", 128, 768, 2048): (1024, 8192),  # the H200's 1024..4095, the H100's 4096..8191
    },
}


def gluon_wo_range(scheme: str, num_experts: int, n: int, k: int, device: str) -> tuple[int, int]:
    """[lo, hi): the tokens for which a call of this shape that names no decode takes this path on ``device`` (a
    ``configs.device_key``): GLUON_WO_CELLS_BY_DEVICE's row for the device where it has one, else GLUON_WO_CELLS',
    else (0, 0) (never)."""
    key = (scheme, num_experts, n, k)
    row = GLUON_WO_CELLS_BY_DEVICE.get(device, {}).get(key)
    return row if row is not None else GLUON_WO_CELLS.get(key, (0, 0))


@dataclass(frozen=True)
class MeasuredGemms:
    """The GEMMs' variants a shape takes for ``lo <= M < hi`` (the measured M up to twice it)."""

    lo: int
    hi: int
    gemms: GluonWoGemms


# (scheme, E, N, K) -> the GEMMs' variants a call of that shape and M takes when it names none (``wo_options``): where
# the H200 measured them >= 3% faster than the session-27 kernel in 5 of 5 rounds, every output PASS against the twin
# (benchmarks/wo8_device_check.py, session 28 checkpoint 1c at f83b663, graph µs of the whole call: the variant / the
# session-27 kernel / bf16; the best median taken, the simplest where two were within 1%); else GluonWoGemms() (the
# session-27 kernel).
_FAST = GluonWoOptions(fast=True)
_SPLIT_FAST = GluonWoOptions(split=True, fast=True)
_SWAP = GluonWoOptions(swap=True, fast=True, split=True)  # session 29's swapped GEMM, a partition a warpgroup
_SWAP_INT4 = GluonWoOptions(swap=True, split=True)  # the same for int4 (its decode is PTX already: no ``fast``)
GLUON_WO_OPTIONS: dict[tuple[str, int, int, int], MeasuredGemms] = {
    # session 29 (wo4k_device_check.py, checkpoint 1b at 9314a02, graph µs of the whole call: the swapped GEMMs with
    # the PTX conversion, split / the pick of then / bf16; 5 of 5 rounds >= 3% faster, every call PASS and bit-equal
    # to the session-27 kernel's; eager wall µs a call 8927 / 9964, 847 / 1001, 1696 / 2083). DeepSeek-V3 M=4096:
    # 8585 / 11162 (base|slots3, session 28's pick here) / 8439
    # Session 39 (GLUON_WO_CELLS' comment): from M=1024, 1.08-1.18x the session-27 GEMMs at 1448
    ("int8_w8a16", 256, 2048, 7168): MeasuredGemms(1024, 8192, GluonWoGemms(_SWAP, _SWAP)),
    # Qwen3 M=4096: 834.0 / 1016.6 / 689.7; Mixtral M=1024: 1652.5 / 2179.3 / 1381.8. Session 31 (wo4k_device_check.py
    # on merged main 814ebdc, H200, Triton 3.6; the swapped GEMMs / the pick of then / bf16, 5/5, PASS; eager wall µs
    # a call 344 / 383, 506 / 590, 3090 / 3819): Qwen3 M=1024 320.3 / 367.8 / 363.7, M=2048 471.3 / 547.5 / 439.8,
    # Mixtral M=2048 3172.8 / 3833.1 / 2320.4
    ("int8_w8a16", 128, 768, 2048): MeasuredGemms(1024, 8192, GluonWoGemms(_SWAP, _SWAP)),
    # M=256 / 512: session 38; M=128: session 39 (648.1 against the session-27 GEMMs' 719.2)
    ("int8_w8a16", 8, 14336, 4096): MeasuredGemms(128, 4096, GluonWoGemms(_SWAP, _SWAP)),
    # DeepSeek-V3 M=4096: int4 11012 / 12078 / 8078, mxfp4 10356 / 11974 (split+fast|fast+slots3 10263). Session 31
    # (as above): int4 swapped, split 9795.4 / 12873.1 (the fast GEMMs) / 8249.1; eager 10202 / 10989
    # Session 39 (GLUON_WO_CELLS' comment): from M=1024; M=1448 / 2048 5721.0 / 5984.6 against the session-27 GEMMs'
    # 8335.8 / 8490.2
    ("int4_w4a16", 256, 2048, 7168): MeasuredGemms(1024, 8192, GluonWoGemms(_SWAP_INT4, _SWAP_INT4)),
    ("mxfp4", 256, 2048, 7168): MeasuredGemms(2048, 8192, GluonWoGemms(_FAST, _FAST)),  # M=2048: session 39
    # Mixtral M=1024: int4 2320 / 2787 / 1349 (fast alone 2410); mxfp4 2273 / 2761 (fast alone 2314). Session 31 (as
    # above): int4 swapped, split 2002.6 / 2590.2 (split + fast) / 1330.5; eager 2095 / 2483
    # Session 38 (GLUON_WO_CELLS' comment): these options at M=128-512 (int4) / 256-512 (mxfp4), 1.27-1.55x faster than
    # the session-27 GEMMs there (int4 M=256 763.3 against 1113.8, mxfp4 883.8 against 1053.9)
    ("int4_w4a16", 8, 14336, 4096): MeasuredGemms(128, 2048, GluonWoGemms(_SWAP_INT4, _SWAP_INT4)),
    ("mxfp4", 8, 14336, 4096): MeasuredGemms(256, 2048, GluonWoGemms(_SPLIT_FAST, _SPLIT_FAST)),
}


def wo_options(w13, w2, scheme: str, num_tokens: int) -> GluonWoGemms:
    """The measured variants of this call's shape and M (GLUON_WO_OPTIONS), else the session-27 kernel's."""
    got = GLUON_WO_OPTIONS.get((scheme, w13.q.shape[0], w13.q.shape[1] // 2, w2.q.shape[1]))
    return got.gemms if got is not None and got.lo <= num_tokens < got.hi else GluonWoGemms()


# The swapped GEMM's ring (BK 64, [128, 128] tiles): no decoded slots, so as many stages as fit beside the 32 KB output
# tile, at most 8: int8 6 gate-up (16 KB activations + 2 x 8 KB codes), 8 down; int4 8 and 8 (4 KB code tiles)
SWAP_MAX_STAGES = 8


def swap_stages(scheme: str, gated: bool) -> int:
    """The swapped GEMM's stages: its ring's stages (activations [128, 64] bf16, one or two code tiles [128, 64 /
    weights a byte]) beside the [128, 128] bf16 output tile and its barriers, within sm_90's SMEM."""
    stage = 2 * BLOCK_M * 64 + (2 if gated else 1) * 128 * 64 // (1 if scheme == "int8_w8a16" else 2)
    return min(SWAP_MAX_STAGES, (SHARED_BYTES - 2 * BLOCK_M * 128 - 1024) // stage)


@dataclass(frozen=True)
class WoGemmLaunch:
    """How one GEMM of a variant launches: its kernel, stored tile's dtype and block, output block, warps, stages and
    the kernel's variant constexprs."""

    words: bool  # q read as int32 words of 8 codes (int4; mxfp4 with fast)
    q_block: tuple  # (BN, BK / weights a stored element)
    c_block_n: int  # the output block's columns (split: BN / 2, a partition's)
    num_warps: int  # the kernel's (split: one warpgroup)
    stages: int  # the ring's (int8's gate-up with a third slot: one stage fewer; swap: ``swap_stages``)
    fast: bool  # the FAST constexpr (int8: the swapped GEMM's only)
    swap: bool  # the swapped GEMM (``gluon_gemm_wo_swap``), which takes no SLOTS

    def kernel(self):
        """The Gluon kernel this GEMM launches (imported on use: Gluon may be missing)."""
        if self.swap:
            return importlib.import_module("moekit.experts._kernels.gluon_gemm_wo_swap").grouped_gemm_wo_swap_kernel
        return importlib.import_module("moekit.experts._kernels.gluon_gemm_wo").grouped_gemm_wo_kernel

    def variant(self, options: GluonWoOptions) -> dict:
        """The kernel's variant constexprs for ``options`` (the swapped GEMM takes no SLOTS)."""
        return dict(SPLIT=options.split, FAST=self.fast, **({} if self.swap else dict(SLOTS=options.slots)))


def wo_gemm_launch(scheme: str, tile: GluonTile, gated: bool, options: GluonWoOptions) -> WoGemmLaunch:
    """``launch_gemm_wo``'s and the lean plan's shared choices for ``options`` on this GEMM."""
    halves = 2 if options.split else 1
    if options.swap:  # codes as bytes (int4: two a byte), its own ring
        if scheme == "mxfp4" or (tile.block_n, tile.block_k) != (128, 64) or (options.fast and scheme != "int8_w8a16"):
            raise ValueError(f"swap takes int8_w8a16 (fast: its PTX conversion) or int4_w4a16 on [128, 64] tiles, "
                             f"not {scheme} with {options} on {tile}")
        return WoGemmLaunch(False, (128, 64 // (1 if scheme == "int8_w8a16" else 2)), 128 // halves,
                            NUM_WARPS // halves, swap_stages(scheme, gated), options.fast, True)
    fast = options.fast and scheme != "int8_w8a16"
    words = scheme == "int4_w4a16" or fast
    stages = min(tile.stages, 3) if options.slots == 3 and gated and scheme == "int8_w8a16" else tile.stages
    return WoGemmLaunch(words, (tile.block_n, tile.block_k // (8 if words else PACK[scheme])), tile.block_n // halves,
                        NUM_WARPS // halves, stages, fast, False)


def gluon_wo_takes(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, scheme: str, activation: str) -> bool:
    """Whether a call that names no decode, config or split takes the weight-only Gluon path: its shape in
    GLUON_WO_CELLS with M in its range (``gluon_wo_range``: the device's own row where it has one), a Hopper with
    Gluon, and a call it fits (``gluon_wo_unfit``)."""
    lo, hi = gluon_wo_range(scheme, w13.q.shape[0], w13.q.shape[1] // 2, x.shape[1], call_device_key(x.device))
    return (lo <= x.shape[0] < hi and gluon_supported(x.device)
            and gluon_wo_unfit(x, w13, w2, scheme, activation) is None)


def gluon_wo_unfit(x: torch.Tensor, w13, w2, scheme: str, activation: str,
                   block_k: int = UP_TILE.block_k) -> str | None:
    """Why the weight-only Gluon path cannot take this call (None when it can): int8_w8a16, int4_w4a16 (zero points,
    groups a multiple of ``block_k``: one group a step) or mxfp4, bf16 x, plain silu, contiguous q, N and K multiples
    of 128.
    ``w13`` / ``w2``: anything with ``q``, ``scale``, ``zero``, ``group_size`` (WeightArgs, WoWeight)."""
    if scheme not in GLUON_WO_SCHEMES:
        return f"scheme {scheme!r} (the Gluon weight-only GEMMs take {tuple(GLUON_WO_SCHEMES)})"
    if scheme == "int4_w4a16" and (w13.group_size % block_k or w2.group_size % block_k or w2.zero is None):
        return f"int4 groups {w13.group_size} / {w2.group_size} (multiples of {block_k}, with zero points only)"
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return f"x {x.dtype} (bf16 with unit-stride rows only)"
    if activation != "silu":
        return f"activation={activation!r} (silu only)"
    if not (w13.q.is_contiguous() and w2.q.is_contiguous()):
        return "strided w13.q or w2.q (TMA reads them as 2-D)"
    hidden, inter = w2.q.shape[1], w13.q.shape[1] // 2
    if inter % 128 or hidden % 128:
        return f"w2 [E, K={hidden}, N={inter}]: N and K must be multiples of 128"
    return None


def scale_strides(w) -> tuple:
    """(expert, row, group) strides of the scale and of the zero (int8: scale [E, R], no group; no zero: 0s)."""
    s = w.scale.stride() if w.scale.dim() == 3 else (*w.scale.stride(), 0)
    zero = w.zero is not None and w.zero is not w.scale and w.zero.dim() == 3  # WeightArgs: zero = scale without one
    return (*s, *(w.zero.stride() if zero else (0, 0, 0)))


def launch_gemm_wo(a: torch.Tensor, w, out: torch.Tensor, block_experts: torch.Tensor, rows_used: torch.Tensor,
                   tile: GluonTile, gated: bool, scheme: str, gate_offset: int = 0,
                   options: GluonWoOptions = GluonWoOptions()) -> None:
    """out [T, C] = act(a [T, R] @ W[e]^T) per row block, W the weight ``w`` (q contiguous [E, w_rows, R / PACK])
    stores: int8 q * scale, int4 (q - zero) * scale per group, mxfp4 e2m1 * 2^(e8m0 - 127)."""
    num_experts, w_rows, stored = w.q.shape
    how = wo_gemm_launch(scheme, tile, gated, options)
    q = w.q.view(num_experts * w_rows, stored)
    if how.words:  # read as int32 words of 8 codes (``gluon_gemm_wo._decode_tile``)
        q = q.view(torch.int32)
    a_desc = gluon_descriptor(a, [BLOCK_M, tile.block_k])
    q_desc = gluon_descriptor(q, list(how.q_block))
    c_desc = gluon_descriptor(out, [BLOCK_M, how.c_block_n])
    num_col_blocks = out.shape[1] // tile.block_n
    grid = (max(1, min(num_sms(a.device), -(-a.shape[0] // BLOCK_M) * num_col_blocks)),)
    zero = w.scale if w.zero is None else w.zero  # int8: never read
    how.kernel()[grid](a_desc, q_desc, c_desc, block_experts, rows_used, w.scale, zero, *scale_strides(w), a.shape[1],
                       num_col_blocks, W_ROWS=w_rows, GATE_OFFSET=gate_offset, GATED=gated, STAGES=how.stages,
                       GROUP_M=tile.group_m, SCHEME=GLUON_WO_SCHEMES[scheme], GROUP=max(w.group_size, 1),
                       num_warps=how.num_warps, maxnreg=MAX_REGISTERS, **how.variant(options), **COMPILE_OPTIONS)


def run_experts_wo_gluon(x: torch.Tensor, w13, w2, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         expert_map: torch.Tensor | None, scheme: str, activation: str = "silu",
                         up_tile: GluonTile = UP_TILE, down: GluonTile | None = None, lean: bool = True,
                         options: GluonWoOptions | GluonWoGemms | None = None) -> torch.Tensor:
    """The path's launches (arguments checked by the caller); raises where the device or the call does not fit.
    ``up_tile`` / ``down``: the GEMMs' tiles (None: the bf16 route's ``down_tile`` for N, without a tail). ``lean``:
    through ``triton_gluon_wo_lean`` (plan, descriptors, workspace and launches kept); off: the plain launches, each
    built per call (the same kernels and arguments: equal outputs). ``options``: the GEMMs' variant, both GEMMs' or
    each one's (None: ``wo_options``, those measured for this shape and M)."""
    if not gluon_supported(x.device):
        raise RuntimeError(f"decode='gluon' needs a Hopper GPU and a Triton with Gluon; x is on {x.device}")
    reason = gluon_wo_unfit(x, w13, w2, scheme, activation, min(up_tile.block_k, (down or up_tile).block_k))
    if reason is not None:
        raise ValueError(f"decode='gluon' cannot take this call: {reason}")
    num_experts, hidden, inter = w2.q.shape[0], x.shape[1], w13.q.shape[1] // 2
    down = down_tile(inter) if down is None else down
    options = wo_options(w13, w2, scheme, x.shape[0]) if options is None else options
    if isinstance(options, GluonWoOptions):
        options = GluonWoGemms(options, options)
    if lean:
        from moekit.experts.triton_gluon_wo_lean import run_wo_lean

        return run_wo_lean(x, w13, w2, topk_ids.contiguous(), topk_weights.contiguous(),
                           None if expert_map is None else expert_map.contiguous(), scheme, up_tile, down, options)
    layout = gluon_layout(x, topk_ids, num_experts, expert_map)
    rows = layout.sorted_ids.numel()
    h = x.new_empty(rows, inter)  # [R, N]; rows past rows_used are never written nor read
    launch_gemm_wo(layout.x_perm, w13, h, layout.block_experts, layout.rows_used, up_tile, True, scheme, inter,
                   options.up)
    y = x.new_empty(rows, hidden)  # [R, K]
    launch_gemm_wo(h, w2, y, layout.block_experts, layout.rows_used, down, False, scheme, options=options.down)
    out = torch.empty_like(x)
    launch_contiguous_sum(y, layout.src_to_dst, topk_weights.contiguous(), out)
    return out


def experts_gluon_wo_twin(x: torch.Tensor, w13: WoWeight, w2: WoWeight, topk_ids: torch.Tensor,
                          topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The path's arithmetic in torch on the same layout: per expert segment float32 products, int8: with the codes,
    the scales on the products' columns; int4 / mxfp4: with each weight dequantized and rounded to bf16 (the
    decode's one rounding); h and y rounded to x's dtype like the kernels, float32 combine. Syncs."""
    num_experts, hidden, inter = w2.q.shape[0], x.shape[1], w13.q.shape[1] // 2
    return segment_twin(x, topk_ids, topk_weights, expert_map, num_experts, inter,
                        lambda e: _weight_t(w13, e, hidden), lambda e: _weight_t(w2, e, inter))


def _weight_t(w: WoWeight, e: int, cols: int) -> torch.Tensor:
    """Expert e's weight as the twin multiplies it, transposed [C, R]: int8 the codes times their rows' scales (the
    kernel scales the products: equal up to float32 rounding), int4 / mxfp4 dequantized and rounded to bf16."""
    if w.scheme == "int8_w8a16":
        return w.q[e].float().t() * w.scale[e][None, :].float()  # == (x @ q^T) * scale up to float32 rounding
    return dequantize_wo(w, cols, e).to(torch.bfloat16).float().t()

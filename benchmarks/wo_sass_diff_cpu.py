"""The Triton down GEMMs (weight-only tile / register / mma / gemv decodes, bf16 and fp8) and the weight-only
gate-ups (tile, register, mma, gemv) in sm_90 SASS, compiled on a machine without a GPU, for a change that must leave
their machine code alone (session 30: the down GEMMs' routed-weight store moved into ``_kernels/down_store``; session
31: mxfp4's "shift" placement removed from the mma decode; session 33: ``gemm.program_tile``, the PTX text of
``_kernels/e2m1_ptx``): ``--dump`` the tree before and after it, on each Triton, then
``gluon_sass_diff_cpu.py --compare`` (identical, parameter offsets only, or the instructions that changed).

    PYTHONPATH=/tmp/before-tree python3 benchmarks/wo_sass_diff_cpu.py --dump /tmp/wo-sass-before   (Triton 3.9)
    PYTHONPATH=$PWD python3 benchmarks/wo_sass_diff_cpu.py --dump /tmp/wo-sass-after
    PYTHONPATH=/tmp/f8pre-site:$PWD python3 benchmarks/wo_sass_diff_cpu.py --dump ...                (Triton 3.6)
    python3 benchmarks/gluon_sass_diff_cpu.py --compare /tmp/wo-sass-before /tmp/wo-sass-after

Cases: each kernel at the tiles its tuned files and heuristics launch (mma 32 x 256 on one warp, register 128 x 128,
gemv 64-column 16-word rows, bf16 32 x 256, fp8 64 x 128; prefill: 64- to 256-row tiles), each scheme, and the
constexprs that reach the moved code: KSUM with an expert map, SPLIT > 1, the sorted (not NAIVE) rows, SUM_AFTER, a
bias, PDL on. The compile is ``wo_reg_sass_cpu``'s (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``, its
``tt.divisibility`` hints); a constexpr a case does not name takes the kernel's default. Line info stays on, as in a
launch: ptxas schedules around the labels that mark the inlined functions' debug scopes, so moving code into a helper
can change the SASS although the PTX instructions are the same (session 30: a helper for the down kernels' row masks
and KSUM arrivals changed tile / register int4 on Triton 3.9, bf16 / fp8 / tile int4 KSUM on 3.6; with
``TRITON_DISABLE_LINE_INFO=1`` all came out identical, so it was not taken). Session 49 again, two helpers for the
weight-only downs' repeated prologue: w2's row pointers (``offs_out`` .. ``z_rows``; tile, register, gemv) changed
tile int4 / int8 and register int4 / int8 on 3.9 and tile int4 KSUM on 3.6 (gemv's 4 identical on both); the whole
prologue after ``program_tile`` (masks, KSUM arrivals, row pointers; tile, register) tile int4 and register int8 on
3.9, tile int4 KSUM on 3.6; and ``gemm.down_kernel`` / ``gemm_fp8.down_fp8_kernel``'s masks, arrivals and columns
in one helper: 10 / 10 identical on 3.9, bf16, fp8 and fp8_after_sorted scheduled otherwise on 3.6. None taken.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# b13_ptr / b2_ptr None: the weight-only tile and register kernels without biases (session 39's pointers; a kernel
# without the parameter drops it), so a tree before them and one after compile the same variants
BASE = dict(BLOCK_M=16, GROUP_M=1, NAIVE=True, UPCAST=False, PDL=True, SPLIT=1, b13_ptr=None, b2_ptr=None)
KSUM = dict(KSUM=True, TOPK_PAD=8, HAS_MAP=True, SUM_ROWS=4, ZERO_T=16)  # ``triton_plan.ksum_constexprs``, k = 8
POINTERS = {"x_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "weights_ptr": "*fp32", "out_ptr": "*bf16",
            "q_ptr": "*u8", "z_ptr": "*u8", "b2_ptr": "*bf16", "w2_ptr": "*bf16", "hq_ptr": "*fp8e4nv",
            "hs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"} | {n: "*i32" for n in (
                "ids_ptr", "sorted_ids_ptr", "expert_ids_ptr", "num_padded_ptr", "counters_ptr", "map_ptr")}


@dataclass
class Case:
    module: str  # under moekit.experts._kernels
    kernel: str
    const: dict
    num_warps: int
    num_stages: int
    pointers: dict = field(default_factory=dict)  # beyond POINTERS (a scheme's q / scale types, fp32 partials)


def _scheme(scheme: int) -> dict:
    """The pointer types of a scheme's q / scale (int8 q int8, scale fp32; int4 scale fp32; mxfp4 scale e8m0)."""
    return {"q_ptr": "*i8" if scheme == 0 else "*u8", "s_ptr": "*u8" if scheme == 2 else "*fp32"}


def wo_cases() -> dict[str, Case]:
    """The weight-only down kernels: tile, register and mma decodes (int8 / int4 / mxfp4), the gemv (int4 / mxfp4)."""
    from moekit.experts.triton_wo_mma import operand_pairs

    group = {0: 4096, 1: 128, 2: 32}  # int8: the whole row (N), a constexpr of its launch
    cases = {}
    for s, name in enumerate(("int8", "int4", "mxfp4")):
        tile = BASE | dict(BLOCK_N=64, BLOCK_K=128, SPAN=min(128, group[s]), GROUP=group[s], SCHEME=s)
        cases[f"tile_{name}"] = Case("gemm_wo", "down_wo_kernel", tile, 4, 3, _scheme(s))
        reg = BASE | dict(BLOCK_N=128, BLOCK_K=128, SPAN=min(128, group[s]), GROUP=group[s], SCHEME=s, ASM=True)
        cases[f"reg_{name}"] = Case("gemm_wo_reg", "down_wo_reg_kernel", reg, 4, 4, _scheme(s))
        mma = BASE | dict(BLOCK_N=32, BLOCK_K=256, SPAN=min(256, group[s]), GROUP=group[s], SCHEME=s, ASM=True,
                          SCALE_WORD=s == 2, PAIRS=operand_pairs(), PER=4 if s == 0 else 8)
        cases[f"mma_{name}"] = Case("gemm_wo_mma", "down_wo_mma_kernel", mma, 1, 3, _scheme(s))
    cases["tile_int4_ahead_sorted"] = Case("gemm_wo", "down_wo_kernel", cases["tile_int4"].const | dict(
        AHEAD=True, NAIVE=False), 4, 3, _scheme(1))
    cases["tile_int4_ksum"] = Case("gemm_wo", "down_wo_kernel", cases["tile_int4"].const | KSUM, 4, 3, _scheme(1))
    cases["tile_mxfp4_split"] = Case("gemm_wo", "down_wo_kernel", cases["tile_mxfp4"].const | dict(SPLIT=4), 4, 3,
                                     _scheme(2) | {"y_ptr": "*fp32"})
    cases["reg_int4_swap_ksum"] = Case("gemm_wo_reg", "down_wo_reg_kernel", cases["reg_int4"].const | KSUM | dict(
        SWAP_AB=True), 4, 4, _scheme(1))
    cases["reg_mxfp4_split_sorted"] = Case("gemm_wo_reg", "down_wo_reg_kernel", cases["reg_mxfp4"].const | dict(
        SPLIT=2, NAIVE=False), 4, 4, _scheme(2) | {"y_ptr": "*fp32"})
    cases["mma_int8_ksum"] = Case("gemm_wo_mma", "down_wo_mma_kernel", cases["mma_int8"].const | KSUM, 1, 3, _scheme(0))
    cases["mma_mxfp4_128_split"] = Case("gemm_wo_mma", "down_wo_mma_kernel", cases["mma_mxfp4"].const | dict(
        BLOCK_K=128, SPAN=32, SPLIT=2, NAIVE=False), 1, 3, _scheme(2) | {"y_ptr": "*fp32"})
    for s, name in ((1, "int4"), (2, "mxfp4")):
        gemv = BASE | dict(BLOCK_M=1, BLOCK_N=64, BKW=16, PER=8, GROUP=group[s], SCHEME=s, ASM=True)
        cases[f"gemv_{name}"] = Case("gemm_wo_gemv", "down_wo_gemv_kernel", gemv, 2, 1, _scheme(s))
    cases["gemv_int4_rows2_ksum"] = Case("gemm_wo_gemv", "down_wo_gemv_kernel", cases["gemv_int4"].const | KSUM | dict(
        BLOCK_M=2, NAIVE=False), 2, 1, _scheme(1))
    cases["gemv_mxfp4_fold_xtile"] = Case("gemm_wo_gemv", "down_wo_gemv_kernel", cases["gemv_mxfp4"].const | dict(
        UP_SPLIT=2, ACT=0, ROUND=1, AHEAD=2, XTILE=True, SPLIT=2), 2, 1,
        _scheme(2) | {"h_ptr": "*fp32", "y_ptr": "*fp32"})
    return cases


def gate_up_cases() -> dict[str, Case]:
    """The word decodes' gate-ups at the tiles their defaults launch: the mma's both sides a program (int8 / mxfp4
    tuned 32 x 256, mxfp4 Mixtral M = 8 32 x 128, int4's heuristic 32 x 128; mxfp4 split in 2 along K, the float32
    partials: ``MMA_UP_SPLITS``), its gate and up rows apart (int4 ``MMA_HALVES``: 32 x 128 on one warp, 64 x 128 on
    two), the gemv's (2-row blocks, 16 weight rows of 16 words; DeepSeek-V3's 32-row x_tile split in 4,
    ``triton_wo_word_winners``), and the split_glu launch that activates their float32 partials."""
    from moekit.experts.triton_wo_mma import operand_pairs

    group, cases = {0: 7168, 1: 128, 2: 32}, {}
    fp32 = {"h_ptr": "*fp32", "p_ptr": "*fp32"}
    for s, name, block_k in ((0, "int8", 256), (1, "int4", 128), (2, "mxfp4", 256), (2, "mxfp4", 128)):
        mma = BASE | dict(BLOCK_N=32, BLOCK_K=block_k, SPAN=min(block_k, group[s]), GROUP=group[s], SCHEME=s, ACT=0,
                          ASM=True, SCALE_WORD=s == 2, PAIRS=operand_pairs(), PER=4 if s == 0 else 8)
        cases[f"up_mma_{name}_{block_k}"] = Case("gemm_wo_mma", "gate_up_wo_mma_kernel", mma, 1, 3, _scheme(s))
    cases["up_mma_mxfp4_256_split"] = Case("gemm_wo_mma", "gate_up_wo_mma_kernel", cases["up_mma_mxfp4_256"].const
                                           | dict(SPLIT=2), 1, 3, _scheme(2) | fp32)
    halves = cases["up_mma_int4_128"].const
    cases["up_mma_int4_halves"] = Case("gemm_wo_mma", "gate_up_halves_wo_mma_kernel", halves, 1, 3, _scheme(1) | fp32)
    cases["up_mma_int4_halves_64w2"] = Case("gemm_wo_mma", "gate_up_halves_wo_mma_kernel", halves | dict(
        BLOCK_N=64), 2, 3, _scheme(1) | fp32)
    for s, name in ((1, "int4"), (2, "mxfp4")):
        gemv = BASE | dict(BLOCK_M=2, BLOCK_N=16, BKW=16, PER=8, GROUP=group[s], SCHEME=s, ACT=0, ASM=True)
        cases[f"up_gemv_{name}"] = Case("gemm_wo_gemv", "gate_up_wo_gemv_kernel", gemv, 1, 1, _scheme(s))
    cases["up_gemv_mxfp4_xtile_split"] = Case("gemm_wo_gemv", "gate_up_wo_gemv_kernel", cases["up_gemv_mxfp4"].const
                                              | dict(BLOCK_M=1, BLOCK_N=32, SPLIT=4, XTILE=True), 2, 1,
                                              _scheme(2) | fp32)
    cases["up_glu_split"] = Case("wo_split", "split_glu_kernel", dict(SPLIT=2, BLOCK_N=1024, ACT=0, PDL=True), 4, 1,
                                 fp32)  # the split gate-ups' activation launch (``triton_wo_gemv.glu_launch``)
    return cases


def tile_reg_up_cases() -> dict[str, Case]:
    """The tile and register decodes' gate-ups (session 33: their prologue's ``gemm.program_tile``): decode tiles
    (``wo_heuristic_config``'s 16-row 64 x 128, 4 warps, 4 stages; the register int4 swap-AB), the winners' prefill
    tiles (``triton_wo_winners``: 64-row 64 x 64; 128-row 128 x 64 on 8 warps with AHEAD, sorted rows, GROUP_M 8)."""
    group, cases = {0: 4096, 1: 128, 2: 32}, {}
    for s, name in enumerate(("int8", "int4", "mxfp4")):
        tile = BASE | dict(BLOCK_N=64, BLOCK_K=128, SPAN=min(128, group[s]), GROUP=group[s], SCHEME=s, ACT=0)
        cases[f"up_tile_{name}"] = Case("gemm_wo", "gate_up_wo_kernel", tile, 4, 4, _scheme(s))
        cases[f"up_reg_{name}"] = Case("gemm_wo_reg", "gate_up_wo_reg_kernel", tile | dict(ASM=True), 4, 4, _scheme(s))
    cases["up_reg_int4_swap"] = Case("gemm_wo_reg", "gate_up_wo_reg_kernel", cases["up_reg_int4"].const | dict(
        SWAP_AB=True), 4, 4, _scheme(1))
    cases["up_tile_int8_m1024"] = Case("gemm_wo", "gate_up_wo_kernel", cases["up_tile_int8"].const | dict(
        BLOCK_M=64, BLOCK_K=64, SPAN=64), 4, 4, _scheme(0))
    cases["up_tile_mxfp4_m1024_ahead"] = Case("gemm_wo", "gate_up_wo_kernel", cases["up_tile_mxfp4"].const | dict(
        BLOCK_M=128, BLOCK_K=64, SPAN=32, GROUP_M=8, NAIVE=False, AHEAD=True), 8, 3, _scheme(2))
    return cases


def dense_cases() -> dict[str, Case]:
    """The bf16 (``gemm.down_kernel``: pointers and a TMA descriptor, a bias, KSUM, SUM_AFTER) and fp8 down GEMMs;
    the bf16 gate-up (``gemm.gate_up_kernel``, plain silu: session 48's LIMIT_AFTER beside LIMIT, a tree before it
    drops the name) on pointers at the tiny-batch tile and through TMA at a prefill tile on sorted rows."""
    bf16 = BASE | dict(BLOCK_N=32, BLOCK_K=256, PRECISION="tf32", W_DESC=False, b2_ptr=None)
    up = BASE | dict(BLOCK_N=64, BLOCK_K=64, ACT=0, GATED=True, INTERLEAVED=False, PAIRS=False, ALPHA=1.0, LIMIT=None,
                     LIMIT_AFTER=False, UP_SHIFT=0.0, PRECISION="tf32", W_DESC=False, w13_up_ptr=None)
    fp8 = BASE | dict(GROUP_N=128, BLOCK_N=64, BLOCK_K=128, EMULATE=False, H_FP32=False, W_DESC=False,
                      ONE_BLOCK=True, AHEAD=True, SWAP_AB=False)
    after = dict(SUM_AFTER=True, SUM_T=4, SUM_K=256, TOPK_PAD=8, HAS_MAP=True)
    return {
        "up_bf16": Case("gemm", "gate_up_kernel", up, 4, 4, {"w13_ptr": "*bf16"}),
        "up_bf16_desc_sorted": Case("gemm", "gate_up_kernel", up | dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, NAIVE=False,
                                                                        W_DESC=True), 8, 3,
                                    {"w13_ptr": _descriptor([8 * 2 * 1536, 2048], [128, 64], "bf16")}),
        "bf16": Case("gemm", "down_kernel", bf16, 4, 3),
        "bf16_desc_ksum": Case("gemm", "down_kernel", bf16 | KSUM | dict(W_DESC=True), 4, 3,
                               {"w2_ptr": _descriptor([8 * 4096, 14336], [32, 256], "bf16")}),
        "bf16_bias_after_sorted": Case("gemm", "down_kernel", {k: v for k, v in bf16.items() if k != "b2_ptr"}
                                       | after | dict(NAIVE=False), 4, 3),
        "fp32_ieee": Case("gemm", "down_kernel", bf16 | dict(PRECISION="ieee", BLOCK_K=64), 4, 3,
                          {"h_ptr": "*fp32", "w2_ptr": "*fp32", "y_ptr": "*fp32"}),
        "fp8": Case("gemm_fp8", "down_fp8_kernel", fp8, 4, 5),
        "fp8_desc_swap_ksum": Case("gemm_fp8", "down_fp8_kernel", fp8 | KSUM | dict(W_DESC=True, SWAP_AB=True), 4, 5,
                                   {"w_ptr": _descriptor([8 * 4096, 14336], [64, 128], "fp8e4nv")}),
        "fp8_after_sorted": Case("gemm_fp8", "down_fp8_kernel", fp8 | after | dict(NAIVE=False, BLOCK_N=128,
                                                                                  GROUP_M=8), 4, 4),
    }


def prefill_cases() -> dict[str, Case]:
    """Taller tiles: the tile decode's winners / heuristic at Mixtral M = 64, 1024, 4096 (``wo_config``), the bf16
    and fp8 tuned files' M >= 128 down tiles (sorted rows, GROUP_M 8, TMA descriptors)."""
    tile = BASE | dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPAN=64, GROUP=4096, GROUP_M=8, SCHEME=0, NAIVE=False)
    bf16 = dict(tile, BLOCK_N=128, BLOCK_K=64, PRECISION="tf32", W_DESC=True, b2_ptr=None)
    fp8 = dict(tile, GROUP_N=128, BLOCK_M=64, BLOCK_K=128, EMULATE=False, H_FP32=False, W_DESC=True, ONE_BLOCK=True,
               AHEAD=True, SWAP_AB=False)
    return {
        "tile_int8_m1024": Case("gemm_wo", "down_wo_kernel", tile, 8, 3, _scheme(0)),
        "tile_int4_m4096": Case("gemm_wo", "down_wo_kernel", tile | dict(BLOCK_M=256, BLOCK_N=64, GROUP=128, SCHEME=1),
                                8, 4, _scheme(1)),
        "tile_mxfp4_m1024": Case("gemm_wo", "down_wo_kernel", tile | dict(BLOCK_N=256, SPAN=32, GROUP=32,
                                                                          SCHEME=2), 8, 3, _scheme(2)),
        "tile_int4_m64": Case("gemm_wo", "down_wo_kernel", tile | dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128,
                                                                       GROUP=128, SPAN=128, SCHEME=1, GROUP_M=1), 4, 3,
                              _scheme(1)),
        "bf16_m4096": Case("gemm", "down_kernel", bf16, 8, 5,
                           {"w2_ptr": _descriptor([8 * 4096, 14336], [128, 64], "bf16")}),
        "bf16_m1024": Case("gemm", "down_kernel", bf16 | dict(BLOCK_M=64, BLOCK_N=256), 8, 4,
                           {"w2_ptr": _descriptor([8 * 4096, 14336], [256, 64], "bf16")}),
        "fp8_m512": Case("gemm_fp8", "down_fp8_kernel", fp8, 8, 4,
                         {"w_ptr": _descriptor([256 * 7168, 2048], [128, 128], "fp8e4nv")}),
    }


def fp8_up_cases() -> dict[str, Case]:
    """The fp8 gate-ups (session 40: b13, the activation variant) at the tiles the plan launches: the tiny-batch
    16 x 128 (TMA weights, NAIVE), swapped with PAIR_DOT (Qwen3's tuned decode), x quantized inside with h float32
    and the folded alignment with a map, the prefill 64 x 128 on 8 warps (sorted rows, pointers); the persistent
    gate-up and down GEMMs (their unread bias pointers)."""
    fp8 = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32"}
    up = BASE | dict(GROUP_N=128, BLOCK_N=128, BLOCK_K=128, EMULATE=False, H_FP32=False, X_RAW=False, W_DESC=True,
                     ONE_BLOCK=True, AHEAD=True, SWAP_AB=False)
    desc = {"w_ptr": _descriptor([8 * 1536, 2048], [128, 128], "fp8e4nv")}
    pair = {"w_ptr": _descriptor([8, 12, 2, 64, 2048], [1, 2, 2, 64, 128], "fp8e4nv")}
    persistent = dict(GROUP_N=128, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, UPCAST=False, EMULATE=False,
                      W_DESC=False, ONE_BLOCK=True, PDL=True, b13_ptr=None, b2_ptr=None)
    return {
        "up_fp8": Case("gemm_fp8", "gate_up_fp8_kernel", up, 4, 4, fp8 | desc),
        "up_fp8_swap_pair": Case("gemm_fp8", "gate_up_fp8_kernel", up | dict(SWAP_AB=True, PAIR_DOT=True,
                                                                             PAIR_CHUNK=64), 4, 4, fp8 | pair),
        "up_fp8_xraw_hfp32_fold": Case("gemm_fp8", "gate_up_fp8_kernel", up | dict(
            BLOCK_N=32, X_RAW=True, H_FP32=True, W_DESC=False, FOLD=True, A_PAD=8, E_PAD=256, FOLD_CHUNK=8,
            HAS_MAP=True), 4, 4, {"xq_ptr": "*bf16", "xs_ptr": "*bf16", "hq_ptr": "*fp32"}),
        "up_fp8_m512": Case("gemm_fp8", "gate_up_fp8_kernel", up | dict(BLOCK_M=64, GROUP_M=8, NAIVE=False,
                                                                        W_DESC=False), 8, 4, fp8),
        "up_fp8_persistent": Case("gemm_fp8_persistent", "gate_up_fp8_persistent_kernel", persistent, 8, 4, fp8),
        "down_fp8_persistent": Case("gemm_fp8_persistent", "down_fp8_persistent_kernel", persistent, 4, 4),
    }


def fp8_variant_cases() -> dict[str, Case]:
    """``--variants`` (the tree after only: no before to compare with): the fp8 kernels with b13 / b2 and gpt-oss's
    spec at the plan's tiles for such calls (pointer weights, no ONE_BLOCK; session 41: the prefill tile with TMA
    weights, a scale a row tile), swapped, and GELU with a bias, to see that they compile for sm_90 and what they cost
    in registers and lines."""
    fp8 = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "b13_ptr": "*bf16", "b2_ptr": "*bf16"}
    spec = dict(ACT=0, INTERLEAVED=True, ALPHA=1.702, LIMIT=7.0, UP_SHIFT=1.0)
    up = {k: v for k, v in fp8_up_cases()["up_fp8"].const.items() if k != "b13_ptr"} | dict(W_DESC=False,
                                                                                          ONE_BLOCK=False)
    down = {k: v for k, v in dense_cases()["fp8"].const.items() if k != "b2_ptr"}
    gptoss_desc = {"w_ptr": _descriptor([32 * 5760, 2880], [128, 128], "fp8e4nv")}  # w13 of gpt-oss-20b as [E*2N, K]
    persistent = fp8_up_cases()["up_fp8_persistent"]
    return {
        "var_up_fp8_gptoss": Case("gemm_fp8", "gate_up_fp8_kernel", up | spec, 4, 4, fp8),
        "var_up_fp8_gptoss_swap": Case("gemm_fp8", "gate_up_fp8_kernel", up | spec | dict(SWAP_AB=True), 4, 4, fp8),
        "var_up_fp8_gptoss_m512": Case("gemm_fp8", "gate_up_fp8_kernel", up | spec | dict(
            BLOCK_M=64, GROUP_M=8, NAIVE=False), 8, 4, fp8),
        "var_up_fp8_gptoss_tma": Case("gemm_fp8", "gate_up_fp8_kernel", up | spec | dict(
            W_DESC=True, ONE_BLOCK=True), 4, 4, fp8 | gptoss_desc),  # gof41: gpt-oss's rows by TMA, the tiny tile
        "var_up_fp8_gptoss_m512_tma": Case("gemm_fp8", "gate_up_fp8_kernel", up | spec | dict(
            BLOCK_M=64, GROUP_M=8, NAIVE=False, W_DESC=True, ONE_BLOCK=True), 8, 4, fp8 | gptoss_desc),  # prefill
        "var_up_fp8_persistent_gptoss_tma": Case("gemm_fp8_persistent", "gate_up_fp8_persistent_kernel", {
            k: v for k, v in persistent.const.items() if k != "b13_ptr"} | spec | dict(W_DESC=True), 8, 4,
            fp8 | gptoss_desc),  # gof41: the persistent GEMMs with gpt-oss's rows by TMA, b13, the spec; and b2:
        "var_down_fp8_persistent_b2": Case("gemm_fp8_persistent", "down_fp8_persistent_kernel", {
            k: v for k, v in persistent.const.items() if k != "b2_ptr"}, 4, 4, fp8),
        "var_up_fp8_gelu_bias": Case("gemm_fp8", "gate_up_fp8_kernel", up | dict(ACT=1, ONE_BLOCK=True), 4, 4, fp8),
        "var_down_fp8_bias": Case("gemm_fp8", "down_fp8_kernel", down, 4, 5, fp8),
        "var_down_fp8_bias_swap_ksum": Case("gemm_fp8", "down_fp8_kernel", down | KSUM | dict(SWAP_AB=True), 4, 5,
                                            fp8),
    }


def _descriptor(shape: list[int], block: list[int], dtype: str) -> str:
    """A host tensor descriptor's signature type (what a launch with one passes)."""
    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.empty(shape, dtype={"bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn}[dtype])
    return mangle_type(TensorDescriptor(t, shape, list(t.stride()), block))


def compile_case(case: Case):
    """triton.compile of ``case`` for sm_90 (a constexpr the case does not name: the kernel's default)."""
    import importlib

    from wo_reg_sass_cpu import _compile

    fn = getattr(importlib.import_module(f"moekit.experts._kernels.{case.module}"), case.kernel)
    const = {p.name: p.default for p in fn.params if p.is_constexpr} | case.const
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    return _compile(fn, POINTERS | case.pointers, const, case.num_warps, case.num_stages)


def dump(out: Path, only: list[str] | None, variants: bool = False) -> int:
    import moekit
    from gluon_sass_diff_cpu import write_sass

    cases = wo_cases() | gate_up_cases() | tile_reg_up_cases() | dense_cases() | prefill_cases() | fp8_up_cases()
    if variants:
        cases = fp8_variant_cases()
    cases = {n: c for n, c in cases.items() if not only or n.startswith(tuple(only))}
    print(f"moekit at {Path(moekit.__file__).parent}: {len(cases)} kernels", flush=True)
    return write_sass(out, {n: partial(compile_case, c) for n, c in cases.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, required=True)
    parser.add_argument("--only", nargs="+", help="name prefixes of the kernels to dump (default: all; e.g. mma gemv)")
    parser.add_argument("--variants", action="store_true", help="the fp8 kernels with biases and gpt-oss's spec "
                        "instead (``fp8_variant_cases``: the tree after only)")
    args = parser.parse_args()
    return dump(args.dump, args.only, args.variants)


if __name__ == "__main__":
    sys.exit(main())

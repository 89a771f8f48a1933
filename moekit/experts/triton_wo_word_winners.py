"""The word decode's (gemv: ``triton_wo_gemv``) reduction splits and gate-up tiles measured fastest
per (scheme, E, N, K, M) at decode sizes on the H200, as data, applied on top of the decode's heuristic tiles:

    word_config(M, E, N, K, k, scheme, decode) -> the decode's heuristic config, as a ``WordConfig`` with the
    splits (and gate-up tile) of the row of the nearest measured m (log2 distance, ties: the smaller) among
    the rows of this (scheme, E, N, K) and decode within a factor 2 (m/2 <= M <= 2m) whose m runs the same
    BLOCK_M (``gemv_rows``); no row: the heuristic config unchanged (no split: DeepSeek-V3 int4 M=8 split
    in 2 measured 688 µs against 670 unsplit, so a row stays near its own M; M = 2 takes M = 1's row, as
    ``choose_decode`` takes M = 1's decode there)

Why splits win at M = 1 (sm_90 SASS, ``benchmarks/wo_gemv_sass_cpu.py``): the gemv's 64 x 16-word gate-up
tile takes 255 registers a thread, so an SM holds at most 4 programs, and the touched experts' tiles are
fewer than that (DeepSeek-V3: 8 x 32 = 256 programs on 132 SMs): the words in flight an SM, not the decode's
instructions, set the time. Splitting the gate-up's K over 2-4 programs (``_kernels/wo_split``) doubles them;
where the down GEMM has the fewest programs (Mixtral: 2 experts x 64 tiles) splitting its long reduction
(N = 14336) does the same. A row's ``fold`` sums the split gate-up's partials and applies the activation in
the down GEMM as it reads h (``_kernels/wo_split.load_h``: bit-equal, no activation launch): one launch fewer, for
2 x splits float32 reads of each h element (H200, f6f35e93:benchmarks/wo_fold_device_check.py). The choice of decode
stays ``triton_wo_plan.choose_decode``'s (DECODE_MEASURED).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moekit.experts.configs import GemmTile, KernelConfig
from moekit.experts.triton_wo_gemv import PER, WordConfig, gemv_heuristic_config, gemv_rows


@dataclass(frozen=True)
class WordPick:
    decode: str  # the word decode these splits were measured with
    up_split: int = 1  # the gate-up's reduction splits
    down_split: int = 0  # the down GEMM's (0: ``triton_wo_plan.decode_split_k``'s)
    # (BLOCK_N, words a step, warps, steps of words loaded ahead beyond one), None: the heuristic's
    up_tile: tuple | None = None
    down_tile: tuple | None = None  # the down GEMM's, the same way
    fold: bool = False  # the split gate-up's sum and activation in the down GEMM's prologue (``WordConfig.glu_fold``)
    x_tile: bool = False  # gemv: x and h read as one [words, values] tile a step (``WordConfig.x_tile``)


# (scheme, E, N, K, M) -> WordPick. H200, Triton 3.6, bf16 activations, µs: benchmarks/wo_decode2_device_check.py
# on branch wo-decode2, two runs (e320f4b, then 34d17b2 with the rows below as the pick against the old pick;
# results/raw logs by the lead); each comment: this row's time in run 1 / run 2, the old pick's (run 2).
# Splits measured but not taken: DeepSeek-V3 int4 M=8 split 2 690 against 671 unsplit; mxfp4 M=8 split 2
# 1099.5 against 1100.0 unsplit (its gain there is the decode: gemv against register 1193, DECODE_MEASURED);
# the gemv with an L2 prefetch lost every M=1 cell (12-22%).
# Session 21 (branch wo4, benchmarks/wo_ahead_device_check.py run 2 at 470c186, graph µs, 5 interleaved rounds, rows
# taken where every round was <= 0.97x the old pick): the x tile (``WordConfig.x_tile``) with the words 2 steps
# ahead (A2: num_stages 2) at the 64-row tiles, or with 32-row tiles (R32). Not taken (no 5/5 win): DeepSeek-V3 int4
# M=1 x tile + A2 96.0 against 98.3; Mixtral int4 M=1 96.8 against 99.2; the x tile alone lost at 64-row int4 tiles
# (Qwen3 M=1 20.7 against 20.0, DeepSeek-V3 108.1 against 98.3); every int8 cell and Mixtral's M=8 / mxfp4 cells
# stayed with their tile / register decodes (the gemv variants 1.1-2.6x slower).
A2 = (64, 16, 2, 1)  # the heuristic's 64 x 16-word 2-warp tile, each step's words loaded 2 steps ahead
R32 = (32, 16, 2, 0)  # 32 x 16 words in 2 warps: twice the programs
WORD_WINNERS: dict[tuple[str, int, int, int, int], WordPick] = {
    # qwen3-30b-a3b: 22.5 / 22.7, old gemv_half 29.2 (gate-up phase 19.1 -> 12.7). Folded (gemv's h read as one
    # contiguous tile a step; benchmarks/verdict_device_check.py, raw/NVIDIA_H200-2026-12-03-dd8bed6-verdict.*):
    # graph 19.7 against 21.8 unfolded, eager 32.7 against 39.8, host_rest 30.8 against 38.3 µs a call. (Not
    # folded where it lost: Qwen3 int4 M=8 91.2 against 80.8, DeepSeek-V3 int4 M=1 105.2 against 98.9; mxfp4 M=1 even).
    # Session 21: x tile + A2 19.1 against 20.0 (5 rounds). The merged bench then read 84.9 eager / 79.6 host µs
    # (raw/NVIDIA_H200-2026-12-03-0efdb0f-bench-dtype.log) and the row was reverted (7e0083a); session 22 found no
    # cause in the row: every call served by the lean fast path, its launches all kept C launches, host 28.5 / 29.1 /
    # 35.5 against the split-4 fold's 27.8 / 37.1 / 33.2, graph 20.6 / 20.5 / 20.6 against 20.8 / 22.0 / 22.1 (3
    # interleaved rounds; in the bench's own cells host 32.9 against 35.6, graph 18.8 against 19.3:
    # benchmarks/host_big_device_check.py, raw/NVIDIA_H200-2026-12-03-9516268-host-ck1.log), so taken again
    ("int4_w4a16", 128, 768, 2048, 1): WordPick("gemv", 4, 0, A2, A2, fold=True, x_tile=True),
    # qwen3-30b-a3b: 81.2 / 81.8, old gemv unsplit 88.6; session 21: x tile + A2 77.5 against 80.6
    ("int4_w4a16", 128, 768, 2048, 8): WordPick("gemv", 2, 0, A2, A2, x_tile=True),
    # qwen3-30b-a3b: session 21 R32 x tile, gate-up split 2 (not folded) 25.9 against gemv_half (64 x 4 words, split
    # 4 folded, L2 prefetch 4) 28.8 (session 19: gemv_half 30.5 against register 36.5)
    ("mxfp4", 128, 768, 2048, 1): WordPick("gemv", 2, 0, R32, R32, x_tile=True),
    # deepseek-v3: 99.7 / 99.7 (as the pick, first timed in its cell: 109.2), old gemv unsplit 127.2
    ("int4_w4a16", 256, 2048, 7168, 1): WordPick("gemv", 2),
    # deepseek-v3: session 21 x tile + A2 621.4 against the heuristic gemv 670.3
    ("int4_w4a16", 256, 2048, 7168, 8): WordPick("gemv", 1, 0, A2, A2, x_tile=True),
    # deepseek-v3: 160.8 / 160.5, old gemv_half 183.2; session 21: R32 x tile, split 4 145.3 against split 2 160.7
    ("mxfp4", 256, 2048, 7168, 1): WordPick("gemv", 4, 0, R32, R32, x_tile=True),
    # deepseek-v3: session 21 R32 x tile 1012.0 against the heuristic gemv 1096.5
    ("mxfp4", 256, 2048, 7168, 8): WordPick("gemv", 1, 0, R32, R32, x_tile=True),
    # mixtral-8x7b: the down GEMM split 8 (2 experts x 64 tiles): run 2 99.3 (gate-up split 4 too: 106.0 / 104.4),
    # old gemv (down split 2) 129.8
    ("int4_w4a16", 8, 14336, 4096, 1): WordPick("gemv", 1, 8),
}
HEURISTICS = {"gemv": gemv_heuristic_config}


def word_pick(scheme: str, num_experts: int, n: int, k: int, num_tokens: int, top_k: int, decode: str,
              table: dict | None = None) -> WordPick | None:
    """The row of ``table`` (default WORD_WINNERS) that covers this call (module docstring), or None."""
    rows = WORD_WINNERS if table is None else table
    block_m = gemv_rows(num_tokens, num_experts, top_k)
    measured = [m for (s, e, nn, kk, m), pick in rows.items()
                if (s, e, nn, kk) == (scheme, num_experts, n, k) and pick.decode == decode
                and m / 2 <= num_tokens <= 2 * m and gemv_rows(m, num_experts, top_k) == block_m]
    if not measured:
        return None
    target = math.log2(max(num_tokens, 1))
    m = min(measured, key=lambda m: (abs(math.log2(m) - target), m))
    return rows[(scheme, num_experts, n, k, m)]


def word_config(num_tokens: int, num_experts: int, n: int, k: int, top_k: int, scheme: str,
                decode: str) -> KernelConfig:
    """``decode``'s heuristic config with the covering row's splits and tiles (a ``WordConfig``), or
    the heuristic config itself where no row covers the call (module docstring)."""
    cfg = HEURISTICS[decode](num_tokens, num_experts, n, k, top_k, scheme)
    pick = word_pick(scheme, num_experts, n, k, num_tokens, top_k, decode)
    return cfg if pick is None else with_pick(cfg, pick, scheme)


def with_pick(cfg: KernelConfig, pick: WordPick, scheme: str) -> WordConfig:
    """``cfg`` (its decode's heuristic config) with ``pick``'s splits and tiles."""

    def tile(base: GemmTile, spec: tuple | None) -> GemmTile:
        if spec is None:
            return base
        rows, words, warps, prefetch = spec  # num_stages = 1 + the steps of words loaded ahead beyond one
        return GemmTile(rows, words * PER[scheme], base.GROUP_M, warps, 1 + prefetch)

    return WordConfig(cfg.BLOCK_M, tile(cfg.up, pick.up_tile), tile(cfg.down, pick.down_tile), up_split=pick.up_split,
                      down_split=pick.down_split, glu_fold=pick.fold, x_tile=pick.x_tile)

"""Where the words decode ("gluon_words", ``triton_wo_words_route``) is the weight-only route's default (issue #16
target 1, session 48): the cells a device measured it faster than the chooser's pick (``triton_wo_plan.choose_decode``)
in both eager wall and CUDA-graph time, as data, and the rule by which a call that names no decode, config or split
takes it (``triton_wo.run_experts_wo``; the same kind of thing as ``triton_gluon_wo.GLUON_WO_CELLS`` at prefill).

    words_default_covers(call) -> bool: ENABLED; no expert map; an activation the words epilogue runs
        (``words_variant``: gated SiLU, gpt-oss's variant included); a Hopper with Gluon, never the interpreter
        (``gluon_supported``: the table's rows are sm_90 measurements); and the row of (scheme, E, N, K) (the
        device's own in WORDS_DEFAULT_CELLS_BY_DEVICE where it has one, else WORDS_DEFAULT_CELLS') whose measured m
        nearest M (log2 distance, ties: the smaller) lies within a factor 2 (m / 2 <= M <= 2 m) and won there
    then ``run_experts_words(default=True)``: the kept sequence, else the words kernels' checks (``words_fit``); a call
        they refuse (unaligned codes, mxfp4 scales past the decode's range, a shape off the 256 grid) runs the pick,
        silently: a default, not a request

Shapes: x [M, K], w13 [E, 2N, K] (anything with ``q``), M tokens, E local experts, N intermediate, K hidden.
"""

from __future__ import annotations

import math
import os

from moekit.experts.configs import call_device_key
from moekit.experts.triton_gluon_launch import gluon_supported
from moekit.experts.triton_wo_words_route import WORDS_SCHEMES, words_variant

# The A/B switch of ``benchmarks/wd48_device_check.py`` (off: every call takes the chooser's pick, as before session
# 48), and a user's way out: MOEKIT_WORDS_DEFAULT=0 in the environment, read once at import. Flip it with
# ``set_enabled`` (it drops the kept fast-path entries, which were recorded under the other choice).
ENABLED = os.environ.get("MOEKIT_WORDS_DEFAULT", "1") != "0"

# (scheme, E, N, K) -> {measured M: whether the words won there in eager wall AND graph time}. Measured on an H100
# 80GB HBM3 (no H200 was lent in sessions 47-48; the chooser's tables are H200 measurements: the same sm_90, 132 SMs),
# torch 2.11, Triton 3.6: first benchmarks/wl46_device_check.py at main 3bdb789 and ef0afa3a (M = 1 and 8, sessions
# 47-48), then benchmarks/wd48_device_check.py at e6a4c2a1 (session 48, through a moekit.MoE layer quantized with
# quantize_, every output PASS): graph µs of the experts call off / on (3/3 interleaved rounds on <= 0.97 x off), eager
# wall µs a call of the experts call and of the layer forward off / on; off = the chooser's pick.
# Not taken: Mixtral int4 (M=1 x1.06 in graph but 110.2 / 119.9 eager wall; M=8 x0.98), DeepSeek-V3 mxfp4 (M=1 / 8
# x0.93 / x0.96), and gpt-oss-20b mxfp4 though it won (x1.28 / x1.21): its K = N = 2880 runs the words on a kept padded
# copy of every expert (``triton_wo_words_pad``, 471 MB beside a layer's 423 MB), and a default may not double the
# experts' memory (``run_experts_words(default=True)`` refuses a call that needs the copy).
WORDS_DEFAULT_CELLS: dict[tuple[str, int, int, int], dict[int, bool]] = {
    # DeepSeek-V3, graph / eager experts / eager layer: M=1 131.0 / 105.4 (x1.24), 117.0 / 102.0, 178.2 / 162.9;
    # M=2 215.9 / 182.7, 225.5 / 188.3, 297.6 / 260.0; M=4 391.7 / 350.4, 397.6 / 355.7, 475.9 / 433.7; M=8 759.4 /
    # 687.6, 765.4 / 690.6, 882.7 / 806.3; M=16 1307.8 / 1066.4 (x1.23), 1313.9 / 1075.4, 1506.5 / 1254.6
    ("int4_w4a16", 256, 2048, 7168): {1: True, 2: True, 4: True, 8: True, 16: True},
    # Mixtral-8x7B: M=1 137.9 / 109.2 (x1.26), 136.0 / 115.2, 142.3 / 121.1; M=2 218.2 / 196.5, 227.3 / 205.0, 233.4 /
    # 211.0; M=4 319.1 / 263.2, 299.5 / 275.4, 328.4 / 292.7; M=16 479.6 / 439.8, 480.7 / 446.8, 489.2 / 454.1. M=8
    # lost in eager wall (graph 403.0 / 366.9, x1.10, but the layer 372.9 / 380.9, the experts call 375.0 / 369.5;
    # sessions 47-48: 372.1 / 372.0): M = 6..11 take the pick
    ("mxfp4", 8, 14336, 4096): {1: True, 2: True, 4: True, 8: False, 16: True},
}
# device key (``configs.device_key``) -> rows that replace a WORDS_DEFAULT_CELLS row on that device only. The H200
# (session 50, benchmarks/wd48_device_check.py --rounds 3 at main e72c850a, ONE H200, torch 2.11, Triton 3.6;
# raw/NVIDIA_H200-2026-12-07-e72c850-wd48.log), graph µs of the experts call off / on (wins of 3 rounds), eager wall
# of the experts call off / on: DeepSeek-V3 int4 M=1 109.1 / 95.9 (3/3), 105.9 / 102.7; M=2 186.0 / 176.6 (3/3),
# 198.6 / 184.6; M=8 621.6 / 668.9 (0/3), 634.8 / 684.2: lost where the H100 won; M=16 1223.6 / 1039.1 (3/3),
# 1233.6 / 1057.4. Mixtral mxfp4 M=1 134.7 / 106.9 (3/3), 133.0 / 114.6; M=2 214.9 / 195.2 (1/1), 225.9 / 210.4;
# M=16 415.6 / 437.2 (0/3), 424.5 / 452.2: lost where the H100 won. M=4 not reached (the check's deadline): M = 3..4
# follow M=2's row; Mixtral M=8 keeps the H100's False (not compared on the H200).
WORDS_DEFAULT_CELLS_BY_DEVICE: dict[str, dict[tuple[str, int, int, int], dict[int, bool]]] = {
    "NVIDIA_H200": {
        ("int4_w4a16", 256, 2048, 7168): {1: True, 2: True, 8: False, 16: True},
        ("mxfp4", 8, 14336, 4096): {1: True, 2: True, 8: False, 16: False},
    },
}


def set_enabled(on: bool) -> None:
    """Turn the words default on or off for the process (``ENABLED``), dropping what was kept under the other choice:
    the fast path's entries (``triton_quant_fast``: a pick's recorded launches would serve a words call) and the
    weight-only plans."""
    global ENABLED
    from moekit.experts.triton_wo import clear_launch_caches
    from moekit.experts.triton_quant_fast import clear_quant_fast

    ENABLED = bool(on)
    clear_quant_fast()
    clear_launch_caches()


def measured_win(row: dict[int, bool], num_tokens: int) -> bool:
    """Whether the row's measured m nearest ``num_tokens`` (log2 distance, ties: the smaller), among those within a
    factor 2 of it, is one the words won; False where none is that near."""
    near = [m for m in row if m / 2 <= num_tokens <= 2 * m]
    if not near:
        return False
    target = math.log2(num_tokens)
    return row[min(near, key=lambda m: (abs(math.log2(m) - target), m))]


def words_default_covers(x, w13, scheme: str, activation, expert_map) -> bool:
    """Whether a call that names no decode, config or split is one the words decode is the default for (module
    docstring); its fit (``words_fit``) is asked after, by ``run_experts_words(default=True)``."""
    if not ENABLED or expert_map is not None or scheme not in WORDS_SCHEMES:
        return False
    if x.shape[0] < 1 or not gluon_supported(x.device):
        return False
    key = (scheme, w13.q.shape[0], w13.q.shape[1] // 2, x.shape[1])
    row = WORDS_DEFAULT_CELLS_BY_DEVICE.get(call_device_key(x.device), {}).get(key) or WORDS_DEFAULT_CELLS.get(key)
    if row is None or not measured_win(row, x.shape[0]):
        return False
    if activation == "silu":
        return True
    try:
        words_variant(activation, None, None)
    except ValueError:  # not gated SiLU: the pick's decodes run it
        return False
    return True

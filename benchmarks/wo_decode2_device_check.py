"""GPU check of the word decodes' split-K gate-up (``triton_wo_gemv.WordConfig``: ``up_split`` splits of the
gate-up's reduction, float32 partials summed with the activation in one launch, ``_kernels/wo_split.py``;
``down_split`` the down GEMM's) against the chooser's pick at issue #16's decode cells: every variant
against the torch twin at the real shapes, timed by CUDA-graph replay over rotated input sets (weights
stream from HBM), with moekit's bf16 path, % of the packed-byte floor and the targets' verdicts.

    PYTHONPATH=$PWD python benchmarks/wo_decode2_device_check.py            # H200, <= 150 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/wo_decode2_device_check.py --smoke   # CPU, tiny

Cells: Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B (in that order: the time limit cuts the last) x int4_w4a16
(g 128, zero points), mxfp4, int8_w8a16 x M = 1, 8, 64. Variants (an error in one is printed, the run goes
on): "pick" (the chooser's decode and config: what a call runs now, the measured splits of
``triton_wo_word_winners`` included), "old" (the chooser's decode before, at its heuristic config, where it
differs), and for the 4-bit schemes SPLIT_VARIANTS' at M = 1 and 8 (gemv or gemv_half with the gate-up
and / or the down GEMM split, some with another gate-up tile); at M = 64 the pick only (the floor's distance).
Machinery (timing, floor, twin, verdicts, the time limit): ``wo_speed_device_check``. At M = 1 also the
gate-up phase alone (its launches, timed the same way) of the pick and the best variant: where the time goes.
Progress lines as shapes finish; the table last; JSON to $OUT/wo_decode2.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import wo_speed_device_check as base  # noqa: E402
from moekit.bench.cells import Shape  # noqa: E402
from moekit.bench.timing import time_stats  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import weight_args, wo_launches  # noqa: E402
from moekit.experts.triton_wo_gemv import gemv_heuristic_config, half_heuristic_config  # noqa: E402
from moekit.experts.triton_wo_plan import wo_plan_for  # noqa: E402
from moekit.experts.triton_wo_word_winners import WordPick, with_pick  # noqa: E402

PRESET_ORDER = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
H4 = (64, 4, 2, 4)  # gemv_half's 64 x 4-word gate-up tile in 2 warps, L2 prefetch 4 steps ahead
SCHEMES = ("int4_w4a16", "mxfp4", "int8_w8a16")
BATCHES = (1, 8, 64)
LIMIT_S = 130.0  # whole run, compiles included (the lead's budget: 150 s)
# name -> WordPick (decode, gate-up splits, down splits or 0 for the rule, the gate-up and down tiles (BLOCK_N,
# words a step, warps, L2 prefetch steps) or None for the decode's heuristic's), per M; 4-bit only. sm_90 SASS (benchmarks/wo_half_sass_cpu.py's compile, int4 gate-up, registers a thread ->
# programs an SM): 64x16w 2 warps 255 -> 4, 64x8w 166 -> 6, half 64x4w 94 -> 10 (mxfp4 79 -> 12). Run 1
# (e320f4b) measured splits 2 / 4 and those tiles; run 2 (34d17b2) the winners' neighbours, the down GEMM's
# splits and an L2 prefetch 4 steps ahead in the gemv (lost every cell: DeepSeek-V3 int4 M=1 117 against 100
# split 2, Qwen3 28.8 against 24.6, Mixtral 154 against 132; since removed).
SPLIT_VARIANTS = {
    1: {"g_s2": WordPick("gemv", 2), "g_s4": WordPick("gemv", 4), "g_s8": WordPick("gemv", 8),
        "g_d8": WordPick("gemv", 1, 8), "g_s2d8": WordPick("gemv", 2, 8), "g_d16": WordPick("gemv", 1, 16),
        "h4_s2": WordPick("gemv_half", 2, 0, H4), "h4_s8": WordPick("gemv_half", 8, 0, H4),
        "h4_d8": WordPick("gemv_half", 1, 8, H4), "h4_s2d8": WordPick("gemv_half", 2, 8, H4)},
    8: {"g_s1": WordPick("gemv"), "g_s2": WordPick("gemv", 2)},
    64: {},
}
MXFP4_ONLY = ("h4_",)  # gemv_half's 64 x 4-word tiles: int4 lost with them at e320f4b (243-277 µs, DeepSeek/Mixtral)
# the chooser's decode before branch wo-decode2 where it differs (its heuristic config, unsplit): "old"
OLD_PICKS = {("qwen3-30b-a3b", "int4_w4a16", 1): "gemv_half", ("qwen3-30b-a3b", "mxfp4", 1): "register",
             ("deepseek-v3", "int4_w4a16", 1): "gemv", ("deepseek-v3", "mxfp4", 1): "gemv_half",
             ("deepseek-v3", "mxfp4", 8): "register", ("mixtral-8x7b", "int4_w4a16", 1): "gemv",
             ("qwen3-30b-a3b", "int4_w4a16", 8): "gemv"}
HEURISTICS = {"gemv": gemv_heuristic_config, "gemv_half": half_heuristic_config}
RUN_CELL = base.run_cell
PHASE_ALSO: list[str] = []  # variants whose gate-up phase is timed besides the pick's and the best's (smoke: split ones)
PHASES: dict[str, tuple[float, float]] = {}  # "shape scheme M=m variant" -> (gate-up phase µs, whole call µs)


def variants(s: Shape, scheme: str, m: int) -> dict:
    """name -> (decode or None, config or None) of one cell: the chooser's pick, the old pick, the variants."""
    out = {"pick": (None, None)}
    old = OLD_PICKS.get((s.name, scheme, m))
    if old is not None:
        heuristic = HEURISTICS[old](m, s.num_experts, s.n, s.k, s.top_k, scheme) if old in HEURISTICS else None
        out["old"] = (old, heuristic)
    for name, pick in SPLIT_VARIANTS.get(m, {}).items():
        if scheme == "mxfp4" or (scheme == "int4_w4a16" and not name.startswith(MXFP4_ONLY)):
            cfg = HEURISTICS[pick.decode](m, s.num_experts, s.n, s.k, s.top_k, scheme)
            out[name] = (pick.decode, with_pick(cfg, pick, scheme))
    return out


def phase_us(s: Shape, scheme: str, w13, w2, inputs, decode, config) -> float:
    """µs of the gate-up phase alone of one variant (its launches up to the gate-up, and the split's
    activation launch): the rest of the call's time is the down GEMM and the k-sum."""
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    options = LaunchOptions(reuse_workspace=False)
    fns = []
    for c in inputs:
        plan = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", config, options, None,
                           decode)
        b, out = plan.workspace.allocate(c.x.device), torch.empty_like(c.x)
        launches = wo_launches(plan, b, c.x, a13, a2, c.topk_ids, c.topk_weights, None, out)
        last = max(i for i, (launch, _) in enumerate(launches) if launch in (plan.gate_up, plan.glu))
        fns.append(lambda ls=launches[:last + 1]: [launch(*pointers) for launch, pointers in ls])
    return time_stats(fns, c.x.device, graph=c.x.device.type == "cuda", **base.TIMING).us


def run_cell(s: Shape, scheme: str, m: int, w13, w2, inputs, bf16_us: float, bw: float):
    """``wo_speed_device_check.run_cell``, then at M = 1 the gate-up phase of the pick and the best (PHASES)."""
    cell = RUN_CELL(s, scheme, m, w13, w2, inputs, bf16_us, bw)
    if m == 1 and base.left_s() > 0:
        for name in dict.fromkeys(n for n in ("pick", cell.best, *PHASE_ALSO) if n in cell.times):
            decode, config = variants(s, scheme, m)[name]
            try:
                PHASES[f"{s.name} {scheme} M={m} {name}"] = (phase_us(s, scheme, w13, w2, inputs, decode, config),
                                                             cell.times[name])
            except Exception as e:  # noqa: BLE001  (a diagnosis only)
                print(f"phase {name}: {type(e).__name__}: {e}", flush=True)
    return cell


def table(cells) -> str:
    lines = [f"{'shape':<14} {'scheme':<10} {'M':>3} {'bf16':>7} {'pick':>8} {'(decode)':<10} {'best':>8} "
             f"{'variant':<7} {'floor':>6} {'%fl pick':>8} {'%fl best':>8} {'x bf16':>6}  target (best)"]
    for c in cells:
        pick = c.times.get("pick", float("nan"))
        best = c.times.get(c.best, float("nan"))
        lines.append(f"{c.preset:<14} {c.scheme:<10} {c.m:>3} {c.bf16_us:7.1f} {pick:8.1f} {c.pick:<10} {best:8.1f} "
                     f"{c.best:<7} {c.floor_us:6.1f} {100 * c.floor_us / pick:7.0f}% {100 * c.floor_us / best:7.0f}% "
                     f"{best / c.bf16_us:6.2f}  {c.target}")
    return "\n".join(lines)


def main(argv=None) -> int:
    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    base.variants, base.run_cell, base.LIMIT_S = variants, run_cell, LIMIT_S
    dev = base.s_dev()
    if smoke:
        base.TIMING.update(budget_s=0.0, min_reps=1, max_reps=1)
        base.LIMIT_S = 1e9  # the interpreter: every cell, however slow
        SPLIT_VARIANTS[1] = {k: SPLIT_VARIANTS[1][k] for k in ("g_s2d8", "h4_s2")}
        SPLIT_VARIANTS[8] = {}
        PHASE_ALSO.extend(SPLIT_VARIANTS[1])
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    bw = base.copy_tbps(dev)
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    shapes = [Shape("tiny", 8, 64, 128, 2)] if smoke else [Shape.from_preset(p) for p in PRESET_ORDER]
    batches = (1, 8) if smoke else BATCHES
    schemes = ("int4_w4a16", "int8_w8a16") if smoke else SCHEMES
    if dev.type == "cuda":
        t0 = time.perf_counter()
        base.compile_all(shapes, schemes, batches, dev)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    cells = []
    for s in shapes:
        if base.left_s() < 0:
            base.SKIPPED.append(s.name)
            continue
        cells += base.shape_cells(s, schemes, batches, bw, dev)
        print(f"-- {s.name} done at {time.perf_counter() - base.START:.1f} s", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_decode2.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw,
                       "cells": [vars(c) for c in cells], "phases_us": PHASES, "failed": base.FAILED,
                       "skipped": base.SKIPPED}, f, indent=1)
    print(f"total {time.perf_counter() - base.START:.1f} s; FAILED:", base.FAILED or "none", "; SKIPPED:",
          base.SKIPPED or "none")
    for c in cells:
        print(f"{c.preset} {c.scheme} M={c.m}: " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(c.times.items(),
                                                                                                 key=lambda kv: kv[1])))
    for key, (gate_up, whole) in PHASES.items():
        print(f"phase {key}: gate-up {gate_up:.1f} us of {whole:.1f} ({100 * gate_up / whole:.0f}%)")
    print(table(cells), flush=True)
    return 1 if base.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

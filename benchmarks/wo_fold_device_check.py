"""GPU check of the folded split gate-up (``WordConfig.glu_fold``: the down GEMM sums the gate-up's float32
partials and applies the activation as it reads h, ``_kernels/wo_split.load_h``; no activation launch) against
the chooser's pick at issue #16's decode cells (run 1 also timed narrower word tiles for Mixtral mxfp4: EXTRA's note).

    PYTHONPATH=$PWD OUT=/tmp/wf python benchmarks/wo_fold_device_check.py            # H200, <= 150 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/wo_fold_device_check.py --smoke   # CPU, tiny

Cells: Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B (the time limit cuts the last) x int4_w4a16 (g 128), mxfp4,
int8_w8a16 x M = 1, 8, 64. Variants: "pick" (the chooser's decode and config: what a call runs now), "fold"
(the pick with its split gate-up folded, where it splits; "unfold" for a folded pick), and EXTRA's (WordPick:
decode, gate-up splits, down splits, tiles (BLOCK_N, words a step, warps, steps ahead), fold; its gemv_half
variants removed with that decode). Each variant against the torch twin (rel-L2 < TOL), each folded one
against its unfolded twin bit for bit (``same``); then CUDA-graph replay
of the op path (fresh workspace: the k-sum a launch of its own) over rotated input sets, the variants' graphs
replayed interleaved in ROUNDS (median), % of the packed-byte floor; the launches of a call. Eager (the lean
path a model takes, k-sum folded up to 8 tokens): where "fold" exists, pick and fold interleaved through
``experts_triton`` (the winners table's row switched), eager and host_rest µs per call (issue #13's <= 40).
Look for: every line PASS (bit-equal lines included); the table's folded graph µs below unfolded (one launch
fewer), host_rest lower ("eager u/f", "host u/f": unfolded / folded). JSON to $OUT/wo_fold.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.bench.timing import time_eager  # noqa: E402
from moekit.experts.configs import clear_config_cache, device_key  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args, wo_launches  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts import triton_wo_plan  # noqa: E402
from moekit.experts.triton_wo_plan import DECODE_MEASURED, choose_decode, wo_plan_for  # noqa: E402
from moekit.experts import triton_wo_word_winners as winners  # noqa: E402
from moekit.experts.triton_wo_word_winners import WordPick, with_pick  # noqa: E402
from bench_rounds import graph_of, interleaved, medians  # noqa: E402
from wo_device_check import bf16_times, copy_tbps, packed_bytes, precompile, quantized, rel_err  # noqa: E402
from bench_run import RunLog  # noqa: E402

PRESET_ORDER = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
SCHEMES = ("int4_w4a16", "mxfp4", "int8_w8a16")
BATCHES = (1, 8, 64)
SETS, ROUNDS, REPLAYS = 4, 5, 6  # rotated input sets per graph; interleaved rounds; replays a round
EAGER = dict(calls=16, repeats=5)  # ``time_eager``'s (the smoke: fewer)
TOL = 1e-2
LIMIT_S = 135.0  # whole run, compiles included (the lead's budget: 150 s)
START = time.perf_counter()
# (preset, scheme, M) -> {name: WordPick}: split gate-ups folded where the pick does not split (or splits
# otherwise). Run 1 (17:34, the gemv's fold on strided loads) also timed Mixtral mxfp4 M = 1 on the word decodes
# with fewer registers a thread than the gemv's 64 x 16-word tile (down split 8): all slower than the register
# pick's 190.9 µs: gemv 32 x 16 words in 2 warps 238.7, 32 x 8 in 1 warp 243.7, gemv_half 64 x 4 (gate-up split
# 2, folded) 244.7, gemv_half 32 x 8 257.1.
EXTRA = {
    ("qwen3-30b-a3b", "int4_w4a16", 1): {"g_s2f": WordPick("gemv", 2, fold=True),
                                         "g_s8f": WordPick("gemv", 8, fold=True)},
    ("deepseek-v3", "int4_w4a16", 1): {"g_s4f": WordPick("gemv", 4, fold=True)},
    ("deepseek-v3", "mxfp4", 1): {"g_s4f": WordPick("gemv", 4, fold=True)},
    ("deepseek-v3", "int4_w4a16", 8): {"g_s2f": WordPick("gemv", 2, fold=True)},
    ("mixtral-8x7b", "int4_w4a16", 1): {"g_s2d8f": WordPick("gemv", 2, 8, fold=True),
                                        "g_s4d8f": WordPick("gemv", 4, 8, fold=True)},
}
T4 = (16, 4, 1, 0)  # the smoke's tiles: 4-word steps, so the tiny K = 128 (16 words) splits
SMOKE_EXTRA = {"g_s2f": WordPick("gemv", 2, 0, T4, T4, fold=True), "g_s3d2f": WordPick("gemv", 3, 2, T4, T4, fold=True)}
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check
SKIPPED: list[str] = []


@dataclasses.dataclass
class Cell:
    preset: str
    scheme: str
    m: int
    bf16_us: float
    floor_us: float
    times: dict = dataclasses.field(default_factory=dict)  # variant -> graph µs (median of the rounds)
    launches: dict = dataclasses.field(default_factory=dict)  # variant -> kernels of one op-path call
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> rel-L2 against the twin
    same: dict = dataclasses.field(default_factory=dict)  # folded variant -> bit-equal to its unfolded twin
    eager: dict = dataclasses.field(default_factory=dict)  # "unfolded" / "folded" -> (eager µs, host_rest µs)


def left_s() -> float:
    return LIMIT_S - (time.perf_counter() - START)


def variants(s: Shape, scheme: str, m: int, smoke: bool) -> dict:
    """name -> (decode, config): the pick, its twin with the fold switched where its gate-up splits, EXTRA's."""
    decode = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
    cfg = wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(DEV), decode)
    out = {"pick": (decode, cfg)}
    if isinstance(cfg, WordConfig) and cfg.up_split > 1:  # the pick's twin, folded or (a folded pick) not
        out["unfold" if cfg.glu_fold else "fold"] = (decode, dataclasses.replace(cfg, glu_fold=not cfg.glu_fold))
    extra = SMOKE_EXTRA if smoke and scheme != "int8_w8a16" else EXTRA.get((s.name, scheme, m), {})
    for name, pick in extra.items():
        base = winners.HEURISTICS[pick.decode](m, s.num_experts, s.n, s.k, s.top_k, scheme)
        out[name] = (pick.decode, with_pick(base, pick, scheme))
    return out


def launch_names(plan, c, a13, a2) -> list[str]:
    """The kernels one op-path call of ``plan`` launches, in order."""
    b, out = plan.workspace.allocate(c.x.device), torch.empty_like(c.x)
    return [launch.kernel.fn.__name__ for launch, _ in wo_launches(plan, b, c.x, a13, a2, c.topk_ids, c.topk_weights,
                                                                   None, out)]


def run_cell(s: Shape, scheme: str, m: int, w13, w2, inputs, bf16_us: float, bw: float, smoke: bool) -> Cell:
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    floor_us = (touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2) / (bw * 1e12) * 1e6
    cell = Cell(s.name, scheme, m, bf16_us, floor_us)
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    options = LaunchOptions(reuse_workspace=False)  # the custom op's
    graphs = {}
    for name, (decode, cfg) in variants(s, scheme, m, smoke).items():
        tag = f"{s.name} {scheme} M={m} {name}"

        def call(c, decode=decode, cfg=cfg):
            return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=cfg, decode=decode)

        try:
            got = call(c0)
            cell.errors[name] = err = rel_err(got, want)
            check(tag, err < TOL, f"rel_err={err:.2e} ({decode})")
            if getattr(cfg, "glu_fold", False):
                twin = dataclasses.replace(cfg, glu_fold=False)
                cell.same[name] = same = torch.equal(got, run_experts_wo(c0.x, a13, a2, c0.topk_ids, c0.topk_weights,
                                                                         None, scheme, config=twin, decode=decode))
                check(f"{tag} bit-equal to unfolded", same)
            plan = wo_plan_for(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, scheme, "silu", cfg, options, None,
                               decode)
            cell.launches[name] = launch_names(plan, c0, a13, a2)
            if err < TOL:
                graphs[name] = graph_of([lambda c=c: call(c) for c in inputs], DEV, replay=False)
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the run)
            traceback.print_exc(limit=3)
            check(tag, False, f"raised {type(e).__name__}: {e}")
    cell.times = medians(interleaved(graphs, len(inputs), DEV, ROUNDS, REPLAYS))
    if ("fold" in cell.errors or "unfold" in cell.errors) and left_s() > 10:
        try:
            cell.eager = eager_pick_fold(s, scheme, m, w13, w2, inputs)
        except Exception as e:  # noqa: BLE001  (a measurement only)
            traceback.print_exc(limit=3)
            check(f"{s.name} {scheme} M={m} eager", False, f"raised {type(e).__name__}: {e}")
    return cell


def lean_weight(w):
    """``w`` (WoWeight) as the ``moekit.quant`` object a model holds (the triton backend's lean path takes it)."""
    from moekit.quant.int4 import Int4Weight
    from moekit.quant.int8 import Int8Weight
    from moekit.quant.mxfp4 import Mxfp4Weight

    if w.scheme == "int8_w8a16":
        return Int8Weight(q=w.q, scale=w.scale)
    cols = w.q.shape[2] * 2
    if w.scheme == "int4_w4a16":
        return Int4Weight(q=w.q, scale=w.scale, zero=w.zero, group_size=w.group_size, cols=cols)
    return Mxfp4Weight(q=w.q, scale=w.scale, cols=cols)


def eager_pick_fold(s: Shape, scheme: str, m: int, w13, w2, inputs) -> dict:
    """(eager µs, host_rest µs) per call of the lean eager path with the winners row's fold off ("pick") and on
    ("folded"), interleaved 3 times each (medians); the row put back after."""
    from moekit.experts.triton import experts_triton

    key = (scheme, s.num_experts, s.n, s.k, m)
    row = winners.WORD_WINNERS.get(key)
    if row is None:
        return {}
    q13, q2 = lean_weight(w13), lean_weight(w2)
    fns = [lambda c=c: experts_triton(c.x, q13, q2, c.topk_ids, c.topk_weights) for c in inputs]
    samples = {"unfolded": [], "folded": []}
    try:
        for _ in range(3):
            for name, fold in (("unfolded", False), ("folded", True)):
                winners.WORD_WINNERS[key] = dataclasses.replace(row, fold=fold)
                clear_config_cache()
                with torch.no_grad():
                    t = time_eager(fns, DEV, **EAGER)
                samples[name].append((t.eager_us, t.host_rest_us))
                # the lean calls' plan: folded or not
                folded = any(plan.glu_fold for plan in triton_wo_plan._WO_PLANS.values())
                check(f"{s.name} {scheme} M={m} eager {name} runs {'folded' if fold else 'unfolded'}", folded == fold)
    finally:
        winners.WORD_WINNERS[key] = row
        clear_config_cache()
    return {name: (statistics.median(e for e, _ in v), statistics.median(h for _, h in v))
            for name, v in samples.items()}


def shape_cells(s: Shape, bw: float, smoke: bool) -> list[Cell]:
    batches = (1,) if smoke else BATCHES
    sets = {m: make_sets(s, m, SETS, torch.bfloat16, DEV, seed=m) for m in batches}
    bf16 = bf16_times(s, sets, DEV)
    cells = []
    for scheme in (("int4_w4a16",) if smoke else SCHEMES):
        if left_s() < 0:
            SKIPPED.append(f"{s.name} {scheme}")
            continue
        w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, DEV, seed=1)
        w2 = quantized(scheme, s.num_experts, s.k, s.n, DEV, seed=2)
        cells += [run_cell(s, scheme, m, w13, w2, sets[m], bf16[m], bw, smoke) for m in batches]
        del w13, w2
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return cells


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<14} {'scheme':<10} {'M':>3} {'bf16':>7} {'unfolded':>8} {'folded':>8} {'best':>8} "
             f"{'variant':<12} {'floor':>6} {'%fl best':>8} {'x bf16':>6} {'#l pick':>7} {'#l best':>7} "
             f"{'eager u/f':>13} {'host u/f':>11}"]
    for c in cells:
        if not c.times:
            continue
        best = min(c.times, key=c.times.get)
        eager = c.eager or {}
        e = (f"{eager['unfolded'][0]:6.1f}/{eager['folded'][0]:<6.1f}" if eager else "-")
        h = (f"{eager['unfolded'][1]:5.1f}/{eager['folded'][1]:<5.1f}" if eager else "-")
        unfolded, folded = ((c.times["unfold"], c.times["pick"]) if "unfold" in c.times
                            else (c.times.get("pick", float("nan")), c.times.get("fold", float("nan"))))
        lines.append(f"{c.preset:<14} {c.scheme:<10} {c.m:>3} {c.bf16_us:7.1f} {unfolded:8.1f} "
                     f"{folded:8.1f} {c.times[best]:8.1f} {best:<12} {c.floor_us:6.1f} "
                     f"{100 * c.floor_us / c.times[best]:7.0f}% {c.times[best] / c.bf16_us:6.2f} "
                     f"{len(c.launches.get('pick', ())):>7} {len(c.launches.get(best, ())):>7} {e:>13} {h:>11}")
    return "\n".join(lines)


def main(argv=None) -> int:
    global DEV
    smoke = "--smoke" in (argv if argv is not None else sys.argv[1:])
    DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    bw = copy_tbps(DEV)
    print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
    shapes = [Shape("tiny", 8, 64, 128, 2)] if smoke else [Shape.from_preset(p) for p in PRESET_ORDER]
    if smoke:  # the tiny shape's M = 1 int4 pick a split gemv, so "fold" and the eager comparison run too
        global LIMIT_S
        LIMIT_S = 1e9
        EAGER.update(calls=2, repeats=1)
        DECODE_MEASURED[("int4_w4a16", 8, 64, 128)] = {1: "gemv"}
        winners.WORD_WINNERS[("int4_w4a16", 8, 64, 128, 1)] = WordPick("gemv", 2, 0, T4, T4)
    if DEV.type == "cuda":
        t0 = time.perf_counter()
        jobs = [(s, scheme, m, decode, cfg, None) for s in shapes for scheme in SCHEMES for m in BATCHES
                for decode, cfg in variants(s, scheme, m, smoke).values()]
        precompile(jobs, DEV)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    cells = []
    for s in shapes:
        if left_s() < 0:
            SKIPPED.append(s.name)
            continue
        cells += shape_cells(s, bw, smoke)
        print(f"-- {s.name} done at {time.perf_counter() - START:.1f} s", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_fold.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw,
                       "cells": [dataclasses.asdict(c) for c in cells], "failed": FAILED, "skipped": SKIPPED}, f,
                      indent=1)
    print(f"total {time.perf_counter() - START:.1f} s; FAILED:", FAILED or "none", "; SKIPPED:", SKIPPED or "none")
    for c in cells:
        print(f"{c.preset} {c.scheme} M={c.m}: " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(c.times.items(),
                                                                                                 key=lambda kv: kv[1])))
        for k, names in c.launches.items():
            print(f"    {k}: {len(names)} launches: {', '.join(names)}")
    print(table(cells), flush=True)
    return 1 if FAILED else 0


DEV = torch.device("cpu")

if __name__ == "__main__":
    sys.exit(main())

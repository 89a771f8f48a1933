"""Fewer launches per experts call at M = 64-1024 (issue 13: host <= 40 µs at every M): the k-sum in the down
GEMM's grid after its programs (``LaunchOptions.sum_tail_max``, ``_kernels/gemm.py`` SUM_AFTER) against its own
launch, on the GPU, interleaved in one process.

    PYTHONPATH=$PWD python benchmarks/host_launch_device_check.py --out $OUT/host [--budget-s 150]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/host_launch_device_check.py --smoke --out /tmp/hl \
        --presets mixtral-8x7b --dtypes bfloat16 --batches 64   (CPU, tiny shapes: checks the script)

Per (preset, dtype, M), Qwen3-30B-A3B / DeepSeek-V3 / Mixtral-8x7B, bf16 and fp8_block, M in --batches' order (the
large M: each M's bf16 then fp8 cells; then the decode cells; no_grad, the bench's uniform routing, 2 rotated input
sets), ``LaunchOptions``:
  M > 8:   sep  sum_tail_max=0 (the k-sum its own launch: main)  /  tail  sum_tail_max=1024 (sum programs after the
           GEMM's, 4 tokens each)  /  tail16  the same with 16 tokens per sum program (WIDER)
  M <= 8:  fold sum_fold_max=8 (the k-sum folded, KSUM: main)    /  tail  sum_fold_max=0, sum_tail_max=1024
Run 1 (ea57e59) also had tail1 at M = 1024 (the one-launch alignment up to A = 8192): +16-17% graph µs on Qwen3, gone.
All pass explicit options, so Mixtral bf16 M = 1024 runs the fused route in all (the default object takes Gluon).
Per cell: PASS/FAIL of the first variant against ``experts_reference`` (rel L2 < 1e-2; fp8 against its recipe,
< 2e-2); each variant's 24 eager outputs bit-equal to the first's (same input set); the pools' kept counters all 0
after; each variant's launches run directly and replayed in a CUDA graph equal to the first's eager out. Launches
per call (profiler); host µs as ``moekit bench`` measures it (``time_eager``: host_us, host_rest_us) and eager µs,
3 rounds interleaved (A B C, C B A, ...), medians; graph µs (a CUDA graph of 16 calls per variant, captured with
the pool's kept counters, 6 interleaved replays, medians).
Look for: every check PASS; tail one launch fewer; tail host_rest below sep's; graph µs within noise (|diff| <
~1%). A line per cell as it goes; JSON to <out>/host_launch.json; a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.timing import time_eager
from moekit.experts import triton as tri
from moekit.experts import triton_fp8 as tri_fp8
from moekit.experts.reference import experts_reference
from moekit.experts.triton import experts_triton
from moekit.experts.triton_fp8_plan import plan_for as fp8_plan_for
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts import triton_plan
from moekit.experts.triton_plan import plan_for, plan_launches
from moekit.quant import quantize

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
DTYPES = ("bfloat16", "fp8_block")
BATCHES = (64, 256, 1024, 1, 8)
TAIL_MAX = 1024  # the sum programs' variants: up to M = 1024 (every cell here)
VARIANTS_LARGE = {"sep": LaunchOptions(sum_tail_max=0), "tail": LaunchOptions(sum_tail_max=TAIL_MAX)}
VARIANTS_DECODE = {"fold": LaunchOptions(sum_tail_max=0), "tail": LaunchOptions(sum_fold_max=0, sum_tail_max=TAIL_MAX)}
# the sum programs with more tokens each: 4x fewer programs (run 1: the tail cost graph time from M = 256, Qwen3
# M = 1024 +6%; a sum program runs at the GEMM's occupancy, its shared memory and registers). A distinct options
# object (the same launches at M <= 1024) keys its own plan, built with the tokens given. Not run on the H200 yet
# (session 20's second run was not lent): the next candidate for sum_tail_max above 64.
WIDER = {"tail16": (LaunchOptions(sum_tail_max=1 << 20), 16)}
TOL = {"bfloat16": 1e-2, "fp8_block": 2e-2}  # fp8: against its exact recipe (x and h quantized too)
EQ_CALLS, ROUNDS, GRAPH_CALLS = 24, 3, 16


class Run:
    device = torch.device("cuda")
    scale = 1
    smoke = False


def sync() -> None:
    if Run.device.type == "cuda":
        torch.cuda.synchronize()


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def counters_zero() -> bool:
    """Every counters tensor the bf16 and fp8 pools keep is all 0 (what each call must leave)."""
    sync()
    return all(bool((c == 0).all()) for pool in (tri._WORKSPACES, tri_fp8._WORKSPACES) for c in pool._counters.values())


def graph_fn(dtype: str, w13, w2, s, options: LaunchOptions):
    """One call's launches with fixed buffers (the pool's, its kept counters included), as a graph captures them:
    the same launches the eager lean call makes (a capture through ``experts_triton`` gets no kept counters)."""
    x, ids, weights = s.x, s.topk_ids, s.topk_weights
    out = torch.empty_like(x)
    if dtype == "bfloat16":
        plan = plan_for(x, w13, w2, ids, weights, None, "silu", None, options)
        b = tri._WORKSPACES.buffers(plan.workspace, x.device)
        pair = tri._DESCRIPTORS.get(w13, w2, plan.descriptor_key) if plan.descriptor_key is not None else None
        w13_arg, up_arg, w2_arg = (pair.w13, pair.w13_up, pair.w2) if pair is not None else (w13, None, w2)
        launches = plan_launches(plan, b, x, w13_arg, up_arg, w2_arg, None, None, ids, weights, None, out,
                                 b.get("counters"))
    else:
        plan = fp8_plan_for(x, w13.q, w13.scale, w2.q, w2.scale, ids, weights, None, tuple(w13.block_shape), None,
                            options)
        b = tri_fp8._WORKSPACES.buffers(plan.workspace, x.device)
        w13_arg, w2_arg = w13.q, w2.q
        if plan.descriptor_key is not None:
            pair = tri_fp8._DESCRIPTORS.get(w13.q, w2.q, plan.descriptor_key)
            w13_arg, w2_arg = pair.w13, pair.w2
        launches = tri_fp8.fp8_launches(plan, b, x, w13_arg, w13.scale, w2_arg, w2.scale, ids, weights, None, out)

    def call() -> torch.Tensor:
        for launch, pointers in launches:
            launch(*pointers)
        return out

    return call, len(launches), launches[-1][0].grid[0]  # the last launch's programs (down with the sum: + the sum's)


def launches_of(call) -> int:
    """CUDA kernels one call launches (profiler), -1 on the CPU."""
    if Run.device.type != "cuda":
        return -1
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        sync()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def capture(fn):
    """A CUDA graph of GRAPH_CALLS calls of ``fn`` (warmed on a side stream) and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            out = fn()
    return g, out


def replay_us(g) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / GRAPH_CALLS


def variants_at(preset: str, m: int) -> dict:
    """The cell's variants, the first the baseline (module docstring)."""
    if m <= 8:
        return VARIANTS_DECODE
    return dict(VARIANTS_LARGE, **{name: options for name, (options, _) in WIDER.items()})


@contextmanager
def sum_tokens(name: str):
    """``triton_plan.SUM_TAIL_TOKENS`` as variant ``name`` builds its plan with (WIDER), restored after."""
    kept = triton_plan.SUM_TAIL_TOKENS
    triton_plan.SUM_TAIL_TOKENS = WIDER[name][1] if name in WIDER else kept
    try:
        yield
    finally:
        triton_plan.SUM_TAIL_TOKENS = kept


def interleaved(names: list, rounds: int):
    """Each round's order: forwards, then backwards, ..."""
    for r in range(rounds):
        yield from (names if r % 2 == 0 else names[::-1])


def cell(preset: str, dtype: str, m: int, weights: dict) -> dict:
    shape = Shape.from_preset(preset, Run.scale)
    w13, w2 = weights[(preset, dtype)]
    sets = make_sets(shape, m, 2, torch.bfloat16, Run.device)
    variants = variants_at(preset, m)
    names = list(variants)
    calls = {name: [lambda s=s, o=o: experts_triton(s.x, w13, w2, s.topk_ids, s.topk_weights, options=o) for s in sets]
             for name, o in variants.items()}
    row: dict = {"variants": names}
    for name in names:
        with sum_tokens(name):  # its plan, lean sequence and kept call are built here, then reused
            for _ in range(3):  # compile, record, keep
                for c in calls[name]:
                    c()
            row[name] = {"down_grid": graph_fn(dtype, w13, w2, sets[0], variants[name])[2]}
    sync()
    wants = [calls[names[0]][i]() for i in range(2)]
    s0 = sets[0]
    row["rel_l2_vs_reference"] = rel_l2(wants[0], experts_reference(s0.x, w13, w2, s0.topk_ids, s0.topk_weights))
    row["reference"] = "PASS" if row["rel_l2_vs_reference"] < TOL[dtype] else "FAIL"
    for name in names:
        outs = [calls[name][i % 2]() for i in range(EQ_CALLS)]
        row[name].update(equal="PASS" if all(torch.equal(o, wants[i % 2]) for i, o in enumerate(outs)) else "FAIL",
                         host_us=[], host_rest_us=[], eager_us=[])
    row["counters_zero"] = "PASS" if counters_zero() else "FAIL"
    for name in names:
        row[name]["launches"] = launches_of(calls[name][0])
    for name in interleaved(names, 1 if Run.smoke else ROUNDS):
        t = time_eager(calls[name], Run.device)
        for key in ("host_us", "host_rest_us", "eager_us"):
            row[name][key].append(round(getattr(t, key), 2))
    for name in names:
        for key in ("host_us", "host_rest_us", "eager_us"):
            row[name][key] = statistics.median(row[name][key])
    fns = {}
    for name, o in variants.items():  # the graphs' launches, run directly first: the same out
        fns[name], row[name]["graph_launches"], _ = graph_fn(dtype, w13, w2, s0, o)
        row[name]["direct_equal"] = "PASS" if torch.equal(fns[name](), wants[0]) else "FAIL"
    row["counters_zero_direct"] = "PASS" if counters_zero() else "FAIL"
    if Run.device.type == "cuda":
        graphs = {}
        for name, fn in fns.items():
            graphs[name], gout = capture(fn)
            graphs[name].replay()
            sync()
            row[name]["graph_equal"] = "PASS" if torch.equal(gout, wants[0]) else "FAIL"
        times = {name: [] for name in names}
        for name in interleaved(names, 6):
            times[name].append(replay_us(graphs[name]))
        for name in names:
            row[name]["graph_us"] = round(statistics.median(times[name]), 2)
        row["counters_zero_after_graphs"] = "PASS" if counters_zero() else "FAIL"
        del graphs
    return row


def weights_for(preset: str, dtype: str, weights: dict) -> None:
    """Every preset's weights stay (bf16 and fp8 of all three: ~40 GB on the H200), each made once."""
    if (preset, dtype) in weights:
        return
    base = weights.get((preset, "bfloat16"))
    if base is None:
        w = make_weights(Shape.from_preset(preset, Run.scale), torch.bfloat16, Run.device)
        base = weights[(preset, "bfloat16")] = (w.w13, w.w2)
    if dtype != "bfloat16":
        weights[(preset, dtype)] = (quantize(base[0], dtype), quantize(base[1], dtype))


def table(results: dict) -> str:
    lines = ["host: time_eager host_us / host_rest_us (medians of 3 interleaved rounds), eager µs, graph µs (16-call"
             " graph, 6 interleaved replays, median), L launches per call, grid: the last launch's programs,"
             " dgraph% against the cell's first variant;"
             " checks: reference, bit-equal (24 eager calls), counters 0, direct and graph outputs equal",
             f"{'cell':<30}{'var':>6} {'L':>2} {'grid':>6} {'host':>7} {'rest':>7} {'eager':>8} {'graph':>8} "
             f"{'dgraph%':>8}  checks"]
    for key, r in results.items():
        if "variants" not in r:
            lines.append(f"{key:<30} {r.get('skipped') or r.get('error')}")
            continue
        base = r[r["variants"][0]].get("graph_us", float("nan"))
        for name in r["variants"]:
            v = r[name]
            checks = [r["reference"], r["counters_zero"], r["counters_zero_direct"],
                      r.get("counters_zero_after_graphs", "-")]
            checks += [v.get(c, "-") for c in ("equal", "direct_equal", "graph_equal")]
            ok = "PASS" if all(c in ("PASS", "-") for c in checks) else "FAIL " + "/".join(checks)
            g = v.get("graph_us", float("nan"))
            lines.append(f"{key:<30}{name:>6} {v['launches']:>2} {v.get('down_grid', 0):>6} {v['host_us']:>7.1f} "
                         f"{v['host_rest_us']:>7.1f} {v['eager_us']:>8.1f} {g:>8.1f} {100 * (g - base) / base:>8.2f}  "
                         f"{ok}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "host_launch_out"))
    p.add_argument("--budget-s", type=float, default=150.0, help="start no cell after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale, Run.smoke = torch.device("cpu"), 64, True
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": {"skipped": torch.cuda.get_device_name() if not a.smoke else "cpu"}}
    weights: dict = {}
    large = [(m, dtype) for m in a.batches if m > 8 for dtype in a.dtypes]
    decode = [(m, dtype) for m in a.batches if m <= 8 for dtype in a.dtypes]
    with torch.no_grad():
        for m, dtype, preset in [(m, d, p) for m, d in large + decode for p in a.presets]:  # --batches' order
            key = f"{preset} {dtype} M={m}"
            if time.perf_counter() - start > a.budget_s:
                results[key] = {"skipped": f"time budget ({a.budget_s:.0f} s) spent"}
                continue
            try:
                weights_for(preset, dtype, weights)
                results[key] = cell(preset, dtype, m, weights)
            except Exception as exc:  # noqa: BLE001  (one failing cell must not lose the others' numbers)
                results[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(json.dumps({key: results[key]}), f"[{time.perf_counter() - start:.0f} s]", flush=True)
            (out_dir / "host_launch.json").write_text(json.dumps(results, indent=1))
    results["elapsed_s"] = {"skipped": f"{time.perf_counter() - start:.1f} s in all"}
    (out_dir / "host_launch.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()

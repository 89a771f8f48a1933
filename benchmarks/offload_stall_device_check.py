"""Device check for issue #18's last cell (auto skewed/50/none/8 at 1.58x its floor on b89fbea: one of 4 timed
steps 40.8 ms against ~16, one CPU branch at 8.9x its model): where a stalled CPU branch's time goes, and
which CPU-branch thread count (``CpuOptions.threads``) keeps it calibrated. Variants and stacks are named
[mode][-tN] (``options_of``: N threads, none the calibration's). ck1 (96560bf) also ran the branch on a
long-lived worker thread with its own OpenMP team and as row blocks on a pool of single-threaded workers with
backups (``CpuOptions.runner``, removed after: both slower, INDEX row); ck2 (3c46b0a) 8 / 4 / 2 / 1 threads.

    PYTHONPATH=$PWD timeout 170 python3 benchmarks/offload_stall_device_check.py --out $OUT/offload4   (H200, < 150 s)
    PYTHONPATH=$PWD python3 benchmarks/offload_stall_device_check.py --smoke                        (CPU, tiny)

Qwen3-30B-A3B widths (E=128, K=2048, N=768, top-8, bf16), 4 layers on their own pinned host weights, the
bench's streams and seed. Parts, printing as they go:

1. exact: each variant's cpu-mode layer (M = 1 and 8, 3 seeds) against the float32 reference (rel L2 < 1e-2,
   CPU experts > 0) and against the first variant's output (rel L2 printed).
2. micro: 1 and 2 cold experts' CPU branch (1 row each, idle link) after the host was idle 0 / 60 ms
   (asleep) or 60 ms waiting for a GPU kernel (``torch.cuda._sleep``: the host in a device sync, as in a decode
   step), the variants in turns; per branch its time over the model, the CPython collections (``gc.callbacks``)
   inside it, every thread's run, run-queue wait and times put on a CPU (``/proc/self/task/*/schedstat``)
   and the process's involuntary / voluntary context switches over it.
3. cells (skewed/50/none/8, then uniform/75/none/8 and skewed/25/router/8 as the budget allows): the stacks
   (``STACKS``) take turns step by step, 80 steps; per stack mean, median, sem, stalled steps (> 1.5x the
   stack's median), its CPU branches over 3x their model, the collections' ms inside its steps; auto-X
   against auto paired by step.

JSON to OUT/offload_stall_device_check.json, rewritten after every part; the tables print last.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import os
import resource
import statistics
import sys
import time

import torch

from moekit.bench.offload_floor import fixed_costs
from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import cpu_rows, default_warm_steps, measure_costs
from offload_setting import offload_setting
from moekit.experts.reference import experts_reference
from moekit.offload import CpuOptions, ExpertCache, OffloadedMoE
from moekit.offload.calibrate import branch, cold_groups
from moekit.offload.cpu_path import CpuPath
from moekit.routing import Routing
from offload_fetch_device_check import _stack, _step, _stream  # benchmarks/ on sys.path
from offload_stall_report import print_result

START = time.perf_counter()
CELLS = (("skewed", 0.5, False, 8), ("uniform", 0.75, False, 8), ("skewed", 0.25, True, 8))
# ``--stacks``; ck1 (96560bf): auto, auto-worker, ...
STACKS = ("auto", "auto-t4", "auto-t2", "auto-t1", "gpu", "cpu", "cpu-t4", "hit")
# ``--variants``: parts 1 and 2 (the first the base; "cal": the calibration's count)
VARIANTS = ("cal", "t4", "t2", "t1")
GAPS = (("sleep", 0.0), ("sleep", 0.06), ("gpu", 0.06))  # part 2: (how the host idles, seconds)
BF16_TOLERANCE = 1e-2
GC_EVENTS: list[tuple[float, float, int]] = []  # (start, end, generation) of every CPython collection


def _gc_callback(phase: str, info: dict) -> None:
    if phase == "start":
        GC_EVENTS.append((time.perf_counter(), 0.0, info["generation"]))
    elif GC_EVENTS:
        s, _, g = GC_EVENTS[-1]
        GC_EVENTS[-1] = (s, time.perf_counter(), g)


def gc_ms(t0: float, t1: float) -> tuple[float, int]:
    """(ms of collections overlapping [t0, t1], the highest generation among them, -1 none)."""
    i = max(0, bisect.bisect_left(GC_EVENTS, (t0, 0.0, 0)) - 1)
    ms, gen = 0.0, -1
    for s, e, g in GC_EVENTS[i:]:
        if s > t1:
            break
        e = e or t1
        if e > t0:
            ms, gen = ms + (min(e, t1) - max(s, t0)) * 1e3, max(gen, g)
    return ms, gen


def sched() -> dict[str, tuple[int, int, int]]:
    """tid -> (ns on a CPU, ns waiting on a run queue, times it was put on a CPU) of every thread of the process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, slices = f.read().split()
            out[tid] = (int(run), int(wait), int(slices))
        except (OSError, ValueError):
            continue
    return out


def sched_delta(before: dict, after: dict) -> dict:
    """Run / run-queue wait ms over all threads, the largest one thread's wait, threads that ran, and per thread
    that ran (run ms, wait ms, times put on a CPU), most run first: a thread that slept through part of a
    branch shows less run than the branch's time and a slice count over 1."""
    zero = (0, 0, 0)
    d = [tuple(a[i] - before.get(t, zero)[i] for i in range(3)) for t, a in after.items()]
    ran = sorted((x for x in d if x[0] > 0), reverse=True)
    return {"run_ms": sum(r for r, _, _ in d) / 1e6, "wait_ms": sum(w for _, w, _ in d) / 1e6,
            "wait_max_ms": max((w for _, w, _ in d), default=0) / 1e6, "ran": len(ran),
            "threads": [(round(r / 1e6, 3), round(w / 1e6, 3), n) for r, w, n in ran[:20]]}


def _ivcsw() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw


def _nvcsw() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


class LoggedPath(CpuPath):
    """The CPU branch with each call logged: start, ms, compute ms, experts, tokens, context switches."""

    def __init__(self, options: CpuOptions, device, log: list) -> None:
        super().__init__(options, device)
        self.log = log

    def finish(self, staged, compute, device, experts: int, tokens: int, threads):
        start, cs = time.perf_counter(), _ivcsw()
        out = super().finish(staged, compute, device, experts, tokens, threads)
        p = self.last
        self.log.append({"t0": start, "t1": time.perf_counter(), "ms": p.total_s * 1e3, "compute_ms": p.compute_s * 1e3,
                         "experts": experts, "tokens": tokens, "ivcsw": _ivcsw() - cs})
        return out


def options_of(variant: str) -> CpuOptions:
    """A variant's (or stack's) ``CpuOptions``: its name is [mode-]tN (N threads) or a mode alone (the
    calibration's count)."""
    threads = next((int(p[1:]) for p in variant.split("-") if p.startswith("t") and p[1:].isdigit()), None)
    return CpuOptions(threads=threads)


def _rows_model(costs, experts: int, tokens: int) -> float:
    """The branch's model ms with its tokens spread evenly over its experts (the log keeps no rows each)."""
    rows = [tokens // experts + (i < tokens % experts) for i in range(experts)]
    return costs.cpu_side_s([r for r in rows if r > 0]) * 1e3


def exact(shell, costs, device) -> list[dict]:
    """Part 1 (module docstring)."""
    c, out = shell.config, []
    w13, w2 = shell.w13.to(device), shell.w2.to(device)  # [E, 2N, K], [E, K, N]
    layers = {r: OffloadedMoE.from_moe(shell, cache_experts=c.num_experts // 2, prefetch=None, compute_misses_on="cpu",
                                       costs=costs, device=device, cpu_options=options_of(r)) for r in VARIANTS}
    for m in (1, 8):
        for seed in range(3):
            g = torch.Generator(device="cpu").manual_seed(1000 * m + seed)
            ids = torch.rand(m, c.num_experts, generator=g).topk(c.top_k, dim=1).indices.to(torch.int32)  # [M, k]
            weights = torch.rand(m, c.top_k, generator=g).softmax(dim=1)  # [M, k]
            x = torch.randn(m, c.hidden_size, generator=g).to(device, w13.dtype)  # [M, K]
            routing = Routing(ids.to(device), weights.to(device))
            with torch.no_grad():
                want = experts_reference(x.float(), w13, w2, routing.topk_ids, routing.topk_weights,
                                         activation=c.activation)
                got = {r: layer.run_routed(x, routing) for r, layer in layers.items()}
            for r, y in got.items():
                err = ((y.float() - want).norm() / want.norm()).item()
                vs = ((y.float() - got[VARIANTS[0]].float()).norm() / got[VARIANTS[0]].float().norm()).item()
                n = layers[r].last_stats.cpu_experts
                out.append({"runner": r, "M": m, "seed": seed, "rel_l2": err, "vs_inline": vs, "cpu_experts": n,
                            "pass": err < BF16_TOLERANCE and n > 0})
    return out


def micro(shell, costs, device, repeats: int) -> list[dict]:
    """Part 2 (module docstring): one row per branch."""
    layers = {r: OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device,
                                       cpu_options=options_of(r)) for r in VARIANTS}
    threads, gemm = costs.cpu_threads or torch.get_num_threads(), costs.cpu_gemm or "direct"
    groups, rows = cold_groups(shell.config.num_experts, 2, 7000), []
    for rep in range(repeats):
        for how, gap in GAPS:
            for n in (1, 2):
                for j in range(len(VARIANTS)):
                    r = VARIANTS[(rep + j) % len(VARIANTS)]
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if how == "gpu" and device.type == "cuda":
                        torch.cuda._sleep(int(gap * 1.4e9))  # ~gap s of GPU clock cycles (~1.4-1.98 GHz)
                        torch.cuda.synchronize(device)
                    else:
                        time.sleep(gap)
                    before, cs, vs, t0 = sched(), _ivcsw(), _nvcsw(), time.perf_counter()
                    ms = branch(layers[r], next(groups), n, 1, layers[r].cpu_options.threads or threads, gemm,
                                busy=False) * 1e3
                    t1 = time.perf_counter()
                    after, cs1, vs1 = sched(), _ivcsw(), _nvcsw()
                    collected, gen = gc_ms(t0, t1)
                    rows.append({"runner": r, "how": how, "gap_ms": gap * 1e3, "experts": n, "ms": ms,
                                 "compute_ms": layers[r].last_cpu.compute_s * 1e3,
                                 "model_ms": costs.cpu_side_s([1] * n) * 1e3,
                                 "gc_ms": collected, "gc_gen": gen, "ivcsw": cs1 - cs, "nvcsw": vs1 - vs,
                                 **sched_delta(before, after)})
    return rows


def _hit_stack(shells, routings, costs, device) -> list[OffloadedMoE]:
    """gpu layers on a cache holding every expert ``routings`` touch, each step run once: all hits after."""
    touched = [set() for _ in routings[0]]
    for per_layer in routings:
        for seen, r in zip(touched, per_layer):
            seen.update(e for e in r.topk_ids.reshape(-1).tolist() if e >= 0)
    cache = ExpertCache(sum(len(s) for s in touched), device=device, policy="lfu")
    layers = [OffloadedMoE.from_moe(shells[i], cache=cache, prefetch=None, costs=costs) for i in range(len(touched))]
    for per_layer in routings:
        x = torch.randn(per_layer[0].topk_ids.shape[0], shells[0].config.hidden_size, device=device,
                        dtype=shells[0].w13.dtype)  # [M, K]
        for layer, r in zip(layers, per_layer):
            layer.run_routed(x, r)
    return layers


def run_cell(shells, config, cell, costs, device, steps: int, deadline: float) -> dict:
    """Part 3 for one cell (module docstring)."""
    stream, fraction, prefetch, m = cell
    warm, total = default_warm_steps(m), len(shells) * config.num_experts
    slots = max(1, round(fraction * total))
    trace, routings = _stream(config, len(shells), m, stream, warm + 1 + steps, device)
    priced = fixed_costs(shells, routings[warm:warm + 4], costs, device, CpuOptions(), slots).priced(costs)
    stacks, logs = {}, {}
    for name in STACKS:
        if name == "hit":
            stacks[name] = _hit_stack(shells, routings[warm:], priced, device)
            continue
        stacks[name] = _stack(shells, trace, slots, name.split("-")[0], prefetch, warm, priced, device)
        for layer in stacks[name]:
            layer._cpu = LoggedPath(options_of(name), device, logs.setdefault(name, []))
    x = torch.randn(m, config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    rows = {name: [] for name in STACKS}
    for step in range(steps + 1):
        if step > 2 and time.perf_counter() > deadline:
            break
        for j in range(len(STACKS)):
            name = STACKS[(step + j) % len(STACKS)]
            logged = len(logs.get(name, []))
            t0 = time.perf_counter()
            seconds, done, _ = _step(stacks[name], x, routings[warm + step], trace.predicted[warm + step],
                                     prefetch and name != "hit", False, device)
            if step:  # the first round untimed
                collected, gen = gc_ms(t0, time.perf_counter())
                branches = [dict(b, model_ms=_rows_model(priced, b["experts"], b["tokens"]),
                                 gc_ms=gc_ms(b["t0"], b["t1"])[0])
                            for b in logs.get(name, [])[logged:]]
                rows[name].append({"ms": seconds * 1e3, "gc_ms": collected, "gc_gen": gen, "branches": branches,
                                   "hits": sum(s.hits for s in done), "cpu_experts": sum(s.cpu_experts for s in done)})
    del stacks
    return {"cell": f"{stream}/{round(fraction * 100)}/{'router' if prefetch else 'none'}/{m}", "slots": slots,
            "stacks": {name: _summary(r) for name, r in rows.items()},
            "paired": {name: _paired(rows[name], rows["auto"]) for name in STACKS if name.startswith("auto-")}}


def _summary(rows: list[dict]) -> dict:
    ms = [r["ms"] for r in rows]
    med = statistics.median(ms)
    branches = [b for r in rows for b in r["branches"]]
    slow = [b for b in branches if b["model_ms"] and b["ms"] > 3 * b["model_ms"]]
    return {"steps": len(ms), "mean_ms": statistics.fmean(ms), "median_ms": med,
            "sem_ms": statistics.stdev(ms) / len(ms) ** 0.5 if len(ms) > 1 else 0.0,
            "stalled": sum(v > 1.5 * med for v in ms), "max_ms": max(ms),
            "mean_unstalled_ms": statistics.fmean(v for v in ms if v <= 1.5 * med),
            "gc_ms": sum(r["gc_ms"] for r in rows), "gc_steps": sum(r["gc_ms"] > 0 for r in rows),
            "stalled_gc": sum(r["ms"] > 1.5 * med and r["gc_ms"] > 0.2 * (r["ms"] - med) for r in rows),
            "branches": len(branches), "slow": len(slow), "slow_gc": sum(b["gc_ms"] > 0.2 * b["ms"] for b in slow),
            "slow_list": [{k: round(v, 3) if isinstance(v, float) else v for k, v in b.items() if k not in ("t0", "t1")}
                          for b in slow][:8],
            "ratio_median": statistics.median(b["ms"] / b["model_ms"] for b in branches if b["model_ms"]) if branches
            else 0.0,
            "cpu_experts": statistics.fmean(r["cpu_experts"] for r in rows),
            "hits": statistics.fmean(r["hits"] for r in rows),
            "ms_list": [round(v, 3) for v in ms]}


def _paired(rows: list[dict], base: list[dict]) -> dict:
    """A stack's steps less auto's, step by step (same rounds): mean and its standard error, ms."""
    d = [a["ms"] - b["ms"] for a, b in zip(rows, base)]
    return {"mean_ms": statistics.fmean(d), "sem_ms": statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0,
            "n": len(d)}


def _dump(result: dict, out: str | None) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        result["total_s"] = time.perf_counter() - START
        with open(os.path.join(out, "offload_stall_device_check.json"), "w") as f:
            json.dump(result, f, default=str)


def main() -> int:
    global STACKS, VARIANTS
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--budget", type=float, default=125.0, help="seconds: no part or cell starts past it")
    parser.add_argument("--steps", type=int, default=0, help="steps a cell (0: 80; smoke 3)")
    parser.add_argument("--repeats", type=int, default=0, help="part 2's rounds (0: 10; smoke 1)")
    parser.add_argument("--stacks", default=",".join(STACKS), help="part 3's stacks: mode[-tN], gpu, hit")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="parts 1-2: tN or cal, the first the base")
    args = parser.parse_args()
    STACKS, VARIANTS = tuple(args.stacks.split(",")), tuple(args.variants.split(","))
    s = offload_setting(args.smoke)
    cuda, device, shape, config = s.cuda, s.device, s.shape, s.config
    gc.callbacks.append(_gc_callback)
    shells = host_shells(config, torch.bfloat16 if cuda else torch.float32, device, layers=shape["layers"])
    costs = measure_costs(shells[0], device, CpuOptions(), cpu_rows((1, 8)))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": shape,
              "cpu_count": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
              "torch_threads": torch.get_num_threads(), "cpu_threads": costs.cpu_threads, "cpu_gemm": costs.cpu_gemm,
              "gc_threshold": gc.get_threshold(), "gc_tracked": len(gc.get_objects()), "cells": []}
    print(f"costs: {time.perf_counter() - START:.1f} s; CPU branch at {costs.cpu_threads} threads ({costs.cpu_gemm}); "
          f"{result['gc_tracked']} objects tracked by gc", flush=True)
    result["exact"] = exact(shells[0], costs, device)
    print(f"exact: {sum(r['pass'] for r in result['exact'])} of {len(result['exact'])} PASS", flush=True)
    _dump(result, args.out)
    result["micro"] = micro(shells[0], costs, device, args.repeats or (10 if cuda else 1))
    print(f"micro: {len(result['micro'])} branches, {time.perf_counter() - START:.1f} s", flush=True)
    _dump(result, args.out)
    for cell in CELLS:
        left = START + args.budget - time.perf_counter()
        if left < 15 and result["cells"]:
            print(f"budget: cell {cell} skipped", flush=True)
            continue
        steps = args.steps or (80 if cuda else 3)
        result["cells"].append(run_cell(shells, config, cell, costs, device, steps, START + args.budget - 5))
        c = result["cells"][-1]
        print(f"cell {c['cell']}: " + ", ".join(f"{k} {v['mean_ms']:.2f}/{v['median_ms']:.2f} ms n{v['steps']} "
                                                 f"st{v['stalled']}" for k, v in c["stacks"].items()), flush=True)
        _dump(result, args.out)
        if cuda:
            torch.cuda.empty_cache()
    _dump(result, args.out)
    print_result(result, START)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Device check for issue #18's cpu mode at M = 1: where a step spends the time its floor, with each CPU
branch as it ran, does not explain (a54d29e: 0.26-0.48 ms a layer outside the branches).

    PYTHONPATH=$PWD python3 benchmarks/offload_step_anatomy.py --out $OUT/offload [--budget 75]  (H200, <= 100 s)
    PYTHONPATH=$PWD python3 benchmarks/offload_step_anatomy.py --smoke                            (CPU, tiny shapes)

Qwen3-30B-A3B widths (E=128, K=2048, N=768, top-8, bf16), 4 layers on their own pinned host weights, the
bench's streams and seed (``offload_fetch_device_check``'s stack and step). Parts:

0. staging: the CPU branch's small moves and switches alone (``offload_staging_micro``).
1. exact: the cpu and gpu modes' outputs at M = 1 against the float32 reference (``offload_cpu_anatomy.exactness``).
2. cells (skewed 75% none, skewed 50% router, M = 1): cpu and gpu stacks, the cpu one also with the staging
   before session 21 ("cpu-old": ``offload_staging_cat``), and an all-hit stack (a
   cache holding every expert the steps touch) take turns step by step; every other step traced
   (``moekit.offload.StepTrace``: host clock and CUDA events at the layers' marks). Per mode: the step
   untraced / traced; for cpu, the floor (``offload_floor.timeline_s``) with each layer's CPU branch as it
   ran and the fixed cost measured before the cell, and with the all-hit stack's own fixed cost (same run,
   same turns): step - that floor is the excess; per mark, the host's and the GPU's time from the layer's
   start (median over layers and steps), and the CPU branch's phases.
   The first cell's cpu stack then runs 8 more steps under cProfile (top 30 by internal time).
3. after: one all-hit layer's forward (host clock to the sync, traced) right after a CPU branch of one cold
   expert (at the calibration's threads, and at 1 thread), after a sleep as long as a branch, after a
   branch and 2 or 30 ms asleep, after 30 ms asleep ("quiet": no OpenMP worker can still be spinning), and
   after nothing (the previous variant's forward): does the host run a layer slower after a branch, and
   for how long (libgomp's workers spin after a region before they sleep)?

Prints as it goes; the tables last. JSON to OUT/offload_step_anatomy.json, rewritten after every part.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

from moekit.bench.offload_floor import fixed_costs, timeline_s
from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import cpu_rows, default_warm_steps, measure_costs
from offload_setting import offload_setting
from moekit.offload import CpuOptions, ExpertCache, OffloadedMoE, StepTrace
from moekit.offload.calibrate import branch, cold_groups
from moekit.offload.cpu_path import CpuPath, CpuPhases, Staged, torch_threads
from moekit.offload.gpu_terms import fixed_from
from offload_cpu_anatomy import exactness  # benchmarks/ on sys.path
from offload_fetch_device_check import _stack, _step, _stream
from offload_staging_micro import staging_line, staging_parts
import offload_staging_cat as cat

START = time.perf_counter()
CELLS = (("skewed", 0.75, False, 1), ("skewed", 0.5, True, 1))  # (stream, cache fraction, prefetch router, M)
MODES = ("cpu", "cpu-old", "gpu", "hit")  # module docstring
AFTER = ("quiet", "branch_t1", "branch_sleep30", "plain", "branch", "sleep", "branch_sleep2")  # a fixed cyclic order:
# branch_t1 follows 30 ms of quiet, plain a branch and 30 ms asleep, sleep the 12-thread branch's forward
QUIET_S = 0.03  # "quiet"'s and "branch_sleep30"'s host idle: libgomp's default spin (300k) is done long before


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CatPath(CpuPath):
    """The CPU branch with the staging before session 21 (``offload_staging_cat``: a cat of byte views on the
    device, one copy, the views made per forward)."""

    def __init__(self, options: CpuOptions, device: torch.device) -> None:
        super().__init__(options, device)
        self.buffers = cat.Buffers(pin=self.pin)

    def stage(self, tensors: list[torch.Tensor]) -> Staged:
        start = time.perf_counter()
        inputs, event = cat.to_host(tensors, pin=self.pin, buffers=self.buffers)
        return Staged(inputs, event, time.perf_counter() - start)

    def finish(self, staged, compute, device, experts: int, tokens: int, threads: int | None) -> torch.Tensor:
        clock = [time.perf_counter()]
        if staged.event is not None:
            staged.event.synchronize()
        clock.append(time.perf_counter())
        with torch_threads(threads) as used:
            y = compute(staged.inputs)
            clock.append(time.perf_counter())
            out = cat.to_device(y, device, pin=self.pin, buffers=self.buffers)
        clock.append(time.perf_counter())
        self.last = CpuPhases(staged.stage_s, clock[1] - clock[0], clock[2] - clock[1], clock[3] - clock[2],
                              experts, tokens, used)
        return out


def hit_stack(shells, routings, costs, device) -> list[OffloadedMoE]:
    """gpu layers on a cache holding every expert ``routings`` touch, each step run once: all hits after."""
    touched = [set() for _ in routings[0]]
    for per_layer in routings:
        for seen, r in zip(touched, per_layer):
            seen.update(e for e in r.topk_ids.reshape(-1).tolist() if e >= 0)
    cache = ExpertCache(sum(len(s) for s in touched), device=device, policy="lfu")
    layers = [OffloadedMoE.from_moe(shells[i], cache=cache, prefetch=None, costs=costs) for i in range(len(touched))]
    x = torch.randn(1, shells[0].config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    for per_layer in routings:
        for layer, r in zip(layers, per_layer):
            layer.run_routed(x, r)
    return layers


def timeline(marks) -> list[dict[str, tuple[float, float]]]:
    """Per layer of a traced step: mark name -> (host s, GPU s) from the layer's "start" (the GPU clock aligned
    to the host's at the layer's "touched", where the host has just synchronised; NaN without CUDA times);
    "next": the next layer's start (the last layer: the step's end). The first mark of each name."""
    order = [m.layer for m in marks if m.name == "start"]
    end = next((m.host_s for m in marks if m.name == "step_end"), float("nan"))
    out = []
    for i, layer in enumerate(order):
        ms = [m for m in marks if m.layer == layer]
        t0 = next(m for m in ms if m.name == "start")
        touched = next((m for m in ms if m.name == "touched"), None)
        offset = float("nan") if touched is None or touched.gpu_s is None else touched.host_s - touched.gpu_s
        times: dict[str, tuple[float, float]] = {}
        for m in ms:
            gpu = float("nan") if m.gpu_s is None else m.gpu_s + offset - t0.host_s
            times.setdefault(m.name, (m.host_s - t0.host_s, gpu))
        nxt = end if i + 1 == len(order) else next(m.host_s for m in marks if m.layer == order[i + 1]
                                                   and m.name == "start")
        times["next"] = (nxt - t0.host_s, float("nan"))
        out.append(times)
    return out


def kind(mode: str, times: dict) -> str:
    """A traced layer's row in the table: its mode, "/branch" with a CPU branch, "/fetch" with a fetch."""
    return mode + ("/branch" if "cpu_start" in times else "") + ("/fetch" if "copy_start:fetch" in times else "")


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def _profile(layers, x, routings, predicted, prefetch: bool, device) -> str:
    """cProfile over ``routings``' steps of the cpu stack (again: the cache moved on), top 30 by internal time."""
    profiler = cProfile.Profile()
    for i, per_layer in enumerate(routings):
        profiler.enable()
        _step(layers, x, per_layer, predicted[i], prefetch, False, device)
        profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


def _stacks(shells, trace, routings, slots: int, prefetch: bool, warm: int, costs, device) -> dict:
    """MODES' stacks: the cell's stacks brought through ``warm`` steps ("cpu-old": the staging before session 21,
    ``offload_staging_cat``), and the all-hit one."""
    stacks = {mode: _stack(shells, trace, slots, mode, prefetch, warm, costs, device) for mode in MODES[:-1]}
    for layer in stacks["cpu-old"]:
        layer._cpu = CatPath(layer.cpu_options, device)
    stacks["hit"] = hit_stack(shells, routings, costs, device)
    return stacks


def run_cell(shells, config, cell, costs, device, steps: int, profile: bool = False) -> dict:
    """Part 2 for one cell (module docstring)."""
    stream, fraction, prefetch, m = cell
    warm, total = default_warm_steps(m), len(shells) * config.num_experts
    slots = max(1, round(fraction * total))
    trace, routings = _stream(config, len(shells), m, stream, warm + 1 + steps, device)
    fixed = fixed_costs(shells, routings[warm:warm + 4], costs, device, CpuOptions(), slots)
    priced = fixed.priced(costs)
    stacks = _stacks(shells, trace, routings[warm:], slots, prefetch, warm, priced, device)
    x = torch.randn(m, config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    steps_by, prev = {mode: [] for mode in MODES}, None
    for step in range(steps + 1):
        for j in range(len(MODES)):
            mode = MODES[(step + j) % len(MODES)]
            traced = step % 2 == 0 and step > 0
            seconds, done, marks = _step(stacks[mode], x, routings[warm + step], trace.predicted[warm + step],
                                         prefetch and mode != "hit", traced, device)
            phases = [(l.last_cpu.stage_s, l.last_cpu.wait_s, l.last_cpu.compute_s, l.last_cpu.back_s)
                      if l.last_cpu is not None else (0.0,) * 4 for l in stacks[mode]]
            if step:
                steps_by[mode].append({"s": seconds, "traced": traced, "done": done, "phases": phases,
                                       "marks": timeline(marks) if traced else [], "after": prev})
            prev = mode
    eb = stacks["cpu"][0].cache.expert_bytes
    text = _profile(stacks["cpu"], x, routings[warm + 1: warm + 9], trace.predicted[warm + 1:], prefetch,
                    device) if profile else ""
    del stacks
    hit_plain = [r for r in steps_by["hit"] if not r["traced"]]
    ref_fixed = fixed_from([r["s"] for r in hit_plain], [sum(s.hits for s in r["done"]) for r in hit_plain],
                           len(shells), eb, priced)
    out = {"cell": f"{stream}/{round(fraction * 100)}/{'router' if prefetch else 'none'}/{m}", "slots": slots,
           "fixed_ms": fixed.layer_s * 1e3, "ref_fixed_ms": ref_fixed * 1e3, "overlap_ms": fixed.overlap_s * 1e3,
           "prefetch_layer_ms": fixed.prefetch_layer_s * 1e3, "issue_us": fixed.issue_s * 1e6,
           "copy_call_ms": fixed.copy_call_s * 1e3, "modes": {}, "kinds": {}, "profile": text}
    for mode, rows in steps_by.items():
        plain = [r for r in rows if not r["traced"]]
        ran = [[sum(p) for p in r["phases"]] for r in plain]
        floors = {name: [timeline_s(r["done"], eb, priced, f, fixed.overlap_s, fixed.prefetch_layer_s, measured=b,
                                    copy_call_s=fixed.copy_call_s)
                         for r, b in zip(plain, ran)] for name, f in (("fixed", fixed.layer_s), ("ref", ref_fixed))}
        cpu_layers = [p for r in plain for p in r["phases"] if sum(p) > 0]
        out["modes"][mode] = {
            "step_ms": statistics.fmean(r["s"] for r in plain) * 1e3,
            "after_ms": {a: statistics.fmean(r["s"] for r in rows if r["after"] == a) * 1e3
                         for a in MODES if any(r["after"] == a for r in rows)},
            "traced_ms": statistics.fmean(r["s"] for r in rows if r["traced"]) * 1e3,
            "floor_ran_ms": statistics.fmean(floors["fixed"]) * 1e3,
            "floor_ran_ref_ms": statistics.fmean(floors["ref"]) * 1e3,
            "branches_per_step": len(cpu_layers) / len(plain),
            "branch_ms": [_median([p[i] for p in cpu_layers]) * 1e3 for i in range(4)],
            "cpu_experts_per_step": statistics.fmean(sum(s.cpu_experts for s in r["done"]) for r in plain),
            "fetched_per_step": statistics.fmean(sum(s.fetched for s in r["done"]) for r in plain),
            "admitted_per_step": statistics.fmean(sum(s.admitted for s in r["done"]) for r in plain),
        }
    out["kinds"] = _kinds(steps_by)
    return out


def _kinds(steps_by: dict) -> dict:
    """Per kind of forward (``kind``): each mark's median host and GPU ms over the traced steps, and its count."""
    kinds: dict = {}
    for mode, rows in steps_by.items():
        for r in rows:
            for times in r["marks"]:
                by = kinds.setdefault(kind(mode, times), {})
                for name, v in times.items():
                    by.setdefault(name, []).append(v)
    return {k: {n: (_median([h for h, _ in v]) * 1e3, _median([g for _, g in v]) * 1e3, len(v))
                for n, v in by.items()} for k, by in sorted(kinds.items())}


def after_branch(shells, config, costs, device, repeats: int) -> dict:
    """Part 3 (module docstring): {variant: [host ms of one all-hit forward, its marks]}."""
    _, routings = _stream(config, 1, 1, "skewed", 4, device)
    layer = hit_stack(shells[:1], routings, costs, device)[0]
    probe = OffloadedMoE.from_moe(shells[0], cache_experts=1, prefetch=None, device=device, cpu_options=CpuOptions())
    groups = cold_groups(config.num_experts, config.top_k, 700)
    x = torch.randn(1, config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    threads, gemm = costs.cpu_threads, costs.cpu_gemm or "direct"
    got = {v: [] for v in AFTER}
    parts = {v: [] for v in AFTER}
    branch_s = []
    for rep in range(repeats):
        for j in range(len(AFTER)):
            variant = AFTER[(rep + j) % len(AFTER)]
            if variant.startswith("branch"):
                branch_s.append(branch(probe, next(groups), 1, 1, 1 if variant == "branch_t1" else threads, gemm,
                                       busy=False))
                pause = {"branch_sleep2": 0.002, "branch_sleep30": QUIET_S}.get(variant)
                if pause:
                    time.sleep(pause)
            elif variant == "quiet":
                time.sleep(QUIET_S)
            elif variant == "sleep":
                time.sleep(statistics.median(branch_s) if branch_s else 0.001)
            _sync(device)
            layer.cache.trace = StepTrace(device)
            start = time.perf_counter()
            layer.run_routed(x, routings[-1][0])
            _sync(device)
            got[variant].append(time.perf_counter() - start)
            layer.cache.mark("step_end", -1)
            parts[variant].append(timeline(layer.cache.trace.read())[0])
            layer.cache.trace = None
    out = {"branch_ms": _median(branch_s) * 1e3, "threads": threads, "gemm": gemm, "variants": {}}
    for v in AFTER:
        names = sorted({n for p in parts[v] for n in p}, key=lambda n: _median([p[n][0] for p in parts[v] if n in p]))
        out["variants"][v] = {"ms": _median(got[v]) * 1e3, "min_ms": min(got[v]) * 1e3,
                              "marks": {n: _median([p[n][0] for p in parts[v] if n in p]) * 1e3 for n in names}}
    return out


def _dump(result: dict, out: str | None) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        result["total_s"] = time.perf_counter() - START
        with open(os.path.join(out, "offload_step_anatomy.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)


def _print(result: dict) -> None:
    c = result["costs"]
    print(f"\n{result['device']}, torch {result['torch']}; CPU {c['cpu_gemm']} at {c['cpu_threads']} threads, "
          f"{c['cpu_step_s'] * 1e3:.3f} ms a call; total {time.perf_counter() - START:.0f} s")
    print(staging_line(result["staging"]))
    a = result.get("after")
    if a:
        print(f"after: one all-hit layer forward, host ms to its sync (median/min), after the setting; branch "
              f"{a['branch_ms']:.2f} ms ({a['gemm']}, {a['threads']} threads); marks: host ms from start")
        for v, r in a["variants"].items():
            print(f"  {v:<14} {r['ms']:6.3f}/{r['min_ms']:6.3f}  "
                  + " ".join(f"{n} {t:.3f}" for n, t in r["marks"].items()))
    for cell in result["cells"]:
        if cell["profile"]:
            print(f"cProfile, cpu stack, {cell['cell']}, 8 steps:" + cell["profile"][-6000:])
    for cell in result["cells"]:
        print(f"cell {cell['cell']}: slots {cell['slots']}, fixed {cell['fixed_ms']:.3f} ms (all-hit stack among the "
              f"turns {cell['ref_fixed_ms']:.3f}), overlap {cell['overlap_ms']:.3f}, prefetch layer "
              f"{cell['prefetch_layer_ms']:.3f}, issue {cell['issue_us']:.1f} us, call after a copy "
              f"{cell['copy_call_ms']:.3f}")
        kinds = cell["kinds"]
        names = sorted({n for k in kinds.values() for n in k},
                       key=lambda n: min(k[n][0] for k in kinds.values() if n in k))
        print("  mark: host/GPU ms from the layer's start (median, n) | " + " | ".join(f"{k:>20}" for k in kinds))
        for n in names:
            print(f"  {n:<20} | " + " | ".join("{:6.3f}/{:6.3f} n{:<4d}".format(*k[n]) if n in k else f"{'-':>20}"
                                               for k in kinds.values()))
        for mode, r in cell["modes"].items():
            b = r["branch_ms"]
            print(f"  {mode:>3}: step {r['step_ms']:.3f} ms (traced {r['traced_ms']:.3f}); floor with branches as they "
                  f"ran {r['floor_ran_ms']:.3f} (x{r['step_ms'] / r['floor_ran_ms']:.2f}), by the all-hit stack's "
                  f"fixed {r['floor_ran_ref_ms']:.3f} (x{r['step_ms'] / r['floor_ran_ref_ms']:.2f}); excess a layer "
                  f"{(r['step_ms'] - r['floor_ran_ref_ms']) / result['shape']['layers']:.3f} ms; branches "
                  f"{r['branches_per_step']:.2f} a step, median stage/wait/compute/back "
                  f"{b[0]:.3f}/{b[1]:.3f}/{b[2]:.3f}/{b[3]:.3f}; cpu experts {r['cpu_experts_per_step']:.2f}, fetched "
                  f"{r['fetched_per_step']:.2f}, admitted {r['admitted_per_step']:.2f} a step; step by the stack "
                  f"before it (traced too): " + ", ".join(f"{a} {v:.3f}" for a, v in r["after_ms"].items()))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--budget", type=float, default=75.0, help="seconds: no part or cell starts past it")
    args = parser.parse_args()
    s = offload_setting(args.smoke)
    cuda, device, shape, config = s.cuda, s.device, s.shape, s.config
    shells = host_shells(config, torch.bfloat16 if cuda else torch.float32, device, layers=shape["layers"])
    costs = measure_costs(shells[0], device, CpuOptions(), cpu_rows((1,)))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": shape,
              "costs": dataclasses.asdict(costs), "cells": []}
    print(f"costs: {time.perf_counter() - START:.1f} s", flush=True)
    result["exact"] = exactness(shells[0], costs, device, (1,), ("gpu", "cpu"))
    for r in result["exact"]:
        print(f"exact {r['mode']:>3} M=1 rel_l2 {r['rel_l2']:.2e} {'PASS' if r['pass'] else 'FAIL'}", flush=True)
    result["staging"] = staging_parts(shells[0], device, costs.cpu_threads, 300 if cuda else 5)
    print(staging_line(result["staging"]), flush=True)
    result["after"] = after_branch(shells, config, costs, device, 40 if cuda else 3)
    print(f"after: {time.perf_counter() - START:.1f} s", flush=True)
    _dump(result, args.out)
    for cell in CELLS:
        if time.perf_counter() - START > args.budget:
            print(f"budget: cell {cell} skipped", flush=True)
            continue
        result["cells"].append(run_cell(shells, config, cell, costs, device, 40 if cuda else 2,
                                        profile=not result["cells"]))
        print(f"cell {result['cells'][-1]['cell']}: {time.perf_counter() - START:.1f} s", flush=True)
        _dump(result, args.out)
        if cuda:
            torch.cuda.empty_cache()
    _dump(result, args.out)
    _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

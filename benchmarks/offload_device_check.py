"""Device check for issue #18's two missed targets: where the CPU-miss path's time goes, and "auto" at M = 1.

    PYTHONPATH=$PWD python benchmarks/offload_device_check.py        (H200; < 2 min, hard limit inside)

1. The CPU branch in phases (``cpu_path.CpuPhases``: stage, wait, compute, back) at DeepSeek-V3 width
   (E=256, N=2048, K=7168, bf16), cold experts, link busy: 1 and 8 experts x 1 token, per thread count
   and CPU GEMM, and session 7's staging (a pinned allocation per copy) against the reused buffers.
2. The costs as ``measure_costs`` fits them now (step, expert, token, threads, margin).
3. The M = 1 table of ``moekit bench --offload`` (both streams, every fraction / policy / prefetch;
   gpu, cpu, auto) per variant: "s7" (session 7's path: per-call staging, admissions after the CPU
   compute, no margin), "new" (reused staging, admissions overlapping the compute, the measured
   margin); then, lru only: "late" (the new path with admissions after the CPU compute), "new-m2"
   (margin at least 2: the margin's share), "new-a1" (one admission per forward with CPU misses, so
   auto's CPU experts still enter the cache), and "new" at M = 8, as time allows. Per variant: each mode's x floor range, auto / best pure mode, the CPU branch's
   measured / modelled time and its phases per step.

The short table is printed last; JSON goes to $OUT/offload_device_check.json when $OUT is set. Without
CUDA it runs tiny shapes on the CPU (a smoke test of the script, no numbers to read).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import measure_costs, measure_offload
from moekit.config import MoEConfig
from moekit.offload import CpuOptions, OffloadedMoE
from moekit.offload.calibrate import branch, most_threads

LIMIT_S = 110.0  # hard limit: later parts are skipped past it
START = time.perf_counter()


class OutOfTime(Exception):
    pass


def _left() -> float:
    return LIMIT_S - (time.perf_counter() - START)


def phase_rows(shell, device, threads: list[int], repeats: int) -> list[dict]:
    """Part 1: the CPU branch's phases per (gemm, threads, staging) at 1 and 8 experts x 1 token."""
    rows, group = [], iter(range(10**6))
    e, k = shell.config.num_experts, 8
    variants = [(g, t, True) for g in ("onednn_fused", "mm_loop") for t in threads]
    variants.append(("onednn_fused", None, False))  # session 7's staging, torch's thread count
    for gemm, t, reuse in variants:
        if _left() < 80:
            break
        options = CpuOptions(threads=t, gemm=gemm, reuse_staging=reuse)
        layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=options)
        branch(layer, [next(group) % e for _ in range(k)], 1, 1, t, gemm)  # first call
        for experts in (1, 8):
            phases = []
            for _ in range(repeats):
                branch(layer, [next(group) % e for _ in range(k)], experts, 1, t, gemm)
                phases.append(layer.last_cpu)
            med = {f: statistics.median(getattr(p, f) for p in phases) * 1e3
                   for f in ("stage_s", "wait_s", "compute_s", "back_s", "total_s")}
            rows.append({"gemm": gemm, "threads": phases[0].threads, "reuse_staging": reuse, "experts": experts,
                         **{f.replace("_s", "_ms"): v for f, v in med.items()},
                         "compute_per_expert_ms": med["compute_s"] / experts})
    return rows


def variant(name: str, shells, device, costs, options: CpuOptions, margin: bool, batches, shape,
            admit: int | None, policies: tuple[str, ...]) -> dict:
    rows = []

    def progress(r):
        rows.append(dataclasses.asdict(r))
        if _left() < 0:
            raise OutOfTime

    start = time.perf_counter()
    complete = True
    try:
        doc = measure_offload(device, batches=batches, shells=shells, costs=costs, cpu_options=options, policies=policies,
                              observed_margin=margin, on_progress=progress, admit_per_forward=admit, **shape)
        margin_used = doc["cpu_margin"]
    except OutOfTime:
        complete, margin_used = False, float("nan")
    return {"name": name, "options": dataclasses.asdict(options), "admit_per_forward": admit, "policies": policies,
            "batches": list(batches), "complete": complete,
            "cpu_margin": margin_used, "seconds": time.perf_counter() - start, "rows": rows}


def digest(v: dict) -> dict:
    """One variant's line: x floor per mode, auto / best, the CPU branch measured / modelled and phases."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in v["rows"]:
        cells.setdefault((r["stream"], r["cache_fraction"], r["policy"], r["prefetch"], r["M"]), {})[r["compute_misses_on"]] = r
    ratios = [m["auto"]["step_ms"] / min(m["gpu"]["step_ms"], m["cpu"]["step_ms"])
              for m in cells.values() if {"gpu", "cpu", "auto"} <= set(m)]
    out = {"name": v["name"], "M": v["batches"], "cells": len(cells), "margin": v["cpu_margin"]}
    for mode in ("gpu", "cpu", "auto"):
        xs = [r["x_floor"] for r in v["rows"] if r["compute_misses_on"] == mode]
        out[mode] = (min(xs), max(xs), sum(x > 1.2 for x in xs), len(xs)) if xs else None
    hits = {mode: statistics.fmean(r["hit_rate"] for r in v["rows"] if r["compute_misses_on"] == mode)
            for mode in ("gpu", "auto") if any(r["compute_misses_on"] == mode for r in v["rows"])}
    out["auto_minus_gpu_hit"] = hits["auto"] - hits["gpu"] if len(hits) == 2 else None
    out["auto_best"] = (max(ratios), sum(q > 1.0 for q in ratios), sum(q > 1.03 for q in ratios), len(ratios)) if ratios else None
    cpu_rows = [r for r in v["rows"] if r["compute_misses_on"] == "cpu"]
    if cpu_rows:
        total = {f: sum(r[f] for r in cpu_rows) for f in ("cpu_ms", "cpu_model_ms", "cpu_stage_ms", "cpu_wait_ms",
                                                          "cpu_compute_ms", "cpu_back_ms", "step_ms")}
        out["cpu_mode"] = {f: t / len(cpu_rows) for f, t in total.items()}
        out["cpu_mode"]["measured_over_model"] = total["cpu_ms"] / total["cpu_model_ms"] if total["cpu_model_ms"] else None
    return out


def main() -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = {} if cuda else {"experts": 16, "hidden": 64, "inter": 32, "top_k": 2}
    full = {"experts": 256, "hidden": 7168, "inter": 2048, "top_k": 8, **shape}
    config = MoEConfig(hidden_size=full["hidden"], moe_intermediate_size=full["inter"], num_experts=full["experts"],
                       top_k=full["top_k"])
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    shells = host_shells(config, torch.bfloat16 if cuda else torch.float32, device, layers=shape.get("layers", 2))  # measure_offload's default L
    shell = shells[0]
    result["setup_s"] = time.perf_counter() - START
    n = torch.get_num_threads()
    top = most_threads()
    threads = sorted({t for t in (top, n, 12, 8, 4) if t <= top}, reverse=True)
    result["phases"] = phase_rows(shell, device, threads, repeats=3)
    clock = time.perf_counter()
    costs = measure_costs(shell, device, CpuOptions())
    result["costs"] = dataclasses.asdict(costs)
    result["costs_s"] = time.perf_counter() - clock
    plain = dataclasses.replace(costs, cpu_margin=1.0)
    wide = dataclasses.replace(costs, cpu_margin=max(costs.cpu_margin, 2.0))
    both, lru = ("lfu", "lru"), ("lru",)
    variants = [("new", CpuOptions(), costs, True, (1,), None, both),
                ("s7", CpuOptions.baseline(), plain, False, (1,), None, both),
                ("late", CpuOptions(admit_early=False), costs, True, (1,), None, lru),
                ("new-m2", CpuOptions(), wide, True, (1,), None, lru),
                ("new-a1", CpuOptions(), costs, True, (1,), 1, lru),
                ("new", CpuOptions(), costs, True, (8,), None, lru)]
    result["variants"] = []
    for name, options, c, margin, batches, admit, policies in variants:
        if _left() < (12 if policies == lru else 22):
            result.setdefault("skipped", []).append(f"{name} M={batches}")
            continue
        result["variants"].append(variant(name, shells, device, c, options, margin, batches, shape, admit, policies))
    result["digest"] = [digest(v) for v in result["variants"]]
    result["total_s"] = time.perf_counter() - START
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "offload_device_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    _print(result)
    return 0


def _print(result: dict) -> None:
    c = result["costs"]
    print(f"\n{result['device']}, torch {result['torch']}, {result['cpu_count']} cpus, torch threads "
          f"{result['torch_threads']}; setup {result['setup_s']:.0f} s, total {result['total_s']:.0f} s")
    print("CPU branch phases (median ms; cold experts, 1 token each, link busy):")
    print(f"{'gemm':>12} {'thr':>3} {'reuse':>5} {'exp':>3} {'stage':>6} {'wait':>6} {'compute':>8} {'back':>6} "
          f"{'total':>7} {'ms/exp':>7}")
    for r in result["phases"]:
        print(f"{r['gemm']:>12} {r['threads']:>3} {str(r['reuse_staging']):>5} {r['experts']:>3} {r['stage_ms']:6.3f} "
              f"{r['wait_ms']:6.3f} {r['compute_ms']:8.3f} {r['back_ms']:6.3f} {r['total_ms']:7.3f} "
              f"{r['compute_per_expert_ms']:7.3f}")
    print(f"costs: step {c['cpu_step_s'] * 1e3:.3f} ms + {c['cpu_expert_s'] * 1e3:.3f} ms/expert + "
          f"{c['cpu_token_s'] * 1e6:.1f} us/token at {c['cpu_threads']} threads, {c['cpu_gemm']}, margin {c['cpu_margin']:.2f}; link "
          f"{c['link_bytes_per_s'] / 1e9:.1f} GB/s (measured in {result['costs_s']:.1f} s)")
    print("variant  M  cells margin | x floor min-max (>1.2 of n) gpu | cpu | auto | auto/best worst (>1, >1.03 of n) "
          "| auto-gpu hit | cpu mode per step: step, branch meas/model ms, stage/wait/compute/back ms")
    for d in result["digest"]:
        modes = " | ".join("-" if d[m] is None else f"{d[m][0]:.2f}-{d[m][1]:.2f} ({d[m][2]}/{d[m][3]})"
                           for m in ("gpu", "cpu", "auto"))
        ab = "-" if d["auto_best"] is None else (f"{d['auto_best'][0]:.2f} ({d['auto_best'][1]}, {d['auto_best'][2]} "
                                                 f"of {d['auto_best'][3]})")
        cm = d.get("cpu_mode")
        cpu = "-" if cm is None else (f"{cm['step_ms']:.1f}, {cm['cpu_ms']:.1f}/{cm['cpu_model_ms']:.1f}, "
                                      f"{cm['cpu_stage_ms']:.2f}/{cm['cpu_wait_ms']:.2f}/{cm['cpu_compute_ms']:.1f}/"
                                      f"{cm['cpu_back_ms']:.2f}")
        dh = "-" if d["auto_minus_gpu_hit"] is None else f"{d['auto_minus_gpu_hit']:+.3f}"
        print(f"{d['name']:>7} {d['M']} {d['cells']:>3} {d['margin']:.2f} | {modes} | {ab} | {dh} | {cpu}")
    for s in result.get("skipped", []):
        print(f"skipped (time limit): {s}")


if __name__ == "__main__":
    sys.exit(main())

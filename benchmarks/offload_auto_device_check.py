"""Device check for issue #18's last misses: "auto" on skewed 75% streams at M = 1, and the cpu mode's step
over its floor.

    PYTHONPATH=$PWD python benchmarks/offload_auto_device_check.py        (H200; < 100 s, hard limit inside)

1. The costs as ``measure_costs`` fits them, with the link's rate while the CPU branch computes
   (``calibrate.link_during_cpu``, new), and a probe of it: a 256 MiB copy alone, the same copy while
   the CPU branch computes 8 cold experts (with that branch's compute ms), 3 times each.
2. ``moekit bench --offload`` cells (DeepSeek-V3 width, bf16, 2 layers), M = 1: uniform and skewed x
   50% / 75% cache x lfu / lru x (skewed) prefetch none / router; then M = 8 at 75%, lru, as time
   allows. Per cell, in one rotation: gpu, auto (refetch priced by each miss's reuse class, fetches
   beside CPU work and admissions at the link's rate during CPU work) and "auto-old" (session 8's
   decision: refetch = this forward's hit rate, the idle link rate throughout); in a second: cpu
   (admissions at the link's rate during CPU work) and "cpu-old" (at the idle link rate). Three runs
   at most per rotation: each holds its own cache, 33.8 GB at 75%.

Printed last, per cell: each mode's step ms / floor ms, step / floor (the bench's timeline floor,
``offload_floor.timeline_s``), step / session 8's floor, hit / simulated hit; auto and auto-old over
the best pure mode. At the session 9 checkpoint (bc1b940, with "auto-idle" and three diagnostic
floors): link 55.0 GB/s alone, 53.0 during CPU work; auto / best pure worst 1.01 (none by > 3%),
auto-old 1.17; cpu 0.89-1.18x session 8's floor, 0.89-1.05x the timeline.
JSON goes to $OUT/offload_auto_device_check.json when $OUT is set. Without CUDA it runs tiny shapes on
the CPU (a smoke test of the script, no numbers to read).
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
from moekit.bench.offload_report import modes_by_cell
from moekit.config import MoEConfig
from moekit.offload import CpuOptions, OffloadedMoE, measure_link_bandwidth
from moekit.offload.calibrate import branch, link_during_cpu

LIMIT_S = 88.0  # hard limit: the cells stop past it (the rows so far are kept)
START = time.perf_counter()
OLD_AUTO = {"auto-old": ("auto", {"refetch": "hit_rate", "link_cpu_bytes_per_s": None})}
OLD_CPU = {"cpu-old": ("cpu", {"link_cpu_bytes_per_s": None})}
# (M, cache fractions, policies, places, variants): at most 3 runs per group (each run holds its own
# cache: 3 x 33.8 GB at 75%), so gpu / auto / auto-old rotate together, and cpu / cpu-old
PARTS = (((1,), (0.5, 0.75), ("lfu", "lru"), ("gpu", "auto"), OLD_AUTO),
         ((1,), (0.5, 0.75), ("lfu", "lru"), ("cpu",), OLD_CPU),
         ((8,), (0.75,), ("lru",), ("gpu", "auto"), OLD_AUTO),
         ((8,), (0.75,), ("lru",), ("cpu",), OLD_CPU))
MODES = ("gpu", "cpu", "cpu-old", "auto", "auto-old")


class OutOfTime(Exception):
    pass


def _left() -> float:
    return LIMIT_S - (time.perf_counter() - START)


def link_probe(shell, device, costs, repeats: int = 3) -> dict:
    """Part 1's probe: the link alone and during the CPU branch (GB/s), that branch's compute ms, and the
    whole branch under a busy link (as calibrated), medians of ``repeats``."""
    layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=CpuOptions())
    e, k = shell.config.num_experts, 8
    groups = iter([[(g * k + j) % e for j in range(k)] for g in range(100, 100 + 4 * repeats)])
    alone, during, compute, busy = [], [], [], []
    for _ in range(repeats):
        alone.append(measure_link_bandwidth(device, 1 << 28, 1) / 1e9)
        rate = link_during_cpu(layer, next(groups), costs.cpu_threads, costs.cpu_gemm)
        during.append(float("nan") if rate is None else rate / 1e9)
        compute.append(float("nan") if rate is None else layer.last_cpu.compute_s * 1e3)
        busy.append(branch(layer, next(groups), k, 1, costs.cpu_threads, costs.cpu_gemm) * 1e3)
    return {name: statistics.median(v) for name, v in
            (("link_alone_GBps", alone), ("link_during_cpu_GBps", during), ("cpu8_compute_ms", compute),
             ("cpu8_branch_busy_link_ms", busy))}


def cells(shells, device, costs, shape: dict, batches, fractions, policies, places,
          variants) -> tuple[list[dict], dict | None, bool]:
    """Part 2 for one set of cells: the rows (so far), the document (None when cut), complete or not."""
    rows = []

    def progress(r):
        rows.append(dataclasses.asdict(r))
        if _left() < 0:
            raise OutOfTime

    try:
        doc = measure_offload(device, batches=batches, fractions=fractions, policies=policies, places=places,
                              shells=shells, costs=costs, variants=variants, on_progress=progress, **shape)
        return rows, doc, True
    except OutOfTime:
        return rows, None, False


def main() -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = {} if cuda else {"experts": 16, "hidden": 64, "inter": 32, "top_k": 2}
    dtype = torch.bfloat16 if cuda else torch.float32
    config = MoEConfig(hidden_size=shape.get("hidden", 7168), moe_intermediate_size=shape.get("inter", 2048),
                       num_experts=shape.get("experts", 256), top_k=shape.get("top_k", 8))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "rows": [], "parts": []}
    shells = host_shells(config, dtype, device, layers=shape.get("layers", 2))  # measure_offload's default L
    shell = shells[0]
    t = time.perf_counter()
    costs = measure_costs(shell, device, CpuOptions())
    result["costs"] = dataclasses.asdict(costs)
    result["costs_s"] = time.perf_counter() - t
    result["probe"] = link_probe(shell, device, costs)
    result["setup_s"] = time.perf_counter() - START
    for batches, fractions, policies, places, variants in PARTS:
        part = {"M": batches, "modes": list(places) + list(variants)}
        if _left() < 10:
            result["parts"].append({**part, "skipped": True})
            continue
        rows, doc, complete = cells(shells, device, costs, shape, batches, fractions, policies, places, variants)
        result["rows"] += rows
        result["parts"].append({**part, "complete": complete, "cpu_margin": None if doc is None else doc["cpu_margin"],
                                "seconds": None if doc is None else doc["table_s"] + sum(doc["setup_s"].values())})
    result["total_s"] = time.perf_counter() - START
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "offload_auto_device_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    _print(result)
    return 0


def _vs_best(modes: dict[str, dict], mode: str) -> float | None:
    if not {"gpu", "cpu", mode} <= set(modes):
        return None
    return modes[mode]["step_ms"] / min(modes["gpu"]["step_ms"], modes["cpu"]["step_ms"])


def _summary(cells: dict[tuple, dict[str, dict]]) -> list[str]:
    out = []
    for mode in ("auto", "auto-old"):
        q = [v for m in cells.values() if (v := _vs_best(m, mode)) is not None]
        if q:
            out.append(f"{mode:>8} / best pure: worst {max(q):.2f}, mean {statistics.fmean(q):.2f}, "
                       f"{sum(v > 1.0 for v in q)} of {len(q)} slower, {sum(v > 1.03 for v in q)} by > 3%")
    for mode in MODES:
        rs = [m[mode] for m in cells.values() if mode in m]
        if rs:
            x = [r["x_floor"] for r in rs]
            xs = [r["step_ms"] / r["floor_sum_ms"] for r in rs if r["floor_sum_ms"]]
            gap = max(abs(r["hit_rate"] - r["sim_hit_rate"]) for r in rs)
            out.append(f"{mode:>8}: x floor {min(x):.2f}-{max(x):.2f} ({sum(v > 1.2 for v in x)} of {len(x)} > 1.2); "
                       f"x session 8's floor {min(xs):.2f}-{max(xs):.2f} ({sum(v > 1.2 for v in xs)} > 1.2); "
                       f"mean hit {statistics.fmean(r['hit_rate'] for r in rs):.3f}; |hit - sim| <= {gap:.3f}")
    return out


def _print(result: dict) -> None:
    c, p = result["costs"], result["probe"]
    print(f"\n{result['device']}, torch {result['torch']}, {result['cpu_count']} cpus, torch threads "
          f"{result['torch_threads']}; setup {result['setup_s']:.0f} s, total {result['total_s']:.0f} s")
    print(f"costs: link {c['link_bytes_per_s'] / 1e9:.1f} GB/s, during CPU {(c['link_cpu_bytes_per_s'] or 0) / 1e9:.1f} GB/s; "
          f"CPU {c['cpu_step_s'] * 1e3:.3f} ms + {c['cpu_expert_s'] * 1e3:.3f} ms/expert + {c['cpu_token_s'] * 1e6:.1f} "
          f"us/token at {c['cpu_threads']} threads ({c['cpu_gemm']}), margin {c['cpu_margin']:.2f}")
    print("probe: " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()))
    for q in result["parts"]:
        state = "skipped" if q.get("skipped") else (f"{'complete' if q['complete'] else 'cut'}, margin "
                                                    f"{q['cpu_margin'] or 0:.2f}, {q['seconds'] or 0:.0f} s")
        print(f"part M={q['M']} {'/'.join(q['modes'])}: {state}")
    print("cell | mode step/floor ms, x floor (the timeline), x session 8's floor, hit/sim | auto/best, auto-old/best")
    cells = modes_by_cell(result["rows"])
    for (stream, fraction, policy, prefetch, m), modes in cells.items():
        parts = [f"{mode} {r['step_ms']:.2f}/{r['floor_ms']:.2f} {r['x_floor']:.2f} "
                 f"{r['step_ms'] / r['floor_sum_ms'] if r['floor_sum_ms'] else 0:.2f} "
                 f"{r['hit_rate']:.2f}/{r['sim_hit_rate']:.2f}" for mode, r in modes.items()]
        q = [_vs_best(modes, mode) for mode in ("auto", "auto-old")]
        print(f"{stream[:4]} {fraction:.0%} {policy} {prefetch[:4]} M={m} | " + " | ".join(parts) + " | "
              + " ".join("-" if v is None else f"{v:.2f}" for v in q))
    for line in _summary(cells):
        print(line)


if __name__ == "__main__":
    sys.exit(main())

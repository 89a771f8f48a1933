"""Device check for issue #18's last target (every cell's step <= 1.2x its floor): the CPU branch's rare
stalls and the gpu path's excess at M = 1 with router prefetch.

    PYTHONPATH=$PWD python3 benchmarks/offload_tail_device_check.py --out $OUT/offload3 [--budget 150]  (H200)
    PYTHONPATH=$PWD python3 benchmarks/offload_tail_device_check.py --smoke                             (CPU)

Qwen3-30B-A3B widths (E=128, K=2048, N=768, top-8, bf16), 4 layers on their own pinned host weights, the
bench's streams and seed (``offload_fetch_device_check``'s stacks and steps). Parts, printing as they go:

1. exact: each CPU-branch variant's layer (cpu mode, M = 1 and 8) against the float32 reference, and its
   output bit for bit against the plain cpu layer's on the same inputs.
2. team: after a host idle gap of 0-600 ms (asleep), interleaved: torch's OpenMP team reading one cold
   expert's weights (``offload_team_probe``: per thread its wake-up and its read, the CPU it ran on), a CPU
   branch of one cold expert (idle link) plain, and the same with ``wake_team`` before it; each branch with
   the process's involuntary context switches and page faults over it (getrusage).
3. cpu cells (skewed/25/router/1, skewed/75/none/1, where c1c5838's cpu mode read 1.35 / 1.34x): stacks
   cpu, cpu-wake (``wake_team`` first where the previous branch ended over ``WAKE_AFTER_S`` before; ck1 ran it
   as ``CpuOptions.wake_after_s``, removed after: no better than none), cpu-probe (the team probe's empty region before
   each branch's compute: every branch's per-thread wake-up and CPUs), cpu-less (2/3 of the calibrated
   threads), gpu and an all-hit stack take turns
   step by step. Every CPU branch logged: measured / model, compute, the gap since the process's previous
   branch, context switches and faults over it. Per variant: step, floor (the all-hit stack's fixed cost; CPU
   side by the model and by the variant's branch median rate), steps over 1.5x their floor, branches > 3x.
4. gpu cells (skewed/50/router/1, skewed/75/router/1, where gpu read 1.17-1.21x): gpu, gpu without prefetch
   ("gpu-none": the same stream, no router prefetch) and the all-hit stack; every other step traced
   (``StepTrace``): per layer kind ("/fetch": it fetched, "/pf": its predecessor prefetched for it) the host /
   GPU time of each mark from the layer's start; per mode
   step - floor a layer, and where it goes (host between the layers, the prefetch's issue, the hits' call).

JSON to OUT/offload_tail_device_check.json, rewritten after every part; the tables print last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time

import torch

from moekit.bench.offload_cells import branch_rate
from moekit.bench.offload_floor import fixed_costs, timeline_s
from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import cpu_rows, default_warm_steps, measure_costs
from offload_setting import offload_setting
from moekit.experts.reference import experts_reference
from moekit.offload import CpuOptions, OffloadedMoE
from moekit.offload.calibrate import branch, cold_groups
from moekit.offload.cpu_path import CpuPath
from moekit.offload.gpu_terms import fixed_from
from moekit.routing import Routing
from offload_fetch_device_check import _stack, _step, _stream  # benchmarks/ on sys.path
from offload_step_anatomy import _median, hit_stack, kind, timeline
from offload_tail_report import cell_lines, print_result, team_lines
from offload_team_probe import TeamProbe

START = time.perf_counter()
WAKE_AFTER_S = 0.001  # cpu-wake: wake the team before a branch when the previous one ended over 1 ms before
from offload_tail_report import GAPS_S  # part 2's idle gaps
CPU_CELLS = (("skewed", 0.25, True, 1), ("skewed", 0.75, False, 1))  # (stream, cache fraction, router prefetch, M)
GPU_CELLS = (("skewed", 0.5, True, 1), ("skewed", 0.75, True, 1))
CPU_MODES = ("cpu", "cpu-wake", "cpu-probe", "cpu-less", "gpu", "hit")
GPU_MODES = ("gpu", "gpu-none", "hit")
BF16_TOLERANCE = 1e-2  # as offload_cpu_anatomy: H200 runs read 2.9e-3-4.6e-3


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _usage() -> tuple[int, int, int]:
    """(involuntary context switches of the process, of this thread, minor page faults of the process)."""
    p, t = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_THREAD)
    return p.ru_nivcsw, t.ru_nivcsw, p.ru_minflt


_GRAIN = 32768  # at::internal::GRAIN_SIZE: elements a thread of an ATen parallel_for takes at least


def wake_team(threads: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """One ATen parallel op that gives each of ``threads`` threads a grain (a [threads x GRAIN] float32 buffer
    zeroed), so every worker of the team is awake when a branch's GEMMs start; returns the buffer (``buffer``
    where it is large enough: a fresh one is fresh pages to fault) for the next call. Measured in ck1 (f963fdf)
    as ``CpuOptions.wake_after_s`` and removed: no better than none (module docstring)."""
    if buffer is None or buffer.numel() < threads * _GRAIN:
        buffer = torch.empty(threads * _GRAIN)
    buffer[: threads * _GRAIN].zero_()
    return buffer


class LoggedPath(CpuPath):
    """The CPU branch with each call logged (module docstring, part 3): the gap since the process's previous
    branch, getrusage over it; with a ``probe`` the team probe's empty region before its compute, with ``wake``
    ``wake_team`` before it where the previous branch ended over ``WAKE_AFTER_S`` before."""

    last_end = [0.0]  # the process's latest logged branch's end (perf_counter)

    def __init__(self, options: CpuOptions, device: torch.device, log: list, probe: TeamProbe | None = None,
                 wake: bool = False) -> None:
        super().__init__(options, device)
        self.log, self.probe, self.wake, self.layer_id, self._buffer = log, probe, wake, -1, None

    def finish(self, staged, compute, device, experts: int, tokens: int, threads):
        team, start, before = [], time.perf_counter(), _usage()

        def probed(inputs):
            if self.probe is not None:
                team.append(self.probe.run(torch.get_num_threads(), []).summary())
            if self.wake and start - LoggedPath.last_end[0] > WAKE_AFTER_S:
                self._buffer = wake_team(torch.get_num_threads(), self._buffer)
            return compute(inputs)

        out = super().finish(staged, probed, device, experts, tokens, threads)
        after, end = _usage(), time.perf_counter()
        p = self.last
        self.log.append({"layer": self.layer_id, "gap_ms": (start - LoggedPath.last_end[0]) * 1e3,
                         "ms": p.total_s * 1e3, "compute_ms": p.compute_s * 1e3, "experts": experts,
                         "ivcsw": after[0] - before[0], "ivcsw_main": after[1] - before[1],
                         "minflt": after[2] - before[2], "team": team[0] if team else None})
        LoggedPath.last_end[0] = end
        return out


def _options(mode: str, costs) -> CpuOptions:
    """cpu-less: 2/3 of the calibrated threads (cores left to the host thread's neighbours: a worker preempted
    stalls the whole region); the others the default."""
    if mode == "cpu-less":
        return CpuOptions(threads=max(1, (costs.cpu_threads or torch.get_num_threads()) * 2 // 3))
    return CpuOptions()


def exact(shell, costs, device, probe: TeamProbe | None) -> list[dict]:
    """Part 1 (module docstring)."""
    c, out = shell.config, []
    w13, w2 = shell.w13.to(device), shell.w2.to(device)  # [E, 2N, K], [E, K, N]
    modes = [m for m in CPU_MODES if m.startswith("cpu") and (m != "cpu-probe" or probe is not None)]
    layers = {}
    for mode in modes:
        layers[mode] = OffloadedMoE.from_moe(shell, cache_experts=c.num_experts // 2, prefetch=None,
                                             compute_misses_on="cpu", costs=costs, device=device)
        layers[mode]._cpu = LoggedPath(_options(mode, costs), device, [], probe if mode == "cpu-probe" else None,
                                       mode == "cpu-wake")
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
                got = {mode: layer.run_routed(x, routing) for mode, layer in layers.items()}
            for mode, y in got.items():
                err = ((y.float() - want).norm() / want.norm()).item()
                same = bool(torch.equal(y, got["cpu"]))
                out.append({"mode": mode, "M": m, "seed": seed, "rel_l2": err, "same_as_cpu": same,
                            "cpu_experts": layers[mode].last_stats.cpu_experts,
                            "pass": err < BF16_TOLERANCE and same and layers[mode].last_stats.cpu_experts > 0})
    return out


def team(shell, costs, device, probe: TeamProbe | None, repeats: int) -> list[dict]:
    """Part 2 (module docstring): one row per (kind, gap, repeat)."""
    layer = OffloadedMoE.from_moe(shell, cache_experts=1, prefetch=None, device=device, cpu_options=CpuOptions())
    host = layer.cache.host(layer.layer_id)
    w13, w2 = host.rebuild(host.parts)[:2]  # host [E, 2N, K], [E, K, N]
    threads, gemm = costs.cpu_threads or torch.get_num_threads(), costs.cpu_gemm or "direct"
    groups = cold_groups(layer.config.num_experts, 1, 5000)
    kinds = (["probe"] if probe is not None else []) + ["branch", "wake+branch"]
    rows, buffer = [], None
    for rep in range(repeats):
        for i in range(len(GAPS_S)):
            gap = GAPS_S[(i + rep) % len(GAPS_S)]
            for what in kinds:
                e = next(groups)[0]
                _sync(device)
                time.sleep(gap)
                before, start = _usage(), time.perf_counter()
                row = {"kind": what, "gap_ms": gap * 1e3, "expert": e}
                if what == "probe":
                    row.update(probe.run(threads, [w13[e], w2[e]]).summary())
                else:
                    if what == "wake+branch":
                        buffer = wake_team(threads, buffer)
                    row["ms"] = branch(layer, [e], 1, 1, threads, gemm, busy=False) * 1e3
                    row["compute_ms"] = layer.last_cpu.compute_s * 1e3
                    row["model_ms"] = costs.cpu_side_s([1]) * 1e3
                after = _usage()
                row.update(wall_ms=(time.perf_counter() - start) * 1e3, ivcsw=after[0] - before[0],
                           ivcsw_main=after[1] - before[1], minflt=after[2] - before[2])
                rows.append(row)
    return rows


def _stacks(shells, trace, routings, slots, prefetch, warm, costs, device, modes, probe, log) -> dict:
    """The cell's stacks brought through ``warm`` steps; cpu variants on a ``LoggedPath``; "gpu-none": gpu
    without prefetch; "hit": the all-hit stack."""
    stacks = {}
    for mode in modes:
        if mode == "hit":
            stacks[mode] = hit_stack(shells, routings, costs, device)
            continue
        stacks[mode] = _stack(shells, trace, slots, mode.split("-")[0], prefetch and mode != "gpu-none", warm, costs,
                              device)
        if mode.startswith("cpu"):
            for layer in stacks[mode]:
                layer._cpu = LoggedPath(_options(mode, costs), device, log.setdefault(mode, []),
                                        probe if mode == "cpu-probe" else None, mode == "cpu-wake")
                layer._cpu.layer_id = layer.layer_id
    return stacks


def run_cell(shells, config, cell, costs, device, steps: int, modes, probe=None, traced_every: int = 0) -> dict:
    """Parts 3 and 4 for one cell (module docstring)."""
    stream, fraction, prefetch, m = cell
    warm, total = default_warm_steps(m), len(shells) * config.num_experts
    slots = max(1, round(fraction * total))
    trace, routings = _stream(config, len(shells), m, stream, warm + 1 + steps, device)
    fixed = fixed_costs(shells, routings[warm:warm + 4], costs, device, CpuOptions(), slots)
    priced, log = fixed.priced(costs), {}
    stacks = _stacks(shells, trace, routings[warm:], slots, prefetch, warm, priced, device, modes, probe, log)
    x = torch.randn(m, config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    rows = {mode: [] for mode in modes}
    for step in range(steps + 1):
        for j in range(len(modes)):
            mode = modes[(step + j) % len(modes)]
            traced = bool(traced_every) and step % traced_every == 0 and step > 0
            logged = {k: len(v) for k, v in log.items()}
            seconds, done, marks = _step(stacks[mode], x, routings[warm + step], trace.predicted[warm + step],
                                         prefetch and mode not in ("hit", "gpu-none"), traced, device)
            ran = [l.last_cpu.total_s if l.last_cpu is not None else 0.0 for l in stacks[mode]]
            if step:
                rows[mode].append({"s": seconds, "traced": traced, "done": done, "ran": ran,
                                   "marks": timeline(marks) if traced else [],
                                   "branches": log[mode][logged.get(mode, 0):] if mode in log else []})
    eb = stacks[modes[0]][0].cache.expert_bytes
    del stacks
    hit_plain = [r for r in rows["hit"] if not r["traced"]]
    ref = fixed_from([r["s"] for r in hit_plain], [sum(s.hits for s in r["done"]) for r in hit_plain], len(shells), eb,
                     priced)
    out = {"cell": f"{stream}/{round(fraction * 100)}/{'router' if prefetch else 'none'}/{m}", "slots": slots,
           "fixed_ms": fixed.layer_s * 1e3, "ref_fixed_ms": ref * 1e3,
           "ref_fixed_mean_ms": (statistics.fmean(r["s"] for r in hit_plain) - statistics.fmean(
               sum(s.hits for s in r["done"]) for r in hit_plain) * eb / priced.gpu_bytes_per_s) / len(shells) * 1e3,
           "overlap_ms": fixed.overlap_s * 1e3,
           "prefetch_layer_ms": fixed.prefetch_layer_s * 1e3, "issue_us": fixed.issue_s * 1e6,
           "fetch_layer_ms": fixed.fetch_layer_s * 1e3, "call_ms": fixed.call_s * 1e3,
           "copy_call_ms": fixed.copy_call_s * 1e3, "branch_layer_ms": fixed.branch_layer_s * 1e3, "modes": {},
           "kinds": {}}
    for mode, got in rows.items():
        out["modes"][mode] = _mode_summary(got, costs, priced, fixed, ref, eb, [
            max(0.0, (r["s"] - sum(s.hits for s in r["done"]) * eb / priced.gpu_bytes_per_s) / len(shells))
            for r in hit_plain])
        for r in got:
            for times in r["marks"]:
                by = out["kinds"].setdefault(kind(mode, times) + ("/pf" if "copy_start:prefetch" in times else ""), {})
                for name, v in times.items():
                    by.setdefault(name, []).append(v)
    out["kinds"] = {k: {n: (_median([h for h, _ in v]) * 1e3, _median([g for _, g in v]) * 1e3, len(v))
                        for n, v in by.items()} for k, by in sorted(out["kinds"].items())}
    return out


def _mode_summary(got: list[dict], costs, priced, fixed, ref: float, eb: int, paired: list[float]) -> dict:
    """One mode's steps in a cell: step, floors (CPU side by its branches' median rate, by the model, as they
    ran; and with each step's fixed cost ``paired``: the all-hit stack's in the same round), counts a step, its
    branches (each given its model ms) and their outliers (> 3x)."""
    plain = [r for r in got if not r["traced"]]
    branches = [b for r in got for b in r["branches"]]
    for b in branches:
        b["model_ms"] = costs.cpu_side_s([1] * b["experts"]) * 1e3  # M = 1: one row an expert
    rate = branch_rate([(b["ms"], b["model_ms"]) for b in branches if b["model_ms"] > 0])
    by_rate = priced.scaled(rate) if rate else priced

    def floor(r, c, measured=None, layer_s=ref):
        return timeline_s(r["done"], eb, c, layer_s, fixed.overlap_s, fixed.prefetch_layer_s, measured=measured,
                          copy_call_s=fixed.copy_call_s, branch_layer_s=fixed.branch_layer_s)

    floors = [floor(r, by_rate) for r in plain]

    def per_step(field):
        return statistics.fmean(sum(getattr(s, field) for s in r["done"]) for r in plain)

    return {"step_ms": statistics.fmean(r["s"] for r in plain) * 1e3, "steps": len(plain),
            "step_median_ms": statistics.median(r["s"] for r in plain) * 1e3,
            "floor_median_ms": statistics.median(floors) * 1e3,
            "sem_ms": statistics.stdev(r["s"] for r in plain) / len(plain) ** 0.5 * 1e3,
            "floor_ms": statistics.fmean(floors) * 1e3,
            "floor_model_ms": statistics.fmean(floor(r, priced) for r in plain) * 1e3,
            "floor_ran_ms": statistics.fmean(floor(r, priced, r["ran"]) for r in plain) * 1e3,
            "floor_paired_ms": statistics.fmean(floor(r, by_rate, None, f) for r, f in zip(plain, paired)) * 1e3,
            "branch_rate": rate or 0.0, "over_1_5": sum(r["s"] > 1.5 * f for r, f in zip(plain, floors)),
            "step_ms_list": [r["s"] * 1e3 for r in plain], "floor_ms_list": [f * 1e3 for f in floors],
            **{name: per_step(name) for name in ("hits", "fetched", "prefetched", "prefetch_used")},
            "branches": len(branches),
            "outliers": [b for b in branches if b["model_ms"] and b["ms"] > 3 * b["model_ms"]],
            "branch_summary": _branch_summary(branches)}


def _branch_summary(branches: list[dict]) -> dict:
    """The branches' ratio to the model (median, max), and the context switches / faults of the slow (> 2x)
    and the others."""
    if not branches:
        return {}
    ratio = [b["ms"] / b["model_ms"] for b in branches if b["model_ms"]]
    slow = [b for b in branches if b["model_ms"] and b["ms"] > 2 * b["model_ms"]]
    rest = [b for b in branches if b not in slow]

    def mean(rows, key):
        return statistics.fmean(b[key] for b in rows) if rows else 0.0

    team = [b["team"] for b in branches if b.get("team")]
    return {"ratio_median": statistics.median(ratio), "ratio_max": max(ratio), "slow": len(slow),
            "slow_ivcsw": mean(slow, "ivcsw"), "rest_ivcsw": mean(rest, "ivcsw"),
            "slow_ivcsw_main": mean(slow, "ivcsw_main"),
            "rest_ivcsw_main": mean(rest, "ivcsw_main"), "slow_minflt": mean(slow, "minflt"),
            "rest_minflt": mean(rest, "minflt"),
            "slow_gap_ms": _median([b["gap_ms"] for b in slow]), "rest_gap_ms": _median([b["gap_ms"] for b in rest]),
            "team_wake_max_ms": _median([t["wake_max_ms"] for t in team]),
            "team_wake_worst_ms": max((t["wake_max_ms"] for t in team), default=float("nan")),
            "team_cpus_min": min((t["distinct_cpus"] for t in team), default=0)}


def _dump(result: dict, out: str | None) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        result["total_s"] = time.perf_counter() - START
        with open(os.path.join(out, "offload_tail_device_check.json"), "w") as f:
            json.dump(result, f, default=str)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--budget", type=float, default=150.0, help="seconds: no part or cell starts past it")
    parser.add_argument("--steps", type=int, default=0, help="steps a cell (0: 120 CPU cells, 40 gpu; smoke 3)")
    args = parser.parse_args()
    s = offload_setting(args.smoke)
    cuda, device, shape, config = s.cuda, s.device, s.shape, s.config
    shells = host_shells(config, torch.bfloat16 if cuda else torch.float32, device, layers=shape["layers"])
    costs = measure_costs(shells[0], device, CpuOptions(), cpu_rows((1,)))
    probe = TeamProbe()
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": shape,
              "cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
              "torch_threads": torch.get_num_threads(), "costs": dataclasses.asdict(costs),
              "probe": f"on {probe.lib}" if probe.available() else f"unavailable: {probe.why}", "cells": []}
    probe = probe if probe.available() else None
    print(f"costs: {time.perf_counter() - START:.1f} s; team probe {result['probe']}", flush=True)
    result["exact"] = exact(shells[0], costs, device, probe)
    print(f"exact: {sum(r['pass'] for r in result['exact'])} of {len(result['exact'])} PASS", flush=True)
    result["team"] = team(shells[0], costs, device, probe, 3 if cuda else 1)
    _dump(result, args.out)
    for line in team_lines(result["team"]):
        print(line, flush=True)
    cells = [(c, CPU_MODES, args.steps or (120 if cuda else 3), 0) for c in CPU_CELLS]
    cells += [(c, GPU_MODES, args.steps or (40 if cuda else 3), 2) for c in GPU_CELLS]
    for cell, modes, steps, traced in cells:
        if time.perf_counter() - START > args.budget:
            print(f"budget: cell {cell} skipped", flush=True)
            continue
        modes = tuple(m for m in modes if m != "cpu-probe" or probe is not None)
        result["cells"].append(run_cell(shells, config, cell, costs, device, steps, modes, probe, traced))
        for line in cell_lines(result["cells"][-1], shape["layers"]):
            print(line, flush=True)
        _dump(result, args.out)
        if cuda:
            torch.cuda.empty_cache()
    _dump(result, args.out)
    print_result(result, START)
    return 0


if __name__ == "__main__":
    sys.exit(main())

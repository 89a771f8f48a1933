"""Device check for issue #18's few-fetch steps: where a step with 1-3 fetches a layer spends the time the
floor does not explain (the last H200 run: skewed 75% M = 1, 3.84 ms against a 1.98 ms floor, 4.4 fetches a step).

    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/offload_fetch_device_check.py [--budget 130]   (H200, <= 150 s)
    PYTHONPATH=$PWD python benchmarks/offload_fetch_device_check.py --smoke                   (CPU, tiny shapes)

Qwen3-30B-A3B widths (E=128, K=2048, N=768, top-8, bf16), 4 layers, each its own pinned host weights, the
simulator's streams with the bench's seed (``offload_cal_device_check.py``'s cells). Parts:

1. forced: one cache holding every expert; before each step k = 0 / 1 / 2 / 4 of each layer's touched
   experts are evicted (``ExpertCache.evict``), so every layer fetches exactly k (M = 1, skewed): per layer,
   the step's time over k = 0's, and that less what the floor prices for k fetches (bytes at the link's and
   the GPU's read rate, the second call): the unexplained cost of a layer with k fetches; the layers
   deciding one call or two by ``cost.one_call`` (new), and with two calls always (as before), step ms.
2. cells (M = 1; M = 8 as the budget allows): gpu / auto / cpu take turns step by step as in the bench
   (in the first three cells with two variants, this branch's changes undone one at a time: gpu-everywait,
   the stream waits for hits as before; gpu-twocalls, two experts calls as before; gpu-dry, the fetches'
   bookkeeping without their copies: what the copy and the waits for it cost), every other step
   traced (``moekit.offload.StepTrace``), then a fresh gpu stack alone over the same steps (no other
   stack's step between: do they slow the next step's host?). Per cell and mode: step ms untraced /
   traced, x the floor (``offload_floor.timeline_s`` with ``fetch_layer_s`` and ``overlap_s``) and x the
   floor without them, fetches and layers
   with a fetch a step; per layer with and without a fetch, the
   trace's phases (``offload_timeline.LayerTimes``: host period, the touched set's wait, bookkeeping before
   the copy, queueing it, the copy's lag and time on the GPU, last byte -> fetched call, each call, tail).
3. fits over the untraced gpu / auto / gpu-alone steps: step - link bytes / BW = layers x fixed + fetches
   x per fetch + layers with a fetch x per such layer; and step - floor = const + the same two columns.
4. profile: torch.profiler and cProfile over a few gpu steps of the first cell, the top host calls; and
   the host's microseconds of each CUDA step a fetch adds, alone (``offload_timeline.host_op_costs``).

Printed last: the forced table, the cells, the phases, the fits. JSON to $OUT/offload_fetch_device_check.json.
"""

from __future__ import annotations

import argparse
import contextlib
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
from moekit.offload.gpu_terms import measure_forced
from moekit.bench.offload_hosts import host_shells
from moekit.bench.offload_measure import DRIFT, STREAMS, cpu_rows, default_warm_steps, measure_costs
from moekit.bench.offload_timeline import fit_steps, host_op_costs, layer_times, mean_times
from moekit.config import MoEConfig
from offload_setting import offload_setting
from moekit.offload import CpuOptions, ExpertCache, OffloadedMoE, OffloadStats, StepTrace
from moekit.offload.whatif import drive
from moekit.routing import Routing
from moekit.sim.cache import decode_stream

START = time.perf_counter()
# (stream, cache fraction, prefetch router, M): the cal run's worst few-fetch cells first
CELLS = (("skewed", 0.75, False, 1), ("skewed", 0.75, True, 1), ("uniform", 0.75, False, 1),
         ("skewed", 0.5, False, 1), ("uniform", 0.25, False, 1), ("skewed", 0.25, False, 1),
         ("skewed", 0.75, False, 8), ("uniform", 0.5, False, 8))
MODES = ("gpu", "auto", "cpu")
FORCED = (0, 1, 2, 4)  # fetches forced into every layer (part 1)
VARIANTS = ("gpu-everywait", "gpu-twocalls", "gpu-dry")  # A/Bs (``_stack``, ``_step``)
PHASES = ("period_s", "host_busy_s", "wait_after_s", "d2h_wait_s", "host_before_copy_s", "copy_issue_s", "copy_lag_s",
          "copy_s", "land_to_call_s",
          "hits_call_s", "fetched_call_s", "host_tail_s")


def _left(budget: float) -> float:
    return budget - (time.perf_counter() - START)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stream(config: MoEConfig, layers: int, m: int, stream: str, count: int, device):
    data = decode_stream(config.num_experts, config.top_k, layers, count, m, STREAMS[stream], DRIFT, seed=3)
    return data.trace, [[Routing(r.topk_ids.to(device), r.topk_weights.to(device)) for r in s] for s in data.routings]


class EveryWaitCache(ExpertCache):
    """The cache before this branch: the compute stream waits for every hit's copy event again, each forward
    (one stream wait per batch its hits came in), where the new one skips copies it has waited for."""

    def wait_ready(self, layer: int, experts: list[int]) -> None:
        if self._copy_stream is None:
            return
        stream, waited = torch.cuda.current_stream(self.device), set()
        for e in experts:
            event = self._slots.copy_done[self._slots.where[(layer, e)]]
            if event is not None and id(event) not in waited:
                stream.wait_event(event)
                waited.add(id(event))


def _stack(shells, trace, slots: int, mode: str, prefetch: bool, warm: int, costs, device) -> list[OffloadedMoE]:
    """``mode``: a compute_misses_on, or "gpu-everywait" (gpu on ``EveryWaitCache``), or "gpu-twocalls" (gpu
    whose layers price no second call, so they always make one for the hits and one for the fetched:
    ``cost.one_call`` off, as before this branch)."""
    place = mode.split("-")[0]
    cache = (EveryWaitCache if mode.endswith("everywait") else ExpertCache)(slots, device=device, policy="lfu")
    own = dataclasses.replace(costs, gpu_call_s=0.0) if mode.endswith("twocalls") else costs
    layers = [OffloadedMoE.from_moe(shells[i], cache=cache, prefetch=None, compute_misses_on=place, costs=own)
              for i in range(trace.num_layers)]
    with cache.bookkeeping_only():
        drive(cache, [layer.layer_id for layer in layers], trace, range(warm), prefetch="router" if prefetch else None,
              place=place, costs=costs, expert_bytes=cache.expert_bytes)
    return layers


def _step(layers, x, per_layer, predicted, prefetch: bool, traced: bool, device,
          dry: bool = False) -> tuple[float, list, list]:
    """(seconds, per-layer stats with their prefetches, marks) of one step through ``layers``; ``dry``: the
    cache's bookkeeping only (fetches copy nothing, nothing waits for a copy; the outputs are garbage)."""
    cache = layers[0].cache
    cache.trace = StepTrace(device) if traced else None
    _sync(device)
    start = time.perf_counter()
    done = []
    with cache.bookkeeping_only() if dry else contextlib.nullcontext():
        for i, routing in enumerate(per_layer):
            layers[i].run_routed(x, routing)
            stats = dataclasses.replace(layers[i].last_stats)
            if prefetch and i + 1 < len(layers):
                ahead = OffloadStats()
                cache.prefetch(layers[i + 1].layer_id, predicted[i + 1], ahead)
                stats.add(ahead)
            done.append(stats)
    _sync(device)
    seconds = time.perf_counter() - start
    marks = []
    if traced:
        cache.mark("step_end", -1)
        marks = cache.trace.read()
        cache.trace = None
    return seconds, done, marks


def _record(mode: str, traced: bool, seconds: float, done: list, costs, fixed, expert_bytes: int) -> dict:
    """One step's row: its time, floors (``fixed``: ``FixedCosts``; the old floor without fetch_layer_s and
    overlap_s) and counts."""
    fetched = sum(s.fetched for s in done)
    moved = sum(s.fetched + s.prefetched + s.admitted for s in done)
    old = dataclasses.replace(costs, fetch_layer_s=0.0)
    return {"mode": mode, "traced": traced, "step_s": seconds,
            "floor_s": timeline_s(done, expert_bytes, costs, fixed.layer_s, fixed.overlap_s),
            "floor_old_s": timeline_s(done, expert_bytes, old, fixed.layer_s),
            "fetched": fetched, "fetch_layers": sum(s.fetched > 0 for s in done), "hits": sum(s.hits for s in done),
            "cpu_experts": sum(s.cpu_experts for s in done), "link_s": moved * expert_bytes / costs.link_bytes_per_s,
            "cpu_model_s": sum(costs.cpu_side_s(list(s.cpu_rows)) for s in done if s.cpu_experts), "layers": len(done)}


def run_cell(shells, config, cell, costs, device, steps: int, profile: bool, modes=MODES) -> dict:
    """One cell (module docstring, part 2): ``modes`` take turns step by step, then gpu alone."""
    stream, fraction, prefetch, m = cell
    warm, total = default_warm_steps(m), len(shells) * config.num_experts
    slots = max(1, round(fraction * total))
    trace, routings = _stream(config, len(shells), m, stream, warm + 1 + steps, device)
    fixed = fixed_costs(shells, routings[warm:warm + 4], costs, device, CpuOptions(), slots)
    costs = dataclasses.replace(costs, gpu_call_s=fixed.call_s, fetch_layer_s=fixed.fetch_layer_s)
    stacks = {mode: _stack(shells, trace, slots, mode, prefetch, warm, costs, device) for mode in modes}
    x = torch.randn(m, config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    rows, times = [], {mode: [] for mode in modes}
    bytes_one = stacks["gpu"][0].cache.expert_bytes
    for step in range(steps + 1):
        for j in range(len(modes)):
            mode = modes[(step + j) % len(modes)]
            traced = step % 2 == 0 and step > 0
            seconds, done, marks = _step(stacks[mode], x, routings[warm + step], trace.predicted[warm + step],
                                         prefetch, traced, device, dry=mode.endswith("dry"))
            if step:
                rows.append(_record(mode, traced, seconds, done, costs, fixed, bytes_one))
                if traced:
                    times[mode] += layer_times(marks,
                                               {layers.layer_id: s.fetched for layers, s in zip(stacks[mode], done)})
    prof = _profile(stacks["gpu"], x, routings[warm + 1: warm + 1 + min(steps, 8)], trace.predicted[warm + 1:],
                    prefetch, device) if profile else {}
    del stacks
    alone = _stack(shells, trace, slots, "gpu", prefetch, warm, costs, device)  # a fresh gpu stack: gpu's counts
    for step in range(steps + 1):  # the same steps, stepped alone: no other stack's step between
        seconds, done, _ = _step(alone, x, routings[warm + step], trace.predicted[warm + step], prefetch, False, device)
        if step:
            rows.append(_record("gpu-alone", False, seconds, done, costs, fixed, bytes_one))
    del alone
    phases = {mode: {"fetch": mean_times([t for t in ts if t.fetched]),
                     "none": mean_times([t for t in ts if not t.fetched])}
              for mode, ts in times.items()}
    return {"cell": f"{stream[:4]} {fraction:.0%} {'rout' if prefetch else 'none'} M={m}", "slots": slots,
            "fixed_ms": fixed.layer_s * 1e3, "call_ms": fixed.call_s * 1e3, "fetch_layer_ms": fixed.fetch_layer_s * 1e3,
            "overlap_ms": fixed.overlap_s * 1e3, "rows": rows, "phases": phases, **prof}


def _profile(layers, x, routings, predicted, prefetch: bool, device) -> dict:
    """The top host calls over ``routings``' steps: torch.profiler's self CPU time by op / runtime call and
    cProfile's by Python function, microseconds per step."""
    n = len(routings)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                          if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        for i, per_layer in enumerate(routings):
            _step(layers, x, per_layer, predicted[i], prefetch, False, device)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
    torch_top = [(e.key[:48], e.count / n, e.self_cpu_time_total / n) for e in events]
    profiler = cProfile.Profile()
    profiler.enable()
    for i, per_layer in enumerate(routings):
        _step(layers, x, per_layer, predicted[i], prefetch, False, device)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]  # by tottime
    py_top = [(f"{os.path.basename(f)}:{line} {name}"[:60], calls / n, tot * 1e6 / n)
              for (f, line, name), (_, calls, tot, _, _) in entries]
    return {"torch_top": torch_top, "py_top": py_top}


def run_forced(shells, config, costs, device, steps: int) -> dict:
    """Part 1 (module docstring): {k: seconds per step} on a cache holding every touched expert."""
    trace, routings = _stream(config, len(shells), 1, "skewed", 8 + steps, device)
    chosen = routings[8:8 + steps]
    union = [set() for _ in shells]
    for per_layer in chosen:
        for seen, r in zip(union, per_layer):
            seen.update(e for e in r.topk_ids.reshape(-1).tolist() if e >= 0)
    cache = ExpertCache(sum(len(u) for u in union), device=device, policy="lfu")
    layers = [OffloadedMoE.from_moe(shell, cache=cache, prefetch=None, costs=costs) for shell in shells]
    x = torch.randn(1, config.hidden_size, device=device, dtype=shells[0].w13.dtype)
    fixed = fixed_costs(shells, chosen[:4], costs, device, CpuOptions())
    two = measure_forced(layers, x, chosen, counts=FORCED, repeats=3)  # costs without a second call's price
    for layer in layers:
        layer.costs = dataclasses.replace(costs, gpu_call_s=fixed.call_s)  # one call where cost.one_call says so
    times = measure_forced(layers, x, chosen, counts=FORCED, repeats=3)
    phases = {}
    for k in FORCED:  # one traced pass per k: the same steps, k evicted from each layer before each
        marked = []
        for per_layer in chosen:
            for layer, r in zip(layers, per_layer):
                cache.evict(layer.layer_id, sorted({e for e in r.topk_ids.reshape(-1).tolist() if e >= 0})[:k])
            _, done, marks = _step(layers, x, per_layer, [], False, True, device)
            marked += layer_times(marks, {layer.layer_id: s.fetched for layer, s in zip(layers, done)})
        phases[k] = mean_times(marked)
    return {"fixed_ms": fixed.layer_s * 1e3, "call_ms": fixed.call_s * 1e3, "expert_bytes": cache.expert_bytes,
            "fetch_layer_ms": fixed.fetch_layer_s * 1e3,
            "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
            "ms_twocalls": {k: statistics.median(v) * 1e3 for k, v in two.items()}, "layers": len(shells),
            "phases": phases}


def fits(cells: list[dict]) -> dict:
    rows = [r for c in cells for r in c["rows"] if not r["traced"] and r["mode"] in ("gpu", "auto", "gpu-alone")]
    cols = {"fetches": [r["fetched"] for r in rows], "fetch_layers": [r["fetch_layers"] for r in rows]}
    plain = fit_steps([r["step_s"] - r["link_s"] for r in rows], {"per_layer": [r["layers"] for r in rows], **cols})
    resid = fit_steps([r["step_s"] - r["floor_s"] for r in rows], {"const": [1.0] * len(rows), **cols})
    few = [r for r in rows if r["fetched"] <= 2 * r["layers"]]
    resid_few = fit_steps([r["step_s"] - r["floor_s"] for r in few],
                          {"const": [1.0] * len(few), "fetches": [r["fetched"] for r in few],
                           "fetch_layers": [r["fetch_layers"] for r in few]})
    return {name: dataclasses.asdict(f) for name, f in (("step-link", plain), ("step-floor", resid),
                                                         ("step-floor, <= 2 fetches a layer", resid_few))}


def _mode_line(rows: list[dict], mode: str) -> str:
    untimed = [r for r in rows if r["mode"] == mode and not r["traced"]]
    traced = [r for r in rows if r["mode"] == mode and r["traced"]]
    if not untimed:
        return f"{mode} -"
    step, floor, old = (statistics.fmean(r[k] for r in untimed) * 1e3 for k in ("step_s", "floor_s", "floor_old_s"))
    tr = statistics.fmean(r["step_s"] for r in traced) * 1e3 if traced else float("nan")
    fetched, layers = (statistics.fmean(r[k] for r in untimed) for k in ("fetched", "fetch_layers"))
    return f"{mode} {step:6.2f} ({tr:6.2f}) {step / floor:4.2f}x/{step / old:4.2f}x f{fetched:4.1f}/{layers:3.1f}"


def _mean_step(rows: list[dict], mode: str) -> float | None:
    """The mean untraced step seconds of ``mode`` (None when it did not run)."""
    times = [r["step_s"] for r in rows if r["mode"] == mode and not r["traced"]]
    return statistics.fmean(times) if times else None


def _auto_vs_best(rows: list[dict]) -> str:
    """auto's mean untraced step over the faster of gpu's and cpu's (as the cal check's cells)."""
    mean = {m: statistics.fmean(r["step_s"] for r in rows if r["mode"] == m and not r["traced"]) for m in MODES}
    return f"{mean['auto'] / min(mean['gpu'], mean['cpu']):.3f}"


def _print(result: dict) -> None:
    c = result["costs"]
    print(f"\n{result['device']}, torch {result['torch']}, shape {result['shape']}, total {result['total_s']:.0f} s; "
          f"link {c['link_bytes_per_s'] / 1e9:.1f} GB/s, GPU read {c['gpu_bytes_per_s'] / 1e9:.0f} GB/s")
    for cell in result["cells"]:
        for key in ("torch_top", "py_top"):
            if cell.get(key):
                print(f"{cell['cell']} {key} (per step: calls, self us):")
                for name, calls, us in cell[key]:
                    print(f"  {name:<60} {calls:7.1f} {us:9.1f}")
    f = result.get("forced")
    if f:
        link = f["expert_bytes"] / c["link_bytes_per_s"] * 1e3
        read = f["expert_bytes"] / c["gpu_bytes_per_s"] * 1e3
        print(f"forced fetches (skewed M=1, {f['layers']} layers; fixed {f['fixed_ms']:.3f} ms/layer, second call "
              f"{f['call_ms']:.3f}, fetch_layer {f['fetch_layer_ms']:.3f}, one fetch {link:.3f} ms at the link; "
              f"step ms with two calls a layer: " + ", ".join(f"k={k} {v:.3f}" for k, v in f["ms_twocalls"].items())
              + "):")
        for k, ms in f["ms"].items():
            per = (ms - f["ms"][0]) / f["layers"]
            extra = per - (k * (link + read) + (f["call_ms"] if k else 0.0))
            print(f"  k={k}: step {ms:6.3f} ms, per layer over k=0 {per:6.3f} ms, unexplained {extra:6.3f} ms; phases "
                  + " ".join(f"{f['phases'][k][p] * 1e3:6.3f}" for p in PHASES))
    print("cell | mode step ms (traced) x floor/x old floor (no fetch_layer_s, overlap_s), fetches/fetch layers a step "
          "| fixed+call/fetch layer/overlap ms")
    for cell in result["cells"]:
        print(f"{cell['cell']:<17}| " + " | ".join(_mode_line(cell["rows"], m) for m in (*MODES, "gpu-alone", *VARIANTS)
                                                   if any(r["mode"] == m for r in cell["rows"]))
              + f" | {cell['fixed_ms']:.2f}+{cell['call_ms']:.2f}/{cell['fetch_layer_ms']:.2f}/{cell['overlap_ms']:.2f}"
              + " | auto/best "
              + _auto_vs_best(cell["rows"]))
    print("phases ms per layer (fetch / none): " + ", ".join(p.removesuffix("_s") for p in PHASES))
    for cell in result["cells"]:
        for mode in ("gpu", "auto", *VARIANTS):
            ph = cell["phases"].get(mode, {})
            for kind in ("fetch", "none"):
                t = ph.get(kind, {})
                if t.get("layers"):
                    print(f"  {cell['cell']:<17} {mode:<4} {kind:<5} n={int(t['layers']):<3} "
                          + " ".join(f"{t[p] * 1e3:6.3f}" for p in PHASES))
    ops = result.get("host_ops_us") or {}
    print("host us per op: " + (", ".join(f"{k} {v:.1f}" for k, v in ops.items()) or "-"))
    ratios = []
    for mode in ("gpu-alone", *VARIANTS):
        pairs = [(_mean_step(c["rows"], mode), _mean_step(c["rows"], "gpu")) for c in result["cells"]]
        pairs = [(a, b) for a, b in pairs if a and b]
        if pairs:
            ratios.append(f"{mode} {statistics.fmean(a / b for a, b in pairs):.3f} ({len(pairs)} cells)")
    print("step over gpu's, mean over cells: " + ("; ".join(ratios) or "-"))
    for name, fit in result.get("fits", {}).items():
        terms = ", ".join(f"{n} {v * 1e3:.3f}" for n, v in zip(fit["names"], fit["terms_s"]))
        print(f"fit {name}: {terms} ms; rms {fit['rms_s'] * 1e3:.3f} ms over {fit['steps']} steps")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--budget", type=float, default=130.0, help="seconds: no new cell starts past it")
    args = parser.parse_args()
    s = offload_setting(args.smoke)
    cuda, device, shape, config = s.cuda, s.device, s.shape, s.config
    shells = host_shells(config, torch.bfloat16 if cuda else torch.float32, device, layers=shape["layers"])
    costs = measure_costs(shells[0], device, CpuOptions(), cpu_rows((1, 8)))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shape": shape,
              "costs": dataclasses.asdict(costs), "cells": []}
    steps = 32 if cuda else 4
    result["forced"] = run_forced(shells, config, costs, device, 8 if cuda else 2)
    print(f"forced: {time.perf_counter() - START:.1f} s", flush=True)
    if cuda:
        torch.cuda.empty_cache()
    for i, cell in enumerate(CELLS if cuda else CELLS[:2]):
        if _left(args.budget) < (25 if cell[3] > 1 else 12):
            print(f"budget: cell {cell} skipped")
            continue
        clock = time.perf_counter()
        modes = (*MODES, *VARIANTS) if i < 3 else MODES  # the A/Bs in the first cells
        result["cells"].append(run_cell(shells, config, cell, costs, device, steps if cell[3] == 1 else steps // 2,
                                        profile=i == 0, modes=modes))
        print(f"cell {result['cells'][-1]['cell']}: {time.perf_counter() - clock:.1f} s", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    result["fits"] = fits(result["cells"])
    result["host_ops_us"] = host_op_costs(device)
    result["total_s"] = time.perf_counter() - START
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "offload_fetch_device_check.json"), "w") as f:
            json.dump(result, f, indent=1, default=str)
    _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 15, session 28 (branch `f8mid8`): fp8_block at the ridge, Mixtral M = 512 / 1024 and Qwen3 M = 1024 / 512 (8 <=
M <= 1024 at >= 90% of the fp8 floor): what limits each cell (the candidates it timed: ``f8mid8_variants``' notes).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/f8mid8_device_check.py --out $OUT/f8mid8 --deadline 66
        [--cells fp8:mixtral-8x7b:512 ...] [--rounds 5] [--no-parts] [--variants route,plain] [--worker-deadline 26]

1. Compile workers (this script with --worker CELL GROUP) run every variant and part once on zero weights of the real
   shapes (a call a worker did not finish is not run here); then the ceilings of this run: copy bandwidth, the fp8 mm
   rate (``torch._scaled_mm`` 8192^3) and the SM clock and board power while that mm runs.
2. Per cell (the bench's weights quantized, uniform routing seeded by M; ``f8mid8_variants``): every variant against
   the fp8 Gluon path's torch twin (rel L2 < 1e-2: PASS / FAIL), bit for bit against its ``same_as``; the route's
   kernels inside its CUDA graph (profiler, device µs; each GEMM's % of copy for its touched weights and % of the fp8
   mm rate on the real rows) under uniform and balanced routing (M*k/E rows an expert); whole calls in ``--rounds``
   CUDA-graph rounds interleaved replay by replay (``f8pre_device_check.replay_rounds``); then the fp8 Gluon GEMMs
   alone, with hot scales, and their probes (loads alone, consumers alone, wgmmas alone, unpromoted), uniform and
   balanced, each with the SM clock and board power while it replays (uniform).
The table is printed last: per variant median µs, % of the byte-model floor, x the route, rounds >= 3% faster; per
part µs, % of copy, % of mm on the real rows and on the rows multiplied. JSON to --out/f8mid8.json after each cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import f8mid8_variants as fv  # noqa: E402
import prefill_device_check as pdc  # noqa: E402
import prefill_variants as pv  # noqa: E402
from f8pre_device_check import floor_us, replay_rounds, versus  # noqa: E402
from mid_tile_clocks import sample_while  # noqa: E402

RESULTS: dict = {"cells": []}
PARTS_TABLE: list[str] = []
log = pdc.log


def graph_kernels(name: str, fn, weight_bytes: dict, flops: dict, copy: float, mm: float) -> dict:
    """Device µs per kernel inside ``fn``'s CUDA graph (profiler over 5 replays, kernels named by their first 28
    characters; the Gluon GEMM's two launches labelled gate-up / down in call order); GEMMs with % copy, % mm."""
    graph = pdc.capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    got: dict = defaultdict(float)
    gluon = 0
    for e in events:
        label = e.name[:28]
        if label.startswith("grouped_gemm_fp8"):
            label, gluon = ("gate-up", "down")[gluon % 2], gluon + 1
        elif "gate_up" in label:
            label = "gate-up"
        elif label.startswith("down_fp8"):
            label = "down"
        got[label] += e.time_range.elapsed_us() / 5
    parts = []
    for label, us in got.items():
        extra = ""
        if label in weight_bytes:
            extra = (f" ({100 * weight_bytes[label] / (us * 1e-6) / 1e12 / copy:.0f}% copy, "
                     f"{100 * flops[label] / (us * 1e-6) / 1e12 / mm:.0f}% mm)")
        parts.append(f"{label} {us:.1f}{extra}")
    clock = sample_while(graph.replay, sum(got.values()) * 1e-6, 0.2)
    log(f"{name} kernels in the graph: " + ", ".join(parts) + f"; sum {sum(got.values()):.1f} us; replayed: "
        f"{clock.sm_mhz} MHz {clock.power_w} W")
    del graph
    return dict(got) | {"sm_mhz": clock.sm_mhz, "power_w": clock.power_w}


def time_parts(name: str, routing: str, x, ids, q, cell: dict, stop_at: float, ran: set) -> dict:
    """The fp8 Gluon GEMMs alone and their probes on one layout (those a worker ran: ``ran``): µs, % copy, % mm on
    the real rows and on the rows multiplied."""
    parts, rows_used = fv.gluon_parts(x, ids, q)
    parts = {label: fn for label, fn in parts.items() if label in ran or label == "gate-up"}
    parts["gate-up"]()
    torch.cuda.synchronize()
    multiplied = int(rows_used.item()) / ids.numel()
    out = {"rows_per_real_row": multiplied}
    for label, fn in parts.items():
        if time.perf_counter() - pdc.T0 > stop_at:
            log(f"{name} {routing} parts: deadline at {label}")
            break
        try:
            graph = pdc.capture(fn)
            us = statistics.median(pdc.replay_us(graph) for _ in range(3))
            clock = sample_while(graph.replay, us * 1e-6, 0.2) if routing == "uniform" else None
        except Exception as exc:  # noqa: BLE001 (one part failing leaves the others)
            log(f"FAIL {name} {routing} {label}: {type(exc).__name__}: {str(exc)[-400:]}")
            continue
        gemm = label.split(" ")[0]
        copy = 100 * cell["weight_bytes"][gemm] / (us * 1e-6) / 1e12 / cell["copy_TBps"]
        mm = 100 * cell["gemm_flops"][gemm] / (us * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        out[label] = {"us": us, "pct_copy": copy, "pct_mm_real": mm, "pct_mm_multiplied": mm * multiplied,
                      "sm_mhz": clock and clock.sm_mhz, "power_w": clock and clock.power_w}
        line = (f"{name:24s} {routing:8s} {label:18s} {us:8.1f} us {copy:5.1f}% copy {mm:5.1f}% mm real, "
                f"{mm * multiplied:5.1f}% mm multiplied ({multiplied:.3f} rows a real row)"
                + (f", {clock.sm_mhz} MHz {clock.power_w} W" if clock else ""))
        log(line)
        PARTS_TABLE.append(line)
        del graph
    return out


def build_cell(spec: str, dev) -> tuple:
    from moekit.bench.cells import Shape, make_weights, uniform_routing

    _, preset, m = spec.split(":")
    m = int(m)
    s = Shape.from_preset(preset)
    w = make_weights(s, torch.bfloat16, dev)
    q = (*pdc.quantize_chunked(w.w13), *pdc.quantize_chunked(w.w2))
    del w
    routing = uniform_routing(m, s, dev, seed=m)
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    return preset, m, s, q, routing.topk_ids, routing.topk_weights, x


def run_cell(spec: str, ceil, opts) -> None:
    from moekit.bench.cells import measured_experts_touched
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    preset, m, s, q, ids, rw, x = build_cell(spec, torch.device("cuda"))
    name = f"fp8 {preset} M={m}"
    ref = experts_gluon_fp8_twin(x, *q, ids, rw)
    outs: dict = {}
    wanted = [v for v in fv.variants(preset, m, q) if opts.variants is None or v.name in opts.variants]
    ran = [v for v in wanted if (preset, v.name) in opts.ran]
    for v in {v.name for v in wanted} - {v.name for v in ran}:
        log(f"FAIL {name} {v}: its compile worker did not finish it (not run)")
        pdc.FAILED.append(f"{name} {v}")
    passing = [v for v in ran if pdc.check(name, v, x, ids, rw, ref, "fp8", outs)]
    del ref, outs
    touched = measured_experts_touched(ids, s.num_experts)
    a = m * s.top_k
    cell = {"cell": spec, "mm_TFLOPs": ceil.fp8_mm_TFLOPs, "copy_TBps": ceil.copy_TBps,
            "floor_us": floor_us(s, m, ids, ceil),
            "weight_bytes": {"gate-up": touched * 2 * s.n * s.k, "down": touched * s.n * s.k},
            "gemm_flops": {"gate-up": 4 * a * s.n * s.k, "down": 2 * a * s.n * s.k}}
    route = next((v for v in passing if v.name == "route"), None)
    bal_ids, bal_rw = pv.balanced_routing(m, s.num_experts, s.top_k, x.device)
    if route is not None:
        args = (cell["weight_bytes"], cell["gemm_flops"], ceil.copy_TBps, ceil.fp8_mm_TFLOPs)
        cell["kernels"] = {"uniform": graph_kernels(f"{name} route uniform", lambda: route.call(x, ids, rw), *args),
                           "balanced": graph_kernels(f"{name} route balanced", lambda: route.call(x, bal_ids, bal_rw),
                                                     *args)}
    cell["rounds_us"] = replay_rounds(name, passing, x, ids, rw, opts.rounds, opts.deadline - 10)
    summarize(name, cell)
    RESULTS["cells"].append(cell)
    (opts.out / "f8mid8.json").write_text(json.dumps(RESULTS, indent=1))
    wants_parts = opts.parts and (preset == "mixtral-8x7b" or m == 1024)
    for routing, r_ids in (("uniform", ids), ("balanced", bal_ids)):
        if wants_parts and time.perf_counter() - pdc.T0 < opts.deadline - 12:
            cell.setdefault("parts", {})[routing] = time_parts(name, routing, x, r_ids, q, cell, opts.deadline - 8,
                                                               {p for pr, p in opts.ran if pr == preset})
    (opts.out / "f8mid8.json").write_text(json.dumps(RESULTS, indent=1))


def summarize(name: str, cell: dict) -> None:
    rounds = cell["rounds_us"]
    for n, t in rounds.items():
        if not t:
            continue
        med = statistics.median(t)
        pct_mm = 100 * sum(cell["gemm_flops"].values()) / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        line = f"{name:24s} {n:10s} {med:8.1f} us {100 * cell['floor_us'] / med:5.1f}% floor {pct_mm:5.1f}% mm"
        if n != "route" and rounds.get("route"):
            line += f"  vs route {versus(t, rounds['route'])}"
        pdc.SUMMARY.append(line)
    pdc.SUMMARY.append(f"{name:24s} floor {cell['floor_us']:.1f} us (90%: {cell['floor_us'] / 0.9:.1f} us)")


def worker(spec: str, group: str) -> int:
    """Run one cell's variant ``group`` (or its parts, "parts") once on zero weights: compiles into the cache."""
    from moekit.bench.cells import Shape, uniform_routing

    dev = torch.device("cuda")
    _, preset, m = spec.split(":")
    m, s = int(m), Shape.from_preset(preset)
    q = fv.zero_weights(preset, dev)
    routing = uniform_routing(m, s, dev, seed=m)
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    if group == "parts":
        for label, fn in fv.gluon_parts(x, routing.topk_ids, q)[0].items():
            fn()
            torch.cuda.synchronize()  # a fault shows here, before the OK
            print(f"OK {spec} {label}", flush=True)
        return 0
    v = next(v for v in fv.variants(preset, m, q) if v.name == group)
    v.call(x, routing.topk_ids, routing.topk_weights)
    torch.cuda.synchronize()
    print(f"OK {spec} {group}", flush=True)
    return 0


def spawn_workers(cells: list, variants: list | None, parts: bool) -> list:
    """One process per variant (those in ``variants``, None: all) and one for the parts (``parts``) at the first cell
    of each preset, one for the route at the others (another M may take another tuned entry), logging to /tmp."""
    procs, seen = [], set()
    for spec in cells:
        preset = spec.split(":")[1]
        mine = [n for n in fv.NAMES[preset] if variants is None or n in variants] + (["parts"] if parts else [])
        groups = ["route"] if preset in seen else mine
        seen.add(preset)
        for group in groups:
            path = Path(f"/tmp/f8mid8_worker_{spec.replace(':', '_')}_{group.replace(' ', '_')}.log")
            with open(path, "w") as f:
                procs.append((subprocess.Popen([sys.executable, __file__, "--worker", spec, group], stdout=f,
                                               stderr=subprocess.STDOUT), path))
    return procs


def wait_workers(procs: list, until: float) -> set:
    """{(preset, variant or part)} the workers ran to the end (the rest is not run here: a hang or a crash in a
    new kernel must not take the run with it), each worker waited for until ``until`` s into the run."""
    done = set()
    for p, path in procs:
        try:
            p.wait(timeout=max(0.1, until - (time.perf_counter() - pdc.T0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        lines = path.read_text(errors="replace").strip().splitlines()
        done |= {(ln.split(" ")[1].split(":")[1], ln.split(" ", 2)[2]) for ln in lines if ln.startswith("OK ")}
        log(f"worker {path.name}: rc {p.returncode}, {(lines or ['(no output)'])[-1][-200:]}")
    return done


def mm_clock():
    """The SM clock and board power while the fp8 mm of the ceiling (8192^3 e4m3) runs back to back."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    return sample_while(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                 use_fast_accum=True), 0.8e-3, 0.3)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=70.0, help="seconds: no new cell or timing after ~this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="*", default=list(fv.CELLS))
    parser.add_argument("--worker-deadline", type=float, default=30.0)
    parser.add_argument("--no-parts", dest="parts", action="store_false", help="no GEMMs alone, no probes")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all)")
    opts = parser.parse_args()
    opts.variants = None if opts.variants is None else opts.variants.split(",")
    opts.out.mkdir(parents=True, exist_ok=True)
    procs = spawn_workers(opts.cells, opts.variants, opts.parts)
    pdc.STALL_S = 40.0
    threading.Thread(target=pdc.watchdog, daemon=True).start()
    from moekit.bench.ceilings import measure_ceilings, measure_fp8_mm

    dev = torch.device("cuda")
    opts.ran = wait_workers(procs, opts.worker_deadline)  # the ceilings measured on a GPU the workers have left
    ceil = measure_ceilings(dev)
    ceil = replace(ceil, fp8_mm_TFLOPs=measure_fp8_mm(dev).TFLOPs)
    clock = mm_clock()
    RESULTS["ceilings"] = {"copy_TBps": ceil.copy_TBps, "fp8_mm_TFLOPs": ceil.fp8_mm_TFLOPs,
                           "fp8_mm_MHz": clock.sm_mhz, "fp8_mm_W": clock.power_w}
    log(f"copy {ceil.copy_TBps:.2f} TB/s, fp8 mm {ceil.fp8_mm_TFLOPs:.0f} TFLOP/s ({clock.sm_mhz} MHz, "
        f"{clock.power_w} W, {clock.source}); torch {torch.__version__}")
    pdc.RUN.each_cell(opts.cells, lambda spec: run_cell(spec, ceil, opts), opts.deadline - 14, pdc.free_memory)
    print("\nGEMMs alone and probes (graph replay, median of 3):\n" + "\n".join(PARTS_TABLE), flush=True)
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3]))
    sys.exit(main())

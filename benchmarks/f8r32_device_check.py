"""Issue 15, session 32 (branch `f8r32`): the pipelined down GEMM (``PIPELINED_DOWN_TILE``; the plan's at Mixtral-8x7B
M*k/E in [256, 512): ``triton_gluon_fp8_launch.wants_pipelined_down``) against the plan's waited tiles at Mixtral 1024
and the cells a wider rule would reach (256-1024 rows an expert); the odd-K check of the pipelined loop first.
(Check 1 timed the options skip, pairs and their mixes, removed since: this script at 76a8820.)

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/f8r32_device_check.py --out $OUT/f8r32 --deadline 66
        [--cells fp8:mixtral-8x7b:1024 ...] [--rounds 5] [--worker-deadline 34]

1. Compile workers (this script with --worker, in parallel): one a odd-K shape (first in the run's use), one a preset
   (the route at each of its cells, the plan's old tiles, the pipelined down). A call a worker did not finish is not
   run here. Then this run's ceilings (copy, fp8 mm).
2. Odd K (E = 4, K = 256, N = 384 and 128: the down GEMM's 3 K-steps, a pair and an odd one, and 1, the odd one
   alone): plan and pipe against the fp8 Gluon path's twin (PASS / FAIL), pipe bit-equal to plan (FAIL if not).
3. Per cell (the bench's weights quantized, uniform routing seeded by M): route, plan, pipe against the twin (pipe
   bit-equal to plan or FAIL); whole calls as CUDA graphs in --rounds settled rounds (``bench_rounds.settled``: each
   graph after a replay of itself, the order turned a name a round); eager host / wall a call.
The table is printed last: median µs, % of the byte-model floor (90% target) or of the fp8 mm rate, x plan (rounds
>= 3% faster of 5). JSON to --out/f8r32.json after each cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import prefill_device_check as pdc  # noqa: E402
from bench_rounds import eager_us, settled, versus  # noqa: E402
from f8mid8_device_check import build_cell  # noqa: E402
from f8pp_device_check import run_workers  # noqa: E402
from f8pre_device_check import floor_us  # noqa: E402
from f8r32_variants import calls  # noqa: E402

CELLS = ("fp8:mixtral-8x7b:1024", "fp8:qwen3-30b-a3b:4096", "fp8:mixtral-8x7b:4096", "fp8:qwen3-30b-a3b:16384",
         "fp8:deepseek-v3:8192")  # 256, 256, 1024, 1024, 256 rows an expert
ODD = ((4, 256, 384), (4, 256, 128))  # (E, K, N): the down GEMM's 3 K-steps (a pair and an odd one), 1 (odd alone)
SAMPLE_S = 0.02  # seconds of replays a sample
RESULTS: dict = {"cells": [], "odd": {}}
log = pdc.log


def timed(label: str, fns: dict, rounds: int, stop_at: float) -> dict:
    """name -> µs a call per settled round for the calls ``fns`` (name -> fn), each captured as a CUDA graph."""
    graphs = {}
    for n, fn in fns.items():
        try:
            graphs[n] = pdc.capture(fn)
        except Exception as exc:  # noqa: BLE001
            log(f"FAIL capture {label} {n}: {type(exc).__name__}: {str(exc)[-300:]}")
            pdc.FAILED.append(f"{label} {n} capture")
    if not graphs:
        return {}
    once_s = max(pdc.replay_us(g, budget_s=0.0) for g in graphs.values()) * 1e-6
    replays = max(3, min(50, int(SAMPLE_S / max(once_s, 1e-6))))
    until = time.time() + max(1.0, stop_at - (time.perf_counter() - pdc.T0))
    got = settled({n: (g, None) for n, g in graphs.items()}, 1, torch.device("cuda"), rounds, replays, until)
    for r in range(len(next(iter(got.values())))):
        log(f"{label} round {r} ({replays} replays): " + ", ".join(f"{n} {t[r]:.1f}" for n, t in got.items()))
    del graphs
    return got


def check_odd(ran: set) -> None:
    """The pipelined down loop's odd last K-step on the device: plan and pipe at the ODD shapes against the twin
    (PASS / FAIL), pipe bit-equal to plan (``pdc.check``: FAIL if not)."""
    from f8pp_device_check import odd_problem

    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    for i, (e, k, n) in enumerate(ODD):
        name = f"odd K E={e} K={k} N={n}"
        if f"odd{i}" not in ran:
            log(f"FAIL {name}: its worker did not finish (not run)")
            pdc.FAILED.append(name)
            continue
        x, q, ids, rw = odd_problem(e, k, n, torch.device("cuda"))
        ref = experts_gluon_fp8_twin(x, *q, ids, rw)
        outs: dict = {}
        ok = [pdc.check(name, v, x, ids, rw, ref, "fp8", outs) for v in calls(q)[1:]]
        RESULTS["odd"][name] = {"pass": len(ok) == 2 and all(ok)}
        pdc.SUMMARY.append(f"{name}: plan, pipe {'PASS' if all(ok) else 'FAIL'} (pipe bit-equal to plan: "
                           f"{'pipe' in outs and 'plan' in outs and torch.equal(outs['pipe'], outs['plan'])})")


def run_cell(spec: str, ceil, opts) -> None:
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin
    from moekit.experts.triton_gluon_fp8_launch import plan_gluon_fp8

    preset, m, s, q, ids, rw, x = build_cell(spec, torch.device("cuda"))
    name = f"fp8 {preset} M={m}"
    log(f"{name}: the route's down tile {plan_gluon_fp8(m, s.top_k, s.num_experts, s.k, inter=s.n).down}")
    ref = experts_gluon_fp8_twin(x, *q, ids, rw)
    outs: dict = {}
    ran = [v for v in calls(q) if f"{preset} {v.name}" in opts.ran]
    passing = [v for v in ran if pdc.check(name, v, x, ids, rw, ref, "fp8", outs)]
    if "route" in outs and "pipe" in outs:
        log(f"{name} route vs pipe: bit-equal {torch.equal(outs['route'], outs['pipe'])}")
    del ref, outs
    a = m * s.top_k
    cell = {"cell": spec, "floor_us": floor_us(s, m, ids, ceil), "passing": [v.name for v in passing],
            "flops": 6 * a * s.n * s.k, "mm_TFLOPs": ceil.fp8_mm_TFLOPs, "rows_an_expert": a / s.num_experts}
    cell["rounds_us"] = timed(name, {v.name: (lambda v=v: v.call(x, ids, rw)) for v in passing}, opts.rounds,
                              opts.deadline - 10)
    if time.perf_counter() - pdc.T0 < opts.deadline - 8:
        cell["eager_host_wall_us"] = eager_us({v.name: [lambda v=v: v.call(x, ids, rw)] for v in passing}, 3, 4)
        log(f"{name} eager (host, wall) µs a call: " + ", ".join(
            f"{n} {h:.0f} / {w:.0f}" for n, (h, w) in cell["eager_host_wall_us"].items()))
    summarize(name, cell, m <= 1024)
    RESULTS["cells"].append(cell)
    (opts.out / "f8r32.json").write_text(json.dumps(RESULTS, indent=1))


def summarize(name: str, cell: dict, ridge: bool) -> None:
    rounds = cell["rounds_us"]
    for n, t in rounds.items():
        med = statistics.median(t)
        line = f"{name:24s} {n:6s} {med:9.1f} us"
        if ridge:
            line += f" {100 * cell['floor_us'] / med:5.1f}% floor"
        else:
            line += f" {100 * cell['flops'] / (med * 1e-6) / 1e12 / cell['mm_TFLOPs']:5.1f}% mm"
        if n != "plan" and rounds.get("plan"):
            line += f"  vs plan {versus(t, rounds['plan'])}"
        eager = cell.get("eager_host_wall_us", {}).get(n)
        if eager:
            line += f"  eager wall {eager[1]:.0f} us"
        pdc.SUMMARY.append(line)
    if ridge:
        pdc.SUMMARY.append(f"{name:24s} floor {cell['floor_us']:.1f} us (90% target: {cell['floor_us'] / 0.9:.1f})")


def worker_groups(cells: list) -> tuple:
    """The compile workers: one a odd-K shape ("odd0", "odd1"), then one a preset of ``cells``."""
    return tuple(f"odd{i}" for i in range(len(ODD))) + tuple(dict.fromkeys(c.split(":")[1] for c in cells))


def worker(group: str, cells: list) -> int:
    """``group``'s calls once each, "OK <key>" after each: "oddI" plan and pipe at ODD[I] ("OK oddI" when both ran);
    a preset: the route at each of its cells, plan and pipe at its first ("OK <preset> <name>")."""
    from f8mid8_variants import zero_weights

    from moekit.bench.cells import Shape, uniform_routing

    dev = torch.device("cuda")
    if group.startswith("odd"):
        from f8pp_device_check import odd_problem

        x, q, ids, rw = odd_problem(*ODD[int(group[3:])], dev)
        jobs = [(group, lambda: [v.call(x, ids, rw) for v in calls(q)[1:]])]
    else:
        s, q = Shape.from_preset(group), zero_weights(group, dev)
        jobs = []
        for i, m in enumerate(int(c.split(":")[2]) for c in cells if c.split(":")[1] == group):
            routing = uniform_routing(m, s, dev, seed=m)
            x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
            jobs += [(f"{group} {v.name}", lambda v=v, x=x, r=routing: v.call(x, r.topk_ids, r.topk_weights))
                     for v in calls(q) if i == 0 or v.name == "route"]
    for key, fn in jobs:
        try:
            fn()
            torch.cuda.synchronize()  # a fault shows here, before the OK
        except Exception as exc:  # noqa: BLE001 (a compile error leaves the rest; a fault fails them too)
            print(f"FAIL {key}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
            continue
        print(f"OK {key}", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=66.0, help="seconds: no new cell or timing after ~this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="*", default=list(CELLS))
    parser.add_argument("--worker-deadline", type=float, default=34.0)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    pdc.STALL_S = 40.0
    threading.Thread(target=pdc.watchdog, daemon=True).start()
    from moekit.bench.ceilings import measure_ceilings, measure_fp8_mm

    dev = torch.device("cuda")
    opts.ran = run_workers(opts.cells, opts.worker_deadline, __file__, worker_groups(opts.cells))
    ceil = measure_ceilings(dev)
    ceil = replace(ceil, fp8_mm_TFLOPs=measure_fp8_mm(dev).TFLOPs)
    RESULTS["ceilings"] = {"copy_TBps": ceil.copy_TBps, "fp8_mm_TFLOPs": ceil.fp8_mm_TFLOPs}
    log(f"copy {ceil.copy_TBps:.2f} TB/s, fp8 mm {ceil.fp8_mm_TFLOPs:.0f} TFLOP/s; torch {torch.__version__}")
    check_odd(opts.ran)
    pdc.RUN.each_cell(opts.cells, lambda spec: run_cell(spec, ceil, opts), opts.deadline - 12, pdc.free_memory)
    (opts.out / "f8r32.json").write_text(json.dumps(RESULTS, indent=1))
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    sys.exit(main())

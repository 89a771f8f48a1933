"""Issue 15, session 32 (branch `f8r32`): fp8_block at the ridge. The fp8 Gluon GEMMs skipping the padding by halves
(``Fp8GluonTile.skip``: a 128-row block's second 64-row half with no real row neither loaded nor multiplied), with
the pipelined promotion (``pipelined``) and the gate-up in two pipelined passes (``pairs``), against the route, at
fp8 Mixtral-8x7B M = 512 / 1024 and Qwen3-30B-A3B M = 1024 / 512 (where the route takes the fused Triton kernels).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/f8r32_device_check.py --out $OUT/f8r32 --deadline 66
        [--cells fp8:mixtral-8x7b:512 ...] [--variants route,gluon,...] [--rounds 5] [--worker-deadline 28]

1. Compile workers (this script with --worker, in parallel: one a group of calls and preset, ``GROUPS``) run each
   call once on zero weights of the real shapes. A call a worker did not finish is not run here. Then this run's
   ceilings (copy, fp8 mm).
2. Per cell (the bench's weights quantized, uniform routing seeded by M): every call against the fp8 Gluon path's
   torch twin (PASS / FAIL, rel L2), skip against the same call without it bit for bit (FAIL if not); whole calls as
   CUDA graphs in --rounds settled rounds (``bench_rounds.settled``: each graph after a replay of itself, the order
   turned a name a round); eager wall per call of the Gluon calls; the GEMMs alone (Mixtral) the same way.
The table is printed last: median µs, % of the byte-model floor beside its 90% target, x the route and x gluon
(rounds >= 3% faster of 5). JSON to --out/f8r32.json after each cell.
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
from f8r32_variants import calls, gemms_alone  # noqa: E402

CELLS = ("fp8:mixtral-8x7b:512", "fp8:mixtral-8x7b:1024", "fp8:qwen3-30b-a3b:1024", "fp8:qwen3-30b-a3b:512")
SAMPLE_S = 0.02  # seconds of replays a sample
RESULTS: dict = {"cells": []}
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


def run_cell(spec: str, ceil, opts) -> None:
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    preset, m, s, q, ids, rw, x = build_cell(spec, torch.device("cuda"))
    name = f"fp8 {preset} M={m}"
    ref = experts_gluon_fp8_twin(x, *q, ids, rw)
    outs: dict = {}
    ran = [v for v in calls(q) if f"{preset} {v.name}" in opts.ran and (not opts.variants or v.name in opts.variants)]
    passing = [v for v in ran if pdc.check(name, v, x, ids, rw, ref, "fp8", outs)]
    for a, b in (("pipe", "gluon"), ("pairs+pipe", "pipe")):
        if a in outs and b in outs:
            log(f"{name} {a} vs {b}: bit-equal {torch.equal(outs[a], outs[b])}")
    del ref, outs
    cell = {"cell": spec, "floor_us": floor_us(s, m, ids, ceil), "passing": [v.name for v in passing],
            "rows_a_real_row": rows_ratio(ids, s.num_experts)}
    cell["rounds_us"] = timed(name, {v.name: (lambda v=v: v.call(x, ids, rw)) for v in passing}, opts.rounds,
                              opts.deadline - 10)
    gluon_calls = {v.name: [lambda v=v: v.call(x, ids, rw)] for v in passing if v.kind in ("gluon", "route")}
    if time.perf_counter() - pdc.T0 < opts.deadline - 8:
        cell["eager_host_wall_us"] = eager_us(gluon_calls, 3, 6)
        log(f"{name} eager (host, wall) µs a call: " + ", ".join(
            f"{n} {h:.0f} / {w:.0f}" for n, (h, w) in cell["eager_host_wall_us"].items()))
    if preset.startswith("mixtral") and time.perf_counter() - pdc.T0 < opts.deadline - 8:
        gemms = {v.name: v.call for v in gemms_alone(x, ids, q) if f"{preset} {v.name}" in opts.ran}
        cell["gemm_rounds_us"] = timed(f"{name} GEMMs", gemms, opts.rounds, opts.deadline - 4)
    summarize(name, cell)
    RESULTS["cells"].append(cell)
    (opts.out / "f8r32.json").write_text(json.dumps(RESULTS, indent=1))


def rows_ratio(ids: torch.Tensor, num_experts: int) -> dict:
    """Rows multiplied a real row: 128-row blocks, and with the padding halves skipped (64-row steps)."""
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts).float()
    real = float(counts.sum())
    return {"blocks": float((torch.ceil(counts / 128) * 128).sum()) / real,
            "skip": float((torch.ceil(counts / 64) * 64).sum()) / real}


def summarize(name: str, cell: dict) -> None:
    for rounds, base in ((cell["rounds_us"], "route"), (cell.get("gemm_rounds_us", {}), None)):
        for n, t in rounds.items():
            if not t:
                continue
            line = f"{name:24s} {n:14s} {statistics.median(t):8.1f} us"
            if base:
                line += f" {100 * cell['floor_us'] / statistics.median(t):5.1f}% floor"
            peer = base or n.split(" ")[0]  # a GEMM alone against the plan's
            if n != peer and rounds.get(peer):
                line += f"  vs {peer} {versus(t, rounds[peer])}"
            if base and n not in ("route", "gluon") and rounds.get("gluon"):
                line += f"  vs gluon {versus(t, rounds['gluon'])}"
            pdc.SUMMARY.append(line)
    ratio = cell["rows_a_real_row"]
    pdc.SUMMARY.append(f"{name:24s} floor {cell['floor_us']:.1f} us (90% target: {cell['floor_us'] / 0.9:.1f} us); "
                       f"rows a real row {ratio['blocks']:.3f}, skipping {ratio['skip']:.3f}")


GROUPS = {"plans": ("route", "gluon", "gate-up", "down"),
          "skip": ("skip", "skip+pipe", "gate-up skip", "down skip", "down skip pipe"),
          "pairs": ("pairs+pipe", "skip+pairs+pipe", "gate-up pairs"),
          "pipe": ("pipe", "down pipe")}  # a worker each and preset (f8pp's pipe2 lost 0.77-0.81x)
ODD = ((4, 384, 384), (4, 128, 128))  # (E, K, N): 3 K-steps in both GEMMs (a pair and an odd step), 1 (odd alone)
ODD_CALLS = ("gluon", "pipe", "skip+pipe", "pairs+pipe", "skip+pairs+pipe")


def worker_groups(cells: list) -> tuple:
    """The compile workers: "odd" (the odd-K shapes, first: small) and GROUP@PRESET for each group and preset."""
    presets = dict.fromkeys(c.split(":")[1] for c in cells)
    return ("odd",) + tuple(f"{g}@{p}" for p in presets for g in GROUPS)


def check_odd() -> None:
    """The pipelined loops' odd last K-step on the device (3 K-steps: a pair and an odd one; 1: the odd one alone), in
    both GEMMs: each call against the twin (PASS / FAIL) and bit for bit against gluon (reported)."""
    from f8pp_device_check import odd_problem

    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    RESULTS["odd"] = {}
    for e, k, n in ODD:
        x, q, ids, rw = odd_problem(e, k, n, torch.device("cuda"))
        ref = experts_gluon_fp8_twin(x, *q, ids, rw)
        outs: dict = {}
        name = f"odd K E={e} K={k} N={n}"
        ok = [pdc.check(name, v, x, ids, rw, ref, "fp8", outs) for v in calls(q) if v.name in ODD_CALLS]
        same = {v: torch.equal(outs[v], outs["gluon"]) for v in ODD_CALLS[1:] if v in outs and "gluon" in outs}
        log(f"{name} vs gluon, bit-equal: {same}")
        RESULTS["odd"][name] = {"pass": all(ok) and len(ok) == len(ODD_CALLS), "bit_equal": same}


def worker(group: str, cells: list) -> int:
    """The calls (Mixtral: and its GEMMs alone) of ``group`` ("NAME@PRESET", ``GROUPS``) once on zero weights, at
    the preset's first cell (the route at each of its cells), "OK <preset> <name>" after each."""
    from f8mid8_variants import zero_weights

    from moekit.bench.cells import Shape, uniform_routing

    dev = torch.device("cuda")
    if group == "odd":
        return odd_worker(dev)
    name, preset = group.split("@")
    s, q = Shape.from_preset(preset), zero_weights(preset, dev)
    jobs = []
    for i, m in enumerate(int(c.split(":")[2]) for c in cells if c.split(":")[1] == preset):
        routing = uniform_routing(m, s, dev, seed=m)
        x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
        run = {v.name: (lambda v=v, x=x, r=routing: v.call(x, r.topk_ids, r.topk_weights)) for v in calls(q)}
        if preset.startswith("mixtral"):
            run |= {v.name: v.call for v in gemms_alone(x, routing.topk_ids, q)}
        jobs += [(f"{preset} {n}", run[n]) for n in GROUPS[name] if n in run and (i == 0 or n == "route")]
    for key, fn in jobs:
        try:
            fn()
            torch.cuda.synchronize()  # a fault shows here, before the OK
        except Exception as exc:  # noqa: BLE001 (a compile error leaves the rest; a fault fails them too)
            print(f"FAIL {key}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
            continue
        print(f"OK {key}", flush=True)
    return 0


def odd_worker(dev) -> int:
    """The odd-K shapes' calls once each, "OK odd" when all ran."""
    from f8pp_device_check import odd_problem

    try:
        for shape in ODD:
            x, q, ids, rw = odd_problem(*shape, dev)
            for v in (v for v in calls(q) if v.name in ODD_CALLS):
                v.call(x, ids, rw)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        print(f"FAIL odd: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
        return 0
    print("OK odd", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=70.0, help="seconds: no new cell or timing after ~this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="*", default=list(CELLS))
    parser.add_argument("--variants", type=lambda v: v.split(","), default=None)
    parser.add_argument("--worker-deadline", type=float, default=30.0)
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
    if "odd" in opts.ran:
        check_odd()
    else:
        log("FAIL odd K: its worker did not finish (not run)")
        pdc.FAILED.append("odd K")
    for spec in opts.cells:
        if time.perf_counter() - pdc.T0 > opts.deadline - 12:
            log(f"SKIP {spec}: deadline")
            pdc.SUMMARY.append(f"{spec}: not reached")
            continue
        try:
            run_cell(spec, ceil, opts)
        except Exception as exc:  # noqa: BLE001
            log(f"FAIL {spec}: {type(exc).__name__}: {str(exc)[-800:]}")
            pdc.FAILED.append(spec)
        pdc.free_memory()
    (opts.out / "f8r32.json").write_text(json.dumps(RESULTS, indent=1))
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    sys.exit(main())

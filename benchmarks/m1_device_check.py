"""Issues 19 / 15 / 16 / 13: decode M = 1 toward 80% of the byte floor (Qwen3-30B-A3B first; DeepSeek-V3, Mixtral
guards).

    PYTHONPATH=$PWD timeout 200 python3 benchmarks/m1_device_check.py --out $OUT/m1   # H200, < 180 s
    PYTHONPATH=$PWD python3 benchmarks/m1_device_check.py --smoke                     # CPU: interpreter, tiny shapes

Cells and variants: ``m1_variants`` (the default as users call it, twice; what earlier runs measured: its docstring).
Per cell: every variant's output on the first input set against the reference (bf16: ``experts_reference``;
fp8_block: its recipe, ``experts_fp8_block_reference``; int4_w4a16: ``experts_reference`` on the dequantized weights)
and against the default's (``=`` bit-equal); PASS / FAIL lines. Then CUDA-graph replay µs over rotated
input sets, variants interleaved over ROUNDS rounds, median; % of the byte floor (bytes of the touched experts'
weights, packed with scales for the quantized ones, plus x and out, at the copy bandwidth measured here); eager wall /
host µs (back-to-back calls) of every timed variant. Compile: WORKERS subprocesses run every (cell, variant) once on
small-E weights of the same N and K (Triton's disk cache) while this process builds the real weights. Table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from compile_workers import collect_workers, compile_one, held_weights, spawn_workers  # noqa: E402
from decode_q3_device_check import (  # noqa: E402
    Cell, Row, measure_copy, rel_l2, shape_of,
)
from m1_variants import CELLS, GUARDS, SCHEME, SMOKE_CELLS, run, variants  # noqa: E402

T0 = time.perf_counter()
WORKER_DEADLINE_S = 40.0
WORKERS = 12
ROUNDS = 7
ROTATION_BYTES = 256 << 20
TOLERANCE = {"bf16": 2e-2, "fp8": 2e-2, "int4": 2e-2}  # fp8: against its recipe; int4: the dequantized weights


def elapsed() -> float:
    return time.perf_counter() - T0


def cells() -> list[tuple]:
    """The cells of this run; ``--dtypes`` (workers get it too) keeps those of the dtypes named."""
    keep = os.environ.get("M1_DTYPES")
    every = SMOKE_CELLS if SMOKE else CELLS + (GUARDS if os.environ.get("M1_GUARDS") else ())
    return [c for c in every if not keep or c[0] in keep.split(",")]


def make_weights(dtype: str, s, dev) -> tuple:
    """(w13, w2) for the kernels and (w13, w2) in bf16 for the reference (the dequantized ones when quantized)."""
    from moekit.bench.cells import make_weights as bf16_weights

    w = bf16_weights(s, torch.bfloat16, dev)
    if dtype == "bf16":
        return (w.w13, w.w2), (w.w13, w.w2)
    from moekit.quant import quantize

    q13, q2 = quantize(w.w13, SCHEME[dtype]), quantize(w.w2, SCHEME[dtype])
    del w
    return (q13, q2), None  # the reference dequantizes per call (the touched experts only)


def tuned_config(dtype: str, s, m: int, dev):
    """The real shape's tuned entry's config (the compile workers pass it: their small-E weights have no file)."""
    from moekit.experts.configs import device_key, get_config
    from moekit.experts.triton_fp8_plan import fp8_entry

    if dtype == "fp8":
        return fp8_entry(m, s.num_experts, s.n, s.k, s.top_k, 128, device_key(dev)).config
    return get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, device_key(dev)) if dtype == "bf16" else None


def worker_main(tasks: list) -> None:
    from moekit.bench.cells import make_sets

    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, vi in tasks:
        dtype, preset, m = cells()[ci]
        s = shape_of(preset, small_for_m=m)
        w = held_weights(held, (dtype, s), lambda: make_weights(dtype, s, dev)[0])
        compile_one(ci, vi, lambda: run(variants(dtype, preset, m)[vi], dtype,
                                        make_sets(s, m, 1, torch.bfloat16, dev)[0], w,
                                        tuned_config(dtype, shape_of(preset), m, dev)), SMOKE)


def start_workers(workers: int) -> list:
    tasks = [(ci, vi) for ci, c in enumerate(cells()) for vi in range(len(variants(*c)))]
    return spawn_workers(__file__, [tasks[j::workers] for j in range(workers)], SMOKE, "m1")


def reference(t, w, ref_w) -> torch.Tensor:
    from moekit.experts.reference import experts_reference
    from moekit.quant.fp8_block import Fp8BlockWeight

    if isinstance(w[0], Fp8BlockWeight):  # the recipe (activations quantized 1 x 128, as the kernels do)
        from moekit.quant.emulate import experts_fp8_block_reference

        return experts_fp8_block_reference(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
    if ref_w is not None:
        return experts_reference(t.x, ref_w[0], ref_w[1], t.topk_ids, t.topk_weights)
    used = torch.unique(t.topk_ids.reshape(-1).long())  # dequantize the touched experts only
    remap = torch.full((w[0].shape[0],), -1, dtype=torch.int32, device=t.x.device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=t.x.device)
    w13, w2 = w[0].dequantize()[used], w[1].dequantize()[used]  # float32 [E, ...]: ~1.6 GB for Qwen3's w13
    ids = remap[t.topk_ids.long()]
    return experts_reference(t.x, w13.to(t.x.dtype), w2.to(t.x.dtype), ids, t.topk_weights)


def expert_bytes(dtype: str, w, s) -> float:
    if dtype == "bf16":
        return 3 * s.n * s.k * 2
    return (w[0].nbytes + w[1].nbytes) / s.num_experts


def check_cell(cell: Cell, vs: list, sets, w, ref_w, status: dict, ci: int) -> list:
    ref = reference(sets[0], w, ref_w)
    default_out, timed = None, []
    for vi, v in enumerate(vs):
        row = Row(v.name)
        cell.rows.append(row)
        if not SMOKE and vi > 0 and status.get((ci, vi)) not in ("ok", None):
            row.status = status[(ci, vi)]
            print(f"FAIL {cell.dtype} {cell.preset} M={cell.M} {v.name}: {row.status}", flush=True)
            continue
        try:
            out = run(v, cell.dtype, sets[0], w)
        except Exception as e:  # noqa: BLE001  (one variant's failure never ends the run)
            row.status = f"error: {type(e).__name__}: {str(e)[:160]}".replace("\n", " ")
            print(f"FAIL {cell.dtype} {cell.preset} M={cell.M} {v.name}: {row.status}", flush=True)
            continue
        row.rel_l2_ref = rel_l2(out, ref)
        if vi == 0:
            default_out = out
        else:
            row.equal_default = default_out is not None and bool(torch.equal(out, default_out))
        ok = row.rel_l2_ref < TOLERANCE[cell.dtype]
        print(f"{'PASS' if ok else 'FAIL'} {cell.dtype} {cell.preset} M={cell.M} {v.name}: rel L2 {row.rel_l2_ref:.2e}"
              f" vs reference, bit-equal to default {row.equal_default}", flush=True)
        if not ok:
            row.status = f"FAIL (rel_l2 {row.rel_l2_ref:.2e})"
            continue
        timed.append((vi, v, row))
    return timed


def time_cell(cell: Cell, timed: list, sets, w, dev, deadline: float) -> None:
    from moekit.bench.timing import time_calls, time_eager

    for _ in range(ROUNDS):
        for _, v, row in timed:
            if elapsed() > deadline:
                break
            fns = [lambda t=t, v=v: run(v, cell.dtype, t, w) for t in sets]
            row.samples.append(time_calls(fns, dev, graph=True, budget_s=0.012, min_reps=3, max_reps=10))
    for _, v, row in timed:
        if row.samples:
            row.us = statistics.median(row.samples)
            row.pct_floor = 100 * cell.floor_us / row.us
    for _, v, row in timed:
        if row.us is None or elapsed() > deadline:
            continue
        e = time_eager([lambda t=t, v=v: run(v, cell.dtype, t, w, eager=True) for t in sets], dev, repeats=3)
        row.eager_us, row.host_us = e.eager_us, e.host_us


def print_cell(c: Cell) -> None:
    d = next((r for r in c.rows if r.variant == "default"), None)
    for r in c.rows:
        us = f"{r.us:7.1f}" if r.us is not None else "      -"
        pct = f"{r.pct_floor:4.0f}%" if r.pct_floor is not None else "    -"
        vs = f"{r.us / d.us:6.3f}" if r.us is not None and d is not None and d.us else "     -"
        spread = f"{min(r.samples):.1f}-{max(r.samples):.1f}" if r.samples else "-"
        eager = f"{r.eager_us:6.1f}/{r.host_us:5.1f}" if r.eager_us is not None else "     -/    -"
        eq = {True: "=", False: "~", None: " "}[r.equal_default]
        err = f"{r.rel_l2_ref:.1e}" if r.rel_l2_ref is not None else "-"
        print(f"{c.dtype:<5}{c.preset:<14}{c.M:>2} {r.variant:<30}{us}{pct} x{vs} [{spread:>11}] eager {eager} "
              f"{err:>8}{eq} {r.status}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--deadline", type=float, default=165.0, help="stop timing after this many seconds")
    ap.add_argument("--dtypes", default="", help="comma-separated dtypes whose cells run (bf16, fp8, int4; all)")
    ap.add_argument("--guards", action="store_true", help="also the guard cells (DeepSeek-V3, Mixtral, Qwen3 M=2 / 8)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.dtypes:
        os.environ["M1_DTYPES"] = args.dtypes  # before the workers start: they inherit it
    if args.guards:
        os.environ["M1_GUARDS"] = "1"
    dev = torch.device("cpu" if SMOKE else "cuda")
    procs = start_workers(1 if SMOKE else WORKERS)
    import triton

    from moekit.bench.cells import make_sets, measured_experts_touched

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    weights = {}
    for dtype, preset, _ in cells():
        if (dtype, preset) not in weights:
            weights[(dtype, preset)] = make_weights(dtype, shape_of(preset), dev)
    copy_tbps = 1.0 if SMOKE else measure_copy(dev)
    print(f"[{elapsed():5.1f}s] weights built, copy {copy_tbps:.2f} TB/s", flush=True)
    status = collect_workers(procs, lambda: WORKER_DEADLINE_S - elapsed())
    print(f"[{elapsed():5.1f}s] compiled {sum(v == 'ok' for v in status.values())} of {len(status)}; others: "
          f"{sorted(set(status.values()) - {'ok'})}"[:600], flush=True)
    results = []
    for ci, (dtype, preset, m) in enumerate(cells()):
        if elapsed() > args.deadline:
            break
        s, cell = shape_of(preset), Cell(dtype, preset, m)
        results.append(cell)
        vs, (w, ref_w) = variants(dtype, preset, m), weights[(dtype, preset)]
        once = max(1, min(s.num_experts, m * s.top_k)) * expert_bytes(dtype, w, s)
        sets = make_sets(s, m, 1 if SMOKE else max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
        cell.touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
        cell.floor_us = (cell.touched * expert_bytes(dtype, w, s) + 2 * m * s.k * 2) / (copy_tbps * 1e12) * 1e6
        timed = check_cell(cell, vs, sets, w, ref_w, status, ci)
        if not SMOKE:
            time_cell(cell, timed, sets, w, dev, args.deadline)
        print(f"[{elapsed():5.1f}s]", flush=True)
        print_cell(cell)
        if args.out:
            write(args.out, name, triton.__version__, copy_tbps, results, [])
    exact = {(c.dtype, c.preset, c.M, v.name): v.exact for c in results for v in variants(c.dtype, c.preset, c.M)}
    failed = [f"{c.dtype} {c.preset} M={c.M} {r.variant}" for c in results for r in c.rows
              if r.status.startswith(("FAIL", "error")) or (r.equal_default is False
                                                            and exact[(c.dtype, c.preset, c.M, r.variant)])]
    if args.out:
        write(args.out, name, triton.__version__, copy_tbps, results, failed)
    print(f"\ncopy {copy_tbps:.2f} TB/s; all cells (graph µs median of rounds, % of byte floor, x default, "
          "[round min-max], eager wall/host µs, rel L2 vs reference, = bit-equal to default)")
    for c in results:
        print_cell(c)
    print(f"NOT BIT-EQUAL OR FAILED: {failed or 'none'}  ({elapsed():.1f} s)")
    return 1 if failed else 0


def write(out: str, name: str, triton_version: str, copy_tbps: float, results: list, failed: list) -> None:
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "m1.json").write_text(json.dumps(
        {"device": name, "torch": torch.__version__, "triton": triton_version, "copy_TBps": copy_tbps,
         "cells": [asdict(c) for c in results], "failed": failed, "seconds": elapsed()}, indent=1) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        sys.exit(main())

"""Issues 19 / 15: the byte-bound cells 8 <= M <= 1024 toward >= 90% of the weight-stream floor, bf16 and fp8_block.

    PYTHONPATH=$PWD timeout 150 python3 benchmarks/bytes_device_check.py --out $OUT/bytes   # H200, ~2.3 min
    PYTHONPATH=$PWD python3 benchmarks/bytes_device_check.py --smoke                       # CPU, interpreter

Cells and variants of the tuned entries: ``bytes_variants``. Per cell (uniform routing, rotated input sets): every
variant's output on the first set against the default's (bit-equal where only widths / stages / GROUP_M change) and
against the reference (bf16 ``experts_reference``, fp8 the recipe's ``experts_fp8_block_reference``): PASS / FAIL;
then CUDA-graph µs with the variants interleaved over ROUNDS rounds, median, x default, % of the byte floor (copy
rate measured in this run); then the breakdown of the default (and of the fastest variant where another): each
kernel's eager device µs (torch.profiler, ``fp8_kernel_breakdown``), each GEMM's weight bytes / µs against the copy
rate, its programs and waves on the SMs, and the rows multiplied per assignment (the padding). Compile: WORKERS
subprocesses run every (cell, variant) once (Triton's disk cache) while this process builds the weights. Partial
lines as it goes, the JSON rewritten after each cell, the table last; --deadline stops timing in time.
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

from bytes_variants import CELLS, SMOKE_CELLS, variants  # noqa: E402
from compile_workers import (  # noqa: E402
    collect_workers, compile_one, held_weights, smoke_shape, spawn_workers, zero_fp8_weights,
)
from decode_q3_device_check import (Cell, check_cell, floor_us, make_weights, measure_copy, print_cell,  # noqa: E402
                                    run_variant, tuned)

T0 = time.perf_counter()
WORKERS = 12
ROUNDS = 5
ROTATION_BYTES = 256 << 20
BREAKDOWN_S = 4.0  # kept after a cell's rounds for its breakdown
ARGS = argparse.Namespace(deadline=115.0, worker_deadline=58.0, out=os.environ.get("OUT"))


def elapsed() -> float:
    return time.perf_counter() - T0


def cells() -> list[tuple]:
    return list(SMOKE_CELLS if SMOKE else CELLS)


def shape_of(preset: str):
    return smoke_shape(preset, SMOKE)


def compile_weights(dtype: str, s, dev):
    """Weights of the real shape for compiling only (values do not matter): zeros, fp8 scales one."""
    if dtype == "bf16":
        return (torch.zeros(s.num_experts, 2 * s.n, s.k, dtype=torch.bfloat16, device=dev),
                torch.zeros(s.num_experts, s.k, s.n, dtype=torch.bfloat16, device=dev))
    return zero_fp8_weights(s, dev)


def worker_main(tasks: list) -> None:
    from moekit.bench.cells import make_sets

    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, vi in tasks:
        dtype, preset, m = cells()[ci]
        s = shape_of(preset)
        w = held_weights(held, (dtype, preset), lambda: compile_weights(dtype, s, dev))
        compile_one(ci, vi, lambda: run_variant(variants(dtype, preset, m)[vi], dtype, tuned(dtype, s, m, dev),
                                                make_sets(s, m, 1, torch.bfloat16, dev)[0], w), SMOKE)


def start_workers(workers: int) -> list:
    """DeepSeek-V3's tasks (11-23 GB of weights) on one worker per dtype, the rest round-robin."""
    tasks = [(ci, vi) for ci, c in enumerate(cells()) for vi in range(len(variants(*c)))]
    big = {d: [t for t in tasks if cells()[t[0]][1] == "deepseek-v3" and cells()[t[0]][0] == d]
           for d in ("bf16", "fp8")}
    big = [b for b in big.values() if b]
    light = [t for t in tasks if cells()[t[0]][1] != "deepseek-v3"]
    n = max(1, workers - len(big))
    return spawn_workers(__file__, big + [light[j::n] for j in range(n) if light[j::n]], SMOKE, "bytes")


def padding(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[int, float]:
    """(blocks, rows multiplied per assignment) of the aligned layout: each expert's rows in block_m steps."""
    counts = torch.bincount(ids.reshape(-1).long(), minlength=num_experts)  # [E]
    blocks = int(((counts + block_m - 1) // block_m).sum())
    return blocks, blocks * block_m / ids.numel()


def breakdown(cell: Cell, v, base, t, w, copy_tbps: float, dev) -> dict:
    """Per kernel eager µs; per GEMM weight bytes/s vs copy, programs, waves; blocks and rows per assignment."""
    from fp8_kernel_breakdown import describe, kernel_breakdown

    s = shape_of(cell.preset)
    cfg = v.config(base.config) if not v.is_default else base.config
    blocks, rows = padding(t.topk_ids, s.num_experts, cfg.BLOCK_M)
    times = kernel_breakdown(lambda: run_variant(v, cell.dtype, base, t, w), calls=5)
    elt = 1 if cell.dtype == "fp8" else 2
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    gemms = {"gate_up": (2 * s.n * s.k, cfg.up.BLOCK_N, s.n), "down": (s.n * s.k, cfg.down.BLOCK_N, s.k)}
    got = {"kernels": describe(times), "blocks": blocks, "rows_per_assignment": round(rows, 3)}
    for kt in times:
        for key, (wbytes, block_n, cols) in gemms.items():
            if key in kt.name and kt.us > 0:
                tbps = cell.touched * wbytes * elt / (kt.us * 1e-6) / 1e12
                programs = blocks * math.ceil(cols / block_n)
                got[key] = {"us": round(kt.us, 2), "TBps": round(tbps, 3), "pct_copy": round(100 * tbps / copy_tbps, 1),
                            "programs": programs, "waves": round(programs / sms, 2)}
    parts = [f"{k} {g['us']:.1f} us {g['TBps']:.2f} TB/s ({g['pct_copy']:.0f}% copy) {g['programs']} programs "
             f"{g['waves']:.2f} waves" for k, g in got.items() if isinstance(g, dict)]
    print(f"  breakdown {cell.dtype} {cell.preset} M={cell.M} {v.name}: BM {cfg.BLOCK_M} {blocks} blocks, "
          f"{rows:.2f} rows/assignment; " + "; ".join(parts) + f"\n    kernels: {got['kernels']}", flush=True)
    return got


def time_rounds(cell: Cell, timed: list, base, sets, w, dev, stop_s: float) -> None:
    from moekit.bench.timing import time_calls

    for _ in range(ROUNDS):
        for _, v, row in timed:
            if elapsed() > stop_s:
                break
            fns = [lambda t=t, v=v: run_variant(v, cell.dtype, base, t, w) for t in sets]
            row.samples.append(time_calls(fns, dev, graph=True, budget_s=0.012, min_reps=3, max_reps=10))
    for _, _, row in timed:
        if row.samples:
            row.us = statistics.median(row.samples)
            row.pct_floor = 100 * cell.floor_us / row.us


def wins(row, default) -> int:
    """Rounds in which ``row`` was >= 3% faster than the default's sample of the same round."""
    return sum(b < 0.97 * a for a, b in zip(default.samples, row.samples))


def write_json(results: list, extra: dict) -> None:
    if not ARGS.out:
        return
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bytes.json").write_text(json.dumps({**extra, "cells": [asdict(c) for c in results],
                                                "seconds": elapsed()}, indent=1, default=str) + "\n")


def measure_cell(ci: int, weights: dict, status: dict, copy_tbps: float, extra: dict, dev) -> Cell:
    """Check, time (this cell's even share of the time left) and break down one cell; extra gets its wins
    (rounds >= 3% faster than the default) and breakdowns."""
    from moekit.bench.cells import make_sets, measured_experts_touched

    dtype, preset, m = cells()[ci]
    share = (ARGS.deadline - elapsed()) / (len(cells()) - ci)
    s, cell = shape_of(preset), Cell(dtype, preset, m)
    vs, base, w = variants(dtype, preset, m), tuned(dtype, s, m, dev), weights[(dtype, preset)]
    once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
    sets = make_sets(s, m, 1 if SMOKE else max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
    cell.touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
    cell.floor_us = floor_us(dtype, s, m, cell.touched, copy_tbps)
    timed = check_cell(cell, vs, base, sets, w, status, ci)
    if not SMOKE:
        time_rounds(cell, timed, base, sets, w, dev, elapsed() + max(2.0, share - BREAKDOWN_S))
    print(f"[{elapsed():5.1f}s]", flush=True)
    print_cell(cell)
    done = [(v, r) for _, v, r in timed if r.us is not None]
    key = f"{dtype} {preset} {m}"
    if done:
        extra["wins"][key] = {r.variant: wins(r, done[0][1]) for _, r in done[1:]}
    picks = [timed[0][1]] if timed else []
    if len(done) > 1:
        best = min(done[1:], key=lambda d: d[1].us)
        if best[1].us < done[0][1].us:
            picks.append(best[0])
    for v in picks:  # the profiler's CUDA events: on the device only
        if not SMOKE and elapsed() < ARGS.deadline + 8:
            extra["breakdowns"][f"{key} {v.name}"] = breakdown(cell, v, base, sets[0], w, copy_tbps, dev)
    return cell


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    procs = start_workers(1 if SMOKE else WORKERS)
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    weights = {}
    for dtype, preset, _ in cells():
        if (dtype, preset) not in weights:
            weights[(dtype, preset)] = make_weights(dtype, shape_of(preset), dev)
    copy_tbps = 1.0 if SMOKE else measure_copy(dev)
    print(f"[{elapsed():5.1f}s] weights built; copy {copy_tbps:.2f} TB/s", flush=True)
    status = collect_workers(procs, lambda: ARGS.worker_deadline - elapsed())
    print(f"[{elapsed():5.1f}s] compiled {sum(v == 'ok' for v in status.values())} of {len(status)}; others: "
          f"{sorted(set(status.values()) - {'ok'})}"[:600], flush=True)
    extra = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": copy_tbps,
             "breakdowns": {}, "wins": {}}
    results = []
    for ci in range(len(cells())):
        if ARGS.deadline - elapsed() < 6 and not SMOKE:
            print(f"skipped (deadline): {cells()[ci]}", flush=True)
            continue
        results.append(measure_cell(ci, weights, status, copy_tbps, extra, dev))
        write_json(results, extra)
    exact = {(c.dtype, c.preset, c.M, v.name): v.exact for c in results for v in variants(c.dtype, c.preset, c.M)}
    failed = [f"{c.dtype} {c.preset} M={c.M} {r.variant}" for c in results for r in c.rows
              if r.status.startswith(("FAIL", "error")) or (r.equal_default is False
                                                            and exact[(c.dtype, c.preset, c.M, r.variant)])]
    extra["failed"] = failed
    write_json(results, extra)
    print("\nall cells (graph µs median of rounds, % of byte floor, x default, [round min-max], eager, "
          "rel L2 vs reference, = bit-equal to default); rounds >= 3% faster than the default:")
    for c in results:
        print_cell(c)
        print(f"  wins: {extra['wins'].get(f'{c.dtype} {c.preset} {c.M}', {})}")
    print(f"FAILED (error, over tolerance, or an exact variant not bit-equal): {failed or 'none'} ({elapsed():.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        parser = argparse.ArgumentParser()
        parser.add_argument("--smoke", action="store_true")
        parser.add_argument("--deadline", type=float, default=ARGS.deadline, help="stop timing after this many s")
        parser.add_argument("--worker-deadline", type=float, default=ARGS.worker_deadline)
        parser.add_argument("--out", default=ARGS.out, help="folder for bytes.json (default $OUT)")
        ARGS = parser.parse_args()
        sys.exit(main())

"""Issue #16 target 3 (weight-only cells at M >= 1024 no slower than bf16 / 0.9, i.e. <= 1.11x moekit's bf16 cell):
the weight-only Gluon GEMMs (``decode="gluon"``, ``moekit/experts/triton_gluon_wo.py``: int8 tiles decoded to bf16 in
shared memory one step ahead of the async wgmma) against today's pick (``choose_decode``: tile or scratch) and
moekit's bf16 path on the same weights (dequantized), int8_w8a16.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wol7_device_check.py --out $OUT/wol7 --deadline 70   # H200
    PYTHONPATH=$PWD python3 benchmarks/wol7_device_check.py --smoke    # CPU: tiny shapes, the Gluon GEMMs faked

Cells: Mixtral-8x7B and Qwen3-30B-A3B at M = 1024 / 4096, then DeepSeek-V3 1024 / 4096 (skipped past the
deadline). Compile workers (one per preset) run every variant once while this process builds the weights and
measures the ceilings (copy rate, dense bf16 mm rate). Per cell: "gluon" (and its tile variants) against the torch
twin (``experts_gluon_wo_twin``) and the exact reference (``fused_experts_wo_torch``), "pick" against the reference:
PASS / FAIL with rel-L2; then CUDA-graph replay over rotated input sets, the variants interleaved in ROUNDS rounds
(median µs, x bf16, x pick, rounds >= 3% faster than the pick), the flop floor (2 x M*k x 3NK over the mm rate) and
the byte floor (touched experts' int8 bytes and scales over the copy rate) as % of each. The table is printed last;
JSON <out>/wol7.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_workers import collect_workers, spawn_workers  # noqa: E402
from wo_device_check import packed_bytes, quantized, rel_err  # noqa: E402

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.triton import experts_triton  # noqa: E402
from moekit.experts.triton_gluon_launch import UP_TILE, GluonTile, down_tile  # noqa: E402
from moekit.experts.triton_gluon_wo import experts_gluon_wo_twin, run_experts_wo_gluon  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode  # noqa: E402

SCHEME = "int8_w8a16"
CELLS = (("mixtral-8x7b", 1024), ("qwen3-30b-a3b", 1024), ("mixtral-8x7b", 4096), ("qwen3-30b-a3b", 4096),
         ("deepseek-v3", 1024), ("deepseek-v3", 4096))
# gluon tile variants: name -> (gate-up tile, down tile or None for the route's down_tile(N))
GLUON = {"gluon": (UP_TILE, None), "gluon_s3": (GluonTile(128, 64, 3), GluonTile(128, 64, 4)),
         "gluon_d256": (UP_TILE, GluonTile(256, 64, 3))}
SETS, ROUNDS, REPLAYS, WIN, TOL = 2, 5, 3, 0.97, 2e-2
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=70.0, out=os.environ.get("OUT"))


def elapsed() -> float:
    return time.perf_counter() - T0


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    pick: str  # the decode today's chooser takes
    flop_floor_us: float
    byte_floor_us: float
    rounds: dict = dataclasses.field(default_factory=dict)  # variant -> µs a call, each round
    times: dict = dataclasses.field(default_factory=dict)  # variant -> median
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> {"ref": rel-L2, "twin": rel-L2}


def shape_of(preset: str) -> Shape:
    return Shape(f"{preset}/smoke", 8, 128, 256, 2) if SMOKE else Shape.from_preset(preset)


def weights(s: Shape, dev, seed: int | None):
    """(w13, w2) int8 WoWeights, their WeightArgs, and the bf16 weights they dequantize to (None when compiling)."""
    w13 = quantized(SCHEME, s.num_experts, 2 * s.n, s.k, dev, seed=seed)
    w2 = quantized(SCHEME, s.num_experts, s.k, s.n, dev, seed=None if seed is None else seed + 1)
    args = tuple(weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    bf16 = tuple((w.q.to(torch.bfloat16) * w.scale[:, :, None]).to(torch.bfloat16) for w in (w13, w2))
    return (w13, w2), args, bf16


def variants(s: Shape, m: int, w) -> dict:
    """name -> fn(inputs) -> out."""
    (w13, w2), (a13, a2), (b13, b2) = w
    out = {"bf16": lambda c: experts_triton(c.x, b13, b2, c.topk_ids, c.topk_weights),
           "pick": lambda c: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, SCHEME)}
    for name, (up, down) in GLUON.items():
        out[name] = (lambda c, up=up, down=down: run_experts_wo_gluon(
            c.x, a13, a2, c.topk_ids, c.topk_weights, None, SCHEME, up_tile=up, down=down or down_tile(s.n)))
    return out


def worker_main(tasks: list) -> None:
    """Compile: each (cell, variant) once at the real shape on uninitialised weights."""
    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, vi in tasks:
        preset, m = CELLS[ci]
        s = shape_of(preset)
        if preset not in held:
            held.clear()
            held[preset] = weights(s, dev, None)
        print(f"START {ci} {vi}", flush=True)
        try:
            fn = list(variants(s, m, held[preset]).values())[vi]
            fn(make_sets(s, m, 1, torch.bfloat16, dev)[0])
            if not SMOKE:
                torch.cuda.synchronize()
            print(f"OK {ci} {vi}", flush=True)
        except Exception as err:  # noqa: BLE001  (reported; the main process tries it itself)
            print(f"ERR {ci} {vi} {type(err).__name__}: {str(err)[:200]!r}".replace("\n", " "), flush=True)


def start_workers() -> list:
    """One worker per preset (its cells in order)."""
    count = len(variants(shape_of(CELLS[0][0]), 1, ((None,) * 2, (None,) * 2, (None,) * 2)))
    parts = {}
    for ci, (preset, _) in enumerate(CELLS):
        parts.setdefault(preset, []).extend((ci, vi) for vi in range(count))
    return spawn_workers(__file__, list(parts.values()), SMOKE, "wol7")


def check(cell: Cell, name: str, fn, c0, want, twin) -> bool:
    """PASS / FAIL of one variant on the first input set (rel-L2 against the reference, gluon also the twin)."""
    tag = f"{cell.preset} M={cell.m} {name}"
    try:
        out = fn(c0)
        errs = {"ref": rel_err(out, want)}
        if name.startswith("gluon"):
            errs["twin"] = rel_err(out, twin)
    except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
        traceback.print_exc(limit=3)
        errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    cell.errors[name] = errs
    ok = "error" not in errs and all(v < TOL for v in errs.values())
    print(f"{'PASS' if ok else 'FAIL'}  {tag}  {errs}", flush=True)
    if not ok:
        FAILED.append(tag)
    return ok


def graph_of(fns, dev):
    """The calls captured in one CUDA graph (warmed on a side stream first); None off the GPU."""
    if dev.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns * 2:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    return g


def interleaved(graphs: dict, calls: int) -> dict:
    """name -> [µs a call, each round]: every graph replayed REPLAYS times a round, the graphs in turn."""
    samples = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for name, g in graphs.items():
            start.record()
            for _ in range(REPLAYS):
                g.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / (REPLAYS * calls))
    return samples


def run_cell(preset: str, m: int, w, dev, ceil: dict) -> Cell:
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    flops = 2 * m * s.top_k * 3 * s.n * s.k
    wbytes = touched * (packed_bytes(w[0][0]) + packed_bytes(w[0][1])) + 2 * 2 * m * s.k
    cell = Cell(preset, m, choose_decode(SCHEME, m, s.num_experts, s.n, s.k, s.top_k),
                flops / (ceil["mm_tflops"] * 1e6), wbytes / (ceil["copy_tbps"] * 1e6))
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w[0][0], w[0][1], c0.topk_ids, c0.topk_weights)
    twin = experts_gluon_wo_twin(c0.x, w[1][0], w[1][1], c0.topk_ids, c0.topk_weights)
    graphs = {}
    for name, fn in variants(s, m, w).items():
        if check(cell, name, fn, c0, want, twin) and dev.type == "cuda":
            graphs[name] = graph_of([lambda c=c, fn=fn: fn(c) for c in inputs], dev)
    if graphs:
        cell.rounds = interleaved(graphs, len(inputs))
        cell.times = {k: statistics.median(v) for k, v in cell.rounds.items()}
    print(f"[{elapsed():5.1f}s] {preset} M={m} pick={cell.pick}: "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def ceilings(dev) -> dict:
    """Copy rate (TB/s, read + write) and dense bf16 mm rate (TFLOP/s, 8192^3), measured in this run."""
    if dev.type != "cuda":
        return {"copy_tbps": 1.0, "mm_tflops": 1.0}
    from moekit.bench.timing import time_calls

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / (time_calls([lambda: dst.copy_(src)], dev, budget_s=0.1) * 1e-6) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm = 2 * 8192**3 / time_calls([lambda: a @ b], dev, budget_s=0.2) / 1e6
    return {"copy_tbps": copy, "mm_tflops": mm}


def row(c: Cell) -> str:
    bf16, pick = c.times.get("bf16"), c.times.get("pick")
    parts = []
    for k, v in c.times.items():
        vs_bf16 = f"{v / bf16:.2f}x bf16" if bf16 else "-"
        won = sum(x <= WIN * p for x, p in zip(c.rounds[k], c.rounds.get("pick", ()))) if k != "pick" else "-"
        parts.append(f"{k} {v:.1f} ({vs_bf16}, {100 * c.flop_floor_us / v:.0f}% flop, "
                     f"{100 * c.byte_floor_us / v:.0f}% byte, wins {won}/{ROUNDS})")
    return (f"{c.preset:<14}{c.m:>5} pick={c.pick:<8} floors flop {c.flop_floor_us:.0f} byte {c.byte_floor_us:.0f}"
            f" µs | " + "; ".join(parts) + ("" if pick else " (no pick time)"))


def dump(cells: list, ceil: dict) -> None:
    if not ARGS.out:
        return
    import triton

    os.makedirs(ARGS.out, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(os.path.join(ARGS.out, "wol7.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__, **ceil,
                   "cells": [dataclasses.asdict(c) for c in cells], "failed": FAILED, "seconds": elapsed()}, f,
                  indent=1)


def install_smoke_fakes() -> None:
    """CPU: the Gluon GEMMs (bf16 and weight-only) replaced by the tests' torch stand-ins."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from _gluon_fakes import install_fakes

    install_fakes()


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    if SMOKE:
        install_smoke_fakes()
    procs = [] if SMOKE else start_workers()
    ceil = ceilings(dev)
    print(f"[{elapsed():5.1f}s] {torch.__version__} copy {ceil['copy_tbps']:.2f} TB/s, mm {ceil['mm_tflops']:.0f} "
          "TFLOP/s", flush=True)
    cells, held = [], {}
    for ci, (preset, m) in enumerate(CELLS):
        budget = 14.0 if preset == "deepseek-v3" else 5.0  # a cell's weights, checks, graphs and rounds
        if elapsed() + budget > ARGS.deadline:
            print(f"skipped (deadline): {preset} M={m}", flush=True)
            continue
        if preset not in held:
            held.clear()
            held[preset] = weights(shape_of(preset), dev, seed=1)
        if ci == 0 and procs:
            status = collect_workers(procs[:1], lambda: ARGS.deadline * 0.5 - elapsed())
            print(f"[{elapsed():5.1f}s] first worker: {status}", flush=True)
        cells.append(run_cell(preset, m, held[preset], dev, ceil))
        dump(cells, ceil)
    collect_workers(procs, lambda: 0.1)
    print(f"\n{SCHEME} graph µs (median of {ROUNDS} rounds), copy {ceil['copy_tbps']:.2f} TB/s, mm "
          f"{ceil['mm_tflops']:.0f} TFLOP/s; wins: rounds <= {WIN} x pick; target <= 1.11x bf16")
    for c in cells:
        print(row(c))
    print(f"FAILED: {FAILED or 'none'} ({elapsed():.1f} s)")
    return 1 if FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        parser = argparse.ArgumentParser()
        parser.add_argument("--smoke", action="store_true")
        parser.add_argument("--deadline", type=float, default=ARGS.deadline, help="no cell starts past it (s)")
        parser.add_argument("--out", default=ARGS.out, help="folder for wol7.json (default $OUT)")
        ARGS = parser.parse_args()
        sys.exit(main())

"""Issue #16 target 3 (weight-only cells at M >= 1024 no slower than bf16 / 0.9, i.e. <= 1.11x moekit's bf16 cell):
the weight-only Gluon GEMMs (``moekit/experts/triton_gluon_wo.py``: stored tiles decoded to bf16 in shared memory one
step ahead of the async wgmma; the default in ``GLUON_WO_CELLS``) against the decode the chooser picked before
(``choose_decode``: tile or scratch) and moekit's bf16 path on the same weights (int8's, dequantized), int8_w8a16,
int4_w4a16 (group 128) and mxfp4.

    PYTHONPATH=$PWD timeout 72 python3 benchmarks/wol7_device_check.py --out $OUT/wol7 --deadline 56   # H200, <= 70 s
    PYTHONPATH=$PWD timeout 60 python3 benchmarks/wol7_device_check.py --out $OUT/wol7 --deadline 46   # <= 60 s
    PYTHONPATH=$PWD python3 benchmarks/wol7_device_check.py --smoke    # CPU: tiny shapes, the Gluon GEMMs faked

Cells: Mixtral-8x7B and Qwen3-30B-A3B at M = 1024, DeepSeek-V3 4096, Mixtral and Qwen3 4096, DeepSeek-V3 1024
(skipped past the deadline). Compile workers (PER_WORKER a preset) run every variant once while this process builds
the weights and measures the ceilings (copy rate, dense bf16 mm rate). Variants (``variants``): bf16; per scheme
"pick" (the default), "prev" (the decode picked before, where the default is the Gluon path) or "gluon". (The merged
run's second phase, "gluon_ws" with the decode in a producer partition, 0/5 and 1.3-1.7x slower than the pick:
removed.) Each against the exact reference (``fused_experts_wo_torch``), the Gluon ones also against the torch twin
(``experts_gluon_wo_twin``): PASS / FAIL with rel-L2; then CUDA-graph replay over rotated input sets, the variants
interleaved in ROUNDS rounds (median µs, x bf16,
rounds >= 3% faster than the pick; "prev": rounds the pick was >= 3% faster), the flop floor (2 x M*k x 3NK over the
mm rate) and the byte floor (touched experts' stored bytes and scales over the copy rate) as % of each. The table is
printed last; JSON <out>/wol7.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import WIN, eager_us, graph_of, interleaved, medians, wins  # noqa: E402
from bench_run import RunLog, ceilings  # noqa: E402
from compile_workers import compile_one, held_weights, spawn_workers  # noqa: E402
from held_run import HeldCell, HeldRun, held_cells, held_device, held_entry, install_test_fakes  # noqa: E402
from wo_device_check import packed_bytes, rel_err  # noqa: E402

from wol7_variants import CELLS, SCHEMES, Weights, gluon_cell, shape_of, variants  # noqa: E402

from moekit.bench.cells import make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.triton_gluon_wo import GLUON_WO_CELLS, experts_gluon_wo_twin  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode  # noqa: E402

SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 2e-2
BREAKDOWN = ("bf16", "pick_int8", "pick_int4")  # kernels profiled where time is left
PER_WORKER = 5  # compile workers a preset (DeepSeek-V3: 2)
WATCHDOG_S = 10.0
EAGER_CALLS = 8
RUN = RunLog()
ARGS = argparse.Namespace(deadline=56.0, out=os.environ.get("OUT"))
elapsed = RUN.elapsed


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    picks: dict  # scheme -> the decode today's chooser takes
    flop_floor_us: float  # 2 x M*k x 3NK over the measured mm rate
    byte_floor_us: dict  # scheme -> the touched experts' stored bytes (and x, out) over the copy rate
    rounds: dict = dataclasses.field(default_factory=dict)  # variant -> µs a call, each round
    times: dict = dataclasses.field(default_factory=dict)  # variant -> median
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> {"ref": rel-L2, "twin": rel-L2}
    skipped: dict = dataclasses.field(default_factory=dict)  # variant -> its compile worker's status
    kernels: dict = dataclasses.field(default_factory=dict)  # variant -> its kernels' eager µs (``breakdown``)
    eager: dict = dataclasses.field(default_factory=dict)  # variant -> {"host_us", "wall_us"} (``eager``)


def worker_main(tasks: list) -> None:
    """Compile: each (cell, variant) once at the real shape on uninitialised weights."""
    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, vi in tasks:
        preset, m = CELLS[ci]
        s = shape_of(preset)
        # (a preset's cells need not be adjacent: its weights are then built again)
        w = held_weights(held, preset, lambda: Weights(s, dev, None))
        compile_one(ci, vi, lambda: list(variants(s, m, w).values())[vi][1](make_sets(s, m, 1, torch.bfloat16, dev)[0]),
                    SMOKE)


def start_workers() -> dict:
    """preset -> its workers: each preset's (cell, variant) tasks in parts of PER_WORKER (one part for DeepSeek-V3's
    bf16 and int8 variants, one for the rest: its weights are 40 GB)."""
    tasks = {}
    for ci, (preset, m) in enumerate(CELLS):
        count = len(variants(shape_of(preset), m, Weights(shape_of(preset), None, None)))
        tasks.setdefault(preset, []).extend((ci, vi) for vi in range(count))
    procs = {}
    for preset, todo in tasks.items():
        if preset == "deepseek-v3":
            parts = [[t for t in todo if t[1] < 3], [t for t in todo if t[1] >= 3]]  # bf16 + int8; int4 + mxfp4
        else:
            parts = [todo[j::PER_WORKER] for j in range(PER_WORKER)]
        procs[preset] = spawn_workers(__file__, [p for p in parts if p], SMOKE, f"wol7_{preset}")
    return procs


def check(cell: Cell, name: str, fn, c0, refs: dict) -> bool:
    """PASS / FAIL of one variant on the first input set: rel-L2 against the exact reference of its scheme (bf16:
    int8's, the weights it dequantizes), gluon also against the twin."""
    tag = f"{cell.preset} M={cell.m} {name}"
    want, twin = refs
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
    return RUN.check(tag, ok, str(errs))


def new_cell(preset: str, m: int, w: Weights, inputs, ceil: dict) -> Cell:
    s = shape_of(preset)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    io = 2 * 2 * m * s.k  # x in, out
    floors = {sc: (touched * (packed_bytes(w.wo(sc)[0]) + packed_bytes(w.wo(sc)[1])) + io) / (ceil["copy_tbps"] * 1e6)
              for sc in SCHEMES}
    picks = {sc: "gluon" if gluon_cell(sc, s, m) else choose_decode(sc, m, s.num_experts, s.n, s.k, s.top_k)
             for sc in SCHEMES}
    return Cell(preset, m, picks, 2 * m * s.top_k * 3 * s.n * s.k / (ceil["mm_tflops"] * 1e6), floors)


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> Cell:
    preset, m = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    cell, c0 = new_cell(preset, m, w, inputs, ceil), inputs[0]
    refs = {}
    for sc in SCHEMES:
        w13, w2 = w.wo(sc)
        refs[sc] = (fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights),
                    experts_gluon_wo_twin(c0.x, w13, w2, c0.topk_ids, c0.topk_weights))
    graphs = {}
    for vi, (name, (scheme, fn)) in enumerate(variants(s, m, w).items()):
        if status.get((ci, vi), "ok") != "ok":  # its compile worker failed or hung: never run here
            cell.skipped[name] = status[(ci, vi)]
            print(f"FAIL  {preset} M={m} {name}  (compile worker: {status[(ci, vi)][:160]})", flush=True)
            RUN.failed.append(f"{preset} M={m} {name}")
            continue
        if check(cell, name, fn, c0, refs[scheme or SCHEMES[0]]) and dev.type == "cuda":
            graphs[name] = graph_of([lambda c=c, fn=fn: fn(c) for c in inputs], dev, replay=False)
    if graphs:
        cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS)
        cell.times = medians(cell.rounds)
        timed = {k: fn for k, (_, fn) in variants(s, m, w).items() if k in graphs}
        eager(cell, timed, inputs)
        breakdown(cell, timed, c0)
    print(f"[{elapsed():5.1f}s] {preset} M={m} picks {cell.picks}: "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def eager(cell: Cell, fns: dict, inputs) -> None:
    """Where a scheme's default is the Gluon path (its calls plain launches, not the lean recorder's): its and the
    replaced decode's eager µs a call, host (enqueueing EAGER_CALLS calls behind ~1 ms of GPU work) and wall (the same
    calls to completion), medians of 3 interleaved rounds."""
    pairs = [k for k in fns if k.startswith("prev_")]
    names = [n for k in pairs for n in (k.replace("prev_", "pick_"), k) if n in fns]
    if SMOKE or not names:
        return
    calls = {n: [lambda c=c, fn=fns[n]: fn(c) for c in inputs] for n in names}
    cell.eager = {n: {"host_us": host, "wall_us": wall} for n, (host, wall) in eager_us(calls, 3, EAGER_CALLS).items()}
    print(f"  eager host / wall µs a call {cell.preset} M={cell.m}: "
          + "  ".join(f"{k} {v['host_us']:.0f} / {v['wall_us']:.0f}" for k, v in cell.eager.items()), flush=True)


def breakdown(cell: Cell, fns: dict, c0) -> None:
    """Each BREAKDOWN variant's kernels (eager, torch.profiler: µs a launch) where time is left."""
    from fp8_kernel_breakdown import describe, kernel_breakdown

    for name in () if SMOKE else BREAKDOWN:
        if name in fns and elapsed() < ARGS.deadline - 12:
            cell.kernels[name] = describe(kernel_breakdown(lambda fn=fns[name]: fn(c0), calls=3))
            print(f"  kernels {cell.preset} M={cell.m} {name}: {cell.kernels[name]}", flush=True)


def run_ceilings(dev) -> dict:
    """Copy rate (TB/s, read + write) and dense bf16 mm rate (TFLOP/s, 8192^3), measured in this run."""
    if dev.type != "cuda":
        return {"copy_tbps": 1.0, "mm_tflops": 1.0}
    got = ceilings(dev)
    return {"copy_tbps": got["copy_TBps"], "mm_tflops": got["bf16_mm_TFLOPs"]}


def row(c: Cell) -> list[str]:
    """The cell's lines: per variant µs, x bf16, % of the flop floor and of its scheme's byte floor, rounds >= 3%
    faster than its scheme's pick."""
    bf16 = c.times.get("bf16")
    floors = ", ".join(f"{k[:4]} {v:.0f}" for k, v in c.byte_floor_us.items())
    lines = [f"{c.preset:<14}{c.m:>5} picks {c.picks}; floors flop {c.flop_floor_us:.0f} µs, "
             f"byte {floors} µs"]
    for k, v in c.times.items():
        tag = k.rsplit("_", 1)[-1]
        scheme = next((sc for sc in SCHEMES if sc.startswith(tag)), None)
        pick = c.rounds.get(f"pick_{tag}", ())
        if k.startswith("prev"):  # the rounds the pick (the Gluon path) took <= WIN x the decode before it
            won = f"pick {wins(pick, c.rounds[k])}" if pick else "-"
        else:
            won = wins(c.rounds[k], pick) if pick and not k.startswith("pick") else "-"
        byte = f", {100 * c.byte_floor_us[scheme] / v:.0f}% byte" if scheme else ""
        lines.append(f"    {k:<16}{v:9.1f} µs {v / bf16 if bf16 else float('nan'):6.3f}x bf16  "
                     f"{100 * c.flop_floor_us / v:3.0f}% flop{byte}  wins vs pick {won}/{ROUNDS}")
    return lines


def install_smoke_fakes() -> None:
    """CPU: the Gluon GEMMs (bf16 and weight-only) replaced by the tests' torch stand-ins; the first cell's int8 a
    cell of the Gluon path's."""
    install_test_fakes()
    s = shape_of(CELLS[0][0])  # its int8 cell the default's (as on the H200 for the real shape): "prev" runs too
    GLUON_WO_CELLS[("int8_w8a16", s.num_experts, s.n, s.k)] = (CELLS[0][1], 2 * CELLS[0][1])


def lines(c: Cell) -> list[str]:
    """The cell's rows in the table, its kernels and its eager host / wall times."""
    out = row(c) + [f"      {name} kernels: {kernels}"[:400] for name, kernels in c.kernels.items()]
    if c.eager:
        out.append("      eager host / wall µs a call: " + "  ".join(
            f"{k} {v['host_us']:.0f} / {v['wall_us']:.0f}" for k, v in c.eager.items()))
    return out


def title(ceil: dict) -> str:
    """The table's first line."""
    return (f"graph µs (median of {ROUNDS} rounds), copy {ceil['copy_tbps']:.2f} TB/s, mm {ceil['mm_tflops']:.0f} "
            f"TFLOP/s; wins: rounds <= {WIN} x the scheme's pick; target <= 1.11x bf16")


def main() -> int:
    dev = held_device(SMOKE, ARGS, install_smoke_fakes)
    procs = {} if SMOKE else start_workers()
    ceil = run_ceilings(dev)
    print(f"[{elapsed():5.1f}s] {torch.__version__} copy {ceil['copy_tbps']:.2f} TB/s, mm {ceil['mm_tflops']:.0f} "
          "TFLOP/s", flush=True)
    specs = [HeldCell(ci, preset, 10.0 if preset == "deepseek-v3" else 5.0, f"{preset} M={m}", preset, preset)
             for ci, (preset, m) in enumerate(CELLS[:1] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, RUN.failed, dev,
                                            lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: [run_cell(ci, w, dev, ceil, status)], ARGS.out,
                                            "wol7.json", ceil, title(ceil), lines, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main([tuple(t) for t in tasks]), ARGS, "wol7.json")

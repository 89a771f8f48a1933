"""Issue #16 target 3 (weight-only cells at M >= 1024 no slower than bf16 / 0.9: <= 1.11x moekit's bf16 cell), session
30: the swapped int8 GEMM with two steps of wgmmas in flight (``GluonWoOptions(inflight=2)``: a step's wgmmas retire
after the next step's decode and issue, ``_kernels/gluon_gemm_wo_swap.py``'s INFLIGHT 2) against the pick (the call
that names no decode: swapfs, session 29's swapped GEMM with the PTX conversion split a warpgroup, on both GEMMs at
these cells) and the bf16 call. Variants (VARIANTS; the gate-up GEMM swapfs unless named):

    dn2s    the down GEMM swapfs with INFLIGHT 2 (each MMA warpgroup 192 registers, the loader's 120)
    dn2     the down GEMM swapf (one 8-warp MMA partition) with INFLIGHT 2
    up2     the gate-up GEMM swapf with INFLIGHT 2 (a split gate-up with it is refused: ptxas serializes), dn2s' down

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/dn2_device_check.py --out $OUT/dn2 --deadline 62   # H200
    PYTHONPATH=$PWD python3 benchmarks/dn2_device_check.py --smoke      # CPU: the first cell, tiny, GEMMs faked

Cells (CELLS, each skipped past the deadline): DeepSeek-V3 4096, Qwen3 4096, Mixtral 1024, int8. Compile workers
run every call once per cell while this process measures the ceilings and builds the weights. Per cell: PASS / FAIL
of each whole call against the torch twin (``experts_gluon_wo_twin``, rel-L2 < 1e-2) and whether it equals swapfs'
call (both GEMMs swapfs) bit for bit (the same products in the same order: it should; --smoke: the pick is not
swapfs there); then CUDA-graph replay, every graph of the cell interleaved in ROUNDS rounds: the bf16 Gluon GEMMs,
swapfs' and each variant's new GEMM alone (the first input set's layout), the whole calls (rotated input sets); eager
host / wall µs a call of the pick and dn2s. The table (printed last): median µs, x bf16's same part, rounds >= 3%
faster than the pick (calls) or swapfs' same GEMM (GEMMs alone). JSON <out>/dn2.json.
"""

from __future__ import annotations

import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import WIN, eager_us, graph_of, interleaved, medians  # noqa: E402
from compile_workers import spawn_workers  # noqa: E402
from held_run import HeldCell, HeldRun, held_ceilings, held_cells, held_device, held_entry  # noqa: E402
from wo4k_device_check import Cell, compile_task, new_cell, variant_rows  # noqa: E402
from wo8_variants import Gemms, Weights, pick_call, shape_of, timed_calls  # noqa: E402
from wo_device_check import rel_err  # noqa: E402

from moekit.bench.cells import make_sets  # noqa: E402
from moekit.experts.triton_gluon_wo import (  # noqa: E402
    GluonWoGemms, GluonWoOptions, experts_gluon_wo_twin, run_experts_wo_gluon, wo_options,
)

I8 = "int8_w8a16"
SWAPFS = GluonWoOptions(swap=True, fast=True, split=True)  # the pick's GEMMs at CELLS (GLUON_WO_OPTIONS)
DEEP_SPLIT = GluonWoOptions(swap=True, fast=True, split=True, inflight=2)
DEEP = GluonWoOptions(swap=True, fast=True, inflight=2)
# name -> (both GEMMs' options, the GEMM it changes: timed alone beside swapfs' same GEMM)
VARIANTS = {"dn2s": (GluonWoGemms(SWAPFS, DEEP_SPLIT), "down"), "dn2": (GluonWoGemms(SWAPFS, DEEP), "down"),
            "up2": (GluonWoGemms(DEEP, DEEP_SPLIT), "up")}
BEST = "dn2s"  # its eager calls are timed beside the pick's
CELLS = (("deepseek-v3", 4096), ("qwen3-30b-a3b", 4096), ("mixtral-8x7b", 1024))
SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 1e-2
WATCHDOG_S = 8.0
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=70.0, out=os.environ.get("OUT"))


def elapsed() -> float:
    return time.perf_counter() - T0


def tasks(ci: int) -> list:
    """Cell ci's compile tasks, a worker each (a variant that hangs or fails loses its task's names only): the bf16
    call, the pick with dn2s, dn2 with up2."""
    return [("bf16",), ("pick", "dn2s"), ("dn2", "up2")]


def dn2_calls(w: Weights, gemms: Gemms | None, ci: int, only: tuple = ()) -> dict:
    """"int8 <name> <part>" -> (scheme, part, fn(inputs)): the pick's call, swapfs' GEMMs alone, each variant's call
    and the GEMM it changes alone (``gemms`` None: calls only; ``only``: those names)."""
    m = CELLS[ci][1]
    out = dict(pick_call(w, I8, m)) if not only or "pick" in only else {}
    if gemms is not None and (not only or "pick" in only):
        for part in ("up", "down"):
            out[f"int8 swapfs {part}"] = (I8, part, lambda c, p=part: gemms.wo(p, *w.wo(I8), I8,
                                                                               GluonWoGemms(SWAPFS, SWAPFS)))
    for name, (opt, part) in VARIANTS.items():
        if only and name not in only:
            continue
        out[f"int8 {name} call"] = (I8, "call", lambda c, o=opt: run_experts_wo_gluon(
            c.x, *w.wo(I8), c.topk_ids, c.topk_weights, None, I8, options=o))
        if gemms is not None:
            out[f"int8 {name} {part}"] = (I8, part, lambda c, p=part, o=opt: gemms.wo(p, *w.wo(I8), I8, o))
    return out


def worker_main(ci: int, j: int) -> None:
    """Compile task j of cell ci (wo4k's ``compile_task``)."""
    preset, m = CELLS[ci]
    compile_task(ci, j, preset, m, tasks(ci)[j], lambda w, task: dn2_calls(w, None, ci, task), SMOKE)


def check(cell: Cell, calls: dict, w: Weights, c0) -> set:
    """PASS / FAIL of each whole call against the twin, and whether it equals swapfs' call (both GEMMs swapfs, the
    same products in the same order) bit for bit; the names that passed."""
    twin = experts_gluon_wo_twin(c0.x, *w.wo(I8), c0.topk_ids, c0.topk_weights)
    swapfs = run_experts_wo_gluon(c0.x, *w.wo(I8), c0.topk_ids, c0.topk_weights, None, I8,
                                  options=GluonWoGemms(SWAPFS, SWAPFS))
    passed = set()
    for key in [k for k in calls if k.endswith(" call")]:
        name = key.split()[1]
        try:
            out = calls[key][2](c0)
            errs = {"twin": rel_err(out, twin), "bit_equal_swapfs": bool(torch.equal(out, swapfs))}
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
            errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        cell.errors[name] = errs
        ok = "error" not in errs and errs["twin"] < TOL
        print(f"{'PASS' if ok else 'FAIL'}  {cell.preset} M={cell.m} int8 {name}  {errs}", flush=True)
        if ok:
            passed.add(name)
        else:
            FAILED.append(f"{cell.preset} M={cell.m} int8 {name}")
    return passed


def compiled(cell: Cell, ci: int, status: dict) -> set:
    """The names whose compile worker failed (each a FAIL line, never run here)."""
    bad = {name: why for j, names in enumerate(tasks(ci)) for name in names
           for why in [status.get((ci, j), "ok")] if why != "ok"}
    for name, why in bad.items():
        cell.skipped[name] = why[:160]
        print(f"FAIL  {cell.preset} M={cell.m} int8 {name}  (compile worker: {why[:160]})", flush=True)
        FAILED.append(f"{cell.preset} M={cell.m} int8 {name}")
    return set(bad)


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> Cell:
    preset, m = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    cell, c0 = new_cell(preset, m, I8, w, inputs, ceil), inputs[0]
    print(f"  {preset} M={m}: the pick's GEMMs {wo_options(*w.wo(I8), I8, m)}", flush=True)
    gemms = Gemms(s, c0)
    bad = compiled(cell, ci, status)
    timed = {} if "bf16" in bad else timed_calls(s, w, gemms)
    calls = {k: v for k, v in dn2_calls(w, gemms, ci).items() if k.split()[1] not in bad}
    passed = check(cell, calls, w, c0) | {"swapfs"}
    timed.update({k: v for k, v in calls.items() if k.split()[1] in passed})
    if dev.type != "cuda":  # --smoke: each timed call once, as the graphs would capture it
        for _, _, fn in timed.values():
            fn(c0)
    else:
        graphs = {k: graph_of([lambda c=(c if part == "call" else c0), fn=fn: fn(c) for c in inputs], dev)
                  for k, (_, part, fn) in timed.items()}  # calls over the rotated sets, GEMMs on the first's layout
        cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS)
        cell.times = medians(cell.rounds)
        pairs = {k: [lambda c=c, fn=timed[k][2]: fn(c) for c in inputs] for k in ("int8 pick call",
                                                                                f"int8 {BEST} call") if k in timed}
        cell.eager = {k: list(v) for k, v in eager_us(pairs, 3, 6).items()}
        print("  eager host / wall µs a call: " + "  ".join(f"{k} {h:.0f} / {v:.0f}" for k, (h, v) in
                                                           cell.eager.items()), flush=True)
    print(f"[{elapsed():5.1f}s] {preset} M={m}: " + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()),
          flush=True)
    return cell


def rows(c: Cell) -> list[str]:
    """wo4k's table (``variant_rows``) for the pick, swapfs and the variants; GEMMs against swapfs' same GEMM."""
    return variant_rows(c, ("pick", "swapfs", *VARIANTS), "swapfs")


def title(ceil: dict) -> str:
    """The table's first line."""
    return (f"graph µs (median of {ROUNDS} rounds), copy {ceil['copy_TBps']:.2f} TB/s, mm "
            f"{ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; x = / bf16's same part; (n/{ROUNDS}): rounds <= {WIN} x the pick "
            "(calls) or swapfs' GEMM alone; target: call <= 1.11x bf16")


def main() -> int:
    dev = held_device(SMOKE, ARGS)
    procs = {} if SMOKE else {ci: spawn_workers(__file__, [[ci, j] for j in range(len(tasks(ci)))], SMOKE,
                                                f"dn2_{ci}") for ci in range(len(CELLS))}
    ceil = held_ceilings(dev, elapsed)
    specs = [HeldCell(ci, preset, 16.0 if preset == "deepseek-v3" else 6.0, f"{preset} M={m} int8", ci,
                      f"{preset} int8") for ci, (preset, m) in enumerate(CELLS[:1] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: [run_cell(ci, w, dev, ceil, status)], ARGS.out,
                                            "dn2.json", ceil, title(ceil), rows, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main(*tasks), ARGS, "dn2.json")

"""Issue #16 target 3 and the eager speed of the weight-only Gluon path: its lean launch
(``moekit/experts/triton_gluon_wo_lean.py``: plan, descriptors, workspace and launches kept; the backend's repeated
calls from one fast-path entry) against its plain launches (~1 ms of host a call) and today's default decode.

    PYTHONPATH=$PWD timeout 70 python3 benchmarks/wolean_device_check.py --out $OUT/wolean --deadline 54   # H200
    PYTHONPATH=$PWD timeout 45 python3 benchmarks/wolean_device_check.py --out $OUT/wolean --deadline 31 --taken
    PYTHONPATH=$PWD python3 benchmarks/wolean_device_check.py --smoke    # CPU: tiny shapes, the Gluon GEMMs faked

Cells (``wolean_variants.CELLS``, in this order, skipped past the deadline): Qwen3-30B-A3B int8 / int4 / mxfp4 at M =
1024, 2048, 4096; Mixtral-8x7B int4 / mxfp4 at 1024; DeepSeek-V3 int8 at 1024, 2048; Mixtral 4096. Compile workers run
every variant once while this process measures the ceilings and builds the weights. Per cell and scheme, variants
"default" (the ``triton`` backend with today's ``GLUON_WO_CELLS``), "plain" (``run_experts_wo_gluon(lean=False)``),
"lean" (the backend with the cell in ``GLUON_WO_CELLS``): PASS / FAIL with rel-L2 against the exact reference
(``fused_experts_wo_torch``), the Gluon ones against the twin (``experts_gluon_wo_twin``) and lean against plain (bit
for bit); then CUDA-graph replay (ROUNDS interleaved rounds, median µs; rounds lean <= 0.97 x default) and eager calls
as ``moekit bench`` times them (``EAGER_CALLS`` back to back after a sync, ROUNDS interleaved loops: host µs a call to
issue them, host after the first call, wall µs a call to completion), % of the byte floor (touched experts' stored bytes
over the copy rate measured here) and of the flop floor (2 M k 3NK over the bf16 mm rate measured here). A cell is taken
(``GLUON_WO_CELLS``) where lean wins 5/5 graph rounds and its eager wall is not above the default's. The table is
printed last; JSON <out>/wolean.json. Where today's default is the Gluon path (``--taken``: the cells checkpoint 1 took,
``wolean_variants.TAKEN_CELLS``), "lean" is the default and "prev" (the backend with the shape out of
``GLUON_WO_CELLS``: the chooser's decode) is what it is held against.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
if "--taken" in sys.argv:  # wolean_variants.TAKEN_CELLS, here and in the compile workers
    os.environ["WOLEAN_CELLS"] = "taken"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import WIN, graph_of, interleaved, wins  # noqa: E402
from compile_workers import compile_one, held_weights, spawn_workers  # noqa: E402
from held_run import (  # noqa: E402
    HeldCell, HeldRun, held_ceilings, held_cells, held_device, held_entry, install_test_fakes)
from wo_device_check import packed_bytes, rel_err  # noqa: E402

from wolean_variants import CELLS, Weights, default_decode, shape_of, variant_names, variants  # noqa: E402

from moekit.bench.cells import make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.triton_gluon_wo import experts_gluon_wo_twin  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch  # noqa: E402

SETS, ROUNDS, REPLAYS, TOL, EAGER_CALLS = 2, 5, 3, 2e-2, 16
WATCHDOG_S = 8.0
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=54.0, out=os.environ.get("OUT"))


def elapsed() -> float:
    return time.perf_counter() - T0


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    scheme: str
    default: str  # today's default decode here
    flop_floor_us: float  # 2 x M*k x 3NK over the measured mm rate
    byte_floor_us: float  # the touched experts' stored bytes (and x, out) over the copy rate
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> {"ref": rel-L2, "twin": .., "plain": ..}
    rounds: dict = dataclasses.field(default_factory=dict)  # variant -> graph µs a call, each round
    times: dict = dataclasses.field(default_factory=dict)  # variant -> median
    eager: dict = dataclasses.field(default_factory=dict)  # variant -> {"host_us", "host_rest_us", "wall_us"}
    skipped: dict = dataclasses.field(default_factory=dict)  # variant -> its compile worker's status


def tasks_of() -> list:
    """Every (cell, scheme, variant) index triple."""
    return [(ci, si, vi) for ci, (preset, m, schemes) in enumerate(CELLS) for si, scheme in enumerate(schemes)
            for vi in range(len(variant_names(scheme, shape_of(preset), m)))]


def worker_main(tasks: list) -> None:
    """Compile: each (cell, scheme, variant) once at the real shape on uninitialised weights."""
    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, si, vi in tasks:
        preset, m, schemes = CELLS[ci]
        s = shape_of(preset)
        w = held_weights(held, preset, lambda: Weights(s, dev, None))
        compile_one(ci * 100 + si, vi, lambda: _twice(list(variants(schemes[si], s, m, w).values())[vi], s, m, dev),
                    SMOKE)


def _twice(fn, s, m: int, dev) -> None:
    """``fn`` called twice on one call's inputs (the lean variant's second call records its sequence)."""
    c = make_sets(s, m, 1, torch.bfloat16, dev)[0]
    fn(c)
    fn(c)


def start_workers() -> dict:
    """preset -> its workers, one per (scheme, default or Gluon): a scheme's Gluon GEMMs compile once for every M of a
    preset (their constexprs and specialised scalars do not depend on M), in one worker; the defaults' decodes in
    another (12 workers in all, on the H200 host's 16 cores)."""
    parts = {}
    for ci, si, vi in tasks_of():
        preset, m, schemes = CELLS[ci]
        name = variant_names(schemes[si], shape_of(preset), m)[vi]
        parts.setdefault(preset, {}).setdefault((schemes[si], name in ("default", "prev")), []).append((ci, si, vi))
    return {preset: spawn_workers(__file__, list(part.values()), SMOKE, f"wolean_{preset}")
            for preset, part in parts.items()}


def check(cell: Cell, name: str, fn, c0, refs: tuple, plain_out) -> object:
    """PASS / FAIL of one variant on the first input set: rel-L2 to the reference, a Gluon variant's to the twin and
    its equality to the plain launch's output ``plain_out`` (where given); returns its output (None on a failure)."""
    tag = f"{cell.preset} M={cell.m} {cell.scheme} {name}"
    out = None
    gluon = name in ("plain", "lean") or (name == "default" and cell.default == "gluon")
    try:
        out = fn(c0)
        errs = {"ref": rel_err(out, refs[0])}
        if gluon:
            errs["twin"] = rel_err(out, refs[1])
        if gluon and plain_out is not None:  # bit for bit the plain launch's
            errs["plain_equal"] = bool(torch.equal(out, plain_out))
    except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
        traceback.print_exc(limit=3)
        errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    cell.errors[name] = errs
    ok = "error" not in errs and errs.get("plain_equal", True) and all(
        v < TOL for k, v in errs.items() if k != "plain_equal")
    print(f"{'PASS' if ok else 'FAIL'}  {tag}  {errs}", flush=True)
    if not ok:
        FAILED.append(tag)
    return out if ok else None


def eager_rounds(fns: dict, inputs) -> dict:
    """key -> {"host_us", "host_rest_us", "wall_us"}: ``moekit bench``'s eager loop (``bench.timing``: EAGER_CALLS
    calls back to back after a sync; host = their issue time a call, host_rest = the same after the first call,
    wall = to the end of their GPU work a call), ROUNDS loops a variant, interleaved; medians. (Not
    ``bench_rounds.eager_us``, which enqueues behind ~1 ms of GPU work: the take rule reads the bench's eager wall.)"""
    samples = {key: ([], [], []) for key in fns}
    for _ in range(ROUNDS):
        for key, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(inputs[0])
            t_first = time.perf_counter()
            for i in range(1, EAGER_CALLS):
                fn(inputs[i % len(inputs)])
            t_issued = time.perf_counter()
            torch.cuda.synchronize()
            t_done = time.perf_counter()
            for record, value in zip(samples[key], ((t_issued - t0) / EAGER_CALLS,
                                                    (t_issued - t_first) / (EAGER_CALLS - 1),
                                                    (t_done - t0) / EAGER_CALLS)):
                record.append(value * 1e6)
    return {key: dict(zip(("host_us", "host_rest_us", "wall_us"), map(statistics.median, v)))
            for key, v in samples.items()}


def new_cell(preset: str, m: int, scheme: str, w: Weights, inputs, ceil: dict) -> Cell:
    s = shape_of(preset)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    wo = w.wo(scheme)[0]
    byte = (touched * (packed_bytes(wo[0]) + packed_bytes(wo[1])) + 2 * 2 * m * s.k) / (ceil["copy_TBps"] * 1e6)
    flop = 2 * m * s.top_k * 3 * s.n * s.k / (ceil["bf16_mm_TFLOPs"] * 1e6)
    return Cell(preset, m, scheme, default_decode(scheme, s, m), flop, byte)


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> list:
    """The cell's schemes: checks, then graph and eager rounds over every variant of every scheme, interleaved."""
    preset, m, schemes = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    c0, cells, graphs, fns = inputs[0], [], {}, {}
    for si, scheme in enumerate(schemes):
        cell = new_cell(preset, m, scheme, w, inputs, ceil)
        cells.append(cell)
        w13, w2 = w.wo(scheme)[0]
        refs = (fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights),
                experts_gluon_wo_twin(c0.x, w13, w2, c0.topk_ids, c0.topk_weights))
        plain_out = None
        for vi, (name, fn) in enumerate(variants(scheme, s, m, w).items()):
            state = status.get((ci * 100 + si, vi), "ok")
            if state != "ok":  # its compile worker failed or hung: never run here
                cell.skipped[name] = state
                print(f"FAIL  {preset} M={m} {scheme} {name}  (compile worker: {state[:160]})", flush=True)
                FAILED.append(f"{preset} M={m} {scheme} {name}")
                continue
            out = check(cell, name, fn, c0, refs, plain_out)
            plain_out = out if name == "plain" else plain_out
            if out is not None and dev.type == "cuda":
                graphs[(si, name)] = graph_of([lambda c=c, fn=fn: fn(c) for c in inputs], dev)
                fns[(si, name)] = fn
    if graphs:
        rounds, eager = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS), eager_rounds(fns, inputs)
        for (si, name), v in rounds.items():
            cells[si].rounds[name], cells[si].times[name] = v, statistics.median(v)
            cells[si].eager[name] = eager[(si, name)]
    for c in cells:
        print(f"[{elapsed():5.1f}s] " + "\n".join(row(c)), flush=True)
    return cells


def verdict(c: Cell) -> str:
    """Whether the Gluon path's lean launch takes the cell: >= 3% faster than the other decode in every graph round,
    eager wall not above it (lean against the default; where the default is the Gluon path, it against "prev")."""
    new, old = ("default", "prev") if c.default == "gluon" else ("lean", "default")
    if not c.rounds.get(new) or not c.rounds.get(old):
        return "-"
    won = wins(c.rounds[new], c.rounds[old])
    wall_ok = c.eager[new]["wall_us"] <= c.eager[old]["wall_us"]
    return f"{new} wins {won}/{ROUNDS} vs {old}, eager wall {'<=' if wall_ok else '>'}: " + (
        "TAKE" if won == ROUNDS and wall_ok else f"keep {old}")


def row(c: Cell) -> list[str]:
    lines = [f"{c.preset:<14}{c.m:>5} {c.scheme:<11} default={c.default}; floors byte {c.byte_floor_us:.0f} µs, "
             f"flop {c.flop_floor_us:.0f} µs; {verdict(c)}"]
    for k, v in c.times.items():
        e = c.eager.get(k, {})
        lines.append(f"    {k:<8} graph {v:8.1f} µs ({100 * c.byte_floor_us / v:3.0f}% byte, "
                     f"{100 * c.flop_floor_us / v:3.0f}% flop)  eager host {e.get('host_us', 0):6.0f} "
                     f"rest {e.get('host_rest_us', 0):6.0f} wall {e.get('wall_us', 0):7.0f} µs a call")
    return lines


def install_smoke_fakes() -> None:
    """CPU: the Gluon GEMMs replaced by the tests' torch stand-ins; the first cell's first scheme taken by the Gluon
    path (its "prev" variant runs, as at a taken cell on the H200)."""
    from moekit.experts.triton_gluon_wo import GLUON_WO_CELLS

    install_test_fakes()
    (preset, m, schemes), s = CELLS[0], shape_of(CELLS[0][0])
    GLUON_WO_CELLS[(schemes[0], s.num_experts, s.n, s.k)] = (m, 2 * m)


def title(ceil: dict) -> str:
    """The table's first line."""
    return (f"graph µs (median of {ROUNDS} rounds), eager µs a call ({EAGER_CALLS} calls a loop, median of {ROUNDS}); "
            f"copy {ceil['copy_TBps']:.2f} TB/s, mm {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; take: lean <= {WIN} x "
            f"default (default <= {WIN} x prev) in every round and eager wall <= it")


def main() -> int:
    dev = held_device(SMOKE, ARGS, install_smoke_fakes)
    procs = {} if SMOKE else start_workers()
    ceil = held_ceilings(dev, elapsed)
    specs = [HeldCell(ci, preset, 4.0 if preset == "qwen3-30b-a3b" else 8.0, f"{preset} M={m}", preset, preset)
             for ci, (preset, m, _) in enumerate(CELLS[:1] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: run_cell(ci, w, dev, ceil, status), ARGS.out,
                                            "wolean.json", ceil, title(ceil), row, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main([tuple(t) for t in tasks]), ARGS, "wolean.json",
               ("--taken", "only the cells checkpoint 1 took (TAKEN_CELLS)"))

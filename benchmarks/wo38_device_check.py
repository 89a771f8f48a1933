"""Issue #16, session 38 (brief wo38): the weight-only route's pick at mid batches (M = 128-1024) against every decode
that can run there. The H200 bench of main d9495089 read int4 / mxfp4 Mixtral-8x7B at M = 256-512 1.9-2.2x the bf16
call, DeepSeek-V3 at M = 512 2.2x its own M = 256, Qwen3 int4 at M = 256 above M = 512: cells the tables never
measured (they interpolate by tile-height bucket). Cells and variants: ``wo38_variants`` (its docstring).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wo38_device_check.py --out $OUT/wo38 --call 1 --deadline 70   # GPU
    PYTHONPATH=$PWD python3 benchmarks/wo38_device_check.py --cells int4:mixtral-8x7b:512 --out $OUT/wo38
    PYTHONPATH=$PWD python3 benchmarks/wo38_device_check.py --smoke     # CPU: interpreter, tiny shapes, Gluon faked

Per cell (in the order given; none starts past the deadline): the route's call ("pick": ``run_experts_wo`` naming
nothing) and each variant, PASS / FAIL against the torch twin ``fused_experts_wo_torch`` (rel-L2 < TOL) on the first
input set; then CUDA graphs over SETS rotated input sets timed in ROUNDS ``bench_rounds.settled`` rounds (each graph
after one replay of itself, shuffled order), median µs; per variant its ratio to the pick and the rounds it took
<= 0.97x the pick's. Compile: WORKERS subprocesses run every distinct (scheme, preset, variant) once (cells in order,
so the first cells' compile first) on uninitialised weights of the preset's N and K (``compile_shape``) while this
process builds the real ones; a cell waits for its own tasks until CELL_S before the deadline, then leaves out the
variants still compiling (logged, "not timed" in the table; not a failure: ``--cells`` that cell alone runs them).
JSON <out>/wo38.json after each cell; the table last. ``--call 1..4``: the slices of ``wo38_variants.CALLS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import graph_of, medians, settled, shuffled, wins  # noqa: E402
from bench_run import RunLog, run_info, write_json  # noqa: E402
from compile_workers import compile_one, spawn_workers, task_status  # noqa: E402
from held_run import held_device, start_watchdog  # noqa: E402
from wo38_variants import CALLS, SMOKE_CELLS, CellSpec, Variant, compile_shape, shape_of, variants  # noqa: E402
from wo_weights import Weights  # noqa: E402
from wo_device_check import rel_err  # noqa: E402

import moekit.experts.triton_gluon_wo as gluon_wo  # noqa: E402
from moekit.bench.cells import make_sets  # noqa: E402
from moekit.experts.configs import device_key  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args  # noqa: E402

SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 1e-2
WORKERS = 14  # of the device's 16 cores
CELL_S = 12.0  # a cell waits for its compile tasks until this long before the deadline, then runs those compiled
WATCHDOG_S = 12.0  # past the deadline and this, the run ends with the table so far (a hung kernel; timeout 85 s)
RUN = RunLog("wo38: graph µs, median of settled rounds; x pick = pick / variant; faster = rounds <= 0.97x the pick")


@dataclasses.dataclass
class Cell:
    scheme: str
    preset: str
    m: int
    rows_per_expert: float
    device_key: str
    variants: dict  # name -> Variant.describe()
    errors: dict = dataclasses.field(default_factory=dict)  # name -> rel-L2 against the twin, or the error
    rounds: dict = dataclasses.field(default_factory=dict)  # name -> µs a call, each round
    times: dict = dataclasses.field(default_factory=dict)  # name -> median µs a call

    @property
    def label(self) -> str:
        return f"{self.scheme.split('_')[0]} {self.preset} M={self.m}"


def cell_specs(args) -> list[CellSpec]:
    if args.smoke:
        return [CellSpec.parse(c) for c in SMOKE_CELLS]
    return [CellSpec.parse(c) for c in (args.cells or CALLS[args.call])]


def call_of(v: Variant, scheme: str, w: Weights):
    """fn(inputs) -> out of a variant on the weights ``w`` (WoWeights for the Gluon path, WeightArgs otherwise)."""
    wo = w.wo(scheme)
    if v.decode == "gluon":
        return lambda c: gluon_wo.run_experts_wo_gluon(c.x, *wo, c.topk_ids, c.topk_weights, None, scheme,
                                                       options=v.gluon)
    args = tuple(weight_args(x.q, x.scale, x.zero, x.group_size) for x in wo)
    return lambda c: run_experts_wo(c.x, *args, c.topk_ids, c.topk_weights, None, scheme, config=v.config,
                                    decode=v.decode)


def route_call(scheme: str, w: Weights):
    """The pick as the route runs it: ``run_experts_wo`` naming nothing."""
    args = tuple(weight_args(x.q, x.scale, x.zero, x.group_size) for x in w.wo(scheme))
    return lambda c: run_experts_wo(c.x, *args, c.topk_ids, c.topk_weights, None, scheme)


def compile_tasks(specs: list, key: str, gluon_ok: bool) -> tuple[list, dict]:
    """(the distinct compile tasks [ci, name, spec text], in cell order; (ci, name) -> the task index that compiles
    it): a variant of the same scheme, preset, decode, config and options as an earlier one shares its task."""
    tasks, index, seen = [], {}, {}
    for ci, spec in enumerate(specs):
        for name, v in variants(spec, key, gluon_ok).items():
            ident = (spec.scheme, spec.preset, repr(v))  # E = 8 and E % 16 == 0 specialise the kernels apart
            if ident not in seen:
                seen[ident] = len(tasks)
                tasks.append([ci, name, f"{spec.scheme}:{spec.preset}:{spec.m}"])
            index[(ci, name)] = seen[ident]
    return tasks, index


def worker_main(tasks: list) -> None:
    """A compile worker: each task's variant run once on uninitialised weights of ``compile_shape``."""
    dev, held = held_device(SMOKE, argparse.Namespace()), {}  # --smoke: the Gluon GEMMs faked, as in the main process
    gluon_ok = gluon_wo.gluon_supported(dev)
    for ti, ci, name, text in tasks:
        scheme, preset, m = text.split(":")
        spec = CellSpec(scheme, preset, int(m))
        s = compile_shape(preset)
        if held.get("preset") != preset:
            held.clear()
            held.update(preset=preset, w=Weights(s, dev, None))
        v = variants(spec, device_key(dev), gluon_ok)[name]
        c0 = make_sets(s, spec.m, 1, torch.bfloat16, dev)[0]
        compile_one(ti, 0, lambda: call_of(v, scheme, held["w"])(c0), SMOKE)


def start_workers(tasks: list) -> list:
    """WORKERS processes, task i to worker i mod WORKERS (each works through the cells in order); --smoke: one
    worker with the first 3 tasks (the interpreter compiles nothing: the worker's path is what it checks)."""
    numbered = [[i, *t] for i, t in enumerate(tasks)]
    parts = [numbered[:3]] if SMOKE else [numbered[j::WORKERS] for j in range(WORKERS)]
    return spawn_workers(__file__, [p for p in parts if p], SMOKE, "wo38")


def wait_compiled(procs: list, wanted: set, wait_s: float) -> dict:
    """Task index -> "ok" / "error: ..." / "crashed" (started, its worker gone) / "compiling" (started or queued, its
    worker alive) once every task of ``wanted`` finished, or ``wait_s`` (s from the start) passed, or the workers
    ended (a task that none reached is absent: this process compiles it)."""
    said = RUN.elapsed()
    while True:
        got = {ti: why for (ti, _), why in task_status(procs).items()}
        alive = any(p.poll() is None for p, _ in procs)
        left = [t for t in wanted if got.get(t, "crashed") == "crashed"]
        if not left or RUN.elapsed() > wait_s or not alive:
            RUN.log(f"compiled: {len(wanted) - len(left)} of this cell's {len(wanted)} tasks, "
                    f"{sum(v == 'ok' for v in got.values())} ok of all so far")
            return {**({t: "compiling" for t in left} if alive else {}), **{t: why for t, why in got.items()
                                                                            if not (alive and t in left)}}
        if RUN.elapsed() > said + 10:
            said = RUN.elapsed()
            RUN.log(f"waiting for {len(left)} compile tasks")
        time.sleep(0.5)


def check(cell: Cell, calls: dict, w: Weights, c0) -> set:
    """PASS / FAIL of each call against the twin; the names that passed."""
    want = fused_experts_wo_torch(c0.x, *w.wo(cell.scheme), c0.topk_ids, c0.topk_weights)
    passed = set()
    for name, fn in calls.items():
        try:
            err = rel_err(fn(c0), want)
            cell.errors[name] = err
            if RUN.check(f"{cell.label} {name}", err < TOL, f"rel_err={err:.2e}  {cell.variants[name]}"):
                passed.add(name)
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
            cell.errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
            RUN.check(f"{cell.label} {name}", False, f"raised {cell.errors[name]}")
    return passed


def run_cell(ci: int, spec: CellSpec, w: Weights, dev, status: dict, index: dict, stop_s: float) -> Cell:
    """The cell's pick and variants: compile status applied, checked, captured, timed (no round begins past ``stop_s``
    s from the start)."""
    s = shape_of(spec.preset)
    key, gluon_ok = device_key(dev), gluon_wo.gluon_supported(dev)
    found = variants(spec, key, gluon_ok)
    cell = Cell(spec.scheme, spec.preset, spec.m, spec.m * s.top_k / s.num_experts, key,
                {name: v.describe() for name, v in found.items()})
    calls = {"pick": route_call(spec.scheme, w)}
    for name, v in found.items():
        why = status.get(index[(ci, name)], "ok")
        if why == "compiling" and name != "pick":  # not ready by the cell's wait: left out, not a failure
            cell.errors[name] = "still compiling at the cell's start: not run (--cells this cell alone runs it)"
            RUN.log(f"{cell.label} {name}: {cell.errors[name]}")
        elif why.startswith(("error", "crashed")):
            cell.errors[name] = f"compile worker: {why[:300]}"
            RUN.check(f"{cell.label} {name}", False, cell.errors[name])
        elif name != "pick":
            calls[name] = call_of(v, spec.scheme, w)
    inputs = make_sets(s, spec.m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=spec.m)
    RUN.log(f"{cell.label} (R = {cell.rows_per_expert:.1f} rows an expert): the route runs {cell.variants['pick']}")
    passed = check(cell, calls, w, inputs[0])
    if dev.type == "cuda":
        graphs = {}
        for n in [n for n in calls if n in passed]:
            try:
                graphs[n] = graph_of([lambda c=c, fn=calls[n]: fn(c) for c in inputs], dev)
            except Exception as e:  # noqa: BLE001  (a call that cannot be captured is reported, the others timed)
                cell.errors[n] = f"graph capture: {type(e).__name__}: {str(e)[:300]}"
                RUN.check(f"{cell.label} {n} graph", False, cell.errors[n])
        cell.rounds = settled({n: (g, None) for n, g in graphs.items()}, len(inputs), dev, ROUNDS, REPLAYS,
                              time.time() + stop_s - RUN.elapsed(), order=shuffled)
        cell.times = medians(cell.rounds)
        del graphs
    RUN.log(f"{cell.label}: " + "  ".join(f"{n} {t:.1f}" for n, t in sorted(cell.times.items(), key=lambda kv: kv[1])))
    RUN.summary.extend(rows(cell))
    return cell


def rows(c: Cell) -> list[str]:
    """The cell's lines of the table: the pick, then the variants fastest first, the best named."""
    pick = c.times.get("pick")
    head = f"{c.label} (R {c.rows_per_expert:.0f}, {c.device_key}): pick {pick or float('nan'):.1f} µs = " \
           f"{c.variants['pick']}"
    out = [head]
    others = sorted((n for n in c.times if n != "pick"), key=c.times.get)
    for n in others:
        faster = wins(c.rounds[n], c.rounds["pick"]) if pick else 0
        out.append(f"    {n:<13}{c.times[n]:9.1f}  x pick {pick / c.times[n] if pick else float('nan'):5.3f}  "
                   f"faster {faster}/{len(c.rounds[n])}  {c.variants[n]}")
    if others and pick:
        best = others[0]
        won = wins(c.rounds[best], c.rounds["pick"])
        out.append(f"    best {best}: x{pick / c.times[best]:.3f}, {won}/{len(c.rounds[best])} rounds >= 3% faster"
                   f"{'  <- a win' if won == len(c.rounds[best]) >= 5 else ''}")
    out += [f"    not timed {n}: {c.errors[n]}" for n in c.variants if n not in c.times and n in c.errors
            and not isinstance(c.errors[n], float)]
    return out


def main(args) -> int:
    dev = held_device(args.smoke, args)  # --smoke: no deadline (the interpreter's calls take minutes)
    specs = cell_specs(args)
    key, gluon_ok = device_key(dev), gluon_wo.gluon_supported(dev)
    tasks, index = compile_tasks(specs, key, gluon_ok)
    procs = start_workers(tasks)
    RUN.log(f"{run_info()} {len(specs)} cells, {len(tasks)} compile tasks, gluon {gluon_ok}")
    result = {**run_info(), "cells": [], "failed": RUN.failed}
    cells, held = [], {}

    def dump() -> None:
        result["cells"] = [dataclasses.asdict(c) for c in cells]
        if args.out:
            write_json(os.path.join(args.out, "wo38.json"), result)

    if not args.smoke:  # past the deadline and a margin (a hung kernel): the workers killed, the table and JSON so far
        start_watchdog(args.deadline + WATCHDOG_S, RUN.elapsed, {"all": procs}, RUN.failed, RUN.print_table, dump)
    try:
        for ci, spec in enumerate(specs):
            if RUN.elapsed() > args.deadline:
                RUN.log(f"SKIP {spec.label}: deadline")
                RUN.summary.append(f"{spec.label}: not reached")
                continue
            if held.get("preset") != spec.preset:
                held.clear()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                held.update(preset=spec.preset, w=Weights(shape_of(spec.preset), dev, 1))
            wanted = {t for (c, _), t in index.items() if c == ci}
            status = wait_compiled(procs, wanted, args.deadline - CELL_S) if procs else {}
            try:
                cells.append(run_cell(ci, spec, held["w"], dev, status, index, args.deadline + WATCHDOG_S - 4))
            except Exception as e:  # noqa: BLE001  (one cell's failure never loses the others)
                RUN.check(spec.label, False, f"raised {type(e).__name__}: {str(e)[:400]}")
            dump()
    finally:
        for p, _ in procs:
            p.kill()
    RUN.print_table()
    return 1 if RUN.failed else 0


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--call", default="1", choices=sorted(CALLS), help="a preset slice of the cells (wo38_variants)")
    p.add_argument("--cells", nargs="+", help="SCHEME:PRESET:M each (SCHEME int4, int8, mxfp4), in this order")
    p.add_argument("--deadline", type=float, default=70.0, help="no cell starts past it (s)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for wo38.json (default $OUT)")
    return p.parse_args(argv)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main(json.loads(sys.argv[2]))
    else:
        sys.exit(main(parse()))

"""Issue #16 target 3, session 31: the route's pick against the same GEMM options named (checkpoint 1 also timed session
30's dn2s, ``GluonWoOptions(inflight=2)``, removed after checkpoint 2), each call timed after a replay of its own graph
(``bench_rounds.settled``: no call inherits the clock and power state another variant left). Session 31's wo4k / dn2
runs timed the pick right after the bf16 call's graph in every round and every other call after a weight-only one; the
pick read 5-14% above "swapfs" at DeepSeek-V3 4096 and Mixtral 1024 int8 though both run the lean launch
(``run_experts_wo_gluon``'s default) with the same options, plans and kernels. Calls (per cell):

    pick        ``run_experts_wo`` naming nothing (the route: ``gluon_wo_takes``, ``wo_options``; WeightArgs)
    lean        ``run_experts_wo_gluon`` with NAMED's options (int8 swapfs, int4 swaps), the lean launch
    plain       the same through the plain launches (``lean=False``)
    pick@bf16, lean@bf16   the pick's / lean's graph timed right after the bf16 call's (full cells): the wo4k order

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/wopk31_device_check.py --out $OUT/wopk31 --deadline 62   # H200
    PYTHONPATH=$PWD python3 benchmarks/wopk31_device_check.py --smoke    # CPU: tiny shapes, the GEMMs faked

Per cell: PASS / FAIL of each call against the torch twin (rel-L2 < 1e-2) and bit-equality to lean's output; CUDA
graphs of each call over the rotated input sets, ROUNDS settled rounds (the order turns one name a round); eager
host / wall µs a call (6 back to back); on PROFILED cells the kernels, memsets and copies one replay of the pick's,
lean's and plain's graphs runs (``graph_kernels``: grid, block, shared bytes, µs each). The table printed last:
median µs, x the bf16 call, and against each call's peer (PEERS) the ratio of medians and the rounds >= 3% faster /
slower. JSON <out>/wopk31.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import eager_us, graph_of, medians, settled, wins  # noqa: E402
from compile_workers import spawn_workers  # noqa: E402
from graph_kernels import graph_kernels, op_lines  # noqa: E402
from held_run import HeldCell, HeldRun, held_ceilings, held_cells, held_device, held_entry  # noqa: E402
from wo4k_device_check import Cell, compile_task, new_cell  # noqa: E402
from wo8_variants import Weights, shape_of, timed_calls  # noqa: E402
from wo_device_check import rel_err  # noqa: E402

from moekit.bench.cells import make_sets  # noqa: E402
from moekit.experts.triton_gluon_wo import (  # noqa: E402
    GluonWoGemms, GluonWoOptions, experts_gluon_wo_twin, run_experts_wo_gluon, wo_options,
)
from moekit.experts.triton_wo import run_experts_wo, weight_args  # noqa: E402

I8, I4 = "int8_w8a16", "int4_w4a16"
_O = GluonWoOptions
SWAPFS = _O(swap=True, fast=True, split=True)
NAMED = {I8: GluonWoGemms(SWAPFS, SWAPFS), I4: GluonWoGemms(_O(swap=True, split=True), _O(swap=True, split=True))}
# (preset, M, scheme, full): full cells also time the wo4k order (pick@bf16, lean@bf16);
# int4 DeepSeek-V3 4096 / Mixtral 1024 and int8 Qwen3 1024 / 2048, Mixtral 2048: the cells def31 took
CELLS = (("deepseek-v3", 4096, I8, True), ("deepseek-v3", 4096, I4, False), ("mixtral-8x7b", 1024, I8, True),
         ("mixtral-8x7b", 2048, I8, True), ("mixtral-8x7b", 1024, I4, False), ("qwen3-30b-a3b", 4096, I8, True),
         ("qwen3-30b-a3b", 2048, I8, False), ("qwen3-30b-a3b", 1024, I8, False))
PROFILED = (0, 2)  # the cells whose pick / lean / plain graphs are listed kernel by kernel
# name -> the peer its rounds are counted against
PEERS = {"pick": "lean", "plain": "lean", "pick@bf16": "pick", "lean@bf16": "lean"}
EAGER = ("pick", "lean", "plain")
SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 1e-2
WATCHDOG_S = 8.0
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=70.0, out=os.environ.get("OUT"))


@dataclasses.dataclass
class PkCell(Cell):
    options: str = ""  # the pick's GEMM options (``wo_options``) and whether the route takes the Gluon path
    kernels: dict = dataclasses.field(default_factory=dict)  # call -> [GpuOp as a dict], one replay of its graph


def elapsed() -> float:
    return time.perf_counter() - T0


def names_of(ci: int) -> list:
    return ["pick", "lean", "plain"]


def tasks(ci: int) -> list:
    """Cell ci's compile tasks, a worker each: the bf16 call (the preset's first cell only), the pick with lean and
    plain."""
    first = next(i for i, c in enumerate(CELLS) if c[0] == CELLS[ci][0]) == ci
    return [("bf16",)] * first + [tuple(names_of(ci))]


def cell_calls(w: Weights, ci: int, only: tuple = ()) -> dict:
    """"<tag> <name> call" -> (scheme, "call", fn(inputs)) for ``names_of(ci)`` (``only``: those names)."""
    _, _, scheme, _ = CELLS[ci]
    tag = scheme.split("_")[0]
    args = tuple(weight_args(x.q, x.scale, x.zero, x.group_size) for x in w.wo(scheme))
    every = {"pick": lambda c: run_experts_wo(c.x, *args, c.topk_ids, c.topk_weights, None, scheme)}
    for name, lean in (("lean", True), ("plain", False)):
        every[name] = lambda c, lean=lean: run_experts_wo_gluon(
            c.x, *w.wo(scheme), c.topk_ids, c.topk_weights, None, scheme, options=NAMED[scheme], lean=lean)
    return {f"{tag} {n} call": (scheme, "call", every[n]) for n in names_of(ci) if not only or n in only}


def worker_main(ci: int, j: int) -> None:
    """Compile task j of cell ci (wo4k's ``compile_task``)."""
    preset, m, _, _ = CELLS[ci]
    compile_task(ci, j, preset, m, tasks(ci)[j], lambda w, task: cell_calls(w, ci, task), SMOKE)


def check(cell: PkCell, calls: dict, w: Weights, c0) -> set:
    """PASS / FAIL of each call against the twin and whether it equals lean's output bit for bit; the names that
    passed."""
    twin = experts_gluon_wo_twin(c0.x, *w.wo(cell.scheme), c0.topk_ids, c0.topk_weights)
    outs, passed = {}, set()
    for key in sorted(calls, key=lambda k: k.split()[1] != "lean"):  # lean's first: the others are held to it
        name = key.split()[1]
        try:
            outs[name] = calls[key][2](c0)
            errs = {"twin": rel_err(outs[name], twin),
                    "bit_equal_lean": "lean" in outs and bool(torch.equal(outs[name], outs["lean"]))}
        except Exception as e:  # noqa: BLE001  (one call's failure never loses the cell)
            errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        cell.errors[name] = errs
        ok = "error" not in errs and errs["twin"] < TOL
        print(f"{'PASS' if ok else 'FAIL'}  {cell.preset} M={cell.m} {cell.tag} {name}  {errs}", flush=True)
        if ok:
            passed.add(name)
        else:
            FAILED.append(f"{cell.preset} M={cell.m} {cell.tag} {name}")
    return passed


def compiled(cell: PkCell, ci: int, status: dict) -> set:
    """The names whose compile worker failed (each a FAIL line, never run here)."""
    bad = {name: why for j, names in enumerate(tasks(ci)) for name in names
           for why in [status.get((ci, j), "ok")] if why != "ok"}
    for name, why in bad.items():
        cell.skipped[name] = why[:160]
        print(f"FAIL  {cell.preset} M={cell.m} {cell.tag} {name}  (compile worker: {why[:160]})", flush=True)
        FAILED.append(f"{cell.preset} M={cell.m} {cell.tag} {name}")
    return set(bad)


def route_of(w: Weights, scheme: str, m: int, c0) -> str:
    """What the route does with this cell: the Gluon path or not, and the options it names."""
    from moekit.experts.triton_gluon_wo import gluon_wo_takes

    args = tuple(weight_args(x.q, x.scale, x.zero, x.group_size) for x in w.wo(scheme))
    takes = gluon_wo_takes(c0.x, *args, c0.topk_ids, scheme, "silu")
    gemms = wo_options(*args, scheme, m)
    return f"gluon={takes} up {short(gemms.up)} down {short(gemms.down)}"


def short(o: GluonWoOptions) -> str:
    """The options' fields that differ from the session-27 kernel's, joined ("base": none)."""
    on = [f.name if f.type in (bool, "bool") else f"{f.name}={getattr(o, f.name)}" for f in dataclasses.fields(o)
          if getattr(o, f.name) != f.default]
    return "+".join(on) or "base"


@dataclasses.dataclass(frozen=True)
class Repeated:
    """A graph replayed ``times`` times a replay (the bf16 call's as wo4k timed it before the pick: REPLAYS)."""

    graph: object
    times: int

    def replay(self) -> None:
        for _ in range(self.times):
            self.graph.replay()


def timed_entries(cell: PkCell, graphs: dict) -> dict:
    """``settled``'s entries: every graph after itself; on full cells the pick's and lean's also after bf16's
    (replayed REPLAYS times, as the wo4k / dn2 rounds timed it right before the pick)."""
    entries = {k: (g, None) for k, g in graphs.items()}
    bf16 = None if graphs.get("bf16 call") is None else Repeated(graphs["bf16 call"], REPLAYS)
    for name in ("pick", "lean"):
        key = f"{cell.tag} {name} call"
        if bf16 is not None and key in graphs and CELLS_FULL.get((cell.preset, cell.m, cell.scheme)):
            entries[f"{cell.tag} {name}@bf16 call"] = (graphs[key], bf16)
    return entries


CELLS_FULL = {c[:3]: c[3] for c in CELLS}


def profile(cell: PkCell, graphs: dict) -> None:
    """The GPU operations of one replay of the pick's, lean's and plain's graphs, printed and kept in the cell."""
    for name in ("pick", "lean", "plain"):
        g = graphs.get(f"{cell.tag} {name} call")
        if g is None:
            continue
        try:
            ops = graph_kernels(g)
        except Exception as e:  # noqa: BLE001  (the profiler is a reading, never the run)
            print(f"  kernels {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        cell.kernels[name] = [dataclasses.asdict(o) for o in ops]
        print(f"  kernels of one replay ({len(ops)}), {cell.preset} M={cell.m} {cell.tag} {name}:", flush=True)
        print("\n".join("    " + line for line in op_lines(ops)), flush=True)
    sig = {n: [(o["name"], tuple(o["grid"]), tuple(o["block"]), o["shared"]) for o in ops]
           for n, ops in cell.kernels.items()}
    for a, b in (("pick", "lean"), ("lean", "plain")):
        if a in sig and b in sig:
            print(f"  same launches {a} / {b}: {sig[a] == sig[b]}", flush=True)


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> PkCell:
    preset, m, scheme, full = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    cell = PkCell(**dataclasses.asdict(new_cell(preset, m, scheme, w, inputs, ceil)))
    c0 = inputs[0]
    cell.options = route_of(w, scheme, m, c0)
    print(f"  {preset} M={m} {cell.tag}: the route {cell.options}", flush=True)
    bad = compiled(cell, ci, status)
    timed = {} if "bf16" in bad else timed_calls(s, w, None)
    calls = {k: v for k, v in cell_calls(w, ci).items() if k.split()[1] not in bad}
    passed = check(cell, calls, w, c0)
    timed.update({k: v for k, v in calls.items() if k.split()[1] in passed})
    if dev.type != "cuda":  # --smoke: each timed call once, as the graphs would capture it
        for _, _, fn in timed.values():
            fn(c0)
    else:
        graphs = {k: graph_of([lambda c=c, fn=fn: fn(c) for c in inputs], dev) for k, (_, _, fn) in timed.items()}
        cell.rounds = settled(timed_entries(cell, graphs), len(inputs), dev, ROUNDS, REPLAYS)
        cell.times = medians(cell.rounds)
        if ci in PROFILED:
            profile(cell, graphs)
        del graphs
        pairs = {k: [lambda c=c, fn=timed[k][2]: fn(c) for c in inputs] for k in
                 (f"{cell.tag} {n} call" for n in EAGER) if k in timed}
        cell.eager = {k: list(v) for k, v in eager_us(pairs, 3, 6).items()}
        print("  eager host / wall µs a call: " + "  ".join(f"{k.split()[1]} {h:.0f} / {v:.0f}" for k, (h, v) in
                                                           cell.eager.items()), flush=True)
    print(f"[{elapsed():5.1f}s] {preset} M={m} {cell.tag}: " + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()),
          flush=True)
    return cell


def rows(c: PkCell) -> list[str]:
    """Per call: median µs, x the bf16 call, against its peer the ratio of medians (peer / call) and the rounds the
    call took <= 0.97 x / >= 1.03 x the peer's; eager wall µs a call."""
    bf16 = c.times.get("bf16 call")
    out = [f"{c.preset:<14}{c.m:>5} {c.tag}  bf16 call {bf16 or float('nan'):.1f} µs  route: {c.options}"]
    for name in ("pick", "lean", "plain", "pick@bf16", "lean@bf16"):
        key = f"{c.tag} {name} call"
        if key not in c.times:
            continue
        t = c.times[key]
        line = f"    {name:<11}{t:9.1f} {t / bf16 if bf16 else float('nan'):5.2f}x"
        peer = PEERS.get(name)
        mine, theirs = c.rounds[key], c.rounds.get(f"{c.tag} {peer} call")
        if theirs:
            slower = sum(v >= 1.03 * p for v, p in zip(mine, theirs))
            line += (f"  vs {peer}: x{c.times[f'{c.tag} {peer} call'] / t:5.3f} faster {wins(mine, theirs)}/"
                     f"{len(mine)} slower {slower}/{len(mine)}")
        eager = c.eager.get(key)
        out.append(line + (f"  eager host {eager[0]:.0f} wall {eager[1]:.0f}" if eager else ""))
    return out


def title(ceil: dict) -> str:
    return (f"graph µs (median of {ROUNDS} settled rounds: each call after a replay of its own graph; @bf16: after the "
            f"bf16 call's), copy {ceil['copy_TBps']:.2f} TB/s, mm {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; x = / the "
            "bf16 call; faster / slower: rounds <= 0.97 x / >= 1.03 x the peer; eager µs a call (6 back to back)")


def main() -> int:
    dev = held_device(SMOKE, ARGS)
    procs = {} if SMOKE else {ci: spawn_workers(__file__, [[ci, j] for j in range(len(tasks(ci)))], SMOKE,
                                                f"wopk31_{ci}") for ci in range(len(CELLS))}
    ceil = held_ceilings(dev, elapsed)
    specs = [HeldCell(ci, preset, 16.0 if preset == "deepseek-v3" else 5.0, f"{preset} M={m} {scheme}", ci,
                      f"{preset} M={m} {scheme}") for ci, (preset, m, scheme, _) in
             enumerate(CELLS[:2] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: [run_cell(ci, w, dev, ceil, status)], ARGS.out,
                                            "wopk31.json", ceil, title(ceil), rows, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main(*tasks), ARGS, "wopk31.json")

"""Issue #16 target 3, session 31, checkpoint 2 (after ``wopk31_device_check.py``'s CK1: the pick's and lean's graphs
run the same kernels, grids and shared memory; timed after a replay of themselves they read equal but at DeepSeek-V3,
where the pick, cyclically after the bf16 call, read 2-7% above lean, and right after the bf16 call's graph both read
5-7% above themselves). Per cell, three timings of CUDA graphs (whole calls over the rotated input sets):

    order   wo4k's way (no warm replay, each graph timed straight after the one before it): the bf16 GEMMs alone
            and the bf16 call (wo4k's entries before the pick), then the pick and lean, their order reversed every
            other round (ORDER_ROUNDS): whether the pick's gap follows the place after the bf16 graphs or the call
    pair    pick against lean, each after a replay of its own graph, their order reversed every other round

then eager host / wall µs a call (6 back to back) of the pick and lean. (Checkpoint 2 also timed session 30's dn2s,
``GluonWoOptions(inflight=2)``, against lean the same way; removed after it.)

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/wopk31b_device_check.py --out $OUT/wopk31b --deadline 62   # H200
    PYTHONPATH=$PWD python3 benchmarks/wopk31b_device_check.py --smoke    # CPU: tiny shapes, the GEMMs faked

The table printed last: per cell the order rounds' medians with the pick after the bf16 call and with lean there,
and the pair rounds' medians, ratio (peer / call) and rounds >= 3% faster / slower. JSON <out>/wopk31b.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import NOTHING, eager_us, graph_of, medians, settled, swapped, wins  # noqa: E402
from compile_workers import spawn_workers  # noqa: E402
from held_run import HeldCell, HeldRun, held_ceilings, held_cells, held_device, held_entry  # noqa: E402
from wo4k_device_check import compile_task  # noqa: E402
from wo8_variants import Gemms, Weights, shape_of, timed_calls  # noqa: E402
from wo_device_check import rel_err  # noqa: E402
from wopk31_device_check import NAMED, route_of  # noqa: E402

from moekit.bench.cells import make_sets  # noqa: E402
from moekit.experts.triton_gluon_wo import experts_gluon_wo_twin, run_experts_wo_gluon  # noqa: E402
from moekit.experts.triton_wo import run_experts_wo, weight_args  # noqa: E402

I8, I4 = "int8_w8a16", "int4_w4a16"
CELLS = (("deepseek-v3", 4096, I8), ("deepseek-v3", 4096, I4), ("mixtral-8x7b", 1024, I8), ("mixtral-8x7b", 2048, I8),
         ("mixtral-8x7b", 1024, I4), ("qwen3-30b-a3b", 4096, I8))
BF16 = {"bf16 up": "bf16 up", "bf16 down": "bf16 down", "bf16 call": "bf16"}  # timed_calls' names -> here
SETS, ROUNDS, ORDER_ROUNDS, REPLAYS, TOL = 2, 5, 8, 3, 1e-2
WATCHDOG_S = 8.0
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=70.0, out=os.environ.get("OUT"))


@dataclasses.dataclass
class OrderCell:
    preset: str
    m: int
    scheme: str
    route: str = ""
    errors: dict = dataclasses.field(default_factory=dict)  # call -> {"twin": rel-L2, "bit_equal_lean"}
    skipped: dict = dataclasses.field(default_factory=dict)  # call -> why
    rounds: dict = dataclasses.field(default_factory=dict)  # "<timing> <call>" -> [µs a call, each round]
    eager: dict = dataclasses.field(default_factory=dict)  # call -> [host, wall] µs a call

    @property
    def tag(self) -> str:
        return self.scheme.split("_")[0]


def elapsed() -> float:
    return time.perf_counter() - T0


def names_of(ci: int) -> list:
    return ["pick", "lean"]


def tasks(ci: int) -> list:
    """Cell ci's compile tasks, a worker each: the bf16 call (the preset's first cell only), the pick with lean."""
    first = next(i for i, c in enumerate(CELLS) if c[0] == CELLS[ci][0]) == ci
    return [("bf16",)] * first + [("pick", "lean")]


def calls_of(w: Weights, ci: int, only: tuple = ()) -> dict:
    """"<tag> <name> call" -> (scheme, "call", fn(inputs)): the pick (the route, on WeightArgs), lean (NAMED's
    options)."""
    _, _, scheme = CELLS[ci]
    args = tuple(weight_args(x.q, x.scale, x.zero, x.group_size) for x in w.wo(scheme))
    every = {"pick": lambda c: run_experts_wo(c.x, *args, c.topk_ids, c.topk_weights, None, scheme),
             "lean": lambda c: run_experts_wo_gluon(c.x, *w.wo(scheme), c.topk_ids, c.topk_weights, None, scheme,
                                                    options=NAMED[scheme])}
    tag = scheme.split("_")[0]
    return {f"{tag} {n} call": (scheme, "call", every[n]) for n in names_of(ci) if not only or n in only}


def worker_main(ci: int, j: int) -> None:
    preset, m, _ = CELLS[ci]
    compile_task(ci, j, preset, m, tasks(ci)[j], lambda w, task: calls_of(w, ci, task), SMOKE)


def check(cell: OrderCell, calls: dict, w: Weights, c0, bad: set) -> set:
    """PASS / FAIL of each call against the twin, bit-equal to lean's output; the names that passed."""
    twin = experts_gluon_wo_twin(c0.x, *w.wo(cell.scheme), c0.topk_ids, c0.topk_weights)
    outs, passed = {}, set()
    for key in sorted(calls, key=lambda k: k.split()[1] != "lean"):
        name = key.split()[1]
        if name in bad:
            cell.skipped[name] = "compile worker"
            print(f"FAIL  {cell.preset} M={cell.m} {cell.tag} {name}  (compile worker)", flush=True)
            FAILED.append(f"{cell.preset} M={cell.m} {cell.tag} {name}")
            continue
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


def timings(cell: OrderCell, graphs: dict, dev) -> None:
    """The order rounds (bf16, then pick / lean reversed every other round, no warm replays) and the pick / lean
    pair (each after a replay of itself, reversed every other round)."""
    first = [n for n in BF16.values() if n in graphs]  # wo4k's order: the bf16 GEMMs alone, the bf16 call

    def order(r: int, names: list) -> list:
        return first + swapped(r, ["pick", "lean"])

    if {"bf16", "pick", "lean"} <= set(graphs):
        got = settled({n: (graphs[n], NOTHING) for n in (*first, "pick", "lean")}, SETS, dev, ORDER_ROUNDS,
                      REPLAYS, order=order)
        cell.rounds.update({f"order {k}": v for k, v in got.items()})
    if {"pick", "lean"} <= set(graphs):
        got = settled({"lean": (graphs["lean"], None), "pick": (graphs["pick"], None)}, SETS, dev, ROUNDS, REPLAYS,
                      order=swapped)
        cell.rounds.update({f"pick-pair {k}": v for k, v in got.items()})


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> OrderCell:
    preset, m, scheme = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    cell, c0 = OrderCell(preset, m, scheme), inputs[0]
    cell.route = route_of(w, scheme, m, c0)
    print(f"  {preset} M={m} {cell.tag}: the route {cell.route}", flush=True)
    bad = {name for j, names in enumerate(tasks(ci)) for name in names if status.get((ci, j), "ok") != "ok"}
    calls = calls_of(w, ci)
    passed = check(cell, calls, w, c0, bad)
    timed = {k.split()[1]: v[2] for k, v in calls.items() if k.split()[1] in passed}
    if "bf16" not in bad:
        bf16 = timed_calls(s, w, Gemms(s, c0) if dev.type == "cuda" else None)  # the GEMMs alone on c0's layout
        timed.update({BF16[k]: fn for k, (_, _, fn) in bf16.items()})
    if dev.type != "cuda":  # --smoke: each timed call once, as the graphs would capture it
        for fn in timed.values():
            fn(c0)
    else:
        graphs = {k: graph_of([lambda c=c, fn=fn: fn(c) for c in inputs], dev) for k, fn in timed.items()}
        timings(cell, graphs, dev)
        del graphs
        pairs = {k: [lambda c=c, fn=timed[k]: fn(c) for c in inputs] for k in ("pick", "lean") if k in timed}
        cell.eager = {k: list(v) for k, v in eager_us(pairs, 3, 6).items()}
    print(f"[{elapsed():5.1f}s] {preset} M={m} {cell.tag}: " + "  ".join(
        f"{k} {v:.1f}" for k, v in medians(cell.rounds).items()), flush=True)
    return cell


def pair_line(c: OrderCell, label: str, name: str, peer: str) -> str:
    """``name`` against ``peer`` in the rounds ``label``: medians, peer / name, rounds >= 3% faster / slower."""
    mine, theirs = c.rounds.get(f"{label} {name}"), c.rounds.get(f"{label} {peer}")
    if not mine or not theirs:
        return f"    {label}: {name} / {peer} not timed"
    slower = sum(v >= 1.03 * p for v, p in zip(mine, theirs))
    return (f"    {label:<10} {name} {statistics.median(mine):9.1f}  {peer} {statistics.median(theirs):9.1f}  "
            f"x{statistics.median(theirs) / statistics.median(mine):5.3f}  faster {wins(mine, theirs)}/{len(mine)} "
            f"slower {slower}/{len(mine)}")


def order_line(c: OrderCell) -> str:
    """The order rounds split by which call followed the bf16 call: the pick / lean ratio each way."""
    pick, lean = c.rounds.get("order pick"), c.rounds.get("order lean")
    if not pick or not lean:
        return "    order: not timed"
    after = [p / q for p, q in zip(pick[::2], lean[::2])]  # even rounds: bf16, pick, lean
    before = [p / q for p, q in zip(pick[1::2], lean[1::2])]  # odd: bf16, lean, pick
    bf16 = statistics.median(c.rounds["order bf16"])
    return (f"    order      pick / lean with the pick after bf16: {' '.join(f'{r:.3f}' for r in after)}; with lean "
            f"after bf16: {' '.join(f'{r:.3f}' for r in before)} (bf16 {bf16:.1f})")


def rows(c: OrderCell) -> list[str]:
    out = [f"{c.preset:<14}{c.m:>5} {c.tag}  route: {c.route}", order_line(c),
           pair_line(c, "pick-pair", "pick", "lean")]
    out += [f"    eager {k}: host {h:.0f} / wall {v:.0f} µs" for k, (h, v) in c.eager.items()]
    return out


def title(ceil: dict) -> str:
    return (f"graph µs a call, copy {ceil['copy_TBps']:.2f} TB/s, mm {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; order: "
            f"{ORDER_ROUNDS} rounds without warm replays; pairs: {ROUNDS} rounds, each after a replay of itself, the "
            "order reversed every other round; faster / slower: rounds <= 0.97 x / >= 1.03 x the peer")


def main() -> int:
    dev = held_device(SMOKE, ARGS)
    procs = {} if SMOKE else {ci: spawn_workers(__file__, [[ci, j] for j in range(len(tasks(ci)))], SMOKE,
                                                f"wopk31b_{ci}") for ci in range(len(CELLS))}
    ceil = held_ceilings(dev, elapsed)
    specs = [HeldCell(ci, preset, 14.0 if preset == "deepseek-v3" else 5.0, f"{preset} M={m} {scheme}", ci,
                      f"{preset} M={m} {scheme}")
             for ci, (preset, m, scheme) in enumerate(CELLS[:1] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: [run_cell(ci, w, dev, ceil, status)], ARGS.out,
                                            "wopk31b.json", ceil, title(ceil), rows, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main(*tasks), ARGS, "wopk31b.json")

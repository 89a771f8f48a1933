"""Issue #16 target 3 (weight-only cells at M >= 1024 no slower than bf16 / 0.9: <= 1.11x moekit's bf16 cell), session
29: the swapped weight-only Gluon GEMM (``_kernels/gluon_gemm_wo_swap.py``, ``GluonWoOptions(swap=True)``: the codes
converted in wgmma's register-operand layout, the activations its shared-memory operand) against the session-27
kernel ("base"), the call that names no decode ("pick": today's variants, ``wo_options``; "prev": the pick before
session 29 where it was not the base) and the bf16 call. Swaps (SWAPS): int8 "swapf" (FAST: its conversion in inline
PTX, 5 instructions a K pair against Triton's ~8), "swapfs" (swapf split into a partition a warpgroup, each half of
the tile's weight rows, no barrier across the two; the int8 pick since CK1b); int4 "swap", "swaps" (split).

    PYTHONPATH=$PWD timeout 80 python3 benchmarks/wo4k_device_check.py --out $OUT/wo4k --deadline 62   # H200
    PYTHONPATH=$PWD timeout 80 python3 benchmarks/wo4k_device_check.py --int4 --out $OUT/wo4k --deadline 62   # int4
    PYTHONPATH=$PWD python3 benchmarks/wo4k_device_check.py --smoke [--int4]     # CPU: tiny shapes, the GEMMs faked

Cells (CELLS, each skipped past the deadline; --int4: int4's only): full ones, DeepSeek-V3 4096 int4 / int8, Mixtral
1024 int4 / int8, Qwen3 4096 int8, time the base, each swap, prev, int4's best swap on one GEMM with the pick's
variant on the other ("swaps|pick", "pick|swaps"), the GEMMs alone; light ones (Mixtral 2048, Qwen3 2048 / 1024 int8:
the M around the taken cells) the pick against the best swap, whole calls only. Compile workers run every call once
per cell while this process measures the ceilings (copy rate, dense bf16 mm) and builds the weights. Per cell: PASS /
FAIL of each variant's whole call against the torch twin (``experts_gluon_wo_twin``, rel-L2 < 1e-2) and whether it
equals the base's bit for bit; then CUDA-graph replay, every graph of the cell in ROUNDS rounds (each after a replay of
itself, in a shuffled order: ``bench_rounds.settled``): the bf16 Gluon GEMMs and the base's and each swap's gate-up
and down GEMMs alone (the first input set's layout), and the whole calls (rotated input sets); eager host / wall µs a
call of the pick and the best swap. The table (printed last):
median µs, x bf16's same part, rounds >= 3% faster than the pick (calls) or the base (GEMMs), % of the matmul rate
(2 x M*k x 3NK over the mm rate) and of the byte floor (the touched experts' stored bytes, x and out over the copy
rate). JSON <out>/wo4k.json.
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

from bench_rounds import WIN, eager_us, graph_of, medians, settled, shuffled, wins  # noqa: E402
from compile_workers import compile_one, spawn_workers  # noqa: E402
from held_run import HeldCell, HeldRun, held_ceilings, held_cells, held_device, held_entry  # noqa: E402
from wo8_variants import Gemms, Weights, pick_call, shape_of, timed_calls  # noqa: E402
from wo_device_check import packed_bytes, rel_err  # noqa: E402

from moekit.bench.cells import make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.triton_gluon_wo import (  # noqa: E402
    GluonWoGemms, GluonWoOptions, experts_gluon_wo_twin, run_experts_wo_gluon, wo_options,
)

I8, I4 = "int8_w8a16", "int4_w4a16"
_O = GluonWoOptions
# per scheme, name -> each GEMM's options (both the same): int8 "swapf" the PTX conversion, "swapfs" that split (the
# pick since CK1b; "swap", Triton's conversion, lost there everywhere: 1.39-1.86x bf16); int4 "swap", "swaps" split.
# The last (``best``) is also timed, on full int4 cells, on one GEMM with the pick's variant on the other
SWAPS = {I8: {"swapf": _O(swap=True, fast=True), "swapfs": _O(swap=True, fast=True, split=True)},
         I4: {"swap": _O(swap=True), "swaps": _O(swap=True, split=True)}}
# "prev": the pick a cell took before session 29 where it is not the base (DeepSeek-V3 int8: the base with a third
# decoded slot on the down GEMM)
PREV = {("deepseek-v3", I8): GluonWoGemms(_O(), _O(slots=3))}
if "--int4" in sys.argv:  # (the compile workers, started without it, inherit the environment)
    os.environ["WO4K_INT4"] = "1"
# (preset, M, scheme, full): a full cell times the base, each swap (the GEMMs alone too), prev, int4's mixes; a light
# one the pick against the best swap, whole calls only (the M around a taken cell). A preset's cells run together;
# --int4: int4's only
CELLS = (("deepseek-v3", 4096, I4, True), ("deepseek-v3", 4096, I8, True), ("mixtral-8x7b", 1024, I4, True),
         ("mixtral-8x7b", 1024, I8, True), ("mixtral-8x7b", 2048, I8, False), ("qwen3-30b-a3b", 4096, I8, True),
         ("qwen3-30b-a3b", 2048, I8, False), ("qwen3-30b-a3b", 1024, I8, False))
CELLS = tuple(c for c in CELLS if c[2] == I4) if os.environ.get("WO4K_INT4") == "1" else CELLS
SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 1e-2
WATCHDOG_S = 8.0
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=70.0, out=os.environ.get("OUT"))


def elapsed() -> float:
    return time.perf_counter() - T0


def best(scheme: str) -> str:
    return list(SWAPS[scheme])[-1]


def names_of(ci: int) -> list:
    """Cell ci's variants but the pick (``variants``' keys)."""
    preset, _, scheme, full = CELLS[ci]
    top = best(scheme)
    if not full:
        return [top]
    mixes = [f"{top}|pick", f"pick|{top}"] if scheme == I4 else []
    return ["base", *SWAPS[scheme], *mixes] + (["prev"] if (preset, scheme) in PREV else [])


def variants(w: Weights, ci: int) -> dict:
    """name -> both GEMMs' options: the base, each swap, prev, and int4's best on one GEMM with the pick's on the
    other (``names_of``)."""
    preset, m, scheme, _ = CELLS[ci]
    pick, top = wo_options(*w.wo(scheme), scheme, m), SWAPS[scheme][best(scheme)]
    every = {"base": GluonWoGemms(), **{k: GluonWoGemms(o, o) for k, o in SWAPS[scheme].items()},
             f"{best(scheme)}|pick": GluonWoGemms(top, pick.down), f"pick|{best(scheme)}": GluonWoGemms(pick.up, top),
             "prev": PREV.get((preset, scheme))}
    return {k: every[k] for k in names_of(ci)}


def wo_calls(w: Weights, gemms: Gemms | None, ci: int, only: tuple = ()) -> dict:
    """"<tag> <variant> <part>" -> (scheme, part, fn(inputs)): the base's and each swap's GEMMs alone on full cells
    (``gemms`` None: none), every variant's whole call, and "<tag> pick call" (``only``: those variants)."""
    _, m, scheme, full = CELLS[ci]
    out = dict(pick_call(w, scheme, m)) if not only or "pick" in only else {}
    tag = scheme.split("_")[0]
    for name, opt in variants(w, ci).items():
        if only and name not in only:
            continue
        out[f"{tag} {name} call"] = (scheme, "call", lambda c, o=opt: run_experts_wo_gluon(
            c.x, *w.wo(scheme), c.topk_ids, c.topk_weights, None, scheme, options=o))
        for part in ("up", "down") if gemms is not None and full and name in ("base", *SWAPS[scheme]) else ():
            out[f"{tag} {name} {part}"] = (scheme, part, lambda c, p=part, o=opt: gemms.wo(p, *w.wo(scheme), scheme,
                                                                                            o))
    return out


def tasks(ci: int) -> list:
    """Cell ci's compile tasks, a worker each (a variant that hangs or fails loses its task's names only): the bf16
    call (the preset's first cell only), the pick with the base, prev and the other swap, the best with its mixes;
    a light cell's pick and best together."""
    names, top = names_of(ci), best(CELLS[ci][2])
    first = next(i for i, c in enumerate(CELLS) if c[0] == CELLS[ci][0]) == ci
    if not CELLS[ci][3]:
        return [("bf16",)] * first + [("pick", *names)]
    return [("bf16",)] * first + [("pick", *[n for n in names if n != top and "|" not in n])] + [
        (top, *[n for n in names if "|" in n])]


def worker_main(ci: int, j: int) -> None:
    """Compile task j of cell ci (``compile_task``)."""
    preset, m, _, _ = CELLS[ci]
    compile_task(ci, j, preset, m, tasks(ci)[j], lambda w, task: wo_calls(w, None, ci, task), SMOKE)


def compile_task(ci: int, j: int, preset: str, m: int, task: tuple, variant_calls, smoke: bool) -> None:
    """Task j of cell ci (preset, M): its calls (bf16's for ``("bf16",)``, else ``variant_calls(w, task)``) run once
    at the real shape on uninitialised weights, printing START / OK / ERR for the main process."""
    dev = torch.device("cpu" if smoke else "cuda")
    s = shape_of(preset)
    w = Weights(s, dev, None)

    def run() -> None:
        c0 = make_sets(s, m, 1, torch.bfloat16, dev)[0]
        calls = timed_calls(s, w, None) if task == ("bf16",) else variant_calls(w, task)
        for _, _, fn in calls.values():
            fn(c0)

    compile_one(ci, j, run, smoke)


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    scheme: str
    flop_us: dict  # part -> its flops over the measured mm rate
    byte_us: dict  # part -> the touched experts' stored bytes (the call: and x, out) over the copy rate
    rounds: dict = dataclasses.field(default_factory=dict)  # timed name -> µs each round
    times: dict = dataclasses.field(default_factory=dict)  # timed name -> median µs
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> {"twin": rel-L2, "bit_equal"}
    skipped: dict = dataclasses.field(default_factory=dict)  # variant -> why
    eager: dict = dataclasses.field(default_factory=dict)  # "<tag> pick|<best> call" -> [host, wall] µs a call

    @property
    def tag(self) -> str:
        return self.scheme.split("_")[0]


def new_cell(preset: str, m: int, scheme: str, w: Weights, inputs, ceil: dict) -> Cell:
    s = shape_of(preset)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    flops = {"up": 2 * m * s.top_k * 2 * s.n * s.k, "down": 2 * m * s.top_k * s.n * s.k}
    flops["call"] = flops["up"] + flops["down"]
    w13, w2 = (touched * packed_bytes(x) for x in w.wo(scheme))
    byte = {"up": w13, "down": w2, "call": w13 + w2 + 2 * 2 * m * s.k}
    return Cell(preset, m, scheme, {k: v / (ceil["bf16_mm_TFLOPs"] * 1e6) for k, v in flops.items()},
                {k: v / (ceil["copy_TBps"] * 1e6) for k, v in byte.items()})


def check(cell: Cell, calls: dict, w: Weights, c0) -> set:
    """PASS / FAIL of each whole call against the twin (and bit-equal to the base's?); the names that passed."""
    twin = experts_gluon_wo_twin(c0.x, *w.wo(cell.scheme), c0.topk_ids, c0.topk_weights)
    base, passed = None, set()
    for key in [k for k in calls if k.endswith(" call")]:
        name = key.split()[1]
        try:
            out = calls[key][2](c0)
            base = out if name == "base" else base
            errs = {"twin": rel_err(out, twin), "bit_equal": base is not None and bool(torch.equal(out, base))}
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
            errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        cell.errors[name] = errs
        ok = "error" not in errs and errs["twin"] < TOL
        print(f"{'PASS' if ok else 'FAIL'}  {cell.preset} M={cell.m} {cell.tag} {name}  {errs}", flush=True)
        if ok:
            passed.add(name)
        else:
            FAILED.append(f"{cell.preset} M={cell.m} {cell.tag} {name}")
    return passed


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> Cell:
    preset, m, scheme, full = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    cell, c0 = new_cell(preset, m, scheme, w, inputs, ceil), inputs[0]
    gemms = Gemms(s, c0)
    timed = timed_calls(s, w, gemms if full else None)
    bad = {name: why for j, names in enumerate(tasks(ci)) for name in names
           for why in [status.get((ci, j), "ok")] if why != "ok"}
    for name, why in bad.items():  # never run here
        cell.skipped[name] = why[:160]
        print(f"FAIL  {preset} M={m} {cell.tag} {name}  (compile worker: {why[:160]})", flush=True)
        FAILED.append(f"{preset} M={m} {cell.tag} {name}")
    timed = {} if "bf16" in bad else timed
    calls = {k: v for k, v in wo_calls(w, gemms, ci).items() if k.split()[1] not in bad}
    passed = check(cell, calls, w, c0)
    timed.update({k: v for k, v in calls.items() if k.split()[1] in passed})
    if dev.type != "cuda":  # --smoke: each timed call once, as the graphs would capture it
        for _, _, fn in timed.values():
            fn(c0)
    else:
        graphs = {}
        for k, (_, part, fn) in timed.items():  # whole calls over the rotated sets, GEMMs alone on the first's layout
            graphs[k] = graph_of([lambda c=(c if part == "call" else c0), fn=fn: fn(c) for c in inputs], dev)
        # each graph after a replay of itself, in a shuffled order (session 31: timed straight after the bf16 call's
        # graph every round, as the dict's order put it, the pick read 7-16% above the same launches)
        cell.rounds = settled({k: (g, None) for k, g in graphs.items()}, len(inputs), dev, ROUNDS, REPLAYS,
                              order=shuffled)
        cell.times = medians(cell.rounds)
        pairs = {k: [lambda c=c, fn=timed[k][2]: fn(c) for c in inputs] for k in (f"{cell.tag} pick call",
                                                                                f"{cell.tag} {best(scheme)} call")
                 if k in timed}
        cell.eager = {k: list(v) for k, v in eager_us(pairs, 3, 6).items()}
        print("  eager host / wall µs a call: " + "  ".join(f"{k} {h:.0f} / {v:.0f}" for k, (h, v) in
                                                           cell.eager.items()), flush=True)
    print(f"[{elapsed():5.1f}s] {preset} M={m} {cell.tag}: " + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()),
          flush=True)
    return cell


def rows(c: Cell) -> list[str]:
    """bf16's parts, then per variant each part's µs, x bf16 and rounds >= 3% faster than the pick (calls) or the
    base (GEMMs); the call's % of the matmul rate and of the byte floor."""
    top = best(c.scheme)
    return variant_rows(c, ("pick", "prev", "base", *SWAPS[c.scheme], f"{top}|pick", f"pick|{top}"), "base")


def variant_rows(c: Cell, names: tuple[str, ...], gemm_versus: str) -> list[str]:
    """The table of ``rows``: bf16's parts, then per variant in ``names`` each part's µs, x bf16 and rounds >= 3%
    faster than the pick (calls) or variant ``gemm_versus``'s same GEMM alone; % of the matmul rate and byte floor."""
    out = [f"{c.preset:<14}{c.m:>5} {c.tag}  bf16 up / down / call: "
           + " / ".join(f"{c.times.get(f'bf16 {p}', float('nan')):.1f}" for p in ("up", "down", "call")) + " µs"]
    for name in names:
        cells = []
        for part in ("up", "down", "call"):
            t, ref = c.times.get(f"{c.tag} {name} {part}"), c.times.get(f"bf16 {part}")
            if t is None:
                continue
            versus = f"{c.tag} pick call" if part == "call" else f"{c.tag} {gemm_versus} {part}"
            won = wins(c.rounds[f"{c.tag} {name} {part}"], c.rounds.get(versus, ()))
            pct = f" {100 * c.flop_us[part] / t:3.0f}% mm {100 * c.byte_us[part] / t:3.0f}% byte"
            cells.append(f"{part} {t:8.1f} {t / ref if ref else float('nan'):5.2f}x ({won}/{ROUNDS}){pct}")
        if cells:
            out.append(f"    {name:<10}" + "  ".join(cells))
    out += [f"    eager {k}: host {h:.0f} / wall {v:.0f} µs" for k, (h, v) in c.eager.items()]
    return out


def title(ceil: dict) -> str:
    """The table's first line."""
    return (f"graph µs (median of {ROUNDS} rounds), copy {ceil['copy_TBps']:.2f} TB/s, mm "
            f"{ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; x = / bf16's same part; (n/{ROUNDS}): rounds <= {WIN} x the pick "
            "(calls) or the base (GEMMs); target: call <= 1.11x bf16")


def main() -> int:
    dev = held_device(SMOKE, ARGS)
    procs = {} if SMOKE else {ci: spawn_workers(__file__, [[ci, j] for j in range(len(tasks(ci)))], SMOKE,
                                                f"wo4k_{ci}") for ci in range(len(CELLS))}
    ceil = held_ceilings(dev, elapsed)
    specs = [HeldCell(ci, preset, 16.0 if preset == "deepseek-v3" else 6.0, f"{preset} M={m} {scheme}", ci,
                      f"{preset} {scheme}") for ci, (preset, m, scheme, _) in enumerate(CELLS[:2] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: [run_cell(ci, w, dev, ceil, status)], ARGS.out,
                                            "wo4k.json", ceil, title(ceil), rows, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main(*tasks), ARGS, "wo4k.json",
               ("--int4", "int4_w4a16 cells (groups 128): base, swap, swaps"))

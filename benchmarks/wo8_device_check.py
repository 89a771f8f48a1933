"""Issue #16 target 3 (weight-only cells at M >= 1024 no slower than bf16 / 0.9: <= 1.11x moekit's bf16 cell), session
28: the weight-only Gluon GEMMs' variants (``wo8_variants.OPTIONS``: "split", two MMA warpgroups each owning half of
the tile's columns with barriers of their own; "fast", the decode in inline PTX on int32 words; "slots3", a third
decoded slot: two steps of MMAs in flight during a decode; their sums; "UP|DOWN", the gate-up GEMM's and the down
GEMM's variants apart) against the session-27 kernel ("base"), the call that names no decode ("pick") and the bf16
Gluon GEMMs on the same layout.

    PYTHONPATH=$PWD timeout 58 python3 benchmarks/wo8_device_check.py --out $OUT/wo8 --deadline 46   # H200, <= 60 s
    PYTHONPATH=$PWD timeout 44 python3 benchmarks/wo8_device_check.py --winners --out $OUT/wo8 --deadline 33  # CK2
    PYTHONPATH=$PWD python3 benchmarks/wo8_device_check.py --smoke [--winners]   # CPU: tiny shapes, GEMMs faked

Cells (``wo8_variants.CELLS``): Mixtral int8 / int4 / mxfp4 M = 1024, DeepSeek-V3 4096 (the three), Mixtral 4096,
Qwen3 int8 / int4 4096 (skipped past the deadline). Compile workers run every call once per preset while this process
measures the ceilings (copy rate, dense bf16 mm) and builds the weights. Then per cell:
  - decode exactness (the first cell): the down GEMM on one-hot rows returns the decoded weights themselves; each
    variant's bf16 bits against the base's and against ``dequantize_wo`` rounded to bf16 (random scales, zeros, e8m0
    100 .. 150), mismatches counted;
  - PASS / FAIL of each variant's whole call against the torch twin (``experts_gluon_wo_twin``, rel-L2 < 1e-2), and
    whether it equals the base's bit for bit;
  - CUDA-graph replay, every graph of the cell interleaved in ROUNDS rounds: bf16's and each variant's gate-up GEMM
    alone, down GEMM alone (the first input set's layout) and whole call (rotated input sets; bf16's: moekit's
    default bf16 call). Median µs, x bf16 (the same part), rounds >= 3% faster than the base and than the pick, % of
    the matmul rate (2 x M*k x 3NK over the mm rate) and of the byte floor (the touched experts' stored bytes over
    the copy rate).
The table is printed last; JSON <out>/wo8.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from functools import partial

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import WIN, eager_us, graph_of, interleaved, medians, wins  # noqa: E402
from compile_workers import compile_one, spawn_workers  # noqa: E402
from held_run import HeldCell, HeldRun, held_ceilings, held_cells, held_device, held_entry  # noqa: E402
from wo8_exact import decode_mismatches  # noqa: E402
from wo8_variants import (  # noqa: E402
    CELLS, WINNERS, Gemms, Weights, options_of, pick_call, shape_of, timed_calls, wo_calls,
)
from wo_device_check import packed_bytes, rel_err  # noqa: E402

from moekit.bench.cells import make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.triton_gluon_wo import experts_gluon_wo_twin  # noqa: E402

SETS, ROUNDS, REPLAYS, TOL = 2, 5, 3, 1e-2
WATCHDOG_S = 8.0
T0 = time.perf_counter()
FAILED: list[str] = []
ARGS = argparse.Namespace(deadline=70.0, out=os.environ.get("OUT"))


def elapsed() -> float:
    return time.perf_counter() - T0


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    flop_us: dict  # part -> its flops over the measured mm rate
    byte_us: dict  # "<scheme> <part>" -> the touched experts' stored bytes (and x, out) over the copy rate
    rounds: dict = dataclasses.field(default_factory=dict)  # timed name -> µs each round
    times: dict = dataclasses.field(default_factory=dict)  # timed name -> median µs
    errors: dict = dataclasses.field(default_factory=dict)  # "<scheme> <variant>" -> {"twin": rel-L2, "bit_equal"}
    exact: dict = dataclasses.field(default_factory=dict)  # "<scheme> <variant>" -> decode mismatches
    skipped: dict = dataclasses.field(default_factory=dict)  # timed name -> why
    eager: dict = dataclasses.field(default_factory=dict)  # --winners: "<scheme> pick|prev call" -> [host, wall] µs


def tasks_of(preset: str) -> list:
    """A preset's compile tasks (its first cell's index, "bf16" or a scheme, the variants): bf16, then per scheme its
    variants in two halves."""
    ci = next(i for i, c in enumerate(CELLS) if c[0] == preset)
    names = {sc: list(options_of(sc)) for sc in CELLS[ci][2]}
    return [(ci, "bf16", [])] + [(ci, sc, part) for sc, ns in names.items()
                                 for part in (ns[:len(ns) // 2], ns[len(ns) // 2:])]


def worker_main(preset: str, todo: list) -> None:
    """Compile: each of ``tasks_of(preset)``'s tasks ``todo`` runs its calls once at the real shape on uninitialised
    weights (START / OK / ERR lines name the task's index)."""
    dev = torch.device("cpu" if SMOKE else "cuda")
    tasks = tasks_of(preset)
    for j in todo:
        ci, what, names = tasks[j]
        s = shape_of(preset)
        compile_one(ci, j, partial(_compile_task, s, Weights(s, dev, None), dev, ci, what, names), SMOKE)


def _compile_task(s, w: Weights, dev, ci: int, what: str, names: list) -> None:
    """One task's calls, once: ``what``'s (bf16's, or a scheme's ``names``, the pick and prev with ``base``)."""
    c0 = make_sets(s, CELLS[ci][1], 1, torch.bfloat16, dev)[0]
    gemms = Gemms(s, c0)
    calls = timed_calls(s, w, gemms) if what == "bf16" else wo_calls(s, w, gemms, what)
    if "base" in names:  # the call that names no decode (and --winners' prev): its kernels too
        calls.update(pick_call(w, what, CELLS[ci][1]))
        names = names + ["pick", "prev"]
    for key, (_, _, fn) in calls.items():
        if what == "bf16" or key.split()[1] in names:
            fn(c0)


def start_workers() -> dict:
    """preset -> its workers, one a task (``tasks_of``), each ``wo8_device_check.py --worker PRESET [INDEX]``."""
    procs = {}
    for preset in dict.fromkeys(c[0] for c in CELLS):
        parts = [[preset, [j]] for j in range(len(tasks_of(preset)))]
        procs[preset] = spawn_workers(__file__, parts, SMOKE, f"wo8_{preset}")
    return procs


def failed_compiles(preset: str, scheme: str, status: dict) -> dict:
    """variant -> its compile worker's failure, for ``preset``'s tasks of ``scheme`` (``collect_workers``' status)."""
    return {name: v for j, (ci, what, names) in enumerate(tasks_of(preset)) if what == scheme
            for v in [status.get((ci, j), "ok")] if v != "ok" for name in names}


def new_cell(preset: str, m: int, schemes: tuple, w: Weights, inputs, ceil: dict) -> Cell:
    s = shape_of(preset)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    flops = {"up": 2 * m * s.top_k * 2 * s.n * s.k, "down": 2 * m * s.top_k * s.n * s.k}
    flops["call"] = flops["up"] + flops["down"]
    byte = {}
    for sc in schemes:
        w13, w2 = (touched * packed_bytes(x) for x in w.wo(sc))
        for part, n in (("up", w13), ("down", w2), ("call", w13 + w2 + 2 * 2 * m * s.k)):
            byte[f"{sc.split('_')[0]} {part}"] = n / (ceil["copy_TBps"] * 1e6)
    return Cell(preset, m, {k: v / (ceil["bf16_mm_TFLOPs"] * 1e6) for k, v in flops.items()}, byte)


def check(cell: Cell, scheme: str, calls: dict, weights: tuple, c0, names) -> set:
    """PASS / FAIL of each variant of ``names`` (the base first): its whole call against the twin, and whether it
    equals the base's bit for bit. Returns the variants that passed."""
    tag = scheme.split("_")[0]
    twin = experts_gluon_wo_twin(c0.x, *weights, c0.topk_ids, c0.topk_weights)
    base, passed = None, set()
    for name in names:
        try:
            out = calls[f"{tag} {name} call"][2](c0)
            base = out if base is None else base
            errs = {"twin": rel_err(out, twin), "bit_equal": bool(torch.equal(out, base))}
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
            errs = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        cell.errors[f"{tag} {name}"] = errs
        ok = "error" not in errs and errs["twin"] < TOL
        print(f"{'PASS' if ok else 'FAIL'}  {cell.preset} M={cell.m} {tag} {name}  {errs}", flush=True)
        if ok:
            passed.add(name)
        else:
            FAILED.append(f"{cell.preset} M={cell.m} {tag} {name}")
    return passed


def run_cell(ci: int, w: Weights, dev, ceil: dict, status: dict) -> Cell:
    preset, m, schemes = CELLS[ci]
    s = shape_of(preset)
    inputs = make_sets(s, m, 1 if SMOKE else SETS, torch.bfloat16, dev, seed=m)
    cell, c0 = new_cell(preset, m, schemes, w, inputs, ceil), inputs[0]
    gemms = Gemms(s, c0)
    timed = timed_calls(s, w, gemms)
    bad = {sc: failed_compiles(preset, sc, status) for sc in schemes}  # variants whose compile worker failed or hung
    for sc, names in bad.items():
        for name, why in names.items():  # never run here
            cell.skipped[f"{sc} {name}"] = why[:160]
            print(f"FAIL  {preset} M={m} {sc} {name}  (compile worker: {why[:160]})", flush=True)
            FAILED.append(f"{preset} M={m} {sc} {name}")
    runs = {sc: [k for k in options_of(sc) if k not in bad[sc]] for sc in schemes}
    if ci == 0:  # the down GEMM of each plain variant
        cell.exact = decode_mismatches(s, dev, {sc: {k: options_of(sc)[k].down for k in names if "|" not in k}
                                                for sc, names in runs.items() if "base" in names})
        print(f"decode mismatches (vs base, vs dequantize): {cell.exact}", flush=True)
    for sc in schemes:
        calls = wo_calls(s, w, gemms, sc)
        if "base" in runs[sc]:
            calls.update(pick_call(w, sc, m))
        passed = check(cell, sc, calls, w.wo(sc), c0, runs[sc] + [k.split()[1] for k in calls if "base" in runs[sc]
                                                                  and k.split()[1] in ("pick", "prev")])
        timed.update({k: v for k, v in calls.items() if k.split()[1] in passed})
    if dev.type == "cuda":
        graphs = {}
        for k, (_, part, fn) in timed.items():  # whole calls over the rotated sets, GEMMs alone on the first's layout
            fns = [lambda c=(c if part == "call" else c0), fn=fn: fn(c) for c in inputs]
            graphs[k] = graph_of(fns, dev)
        cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS)
        cell.times = medians(cell.rounds)
        if WINNERS and ci == 0:  # the new cells: the default's plain launches against the decode it replaced, eager
            pairs = {k: [lambda c=c, fn=timed[k][2]: fn(c) for c in inputs] for k in timed
                     if k.split()[1] in ("pick", "prev")}
            cell.eager = {k: list(v) for k, v in eager_us(pairs, 3, 6).items()}
            print(f"  eager host / wall µs a call: " + "  ".join(f"{k} {h:.0f} / {w:.0f}"
                                                               for k, (h, w) in cell.eager.items()), flush=True)
    print(f"[{elapsed():5.1f}s] {preset} M={m}: " + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()),
          flush=True)
    return cell


def rows(c: Cell) -> list[str]:
    """Per scheme and variant: each part's µs, x bf16 and rounds >= 3% faster than the base; the call's % of the
    matmul rate and of the scheme's byte floor."""
    out = [f"{c.preset:<14}{c.m:>5}  bf16 up / down / call: "
           + " / ".join(f"{c.times.get(f'bf16 {p}', float('nan')):.1f}" for p in ("up", "down", "call")) + " µs"]
    for key in dict.fromkeys(k.rsplit(" ", 1)[0] for k in c.times if not k.startswith("bf16")):
        tag = key.split()[0]
        cells = []
        for part in ("up", "down", "call"):
            t, ref = c.times.get(f"{key} {part}"), c.times.get(f"bf16 {part}")
            base = c.rounds.get(f"{tag} base {part}", ())
            if t is None:
                cells.append(f"{part} -")
                continue
            won = wins(c.rounds[f"{key} {part}"], base)
            cells.append(f"{part} {t:8.1f} {t / ref if ref else float('nan'):5.2f}x ({won}/{ROUNDS})")
        call, pick = c.times.get(f"{key} call"), c.rounds.get(f"{tag} pick call", ())
        vs_pick = wins(c.rounds.get(f"{key} call", ()), pick)
        pct = (f"  {100 * c.flop_us['call'] / call:3.0f}% mm {100 * c.byte_us[f'{tag} call'] / call:3.0f}% byte"
               f"  vs pick {vs_pick}/{ROUNDS}" if call else "")
        out.append(f"    {key:<18}" + "  ".join(cells) + pct)
    return out


def title(ceil: dict) -> str:
    """The table's first line."""
    return (f"graph µs (median of {ROUNDS} rounds), copy {ceil['copy_TBps']:.2f} TB/s, mm "
            f"{ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s; x = / bf16's same part; (n/{ROUNDS}): rounds <= {WIN} x the base "
            "(vs pick: x the call that names no decode); target: call <= 1.11x bf16")


def main() -> int:
    dev = held_device(SMOKE, ARGS)
    procs = {} if SMOKE else start_workers()
    ceil = held_ceilings(dev, elapsed)
    specs = [HeldCell(ci, preset, 4.0 if WINNERS else 16.0 if preset == "deepseek-v3" else 6.0, f"{preset} M={m}",
                      preset, preset) for ci, (preset, m, _) in enumerate(CELLS[:1] if SMOKE else CELLS)]
    return held_cells(specs, procs, HeldRun(ARGS.deadline, elapsed, FAILED, dev, lambda p: Weights(shape_of(p), dev, 1),
                                            lambda ci, w, status: [run_cell(ci, w, dev, ceil, status)], ARGS.out,
                                            "wo8.json", ceil, title(ceil), rows, None if SMOKE else WATCHDOG_S))


if __name__ == "__main__":
    held_entry(main, lambda tasks: worker_main(*tasks), ARGS, "wo8.json",
               ("--winners", "the taken variants' calls only (wo8_variants)"))

"""Issue 19 at the ridge (branch `mid7`): bf16 Mixtral-8x7B M = 512 / 1024 and Qwen3-30B-A3B M = 1024 / 512 against
90% of the floor: where each call's time goes (the route, its Gluon tiles, each part alone; the half-tile and wide
Gluon GEMMs it measured at checkpoints 1, 1b, 1c were removed after the merged run: ``triton-notes.md``).

    PYTHONPATH=$PWD timeout 75 python3 benchmarks/mid7_device_check.py --out $OUT/mid7 --deadline 64   # H200

First compile workers (this script with ``--worker``) run every call and part once at the real shapes (zero weights)
to fill Triton's cache; then the ceilings (the bench's own: copy, bf16 mm 8192^3). Per cell (the bench's weights,
two uniform routing sets; ``mid7_variants`` names every call):
  1. correctness: every whole call on set 0 against the Gluon path's torch twin (``experts_gluon_twin``; rel L2 <
     5e-3 for the Gluon calls, < 1e-2 for the route), PASS / FAIL; a failing call is not timed;
  2. whole calls: CUDA-graph replay over both sets (``time_calls(graph=True)``, as the bench at M <= 1024), ROUNDS
     interleaved rounds, median; x the route and the rounds >= 3% faster than the route's; % of the floor
     (``cell_model``: max(bytes / copy, FLOPs / mm) on this run's ceilings);
  3. parts alone (graph replay, PART_ROUNDS rounds, median): each GEMM at g128 / balanced routing, the
     probes (loads only, MMAs only), layout, combine, cuBLAS bmm; per GEMM its touched weight bytes / µs against copy
     and its FLOPs / µs against mm on the real rows and on the rows it multiplies (padding included).
Prints as it goes, JSON to ``--out``/mid7.json after each cell, the table LAST. Exit 1 when a check fails. A watchdog
ends the run (the table so far printed) when nothing was logged for 25 s (a kernel that hangs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rounds import faster_rounds, rotated_rounds  # noqa: E402
from bench_run import RunLog, ceilings, rel_l2  # noqa: E402

CELLS = ("mixtral-8x7b:512", "mixtral-8x7b:1024", "qwen3-30b-a3b:1024", "qwen3-30b-a3b:512")
ROUNDS, PART_ROUNDS = 5, 3
WORKERS_PER_CELL = 4
RUN = RunLog("bf16, H200: whole calls (graph replay, median of rounds; x = route µs / variant µs, rounds >= 3% "
             "faster than the route), then parts alone", stall_s=25.0)
RESULTS: dict = {"cells": []}
T0, FAILED, SUMMARY, log = RUN.t0, RUN.failed, RUN.summary, RUN.log


def cell_inputs(spec: str, dev, zeros: bool = False) -> dict:
    """Shape, weights (``zeros``: for compiling only), two routing sets and balanced routing of a cell."""
    from prefill_variants import balanced_routing

    from moekit.bench.cells import ExpertWeights, Shape, make_sets, make_weights

    preset, m = spec.split(":")
    s, m = Shape.from_preset(preset), int(m)
    if zeros:
        w = ExpertWeights(torch.zeros(s.num_experts, 2 * s.n, s.k, device=dev, dtype=torch.bfloat16),
                          torch.zeros(s.num_experts, s.k, s.n, device=dev, dtype=torch.bfloat16))
    else:
        w = make_weights(s, torch.bfloat16, dev)
    sets = make_sets(s, m, 2, torch.bfloat16, dev)
    return {"s": s, "m": m, "w": w, "sets": sets, "balanced": balanced_routing(m, s.num_experts, s.top_k, dev)[0]}


def calls_of(c: dict) -> tuple[list, dict]:
    """(whole-call variants, {part: call}) of a cell's inputs."""
    import mid7_variants as mv

    s0, w = c["sets"][0], c["w"]
    parts = mv.part_calls(s0.x, s0.topk_ids, s0.topk_weights, w.w13, w.w2, c["m"], c["s"].top_k, c["balanced"])
    return mv.whole_variants(w.w13, w.w2, c["m"], c["s"].top_k), parts


def wanted(name: str, only: set) -> bool:
    """Whether a whole-call variant is timed (``--only``; route and g128 always)."""
    return not only or name in ("route", "g128") or name in only


def worker_main(ci: int, slot: int) -> None:
    """Run this worker's share (index % WORKERS_PER_CELL == slot) of cell ci's calls once (Triton's disk cache)."""
    dev = torch.device("cuda")
    c = cell_inputs(CELLS[ci], dev, zeros=True)
    variants, parts = calls_of(c)
    s0 = c["sets"][0]
    only = set(filter(None, os.environ.get("MID7_ONLY", "").split(",")))  # --only, from the main process
    items = [(v.name, lambda v=v: v.call(s0.x, s0.topk_ids, s0.topk_weights)) for v in variants
             if wanted(v.name, only)] + list(parts.items())
    for name, fn in items[slot::WORKERS_PER_CELL]:
        print(f"START {CELLS[ci]} {name}", flush=True)
        try:
            fn()
            torch.cuda.synchronize()
            print(f"OK {CELLS[ci]} {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 (reported; the main process reports it again)
            print(f"ERR {CELLS[ci]} {name}: {type(exc).__name__}: {str(exc)[-300:]}", flush=True)


def start_workers(cells: list) -> list:
    import subprocess

    procs = []
    for spec in cells:
        for slot in range(WORKERS_PER_CELL):
            logf = open(f"/tmp/mid7_worker_{os.getpid()}_{CELLS.index(spec)}_{slot}.log", "w")
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(CELLS.index(spec)), str(slot)],
                                          stdout=logf, stderr=subprocess.STDOUT))
    return procs


def wait_workers(procs: list, until_s: float) -> set:
    """Wait for the compile workers (killed at ``until_s``); returns {"cell name"} of the calls a worker started and
    did not finish OK (a hang, a crash, an error that may have broken its CUDA context): the main process does not
    run those, except the route and g128 (the baselines)."""
    import subprocess

    for p in procs:
        try:
            p.wait(timeout=max(0.1, until_s - (time.perf_counter() - T0)))
        except subprocess.TimeoutExpired:
            p.kill()
    bad, started, ok = [], set(), set()
    for f in Path("/tmp").glob(f"mid7_worker_{os.getpid()}_*.log"):
        for ln in f.read_text(errors="replace").splitlines():
            head, _, rest = ln.partition(" ")
            if head == "START":
                started.add(rest)
            elif head == "OK":
                ok.add(rest)
            elif head == "ERR":
                bad.append(ln)
    hung = {item for item in started - ok if item.split(" ", 1)[1] not in ("route", "g128")}
    log(f"compile workers done; errors: {bad or 'none'}; not finished OK (not run): {sorted(hung) or 'none'}"[:2000])
    return hung


def check(name: str, v, s0, ref, outs: dict) -> bool:
    """PASS / FAIL against the twin; the Gluon variants also say whether they equal g128 bit for bit."""
    try:
        out = v.call(s0.x, s0.topk_ids, s0.topk_weights)
        torch.cuda.synchronize()
        err = rel_l2(out, ref)
        outs[v.name] = out
        if v.name not in ("route", "g128") and "g128" in outs:
            log(f"{name} {v.name}: bit-equal to g128 {torch.equal(out, outs['g128'])}")
    except Exception as exc:  # noqa: BLE001 (a variant that fails is reported, the rest go on)
        log(f"FAIL {name} {v.name}: {type(exc).__name__}: {str(exc)[-600:]}")
        FAILED.append(f"{name} {v.name}")
        return False
    ok = err < v.tolerance
    log(f"{'PASS' if ok else 'FAIL'} {name} {v.name}: rel L2 vs the Gluon twin {err:.2e} (< {v.tolerance:g})")
    if not ok:
        FAILED.append(f"{name} {v.name}")
    return ok


def graph_us(fns: list, dev, budget_s: float) -> float:
    from moekit.bench.timing import time_calls

    return time_calls(fns, dev, graph=True, budget_s=budget_s, min_reps=3, max_reps=40)


def rounds_of(name: str, calls: dict, dev, rounds: int, budget_s: float, stop_at: float) -> dict:
    """{label: [µs per round]}: the calls interleaved, each round starting one further along; a call that fails is
    reported and not run again."""

    def measure(k: str):
        try:
            return graph_us(calls[k], dev, budget_s)
        except Exception as exc:  # noqa: BLE001 (a part that fails is reported, the rest go on)
            log(f"FAIL {name} {k}: {type(exc).__name__}: {str(exc)[-300:]}")
            FAILED.append(f"{name} {k}")
            return None

    return rotated_rounds(name, list(calls), rounds, measure, lambda r: r >= 2 and time.perf_counter() - T0 > stop_at,
                          log)


def padded_rows(x, ids, num_experts: int) -> int:
    """Rows the 128-aligned layout multiplies (syncs once)."""
    from moekit.experts.triton_gluon import gluon_layout

    return int(gluon_layout(x, ids, num_experts).rows_used[0])


def run_cell(spec: str, dev, ceil: dict, args) -> None:
    from moekit.bench.cells import cell_model, measured_experts_touched
    from moekit.experts.triton_gluon import experts_gluon_twin

    c = cell_inputs(spec, dev)
    s, m, w, sets = c["s"], c["m"], c["w"], c["sets"]
    s0, name = sets[0], spec
    touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
    model = cell_model(s, m, touched, 2, ceil["copy_TBps"], ceil["bf16_mm_TFLOPs"])
    rows = padded_rows(s0.x, s0.topk_ids, s.num_experts)
    cell = {"cell": spec, "floor_us": model.floor_us, "flops": model.flops, "bytes": model.bytes, "touched": touched,
            "rows_multiplied": rows, "assignments": m * s.top_k}
    log(f"{name}: floor {model.floor_us:.1f} us (bytes {model.bytes / 1e9:.3f} GB, {model.flops / 1e9:.1f} GFLOP), "
        f"90% needs <= {model.floor_us / 0.9:.1f} us; rows multiplied per real row {rows / (m * s.top_k):.3f} "
        f"({rows // 128} row blocks)")
    variants, parts = calls_of(c)
    variants = [v for v in variants if f"{spec} {v.name}" not in args.hung and wanted(v.name, args.only)]
    parts = {k: f for k, f in parts.items() if f"{spec} {k}" not in args.hung}
    ref = experts_gluon_twin(s0.x, w.w13, w.w2, s0.topk_ids, s0.topk_weights)
    outs: dict = {}
    passing = [v for v in variants if check(name, v, s0, ref, outs)]
    del ref, outs
    share = (args.deadline - (time.perf_counter() - T0)) / max(1, len(args.cells) - len(RESULTS["cells"]))
    stop = time.perf_counter() - T0 + 0.65 * share
    whole = {v.name: [lambda v=v, t=t: v.call(t.x, t.topk_ids, t.topk_weights) for t in sets] for v in passing}
    cell["rounds_us"] = rounds_of(name, whole, dev, args.rounds, 0.015, stop)
    part_fns = {k: [f] for k, f in parts.items()}
    cell["parts_us"] = rounds_of(f"{name} parts", part_fns, dev, PART_ROUNDS, 0.006, stop + 0.3 * share)
    RESULTS["cells"].append(cell)
    (args.out / "mid7.json").write_text(json.dumps({**RESULTS, "failed": FAILED}, indent=1))
    summarize(cell, s, ceil)


def part_rates(label: str, us: float, cell: dict, s, ceil: dict) -> str:
    """A GEMM part's % of copy (its touched weights once) and % of mm (real rows; rows multiplied)."""
    gemm = label.split()[0]
    if gemm not in ("up", "down") or "layout" in label:
        return ""
    share = 2 / 3 if gemm == "up" else 1 / 3
    wbytes = cell["touched"] * (2 if gemm == "up" else 1) * s.n * s.k * 2
    real = share * cell["flops"] / (us * 1e-6) / 1e12 / ceil["bf16_mm_TFLOPs"]
    pad = 1.0 if "balanced" in label or "bmm" in label else cell["rows_multiplied"] / cell["assignments"]
    return (f" {100 * wbytes / (us * 1e-6) / 1e12 / ceil['copy_TBps']:5.1f}% copy, {100 * real:5.1f}% mm real rows, "
            f"{100 * real * pad:5.1f}% mm multiplied")


def summarize(cell: dict, s, ceil: dict) -> None:
    rounds = cell.get("rounds_us", {})
    SUMMARY.append(f"{cell['cell']}: floor {cell['floor_us']:.1f} us, 90% needs <= {cell['floor_us'] / 0.9:.1f}; "
                   f"rows per real row {cell['rows_multiplied'] / cell['assignments']:.3f}")
    base = rounds.get("route")
    for n, t in rounds.items():
        med = statistics.median(t)
        vs = ""
        if base and n != "route":
            wins = faster_rounds(t, base)
            vs = f" x{statistics.median(base) / med:5.3f} ({wins}/{min(len(t), len(base))} rounds >= 3%)"
        SUMMARY.append(f"  {n:14s} {med:8.1f} us [{min(t):.0f}-{max(t):.0f}] {100 * cell['floor_us'] / med:5.1f}% "
                       f"floor{vs}")
    for n, t in cell.get("parts_us", {}).items():
        med = statistics.median(t)
        SUMMARY.append(f"  alone {n:14s} {med:8.1f} us{part_rates(n, med, cell, s, ceil)}")
    for line in SUMMARY[-(len(rounds) + len(cell.get('parts_us', {})) + 1):]:
        print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=70.0, help="no new timing after this many seconds")
    parser.add_argument("--worker-deadline", type=float, default=28.0, help="compile workers killed after this")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--only", type=lambda t: set(t.split(",")), default=set(),
                        help="comma-separated whole-call variants to time besides route and g128 (default: all)")
    args = parser.parse_args()
    args.deadline -= 4.0  # the table and JSON after the last timing
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    os.environ["MID7_ONLY"] = ",".join(sorted(args.only))  # the compile workers' share
    procs = start_workers(args.cells)
    import triton

    args.hung = wait_workers(procs, args.worker_deadline)  # before the ceilings: the workers' kernels share the GPU
    threading.Thread(target=RUN.watchdog, kwargs={"poll_s": 1.0}, daemon=True).start()
    ceil = ceilings(dev)
    RESULTS.update(ceilings=ceil, device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__)
    log(f"ceilings: {ceil}; torch {torch.__version__}, triton {triton.__version__}")
    for spec in args.cells:
        if time.perf_counter() - T0 > args.deadline:
            SUMMARY.append(f"{spec}: not reached (deadline)")
            continue
        try:
            run_cell(spec, dev, ceil, args)
        except Exception as exc:  # noqa: BLE001 (one cell's failure is reported, the others still run)
            log(f"FAIL {spec}: {type(exc).__name__}: {str(exc)[-800:]}")
            FAILED.append(spec)
        torch.cuda.empty_cache()
    RUN.print_table()
    return 1 if FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        sys.exit(main())

"""Issues 15 and 19 at the ridge (branch `ovl`): what the H200 can do at all where a cell's weight stream and its
tensor work take similar times. Per cell, the bound kernel (``ovl_kernels``: exactly the cell's weight bytes, read
once, and exactly its real rows' MMAs, one program an SM, stream-K balanced), its loads alone and its MMAs alone,
moekit's own call (the bench's route) and cuBLAS on the same rows per expert, against the bench's floor and the
issue's target.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/ovl_device_check.py --out $OUT/ovl --deadline 70      # H200

1. Compile workers (this script with ``--worker``) run every bound configuration once on small weights (the
   kernel's counts are not specialized: one compile a tile) and the route once at each cell's real shape.
2. Ceilings in this run (copy, bf16 mm 8192^3, fp8 mm when an fp8 cell runs) and the bf16 mm's SM clock / power.
3. Per cell (bf16 cells first): every call checked (PASS / FAIL: the bound against ``ovl_plan``'s twins on
   programs 0 and G - 1, the route against the Gluon path's twin, cuBLAS's up GEMM against float32), then timed in
   CUDA-graph replay, all calls interleaved in each of ROUNDS rounds (medians); the SM clock and board power while
   the best bound and the route replay (``mid_tile_clocks``).
Table LAST: floor (the bench's byte model on this run's ceilings), target (90% of the floor at M <= 1024; 70% of
the bf16 / 60% of the fp8 mm rate above), the best bound (% floor, % mm), loads / MMAs alone, the route, and the
verdict: target above the bound (unreachable on this GPU), or how far the route trails the bound. JSON to
``--out``/ovl.json after each cell. A watchdog ends the run (table so far) after 25 s without a log line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import ovl_cells as oc  # noqa: E402
from bench_run import RunLog, ceilings  # noqa: E402

DEFAULT_CELLS = oc.CELLS[:6]
ROUNDS = 5
RUN = RunLog("ovl, H200: the bound kernel against the floor, the target and the route (graph replay, medians of "
             "the rounds)", stall_s=25.0)
RESULTS: dict = {"cells": []}
log = RUN.log


def compile_jobs(cells: list) -> list:
    """(cell spec, config name or "route") of every call a run makes, each bound tile once."""
    jobs, seen = [], set()
    for spec in cells:
        dtype, preset, m = spec.split(":")
        for cfg in oc.bound_cfgs(dtype):
            key = (dtype, cfg, tile_tokens(preset, int(m), cfg))
            if key not in seen:
                seen.add(key)
                jobs.append((spec, cfg.name))
        jobs.append((spec, "route"))
    return jobs


def tile_tokens(preset: str, m: int, cfg) -> tuple:
    from moekit.bench.cells import Shape

    s = Shape.from_preset(preset)
    p = oc.op.plan_for(s.num_experts, s.n, s.k, m * s.top_k, 64 * cfg.consumers, cfg.block_k, cfg.tn, 1)
    return p.tn, p.nchunk


def worker_main(slot: int, workers: int, cells: list) -> None:
    """Run this worker's share of the compile jobs once: bound tiles on small weights, routes at real shapes."""
    dev = torch.device("cuda")
    for spec, name in compile_jobs(cells)[slot::workers]:
        print(f"START {spec} {name}", flush=True)
        try:
            dtype, preset, m = spec.split(":")
            if name == "route":
                oc.route_call(oc.cell_inputs(spec, dev, empty=True), check=False)
            else:
                cfg = next(c for c in oc.bound_cfgs(dtype) if c.name == name)
                small_bound(dtype, preset, int(m), cfg, dev)
            torch.cuda.synchronize()
            print(f"OK {spec} {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 (reported; the main process meets it again)
            print(f"ERR {spec} {name}: {type(exc).__name__}: {str(exc)[-300:]}", flush=True)
        torch.cuda.empty_cache()


def small_bound(dtype: str, preset: str, m: int, cfg, dev) -> None:
    """The bound's tile at this cell (same T, TN, chunks) on two experts N = K = 1024."""
    from moekit.bench.cells import Shape

    s = Shape.from_preset(preset)
    tokens = oc.op.plan_for(s.num_experts, s.n, s.k, m * s.top_k, 64, cfg.block_k, 8, 1).tokens
    wdt = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    small = oc.Cell("small", dtype, Shape("small", 2, 1024, 1024, 1), 2 * tokens,
                    torch.zeros(2, 2048, 1024, device=dev, dtype=wdt), torch.zeros(2, 1024, 1024, device=dev,
                                                                                   dtype=wdt))
    oc.bound_call(small, cfg, 4, check=False).fns[0]()


def run_workers(cells: list, workers: int, until_s: float) -> set:
    """Run the compile workers (killed at ``until_s``); the bound jobs that did not finish OK (a hang, a crash:
    the main process does not launch those), as ``job_key``s."""
    tag = f"/tmp/ovl_worker_{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(workers), *cells],
                              stdout=open(f"{tag}_{i}.log", "w"), stderr=subprocess.STDOUT) for i in range(workers)]
    for p in procs:
        try:
            p.wait(timeout=max(0.1, until_s - RUN.elapsed()))
        except subprocess.TimeoutExpired:
            p.kill()
    lines = [ln for i in range(workers) for ln in Path(f"{tag}_{i}.log").read_text(errors="replace").splitlines()]
    started = {ln[6:] for ln in lines if ln.startswith("START ")}
    done = {ln[3:] for ln in lines if ln.startswith("OK ")}
    errs = [ln for ln in lines if ln.startswith("ERR ")]
    log(f"compile workers: {len(done)} of {len(started)} started OK; errors {errs or 'none'}; not finished "
        f"{sorted(started - done) or 'none'}"[:1500])
    return {job_key(*ln.split(" ", 1)) for ln in started - done if not ln.endswith(" route")}


def job_key(spec: str, name: str) -> tuple:
    """A bound job's compile: (dtype, config name, (TN, chunks) at the cell)."""
    dtype, preset, m = spec.split(":")
    cfg = next(c for c in oc.bound_cfgs(dtype) if c.name == name)
    return dtype, name, tile_tokens(preset, int(m), cfg)


def floor_target(c: oc.Cell, ceil: dict) -> dict:
    """The bench's byte model (touched experts measured on the sets) on this run's ceilings, and the issue's target
    time: floor / 0.9 at M <= 1024, else FLOPs at 70% (bf16) / 60% (fp8) of the mm rate."""
    from moekit.bench.cells import cell_model, measured_experts_touched

    s = c.shape
    touched = statistics.mean(measured_experts_touched(ids, s.num_experts) for _, ids, _ in c.sets)
    fp8 = c.dtype == "fp8"
    mm = ceil["fp8_mm_TFLOPs"] if fp8 else ceil["bf16_mm_TFLOPs"]
    expert = s.expert_bytes(1) + 4 * 3 * (s.n // 128) * (s.k // 128) if fp8 else None
    model = cell_model(s, c.m, touched, 2, ceil["copy_TBps"], mm, expert)
    target = model.floor_us / 0.9 if c.m <= 1024 else model.flops / ((0.6 if fp8 else 0.7) * mm * 1e12) * 1e6
    return {"floor_us": model.floor_us, "target_us": target, "flops": model.flops, "bytes": model.bytes,
            "touched": touched, "mm_TFLOPs": mm, "copy_TBps": ceil["copy_TBps"]}


def timed_rounds(calls: dict, rounds: int, stop_at: float, sample_ms: float = 6.0) -> dict:
    """name -> [µs a call, each round]: each call list captured in one graph, replayed about ``sample_ms`` a
    sample, every graph once a round, each round starting one further along."""
    from bench_rounds import event_timer, graph_of

    dev, timer = torch.device("cuda"), event_timer()
    graphs = {}
    for name, fns in calls.items():
        g = graph_of(fns, dev)
        once = timer(g.replay)
        graphs[name] = (g, len(fns), max(1, min(50, int(sample_ms / max(once, 1e-3)))))
    names, per = list(graphs), {n: [] for n in graphs}
    for r in range(rounds):
        if r >= 2 and RUN.elapsed() > stop_at:
            log(f"deadline: {r} rounds")
            break
        for n in names[r % len(names):] + names[:r % len(names)]:
            g, k, reps = graphs[n]
            per[n].append(timer(lambda: [g.replay() for _ in range(reps)]) * 1e3 / (reps * k))
        log(f"round {r}: " + ", ".join(f"{n} {t[-1]:.1f}" for n, t in per.items()))
    return per


def checked_calls(c: oc.Cell, sms: int, skip: set) -> dict:
    """name -> fns of every call that passed its check (the others logged FAIL and not timed); bound jobs in
    ``skip`` (their compile worker did not finish them) are logged FAIL and not launched."""
    preset = c.shape.name
    cfgs = []
    for cfg in oc.bound_cfgs(c.dtype):
        if (c.dtype, cfg.name, tile_tokens(preset, c.m, cfg)) in skip:
            RUN.check(f"{c.spec} {cfg.name}", False, "its compile worker did not finish it: not launched")
        else:
            cfgs.append(cfg)
    makers = [lambda cfg=cfg: oc.bound_call(c, cfg, sms) for cfg in cfgs]
    makers += [lambda: oc.route_call(c), lambda: oc.cublas_call(c)]
    calls = {}
    for make in makers:
        try:
            call = make()
        except Exception as exc:  # noqa: BLE001 (a call that fails is reported, the rest go on)
            RUN.check(f"{c.spec} call", False, f"{type(exc).__name__}: {str(exc)[-500:]}")
            continue
        if RUN.check(f"{c.spec} {call.name}", call.status.startswith("PASS"), call.status):
            calls[call.name] = call.fns
        log(f"{c.spec}: {call.name} checked")  # (the watchdog's clock)
    return calls


def clocks(c: oc.Cell, calls: dict, med: dict, names: list) -> dict:
    from mid_tile_clocks import graph_clocks

    got = {}
    for n in names:
        if n in calls:
            fns = calls[n]
            cs = graph_clocks(lambda fns=fns: [f() for f in fns], med[n] * len(fns), seconds=0.2)
            got[n] = {"MHz": cs.sm_mhz, "W": cs.power_w, "source": cs.source}
    log(f"{c.spec} clocks: {got}")
    return got


def run_cell(spec: str, ceil: dict, sms: int, args) -> None:
    c = oc.cell_inputs(spec, torch.device("cuda"))
    cell = {"cell": spec, **floor_target(c, ceil)}
    log(f"{spec}: floor {cell['floor_us']:.1f} us, target {cell['target_us']:.1f} us ({cell['bytes'] / 1e9:.3f} GB, "
        f"{cell['flops'] / 1e9:.1f} GFLOP, {cell['touched']:.1f} experts touched)")
    calls = checked_calls(c, sms, args.skip)
    left = args.deadline - RUN.elapsed()
    cell["rounds_us"] = timed_rounds(calls, args.rounds, RUN.elapsed() + 0.7 * left / max(1, args.cells_left))
    med = {n: statistics.median(t) for n, t in cell["rounds_us"].items()}
    bounds = [n for n in med if n.startswith("bound")]
    promoted = [n for n in bounds if n.endswith((" prom", " pipe"))]  # fp8: the recipe's bound; plain: second line
    cell["best_bound"] = min(promoted or bounds, key=med.get) if bounds else None
    plain = [n for n in bounds if n not in promoted] if promoted else []
    cell["best_plain"] = min(plain, key=med.get) if plain else None
    try:
        cell["clocks"] = clocks(c, calls, med, [cell["best_bound"], "route"])
    except Exception as exc:  # noqa: BLE001 (a diagnostic: the timings stand without it)
        log(f"{spec} clocks: {type(exc).__name__}: {str(exc)[-300:]}")
    RESULTS["cells"].append(cell)
    (args.out / "ovl.json").write_text(json.dumps({**RESULTS, "failed": RUN.failed}, indent=1))
    summarize(cell, med)


def verdict(cell: dict, med: dict) -> str:
    b, t, r = med.get(cell["best_bound"]), cell["target_us"], med.get("route")
    if b is None:
        return "no bound timed"
    if r is not None and r < 0.99 * b:
        return f"ROUTE FASTER THAN THE BOUND ({r:.1f} < {b:.1f} us): the bound kernel is not good enough"
    head = (f"target UNREACHABLE on this GPU: the bound takes {b:.1f} us > the target {t:.1f} us" if b > t else
            f"target reachable: the bound is {t / b:.2f}x inside it")
    if cell.get("best_plain"):
        head += f" (fp8 without the promotion: {med[cell['best_plain']]:.1f} us)"
    return head + (f"; the route trails the bound by {100 * (r / b - 1):.0f}%" if r is not None else "")


def summarize(cell: dict, med: dict) -> None:
    f, mm, best = cell["floor_us"], cell["mm_TFLOPs"], cell["best_bound"]
    pct = lambda us: f"{100 * f / us:5.1f}% floor {100 * cell['flops'] / (us * 1e-6) / 1e12 / mm:5.1f}% mm"  # noqa
    rounds = cell["rounds_us"]
    lines = [f"{cell['cell']}: floor {f:.1f} us, target {cell['target_us']:.1f} us; {verdict(cell, med)}"]
    for n in sorted(med, key=lambda n: (not n.startswith(("bound", "route")), med[n])):
        t = rounds[n]
        vs = ""
        if best and n != best and best in rounds:
            from bench_rounds import faster_rounds

            vs = f"  x{med[n] / med[best]:5.3f} the best bound (>= 3% slower in {faster_rounds(rounds[best], t)}" \
                 f"/{min(len(t), len(rounds[best]))})"
        lines.append(f"  {n:34s} {med[n]:8.1f} us [{min(t):.0f}-{max(t):.0f}] {pct(med[n])}{vs}")
    for n, got in cell.get("clocks", {}).items():
        lines.append(f"  clock while {n} replays: {got['MHz']} MHz, {got['W']} W ({got['source']})")
    RUN.summary.extend(lines)
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=70.0, help="no new cell or round after this many seconds")
    parser.add_argument("--cells", nargs="+", default=list(DEFAULT_CELLS), help=f"of {', '.join(oc.CELLS)}")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--worker-deadline", type=float, default=28.0, help="compile workers killed after this")
    args = parser.parse_args()
    args.deadline -= 3.0  # the table and JSON after the last timing
    args.out.mkdir(parents=True, exist_ok=True)
    cells = sorted(args.cells, key=lambda spec: not spec.startswith("bf16"))  # bf16 first
    args.skip = run_workers(cells, args.workers, args.worker_deadline)
    threading.Thread(target=RUN.watchdog, kwargs={"poll_s": 1.0}, daemon=True).start()
    import triton
    from mid_tile_clocks import matmul_clocks

    from moekit.experts.triton_gluon_launch import num_sms

    dev = torch.device("cuda")
    ceil = ceilings(dev, fp8=any(spec.startswith("fp8") for spec in cells))
    mm_clock = matmul_clocks(0.25)
    RESULTS.update(ceilings=ceil, mm_clock={"MHz": mm_clock.sm_mhz, "W": mm_clock.power_w},
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    log(f"ceilings {ceil}; bf16 mm 8192^3 at {mm_clock.sm_mhz} MHz {mm_clock.power_w} W; torch {torch.__version__}, "
        f"triton {triton.__version__}")
    RUN.summary.append(f"ceilings {ceil}; bf16 mm at {mm_clock.sm_mhz} MHz, {mm_clock.power_w} W")
    for i, spec in enumerate(cells):
        args.cells_left = len(cells) - i
        if RUN.elapsed() > args.deadline - 4:
            RUN.summary.append(f"{spec}: not reached (deadline)")
            continue
        try:
            run_cell(spec, ceil, num_sms(dev), args)
        except Exception as exc:  # noqa: BLE001 (one cell's failure is reported, the others still run)
            log(f"FAIL {spec}: {type(exc).__name__}: {str(exc)[-800:]}")
            RUN.failed.append(spec)
        torch.cuda.empty_cache()
    RUN.print_table()
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        sys.exit(main())

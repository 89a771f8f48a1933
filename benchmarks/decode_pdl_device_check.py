"""Issues 19 / 15: decode (M = 1, 2) with the down GEMM's weights loaded before its PDL wait, bf16 and fp8_block.

    timeout 280 python3 benchmarks/decode_pdl_device_check.py --out $OUT/decode   # H200, < 180 s wall
    PYTHONPATH=$PWD python benchmarks/decode_pdl_device_check.py --smoke             # CPU: interpreter, no timing

Variants of the tuned default (``decode_pdl_variants``): ``KernelConfig.down_preload`` (a down program reads its
expert from topk_ids and issues its first weight tiles' loads before ``griddepcontrol.wait``, while gate-up runs),
``up_signal_early`` (gate-up lets the down grid launch right after its own wait, so those loads overlap its stream),
and the down tiles that keep the preloaded tiles in 128 registers a thread. Cells: Qwen3-30B-A3B M = 1 / 2 (the
target), DeepSeek-V3 and Mixtral-8x7B M = 1 (must not get slower), timed first; then correctness-only cells at
M = 2 / 8 of all three while time is left (--deadline + 20 s).

Per cell: every variant's output on the first set against the default's (bit-equal where the tiles are the same)
and against the reference (bf16: ``experts_reference``; fp8: ``experts_fp8_block_reference``), PASS / FAIL; then
CUDA-graph replay µs, the variants interleaved over ROUNDS rounds, median; % of the byte floor (copy bandwidth
measured here); eager wall µs (the real client: back-to-back eager calls) of the default and the fastest variant.
Compile: WORKERS subprocesses run every (cell, variant) once on small-E weights of the same N and K (Triton's disk
cache) while this process builds the real weights. Partial tables print as cells finish; the full table last; JSON
to --out/decode_pdl.json (also written when the deadline stops the timing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from decode_pdl_variants import CELLS, SMOKE_CELLS, Variant, variants  # noqa: E402
from decode_q3_device_check import (  # noqa: E402  (the shapes, weights, reference, floor and row types of run 18)
    Cell, Row, floor_us, make_weights, measure_copy, print_cell, reference, rel_l2, shape_of, tuned,
)

T0 = time.perf_counter()
WORKERS = 12
BIG_WORKERS = 1  # of them, the one that takes the tasks with DeepSeek-V3's full weights at M >= 2
ROUNDS = 5
ROTATION_BYTES = 256 << 20
TOLERANCE = {"bf16": 2e-2, "fp8": 2e-2}


def elapsed() -> float:
    return time.perf_counter() - T0


def cells() -> list[tuple]:
    return list(SMOKE_CELLS if SMOKE else CELLS)


def itemsize(dtype: str) -> int:
    return 1 if dtype == "fp8" else 2


def run_variant(v: Variant, dtype: str, base, t, w, eager: bool = False, explicit: bool = False):
    """One call of ``v``: the default (config None: the tuned entry; ``explicit``: that entry's config passed, as
    the compile workers' small-E weights find no tuned file) or the tuned config changed by ``v``."""
    config = (base.config if explicit else None) if v.is_default else v.config(base.config, itemsize(dtype))
    if dtype == "bf16":
        from moekit.experts.triton import fused_experts

        return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    x_in = base.x_in_gate_up if (eager and not v.is_default) else None  # the default's eager switch
    return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                    config=config, x_in_gate_up=x_in)


# ---------------------------------------------------------------------------------------------------
# Compile workers: each runs its (cell, variant) tasks once on small-E weights, printing START/OK/ERR
# ---------------------------------------------------------------------------------------------------


def worker_main(tasks: list) -> None:
    from moekit.bench.cells import make_sets

    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, vi in tasks:
        dtype, preset, m, timed = cells()[ci]
        s = shape_of(preset, small_for_m=m)
        if (dtype, s) not in held:
            held.clear()
            if not SMOKE:
                torch.cuda.empty_cache()
            held[(dtype, s)] = make_weights(dtype, s, dev)
        print(f"START {ci} {vi}", flush=True)
        try:
            t = make_sets(s, m, 1, torch.bfloat16, dev)[0]
            base = tuned(dtype, shape_of(preset), m, dev)  # the real shape's entry
            run_variant(variants(dtype, preset, m, timed)[vi], dtype, base, t, held[(dtype, s)], explicit=True)
            if not SMOKE:
                torch.cuda.synchronize()
            print(f"OK {ci} {vi}", flush=True)
        except Exception as err:  # noqa: BLE001  (reported; the main process compiles or skips it)
            print(f"ERR {ci} {vi} {type(err).__name__}: {str(err)[:200]!r}".replace("\n", " "), flush=True)


def start_workers(workers: int) -> list:
    tasks = [(ci, vi) for ci, c in enumerate(cells()) for vi in range(len(variants(*c)))]

    def big(task) -> bool:
        s = shape_of(cells()[task[0]][1], small_for_m=cells()[task[0]][2])
        return s.num_experts * 3 * s.n * s.k * 2 > 4e9

    heavy, light = [t for t in tasks if big(t)], [t for t in tasks if not big(t)]
    n_big = min(BIG_WORKERS, workers - 1) if heavy else 0
    slices = [heavy[j::n_big] for j in range(n_big)] + [light[j::workers - n_big] for j in range(workers - n_big)]
    procs = []
    for j, part in enumerate(slices):
        log = Path(f"/tmp/decode_pdl_worker_{os.getpid()}_{j}.log")
        with open(log, "w") as out:
            args = [sys.executable, __file__, "--worker", json.dumps(part)] + (["--smoke"] if SMOKE else [])
            procs.append((subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), log))
    return procs


def collect_workers(procs, until_s: float) -> dict:
    """{(cell, variant): "ok" / "error: ..." / "crashed"}; a task a worker was in when the deadline killed it is left
    out (the main process compiles it)."""
    killed = set()
    for j, (p, _) in enumerate(procs):
        try:
            p.wait(timeout=max(0.1, until_s - elapsed()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            killed.add(j)
    status = {}
    for j, (_, log) in enumerate(procs):
        last = None
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 3)
            if parts[0] in ("START", "OK", "ERR") and len(parts) >= 3:
                status[(int(parts[1]), int(parts[2]))] = {"START": "crashed", "OK": "ok"}.get(
                    parts[0], "error: " + (parts[3] if len(parts) > 3 else ""))
                last = (int(parts[1]), int(parts[2]))
        if j in killed and status.get(last) == "crashed":
            del status[last]
    return status


# ---------------------------------------------------------------------------------------------------
# The measurements (this process)
# ---------------------------------------------------------------------------------------------------


def check_cell(cell: Cell, vs: list, base, sets, w, status: dict, ci: int) -> list:
    """Each variant's output on sets[0] against the default's and the reference; the variants fit to time."""
    ref = reference(cell.dtype, sets[0], w)
    default_out, timed = None, []
    for vi, v in enumerate(vs):
        row = Row(v.name)
        cell.rows.append(row)
        if not SMOKE and vi > 0 and status.get((ci, vi)) not in ("ok", None):  # None: no worker reached it, try here
            row.status = status[(ci, vi)]
            continue
        try:
            out = run_variant(v, cell.dtype, base, sets[0], w)
        except Exception as e:  # noqa: BLE001  (one variant's failure never ends the run)
            row.status = f"error: {type(e).__name__}: {str(e)[:160]}".replace("\n", " ")
            continue
        row.rel_l2_ref = rel_l2(out, ref)
        if vi == 0:
            default_out = out
        else:
            row.equal_default = default_out is not None and bool(torch.equal(out, default_out))
        ok = row.rel_l2_ref < TOLERANCE[cell.dtype] and (row.equal_default is not False or not v.exact)
        row.status = "PASS" if ok else f"FAIL (rel_l2 {row.rel_l2_ref:.2e}, equal {row.equal_default})"
        if ok:
            timed.append((vi, v, row))
    return timed


def time_cell(cell: Cell, timed: list, base, sets, w, dev, deadline_s: float) -> None:
    """Graph µs, the variants interleaved over ROUNDS rounds; eager µs of the default and the fastest."""
    from moekit.bench.timing import time_calls, time_eager

    for _ in range(ROUNDS):
        for _, v, row in timed:
            if elapsed() > deadline_s:
                break
            fns = [lambda t=t, v=v: run_variant(v, cell.dtype, base, t, w) for t in sets]
            row.samples.append(time_calls(fns, dev, graph=True, budget_s=0.012, min_reps=3, max_reps=10))
    for _, _, row in timed:
        if row.samples:
            row.us = statistics.median(row.samples)
            row.pct_floor = 100 * cell.floor_us / row.us
    done = [(v, row) for _, v, row in timed if row.us is not None]
    if not done or elapsed() > deadline_s:
        return
    best = min(done, key=lambda d: d[1].us)
    for v, row in {id(r): (v, r) for v, r in (done[0], best)}.values():
        e = time_eager([lambda t=t, v=v: run_variant(v, cell.dtype, base, t, w, eager=True) for t in sets], dev,
                       repeats=3)
        row.eager_us, row.host_us = e.eager_us, e.host_us


def write_json(out_dir: str | None, payload: dict) -> None:
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "decode_pdl.json").write_text(json.dumps(payload, indent=1) + "\n")


def main(args) -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    procs = start_workers(1 if SMOKE else WORKERS)
    import triton

    from moekit.bench.cells import make_sets, measured_experts_touched

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    weights = {}
    for dtype, preset, _, _ in cells():
        if (dtype, preset) not in weights:
            weights[(dtype, preset)] = make_weights(dtype, shape_of(preset), dev)
    print(f"[{elapsed():5.1f}s] weights built", flush=True)
    copy_tbps = 1.0 if SMOKE else measure_copy(dev)
    status = collect_workers(procs, args.deadline * 0.45)
    print(f"[{elapsed():5.1f}s] compiled {sum(v == 'ok' for v in status.values())} of {len(status)}; copy "
          f"{copy_tbps:.2f} TB/s; others: {sorted(set(status.values()) - {'ok'})}"[:600], flush=True)
    results, payload = [], {"device": name, "torch": torch.__version__, "triton": triton.__version__,
                            "copy_TBps": copy_tbps}
    order = [c for c in enumerate(cells()) if c[1][3]] + [c for c in enumerate(cells()) if not c[1][3]]
    for ci, (dtype, preset, m, timed_cell) in order:  # timed cells (checked, then timed), then the checks alone
        if elapsed() > args.deadline + (0 if timed_cell else 20):
            print(f"deadline: {dtype} {preset} M={m} not run", flush=True)
            continue
        s, cell = shape_of(preset), Cell(dtype, preset, m)
        results.append(cell)
        vs, base, w = variants(dtype, preset, m, timed_cell), tuned(dtype, s, m, dev), weights[(dtype, preset)]
        once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
        sets = make_sets(s, m, 1 if SMOKE else max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
        cell.touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
        cell.floor_us = floor_us(dtype, s, m, cell.touched, copy_tbps)
        timed = check_cell(cell, vs, base, sets, w, status, ci)
        print(f"[{elapsed():5.1f}s] checked {dtype} {preset} M={m}: "
              + ", ".join(f"{r.variant} {r.status}" for r in cell.rows), flush=True)
        if timed_cell and not SMOKE:
            time_cell(cell, timed, base, sets, w, dev, args.deadline)
            print_cell(cell)
        write_json(args.out, dict(payload, cells=[asdict(c) for c in results], seconds=elapsed()))
    failed = [f"{c.dtype} {c.preset} M={c.M} {r.variant}: {r.status}" for c in results for r in c.rows
              if r.status.startswith(("FAIL", "error", "crashed"))]
    write_json(args.out, dict(payload, cells=[asdict(c) for c in results], failed=failed, seconds=elapsed()))
    print("\nall cells (graph µs median of rounds, % of byte floor, x default, [round min-max], eager wall/host µs, "
          "rel L2 vs reference, = bit-equal to default, status)")
    for c in results:
        print_cell(c)
    print(f"FAILED: {failed or 'none'}  ({elapsed():.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--out", default=os.environ.get("OUT"), help="folder for decode_pdl.json")
        p.add_argument("--deadline", type=float, default=140.0, help="seconds after which no timing starts")
        p.add_argument("--smoke", action="store_true", help="CPU: the interpreter, tiny shapes, no timing")
        sys.exit(main(p.parse_args()))

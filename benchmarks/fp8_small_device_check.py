"""fp8 block-scaled experts at decode and mid batches (issue 15): variants of the Triton fp8 path, on the device.

    PYTHONPATH=$PWD python benchmarks/fp8_small_device_check.py            # < 150 s; JSON to $OUT/fp8_small.json
    PYTHONPATH=$PWD python benchmarks/fp8_small_device_check.py --smoke    # CPU: interpreter, tiny shapes, no timing

Cells: Qwen3-30B-A3B M = 1 / 2 / 4 / 8 / 64 / 1024, DeepSeek-V3 M = 1 / 8, Mixtral-8x7B M = 1 / 1024 (bf16 x, uniform
routing, random e4m3 weights with random 128 x 128 block scales). Per cell the plan's default (tuned file or
heuristic) and the variants of ``fp8_small_variants.variants``: tiles (BLOCK_M, GROUP_M, each GEMM's BLOCK_N /
warps / stages), weights through TMA or pointers, x quantized inside the gate-up GEMM (one launch fewer), the
in-loop quantized tiles loaded a K-step ahead or not (``gemm_fp8``'s AHEAD), at M = 1024 the fp8 Gluon path,
and the ``triton`` backend's own choice (what ``moekit bench`` times; at M <= 8 also with the tuned entry's
"x_in_gate_up" set, which only eager calls follow). Each variant's output on the cell's first input set is
checked against the ``reference`` backend (``experts_fp8_block_reference``: the recipe), rel L2 < 2e-2, and
compared bit for bit with the default's; then timed by CUDA-graph replay over rotated inputs
(``fp8_speed_device_check.time_graph``), and at M <= 64 the default, x-in and backend variants eagerly too
(host and wall µs per call). % of the fp8 floor per cell (``fp8_device_check.floor_us``: copy bandwidth and
``torch._scaled_mm`` measured in this run). Each kernel's eager device µs of every default, and at M <= 8 of
the fastest variant (``fp8_kernel_breakdown``).

Compile: WORKERS subprocesses run every variant once on zero weights (Triton's disk cache; a compiler crash
takes down a worker, never this process) while this process builds weights, inputs and references. Then the
timings in priority order (every default first), each line printed, until DEADLINE_S. Tables last: every
variant (µs, % floor, rel L2, bit-equal to default), then per cell the default and the best.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import fp8_speed_device_check as speed  # noqa: E402  (its T0 is this run's start too)
from fp8_small_variants import Variant, variants  # noqa: E402

DEADLINE_S = 138.0  # stop timing here (the lead's limit is 150 s)
speed.WORKER_DEADLINE_S = 75.0  # compile workers still running then are stopped (their rest is skipped)
WORKERS = 13  # of the device host's 16 cores
BIG_PRESET_WORKERS = 3  # DeepSeek-V3's zero e4m3 weights are 11 GB per worker
CELLS = (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 4), ("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", 64),
         ("qwen3-30b-a3b", 1024), ("deepseek-v3", 1), ("deepseek-v3", 8), ("mixtral-8x7b", 1), ("mixtral-8x7b", 1024))
SMOKE_M = {1: 1, 2: 2, 4: 3, 8: 5, 64: 12, 1024: 40}  # the tiny shapes' M for each cell's M
TOLERANCE = 2e-2
ROTATION_BYTES = 256 << 20


def run_variant(v: Variant, t, w13, w2):
    """One call of ``v`` on inputs ``t`` and Fp8BlockWeight pair (w13, w2)."""
    if v.route == "backend":
        from moekit.experts.triton import experts_triton

        return experts_triton(t.x, w13, w2, t.topk_ids, t.topk_weights)
    if v.route == "gluon":
        from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8

        return experts_gluon_fp8(t.x, w13.q, w13.scale, w2.q, w2.scale, t.topk_ids, t.topk_weights)
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    return fused_experts_fp8_launch(t.x, w13.q, w13.scale, w2.q, w2.scale, t.topk_ids, t.topk_weights,
                                    config=v.kernel_config(), weight_tma=v.tma, x_in_gate_up=v.x_in, ahead=v.ahead)


@contextmanager
def entry_switch(v: Variant, preset: str, m: int):
    """For ``v.entry_x_in`` True or False: the packaged H200 file of ``preset`` with "x_in_gate_up" set so in the
    entry M uses, from a temporary MOEKIT_CONFIG_DIR (caches cleared around); None: nothing."""
    if v.entry_x_in is None:
        yield
        return
    from moekit.experts.configs import PACKAGED_DIR, clear_config_cache, nearest
    from moekit.experts.triton import clear_launch_caches
    from moekit.experts.triton_fp8_plan import config_file_name

    s = shape_of(preset)
    name = config_file_name(s.num_experts, s.n, s.k, "NVIDIA_H200")
    doc = json.loads((PACKAGED_DIR / name).read_text())
    doc["configs"][str(nearest({int(k): int(k) for k in doc["configs"]}, m))]["x_in_gate_up"] = v.entry_x_in
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(json.dumps(doc))
        os.environ["MOEKIT_CONFIG_DIR"] = tmp
        clear_config_cache()
        clear_launch_caches()
        try:
            yield
        finally:
            del os.environ["MOEKIT_CONFIG_DIR"]
            clear_config_cache()
            clear_launch_caches()


def shape_of(preset: str):
    from moekit.bench.cells import Shape

    real = Shape.from_preset(preset)
    return Shape(f"{preset}/smoke", min(real.num_experts, 8), 128, 256, min(real.top_k, 2)) if SMOKE else real


def fp8_weights(s, dev, zeros: bool = False):
    """Fp8BlockWeight pair: random e4m3 (zeros: all 0) with random 128 x 128 block scales, made per few experts."""
    from moekit.quant.fp8_block import Fp8BlockWeight

    pair = []
    for rows, cols in ((2 * s.n, s.k), (s.k, s.n)):
        q = torch.zeros(s.num_experts, rows, cols, dtype=torch.float8_e4m3fn, device=dev)
        if not zeros:
            g = torch.Generator(device=dev).manual_seed(rows * 7 + cols)
            for e0 in range(0, s.num_experts, 8):
                chunk = q[e0:e0 + 8]
                q[e0:e0 + 8] = (torch.randn(chunk.shape, generator=g, device=dev) * 48).clamp(-448, 448).to(q.dtype)
        scale = torch.rand(s.num_experts, math.ceil(rows / 128), math.ceil(cols / 128), device=dev) * 2e-4 + 1e-4
        pair.append(Fp8BlockWeight(q=q, scale=scale, dtype=torch.bfloat16))
    return tuple(pair)


# ---------------------------------------------------------------------------------------------------
# Compile workers (subprocesses): each runs its tasks once on zero weights, printing START/OK/ERR lines
# ---------------------------------------------------------------------------------------------------


def all_tasks() -> list[tuple[str, int, int]]:
    tasks = [(p, m, i) for p, m in CELLS for i in range(len(variants(p, m)))]
    return sorted(tasks, key=lambda t: (t[2] > 0, t[0] == "deepseek-v3", t[2], t[1]))


def worker_main(tasks: list) -> None:
    from moekit.bench.cells import make_sets

    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for preset, m, i in tasks:
        if preset not in held:
            held.clear()
            if not SMOKE:
                torch.cuda.empty_cache()
            held[preset] = fp8_weights(shape_of(preset), dev, zeros=True)
        print(f"START {preset} {m} {i}", flush=True)
        try:
            t, v = make_sets(shape_of(preset), SMOKE_M[m] if SMOKE else m, 1, torch.bfloat16, dev)[0], variants(preset, m)[i]
            with entry_switch(v, preset, m):
                run_variant(v, t, *held[preset])
            if not SMOKE:
                torch.cuda.synchronize()
            print(f"OK {preset} {m} {i}", flush=True)
        except Exception as err:  # noqa: BLE001  (reported; the main process skips the variant)
            print(f"ERR {preset} {m} {i} {type(err).__name__}: {str(err)[:200]!r}".replace("\n", " "), flush=True)


def start_workers(tasks: list, workers: int) -> list:
    slices = [[] for _ in range(workers)]
    big = min(BIG_PRESET_WORKERS, workers - 1)
    for t in tasks:  # in order, each to the shortest list it may go to
        allowed = slices[:big] if t[0] == "deepseek-v3" else slices[big:]
        min(allowed, key=len).append(t)
    procs = []
    for j, part in enumerate(slices):
        log = Path(f"/tmp/fp8_small_worker_{os.getpid()}_{j}.log")
        with open(log, "w") as out:
            args = [sys.executable, __file__, "--worker", json.dumps(part)] + (["--smoke"] if SMOKE else [])
            procs.append((subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), log))
    return procs


# ---------------------------------------------------------------------------------------------------
# The measurements (this process)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    preset: str
    M: int
    variant: str
    spec: dict
    status: str  # "ok", "FAIL (rel_l2 ...)", "error: ...", "not compiled", "crashed in the compile worker", "no time"
    us: float | None = None
    host_us: float | None = None  # eager host µs per call (M <= 64: default, x-in and backend variants)
    eager_us: float | None = None  # eager wall µs per call (the same ones)
    rel_l2: float | None = None  # against the reference backend
    equal_default: bool | None = None  # bit-equal to the default variant's output
    pct_floor: float | None = None


@dataclass
class Cell:
    preset: str
    M: int
    shape: object
    sets: list
    ref: torch.Tensor
    touched: float  # mean distinct experts per call over the sets
    floor_us: float | None = None
    default_out: torch.Tensor | None = None


def prepare(dev) -> tuple[dict, list[Cell]]:
    from moekit.bench.cells import make_sets, measured_experts_touched
    from moekit.quant.emulate import experts_fp8_block_reference

    weights, cells = {}, []
    for preset, m in CELLS:
        s = shape_of(preset)
        if preset not in weights:
            weights[preset] = fp8_weights(s, dev)
        m = SMOKE_M[m] if SMOKE else m
        once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
        sets = make_sets(s, m, 1 if SMOKE else max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
        ref = experts_fp8_block_reference(sets[0].x, *weights[preset], sets[0].topk_ids, sets[0].topk_weights)
        touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
        cells.append(Cell(preset, m, s, sets, ref, touched))
        print(f"[{speed.elapsed():5.1f}s] prepared {preset} M={m}", flush=True)
    return weights, cells


def measure(v: Variant, i: int, cell: Cell, w, status: dict, dev) -> Row:
    row = Row(cell.preset, cell.M, v.name, asdict(v), "ok", pct_floor=None)
    compiled = status.get((cell.preset, cell.M, i))
    if speed.elapsed() > DEADLINE_S and not SMOKE:
        row.status = "no time"
        return row
    if not SMOKE and compiled != "ok" and i > 0:
        row.status = {None: "not compiled", "crashed": "crashed in the compile worker"}.get(compiled, compiled)
        return row
    if SMOKE and v.route != "triton":
        row.status = "skipped (no Hopper here)"
        return row
    try:
        with entry_switch(v, cell.preset, cell.M):
            check_and_time(v, i, cell, w, row, dev)
    except Exception as e:  # noqa: BLE001  (one variant's failure never ends the run)
        row.status = f"error: {type(e).__name__}: {str(e)[:160]}".replace("\n", " ")
    return row


def check_and_time(v: Variant, i: int, cell: Cell, w, row: Row, dev) -> None:
    """``measure``'s work: the check against the reference, then graph µs, and eager µs where asked."""
    out = run_variant(v, cell.sets[0], *w)
    row.rel_l2 = speed.rel_l2(out, cell.ref)
    if i == 0:
        cell.default_out = out
    elif cell.default_out is not None:
        row.equal_default = bool(torch.equal(out, cell.default_out))
    if not row.rel_l2 < TOLERANCE:
        row.status = f"FAIL (rel_l2 {row.rel_l2:.2e})"
        return
    if SMOKE:
        return
    row.us = speed.time_graph(lambda t: run_variant(v, t, *w), cell.sets, dev)
    row.pct_floor = 100 * cell.floor_us / row.us
    if cell.M <= 64 and (i == 0 or v.x_in or v.route == "backend"):
        from moekit.bench.timing import time_eager

        timing = time_eager([lambda t=t: run_variant(v, t, *w) for t in cell.sets], dev, repeats=5)
        row.host_us, row.eager_us = timing.host_us, timing.eager_us


def print_row(r: Row) -> None:
    us = f"{r.us:9.1f}" if r.us is not None else "        -"
    pct = f"{r.pct_floor:5.0f}%" if r.pct_floor is not None else "     -"
    host = f"{r.host_us:6.1f}/{r.eager_us:6.1f}" if r.host_us is not None else "     -/     -"
    err = f"{r.rel_l2:.1e}" if r.rel_l2 is not None else "-"
    eq = {True: "=", False: "~", None: " "}[r.equal_default]
    print(f"[{speed.elapsed():5.1f}s] {r.preset:<14}{r.M:>5} {r.variant:<40}{us}{pct} host{host} {err:>8}{eq} {r.status}",
          flush=True)


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    # the smoke run sends a few tasks through two workers (the machinery), then checks every variant itself
    procs = start_workers(all_tasks()[:4], 2) if SMOKE else start_workers(all_tasks(), WORKERS)
    torch.backends.cuda.matmul.allow_tf32 = False
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    weights, cells = prepare(dev)
    status = speed.collect_workers(procs)
    print(f"[{speed.elapsed():5.1f}s] compiled: {sum(v == 'ok' for v in status.values())} ok of "
          f"{len(all_tasks())}; others: {sorted(set(status.values()) - {'ok'})}"[:600], flush=True)
    if SMOKE:
        status = {}
    else:
        from fp8_device_check import floor_us, measure_ceilings

        ceilings = measure_ceilings(dev)
        for cell in cells:
            cell.floor_us = floor_us(cell.shape, cell.M, cell.touched, ceilings)
        print(f"[{speed.elapsed():5.1f}s] copy {ceilings.copy_TBps:.2f} TB/s, fp8 mm {ceilings.fp8_mm_TFLOPs} TFLOP/s",
              flush=True)
    # every default first, then the variants round-robin over the cells (a cut at DEADLINE_S leaves each cell some)
    jobs = sorted(((c, i) for c in cells for i in range(len(variants(c.preset, _real_m(c))))), key=lambda j: j[1])
    rows: dict[tuple, list[Row]] = {(c.preset, c.M): [] for c in cells}
    for cell, i in jobs:
        v = variants(cell.preset, _real_m(cell))[i]
        if SMOKE and i > 4 and not v.x_in:  # the interpreter is slow: the first few and the x-in ones
            continue
        row = measure(v, i, cell, weights[cell.preset], status, dev)
        rows[(cell.preset, cell.M)].append(row)
        print_row(row)
    report(cells, rows)
    kernels = {} if SMOKE else breakdowns(cells, rows, weights)
    failed = [f"{r.preset} M={r.M} {r.variant}" for rs in rows.values() for r in rs if r.status.startswith("FAIL")]
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_small.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "triton": triton.__version__,
             "compile": {" ".join(map(str, k)): v for k, v in status.items()},
             "cells": [{"preset": c.preset, "M": c.M, "floor_us": c.floor_us,
                        "rows": [asdict(r) for r in rows[(c.preset, c.M)]]} for c in cells],
             "kernels": kernels, "failed": failed, "seconds": speed.elapsed()}, indent=1) + "\n")
    print(f"FAILED: {failed or 'none'}  ({speed.elapsed():.1f} s)", flush=True)
    return 1 if failed else 0


def breakdowns(cells: list[Cell], rows: dict, weights: dict) -> dict:
    """Each kernel's device µs, eager, of every cell's default and at M <= 8 of its fastest variant too (until
    DEADLINE_S + 8 s)."""
    from fp8_kernel_breakdown import describe, kernel_breakdown

    found = {}
    for c in (c for c in cells if speed.elapsed() < DEADLINE_S + 8):
        timed = sorted((r for r in rows[(c.preset, c.M)] if r.us is not None), key=lambda r: r.variant != "default")
        for r in timed[:1] + sorted(timed[1:], key=lambda r: r.us)[:1 if c.M <= 8 else 0]:
            v = next(v for v in variants(c.preset, _real_m(c)) if v.name == r.variant)
            try:
                with entry_switch(v, c.preset, c.M):
                    line = describe(kernel_breakdown(lambda: run_variant(v, c.sets[0], *weights[c.preset])))
            except Exception as e:  # noqa: BLE001  (a breakdown is extra: it never ends the run)
                line = f"error: {type(e).__name__}: {str(e)[:120]}"
            found[f"{c.preset} {c.M} {v.name}"] = line
            print(f"kernels {c.preset} M={c.M} {v.name} (graph {r.us:.1f} us): {line}", flush=True)
    return found


def _real_m(cell: Cell) -> int:
    return next(m for p, m in CELLS if p == cell.preset and (SMOKE_M[m] if SMOKE else m) == cell.M)


def report(cells: list[Cell], rows: dict) -> None:
    print("\nevery variant (graph µs; % of floor; eager host/wall µs; rel L2 vs reference, = bit-equal to default)")
    for c in cells:
        for r in rows[(c.preset, c.M)]:
            print_row(r)
    print(f"\n{'cell':<14}{'M':>5}{'floor':>8}{'default':>9}{'%fl':>5}{'best':>9}{'%fl':>5}  best variant")
    for c in cells:
        timed = [r for r in rows[(c.preset, c.M)] if r.us is not None]
        d = next((r for r in timed if r.variant == "default"), None)
        top = min(timed, key=lambda r: r.us) if timed else None
        f = lambda v, w, p=1: f"{v:{w}.{p}f}" if v is not None else " " * (w - 1) + "-"  # noqa: E731
        print(f"{c.preset:<14}{c.M:>5}{f(c.floor_us, 8)}{f(d and d.us, 9)}{f(d and d.pct_floor, 5, 0)}"
              f"{f(top and top.us, 9)}{f(top and top.pct_floor, 5, 0)}  {top.variant if top else '-'}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        sys.exit(main())

"""fp8 block-scaled experts (``moekit.experts.triton_fp8``) on the device: a focused config sweep, in < 100 s.

    PYTHONPATH=$PWD python benchmarks/fp8_speed_device_check.py          # JSON to $OUT/fp8_speed.json if $OUT is set

Per preset (Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B routed experts) and M in BATCHES: the default
plan (tuned file or heuristic) and a few candidates per M bucket (``candidates``: tiles, warps, stages,
TMA or pointer weights, x quantized inside gate-up). Each one's output on the
cell's first input set is checked against the torch twin (rel L2 < 2e-2), and each is timed by CUDA-graph
replay over rotated inputs (``moekit.bench.timing``), beside moekit's bf16 Triton path on the unquantized
weights and the fp8 floor (``fp8_device_check.floor_us``; copy bandwidth and ``torch._scaled_mm`` 8192^3
e4m3 measured in the same run). Host µs per eager call of the default, fp8 and bf16, at M <= 64.

Time: the candidates' kernels are compiled first by WORKERS subprocesses into Triton's disk cache (a
candidate that crashes the compiler takes its worker down, never this process; it and the rest of that
worker's list are then skipped here), while this process builds the weights, inputs and twin outputs.
Then the timings, in priority order (every cell's default and bf16 first, then candidates, M = 16384
last), each stopped at DEADLINE_S. Prints one line per measurement, the tables last.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

T0 = time.perf_counter()
DEADLINE_S = 85.0  # stop timing here (the lead's limit is 100 s)
WORKER_DEADLINE_S = 52.0  # compile workers still running then are stopped (their rest is skipped)
WORKERS = 12  # of the device host's 16 cores
BIG_PRESET_WORKERS = 4  # DeepSeek-V3's e4m3 weights are 11 GB per worker
BATCHES = (1, 8, 64, 1024, 4096, 16384)
DEVICE = "cuda"  # a CPU smoke test of the plumbing sets "cpu" (Triton's interpreter, tiny shapes)
ROTATION_BYTES = 256 << 20  # rotate inputs until one pass touches ~4x the H200's L2 (the bench's rule)


def elapsed() -> float:
    return time.perf_counter() - T0


@dataclass(frozen=True)
class Candidate:
    """One way to run a cell: a config (None: the plan's default) and the plan's A/B switches."""

    name: str
    config: tuple | None  # (BLOCK_M, up (BN, warps, stages), down (BN, warps, stages)); BLOCK_K = 128, GROUP_M 1 or 8
    tma: bool | None = None
    x_in: bool | None = None

    def kernel_config(self):
        from moekit.experts.configs import GemmTile, KernelConfig

        if self.config is None:
            return None
        block_m, up, down = self.config
        group_m = 1 if block_m == 16 else 8
        return KernelConfig(block_m, GemmTile(up[0], 128, group_m, up[1], up[2]),
                            GemmTile(down[0], 128, group_m, down[1], down[2]))


def candidates(m: int) -> list[Candidate]:
    """The default first, then the bucket's alternatives: decode (16-row tiles), M = 64, prefill."""
    default = Candidate("default", None)
    if m <= 8:
        return [default,
                Candidate("d128/5+128/5", (16, (128, 4, 5), (128, 4, 5)), tma=True),
                Candidate("d128/5+64/5", (16, (128, 4, 5), (64, 4, 5)), tma=True),
                Candidate("d128/5+32/5", (16, (128, 4, 5), (32, 4, 5)), tma=True),
                Candidate("d64/6+64/6", (16, (64, 4, 6), (64, 4, 6)), tma=True),
                Candidate("d32/6+128/5", (16, (32, 4, 6), (128, 4, 5)), tma=True),
                Candidate("d64/4+128/4", (16, (64, 4, 4), (128, 4, 4)), tma=True),
                Candidate("d128/5+128/5 x-in", (16, (128, 4, 5), (128, 4, 5)), tma=True, x_in=True)]
    if m <= 64:
        return [default,
                Candidate("d128/5+128/5", (16, (128, 4, 5), (128, 4, 5)), tma=True),
                Candidate("d128/4+128/4", (16, (128, 4, 4), (128, 4, 4)), tma=True),
                Candidate("d64/6+64/6", (16, (64, 4, 6), (64, 4, 6)), tma=True),
                Candidate("p64 8w/4+4w/4 ptr", (64, (128, 8, 4), (128, 4, 4)), tma=False),
                Candidate("p64 8w/4+4w/4 tma", (64, (128, 8, 4), (128, 4, 4)), tma=True)]
    return [default,
            Candidate("p64 8w/4+4w/4 ptr", (64, (128, 8, 4), (128, 4, 4)), tma=False),
            Candidate("p64 8w/4+4w/4 tma", (64, (128, 8, 4), (128, 4, 4)), tma=True),
            Candidate("p64 8w/3+4w/4 tma", (64, (128, 8, 3), (128, 4, 4)), tma=True),
            Candidate("p64 8w/4+4w/5 tma", (64, (128, 8, 4), (128, 4, 5)), tma=True),
            Candidate("p64 8w/4+8w/4 ptr", (64, (128, 8, 4), (128, 8, 4)), tma=False),
            Candidate("p128 8w/3+8w/4 ptr", (128, (128, 8, 3), (128, 8, 4)), tma=False),
            Candidate("p128 8w/3+4w/4 ptr", (128, (128, 8, 3), (128, 4, 4)), tma=False)]


def run_candidate(c: Candidate, t, q):
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    return fused_experts_fp8_launch(t.x, *q, t.topk_ids, t.topk_weights, config=c.kernel_config(), weight_tma=c.tma,
                                    x_in_gate_up=c.x_in)


# ---------------------------------------------------------------------------------------------------
# Compile workers (subprocesses): each runs its tasks once, printing START/OK/ERR lines
# ---------------------------------------------------------------------------------------------------


def all_tasks(presets) -> list[tuple[str, int, int]]:
    """(preset, M, candidate index) of every measurement in the order they are worth compiling: the
    defaults first, then candidate by candidate (a kernel compiled for one preset often serves the next)."""
    tasks = [(p, m, i) for p in presets for m in BATCHES for i in range(len(candidates(m)))]
    return sorted(tasks, key=lambda t: (t[2], t[1] == 16384, t[1], t[0]))


def worker_main(tasks: list) -> None:
    from moekit.bench.cells import Shape, make_sets

    dev, held = torch.device(DEVICE), {}
    for preset, m, i in tasks:
        if preset not in held:
            held.clear()
            torch.cuda.empty_cache()
            s = Shape.from_preset(preset)
            e, n, k = s.num_experts, s.n, s.k
            held[preset] = (s, (torch.zeros(e, 2 * n, k, dtype=torch.float8_e4m3fn, device=dev),
                                torch.ones(e, 2 * n // 128, k // 128, device=dev),
                                torch.zeros(e, k, n, dtype=torch.float8_e4m3fn, device=dev),
                                torch.ones(e, k // 128, n // 128, device=dev)))
        s, q = held[preset]
        print(f"START {preset} {m} {i}", flush=True)
        try:
            run_candidate(candidates(m)[i], make_sets(s, m, 1, torch.bfloat16, dev)[0], q)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            print(f"OK {preset} {m} {i}", flush=True)
        except Exception as err:  # noqa: BLE001  (reported; the main process skips the candidate)
            print(f"ERR {preset} {m} {i} {type(err).__name__}: {str(err)[:200]!r}".replace("\n", " "), flush=True)


def start_workers(tasks: list) -> list[tuple[subprocess.Popen, Path]]:
    """WORKERS subprocesses over ``tasks``; DeepSeek-V3's tasks only on the first BIG_PRESET_WORKERS."""
    slices = [[] for _ in range(WORKERS)]
    for t in tasks:  # in order, each to the shortest list it may go to
        allowed = slices[:BIG_PRESET_WORKERS] if t[0] == "deepseek-v3" else slices
        min(allowed, key=len).append(t)
    procs = []
    for j, part in enumerate(slices):
        log = Path(f"/tmp/fp8_speed_worker_{os.getpid()}_{j}.log")
        with open(log, "w") as out:
            procs.append((subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(part)], stdout=out,
                                           stderr=subprocess.STDOUT), log))
    return procs


def collect_workers(procs) -> dict[tuple, str]:
    """Wait until WORKER_DEADLINE_S; (preset, M, i) -> "ok", "error: ..." or "crashed" (started, never
    finished: the compiler took the worker down, or it was stopped). Tasks never started are absent."""
    for p, _ in procs:
        try:
            p.wait(timeout=max(0.1, WORKER_DEADLINE_S - elapsed()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    status = {}
    for p, log in procs:
        shown = 0
        for line in log.read_text(errors="replace").splitlines():
            parts = line.split(" ", 4)
            if parts[0] in ("START", "OK", "ERR") and len(parts) >= 4:
                key = (parts[1], int(parts[2]), int(parts[3]))
                status[key] = {"START": "crashed", "OK": "ok"}.get(parts[0], "error: " + " ".join(parts[4:]))
            elif ("Error" in line or "Segmentation" in line or "Abort" in line) and shown < 3:
                shown += 1
                print(f"  worker {p.pid}: {line[:200]}", flush=True)
        if p.returncode not in (0, None):
            print(f"  worker {p.pid} exited with {p.returncode}", flush=True)
    return status


# ---------------------------------------------------------------------------------------------------
# The measurements (this process)
# ---------------------------------------------------------------------------------------------------


@dataclass
class CellInputsAll:
    preset: str
    M: int
    shape: object  # moekit.bench.cells.Shape
    sets: list  # rotated CellInputs
    touched: float  # mean distinct experts per call over the sets
    twin: torch.Tensor  # the torch twin's output on sets[0]


@dataclass
class Measured:
    preset: str
    M: int
    candidate: str
    spec: dict  # the Candidate's fields
    status: str  # "ok", "FAIL (rel_l2)", "error: ...", "crashed in the compile worker", "not compiled", "no time"
    us: float | None = None
    err_twin: float | None = None
    floor_us: float | None = None
    pct_floor: float | None = None
    TFLOPs: float | None = None
    pct_fp8_mm: float | None = None
    vs_bf16: float | None = None  # bf16 µs / fp8 µs: >= 1 meets "never slower than bf16"


@dataclass
class Baseline:
    preset: str
    M: int
    touched: float
    floor_us: float
    bf16_us: float | None = None
    fp8_host_us: float | None = None  # eager, default plan: host issue time per call
    bf16_host_us: float | None = None
    rows: list = field(default_factory=list)  # Measured


def prepare(presets, dev):
    """Per preset: bf16 weights, e4m3 weights, and per M the rotated inputs and the twin's output; one bf16
    call per cell compiles its kernels meanwhile (the workers compile the fp8 ones)."""
    from fp8_device_check import quantize_blocks
    from moekit.bench.cells import Shape, make_sets, make_weights, measured_experts_touched
    from moekit.experts.triton import experts_triton
    from moekit.experts.triton_fp8 import fused_experts_fp8_torch

    weights, cells = {}, []
    for preset in presets:
        s = Shape.from_preset(preset)
        w = make_weights(s, torch.bfloat16, dev)
        q = (*quantize_blocks(w.w13), *quantize_blocks(w.w2))
        weights[preset] = (w, q)
        for m in BATCHES:
            once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
            sets = make_sets(s, m, max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
            touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
            first = sets[0]
            twin = fused_experts_fp8_torch(first.x, *q, first.topk_ids, first.topk_weights)
            experts_triton(first.x, w.w13, w.w2, first.topk_ids, first.topk_weights)
            cells.append(CellInputsAll(preset, m, s, sets, touched, twin))
        print(f"[{elapsed():5.1f}s] prepared {preset}", flush=True)
    return weights, cells


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(out.isfinite().all()):
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def time_graph(fn, sets, dev) -> float:
    from moekit.bench.timing import time_calls

    return time_calls([lambda t=t: fn(t) for t in sets], dev, graph=True, budget_s=0.04, min_reps=3, max_reps=12)


def measure(c: Candidate, cell: CellInputsAll, q, base: Baseline, fp8_mm, dev) -> Measured:
    """Check one candidate against the twin on sets[0], then time it."""
    row = Measured(cell.preset, cell.M, c.name, asdict(c), "ok", floor_us=base.floor_us)
    try:
        err = rel_l2(run_candidate(c, cell.sets[0], q), cell.twin)
        row.err_twin = err
        if not err < 2e-2:
            row.status = f"FAIL (rel_l2 {err:.2e})"
            return row
        row.us = time_graph(lambda t: run_candidate(c, t, q), cell.sets, dev)
    except Exception as e:  # noqa: BLE001  (one candidate's failure never ends the run)
        row.status = f"error: {type(e).__name__}: {str(e)[:160]}".replace("\n", " ")
        return row
    s = cell.shape
    row.pct_floor = 100 * base.floor_us / row.us
    row.TFLOPs = 6 * s.n * s.k * cell.M * s.top_k / (row.us * 1e-6) / 1e12
    row.pct_fp8_mm = 100 * row.TFLOPs / fp8_mm if fp8_mm else None
    row.vs_bf16 = base.bf16_us / row.us if base.bf16_us else None
    return row


def baseline(cell: CellInputsAll, w, q, ceilings, dev) -> Baseline:
    """bf16 graph time, and at M <= 64 the host µs of the default fp8 and of bf16 (eager)."""
    from fp8_device_check import floor_us
    from moekit.bench.timing import time_eager
    from moekit.experts.triton import experts_triton
    from moekit.experts.triton_fp8 import fused_experts_fp8

    base = Baseline(cell.preset, cell.M, cell.touched, floor_us(cell.shape, cell.M, cell.touched, ceilings))
    bf16 = lambda t: experts_triton(t.x, w.w13, w.w2, t.topk_ids, t.topk_weights)  # noqa: E731
    fp8 = lambda t: fused_experts_fp8(t.x, *q, t.topk_ids, t.topk_weights)  # noqa: E731
    try:
        base.bf16_us = time_graph(bf16, cell.sets, dev)
        if cell.M <= 64:
            base.fp8_host_us = time_eager([lambda t=t: fp8(t) for t in cell.sets], dev, repeats=3).host_us
            base.bf16_host_us = time_eager([lambda t=t: bf16(t) for t in cell.sets], dev, repeats=3).host_us
    except Exception as e:  # noqa: BLE001
        print(f"  baseline {cell.preset} M={cell.M}: {type(e).__name__}: {e}"[:300], flush=True)
    return base


def measure_all(cells, weights, status, ceilings, dev) -> list[Baseline]:
    """Every cell's baseline and default first, then the candidates, M = 16384 last, until DEADLINE_S."""
    early, late = [c for c in cells if c.M != 16384], [c for c in cells if c.M == 16384]
    jobs = [(c, 0) for c in early] + [(c, i) for c in early for i in range(1, len(candidates(c.M)))]
    jobs += [(c, i) for c in late for i in range(len(candidates(c.M)))]
    bases = {}
    for cell, i in jobs:
        w, q = weights[cell.preset]
        key = (cell.preset, cell.M)
        if key not in bases:
            if elapsed() > DEADLINE_S:
                continue
            bases[key] = baseline(cell, w, q, ceilings, dev)
        bases[key].rows.append(one(candidates(cell.M)[i], i, cell, q, bases[key], status, ceilings, dev))
    return list(bases.values())


def one(c: Candidate, i: int, cell, q, base: Baseline, status, ceilings, dev) -> Measured:
    compiled = status.get((cell.preset, cell.M, i))
    if elapsed() > DEADLINE_S:
        row = Measured(cell.preset, cell.M, c.name, asdict(c), "no time", floor_us=base.floor_us)
    elif i > 0 and compiled != "ok":  # the default runs here whatever (it ran in every session before)
        why = {None: "not compiled", "crashed": "crashed in the compile worker"}.get(compiled, compiled)
        row = Measured(cell.preset, cell.M, c.name, asdict(c), why, floor_us=base.floor_us)
    else:
        row = measure(c, cell, q, base, ceilings.fp8_mm_TFLOPs, dev)
    us = f"{row.us:9.1f}" if row.us is not None else "        -"
    print(f"[{elapsed():5.1f}s] {cell.preset:<14}{cell.M:>6} {c.name:<24}{us} us  {row.status}", flush=True)
    return row


def best(base: Baseline) -> Measured | None:
    timed = [r for r in base.rows if r.us is not None]
    return min(timed, key=lambda r: r.us) if timed else None


def print_tables(bases: list[Baseline], ceilings) -> None:
    print("\ncandidates (us; % of floor; rel L2 vs twin; status)")
    for b in bases:
        for r in b.rows:
            us = f"{r.us:9.1f}" if r.us is not None else "        -"
            pct = f"{r.pct_floor:5.0f}%" if r.pct_floor is not None else "     -"
            err = f"{r.err_twin:.1e}" if r.err_twin is not None else "-"
            print(f"{r.preset:<14}{r.M:>6} {r.candidate:<24}{us}{pct}  {err:>8}  {r.status}")
    mm = f"{ceilings.fp8_mm_TFLOPs:.0f}" if ceilings.fp8_mm_TFLOPs else "n/a"
    print(f"\ncopy {ceilings.copy_TBps:.2f} TB/s, fp8 mm {mm} TFLOP/s; default = tuned file or heuristic; "
          f"best = fastest candidate that passed; host = eager host us per call (fp8 default / bf16)")
    print(f"{'shape':<14}{'M':>6}{'floor':>9}{'bf16':>9}{'default':>9}{'%fl':>5}{'best':>9}{'%fl':>5}{'%mm':>5}"
          f"{'xbf16':>6}  {'best candidate':<24}{'host':>12}")
    for b in bases:
        d, top = (b.rows[0] if b.rows and b.rows[0].candidate == "default" else None), best(b)
        fmt = lambda v, w, p=1: f"{v:{w}.{p}f}" if v is not None else " " * (w - 1) + "-"  # noqa: E731
        host = f"{fmt(b.fp8_host_us, 5, 0)}/{fmt(b.bf16_host_us, 4, 0)}" if b.fp8_host_us else ""
        print(f"{b.preset:<14}{b.M:>6}{b.floor_us:9.1f}{fmt(b.bf16_us, 9)}{fmt(d and d.us, 9)}"
              f"{fmt(d and d.pct_floor, 5, 0)}{fmt(top and top.us, 9)}{fmt(top and top.pct_floor, 5, 0)}"
              f"{fmt(top and top.pct_fp8_mm, 5, 0)}{fmt(top and top.vs_bf16, 6, 2)}  "
              f"{(top.candidate if top else '-'):<24}{host:>12}")


def main() -> int:
    presets = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
    procs = start_workers(all_tasks(presets))
    dev = torch.device(DEVICE)
    torch.backends.cuda.matmul.allow_tf32 = False  # the twin's float32 GEMMs stay float32
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    weights, cells = prepare(presets, dev)
    status = collect_workers(procs)
    print(f"[{elapsed():5.1f}s] compiled: {sum(v == 'ok' for v in status.values())} ok, "
          f"{sum(v == 'crashed' for v in status.values())} crashed, "
          f"{sum(v.startswith('error') for v in status.values())} errors, of {len(all_tasks(presets))}", flush=True)
    from fp8_device_check import measure_ceilings

    ceilings = measure_ceilings(dev)
    bases = measure_all(cells, weights, status, ceilings, dev)
    print_tables(bases, ceilings)
    failed = [f"{r.preset} M={r.M} {r.candidate}" for b in bases for r in b.rows if r.status.startswith("FAIL")]
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "fp8_speed.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "triton": triton.__version__,
             "ceilings": asdict(ceilings), "compile": {" ".join(map(str, k)): v for k, v in status.items()},
             "cells": [asdict(b) for b in bases], "failed": failed, "seconds": elapsed()}, indent=1) + "\n")
    print(f"FAILED: {failed or 'none'}  ({elapsed():.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        sys.exit(main())

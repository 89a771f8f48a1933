"""Issues 19 / 15: Qwen3-30B-A3B decode (M = 1, 2, 8) toward the weight-stream floor, bf16 and fp8_block.

    PYTHONPATH=$PWD OUT=/tmp/o python benchmarks/decode_q3_device_check.py  # H200, < 150 s; JSON: $OUT/decode_q3.json
    PYTHONPATH=$PWD python benchmarks/decode_q3_device_check.py --smoke     # CPU: interpreter, tiny shapes, no timing

Variants of the tuned default (``decode_q3_variants``): ``KernelConfig.swap_ab`` (each K-step computes the transposed
product, so 16-row decode tiles run on wgmma) with the tuned tiles and neighbours, and "noswap" where the tuned
entry swaps. Cells: Qwen3-30B-A3B M = 1 / 2 / 8, DeepSeek-V3 and Mixtral-8x7B M = 1 / 8 (those must not get slower),
bf16 and fp8_block, uniform routing over rotated input sets. Run 1 (62cabd5) also measured the L2 prefetch of the
down weights and a 7-stage down GEMM: benchmarks/triton-notes.md.

Per cell: every variant's output on the first set against the default's (bit-equal where only tiles or stages
change: the sums run in the same order; a variant that flips SWAP_AB sums the same products in another order, so
only within the tolerance) and each one's against the reference (bf16: ``experts_reference``;
fp8: ``experts_fp8_block_reference``, the recipe); then CUDA-graph replay µs, the variants interleaved over ROUNDS
rounds, median per variant; % of the byte floor (copy bandwidth measured here); eager wall µs of the default and
of the cell's fastest variant. Compile: WORKERS subprocesses run every (cell, variant) once on small-E weights of
the same N and K (Triton's disk cache) while this process builds the real weights. Tables last.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from compile_workers import collect_workers, compile_one, held_weights, spawn_workers  # noqa: E402
from decode_q3_variants import CELLS, SMOKE_CELLS, Variant, variants  # noqa: E402
from moekit.quant.fp8_block import Fp8BlockWeight  # noqa: E402

T0 = time.perf_counter()
DEADLINE_S = 132.0  # stop timing here (the lead's limit is 150 s)
WORKER_DEADLINE_S = 62.0
WORKERS = 12
BIG_WORKERS = 1  # of them, the one that takes the tasks with DeepSeek-V3's full weights (11-23 GB each)
ROUNDS = 5
ROTATION_BYTES = 256 << 20
TOLERANCE = {"bf16": 2e-2, "fp8": 2e-2}


def elapsed() -> float:
    return time.perf_counter() - T0


def shape_of(preset: str, small_for_m: int = 0):
    """The preset's shape; ``small_for_m``: with the fewest experts that compile the same kernels at that M (the
    same N, K, E divisible by 16 and the same tiny-batch decision, A*4 <= E; past it, E itself: the folded
    alignment's constexprs depend on E)."""
    from moekit.bench.cells import Shape

    real = Shape.from_preset(preset)
    if SMOKE:
        return Shape(f"{preset}/smoke", min(real.num_experts, 8), 128, 256, min(real.top_k, 2))
    slots = small_for_m * real.top_k
    if small_for_m and real.num_experts % 16 == 0 and 4 * slots <= real.num_experts:
        return Shape(f"{preset}/small", max(16, -(-4 * slots // 16) * 16), real.n, real.k, real.top_k)
    return real


def fp8_weights(s, dev):
    """Fp8BlockWeight pair: random e4m3 with random 128 x 128 block scales, drawn 8 experts at a time."""
    pair = []
    for rows, cols in ((2 * s.n, s.k), (s.k, s.n)):
        q = torch.zeros(s.num_experts, rows, cols, dtype=torch.float8_e4m3fn, device=dev)
        g = torch.Generator(device=dev).manual_seed(rows * 7 + cols)
        for e0 in range(0, s.num_experts, 8):  # [8, rows, cols] float32 at a time: DeepSeek-V3's whole are 11-23 GB
            q[e0:e0 + 8] = (torch.randn(q[e0:e0 + 8].shape, generator=g, device=dev) * 48).clamp(-448, 448).to(q.dtype)
        scale = torch.rand(s.num_experts, math.ceil(rows / 128), math.ceil(cols / 128), device=dev) * 2e-4 + 1e-4
        pair.append(Fp8BlockWeight(q=q, scale=scale, dtype=torch.bfloat16))
    return tuple(pair)


def make_weights(dtype: str, s, dev):
    if dtype == "fp8":
        return fp8_weights(s, dev)
    from moekit.bench.cells import make_weights as bf16_weights

    w = bf16_weights(s, torch.bfloat16, dev)
    return w.w13, w.w2


def run_variant(v: Variant, dtype: str, base, t, w, eager: bool = False, explicit: bool = False):
    """One call of ``v``: the default (config None, the tuned entry; ``explicit``: that entry's config passed, as
    the compile workers' small-E weights would find no tuned file) or the tuned config changed by ``v``."""
    config = (base.config if explicit else None) if v.is_default else v.config(base.config)
    if dtype == "bf16":
        from moekit.experts.triton import fused_experts

        return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights, config=config)
    from moekit.experts.triton_fp8 import fused_experts_fp8_launch

    x_in = base.x_in_gate_up if (eager and not v.is_default) else None  # the default's eager switch (entry 1)
    return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                    config=config, x_in_gate_up=x_in)


def tuned(dtype: str, s, m: int, dev):
    """The tuned entry (``Fp8Entry``-like: .config, .x_in_gate_up) the default runs with."""
    from moekit.experts.configs import device_key, get_config
    from moekit.experts.triton_fp8_plan import Fp8Entry, fp8_entry

    key = device_key(dev)
    if dtype == "fp8":
        return fp8_entry(m, s.num_experts, s.n, s.k, s.top_k, 128, key)
    return Fp8Entry(get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, key))


def cells() -> list[tuple]:
    return list(SMOKE_CELLS if SMOKE else CELLS)


# ---------------------------------------------------------------------------------------------------
# Compile workers: each runs its (cell, variant) tasks once on small-E weights, printing START/OK/ERR
# ---------------------------------------------------------------------------------------------------


def worker_main(tasks: list) -> None:
    from moekit.bench.cells import make_sets

    dev, held = torch.device("cpu" if SMOKE else "cuda"), {}
    for ci, vi in tasks:
        dtype, preset, m = cells()[ci]
        s = shape_of(preset, small_for_m=m)
        w = held_weights(held, (dtype, s), lambda: make_weights(dtype, s, dev), free_cache=not SMOKE)
        base = lambda: tuned(dtype, shape_of(preset), m, dev)  # noqa: E731  (the real shape's entry)
        compile_one(ci, vi, lambda: run_variant(variants(dtype, preset, m)[vi], dtype, base(),
                                                make_sets(s, m, 1, torch.bfloat16, dev)[0], w, explicit=True), SMOKE)


def start_workers(workers: int) -> list:
    """Tasks whose small weights pass 4 GB (DeepSeek-V3 at M = 8: all 256 experts) go to the first BIG_WORKERS
    workers only (GPU memory), the rest round-robin over the others."""
    tasks = [(ci, vi) for ci, c in enumerate(cells()) for vi in range(len(variants(*c)))]

    def big(task) -> bool:
        s = shape_of(cells()[task[0]][1], small_for_m=cells()[task[0]][2])
        return s.num_experts * 3 * s.n * s.k * 2 > 4e9

    heavy, light = [t for t in tasks if big(t)], [t for t in tasks if not big(t)]
    n_big = min(BIG_WORKERS, workers - 1) if heavy else 0
    slices = [heavy[j::n_big] for j in range(n_big)] + [light[j::workers - n_big] for j in range(workers - n_big)]
    return spawn_workers(__file__, slices, SMOKE, "decode_q3")


# ---------------------------------------------------------------------------------------------------
# The measurements (this process)
# ---------------------------------------------------------------------------------------------------


@dataclass
class Row:
    variant: str
    status: str = "ok"
    samples: list = field(default_factory=list)  # graph µs per round
    us: float | None = None  # median of samples
    pct_floor: float | None = None
    eager_us: float | None = None
    host_us: float | None = None
    equal_default: bool | None = None
    rel_l2_ref: float | None = None


@dataclass
class Cell:
    dtype: str
    preset: str
    M: int
    floor_us: float | None = None
    touched: float = 0.0
    rows: list = field(default_factory=list)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(out.isfinite().all()):
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def reference(dtype: str, t, w) -> torch.Tensor:
    if dtype == "fp8":
        from moekit.quant.emulate import experts_fp8_block_reference

        return experts_fp8_block_reference(t.x, w[0], w[1], t.topk_ids, t.topk_weights)
    from moekit.experts.reference import experts_reference

    return experts_reference(t.x, w[0], w[1], t.topk_ids, t.topk_weights)


def floor_us(dtype: str, s, m: int, touched: float, copy_tbps: float) -> float:
    """Bytes of the touched experts' weights (fp8: e4m3 + fp32 128x128 block scales), x and out, at copy speed."""
    if dtype == "fp8":
        scales = 4 * (math.ceil(2 * s.n / 128) * math.ceil(s.k / 128) + math.ceil(s.k / 128) * math.ceil(s.n / 128))
        per_expert = 3 * s.n * s.k + scales
    else:
        per_expert = 3 * s.n * s.k * 2
    return (touched * per_expert + 2 * m * s.k * 2) / (copy_tbps * 1e12) * 1e6


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
        if not row.rel_l2_ref < TOLERANCE[cell.dtype]:
            row.status = f"FAIL (rel_l2 {row.rel_l2_ref:.2e})"
            continue
        timed.append((vi, v, row))
    return timed


def time_cell(cell: Cell, timed: list, base, sets, w, dev) -> None:
    """Graph µs, the variants interleaved over ROUNDS rounds; eager µs of the default and the fastest."""
    from moekit.bench.timing import time_calls, time_eager

    for _ in range(ROUNDS):
        for _, v, row in timed:
            if elapsed() > DEADLINE_S:
                break
            fns = [lambda t=t, v=v: run_variant(v, cell.dtype, base, t, w) for t in sets]
            row.samples.append(time_calls(fns, dev, graph=True, budget_s=0.012, min_reps=3, max_reps=10))
    for _, _, row in timed:
        if row.samples:
            row.us = statistics.median(row.samples)
            row.pct_floor = 100 * cell.floor_us / row.us
    done = [(v, row) for _, v, row in timed if row.us is not None]
    if not done or elapsed() > DEADLINE_S:
        return
    best = min(done, key=lambda d: d[1].us)
    for v, row in {id(r): (v, r) for v, r in (done[0], best)}.values():
        e = time_eager([lambda t=t, v=v: run_variant(v, cell.dtype, base, t, w, eager=True) for t in sets], dev,
                       repeats=3)
        row.eager_us, row.host_us = e.eager_us, e.host_us


def breakdowns(results: list, weights: dict, dev) -> dict:
    """Each kernel's eager device µs (``fp8_kernel_breakdown``) of the default and the fastest variant of the
    Qwen3-30B-A3B M = 1 cells, while time is left (DEADLINE_S + 10 s)."""
    from fp8_kernel_breakdown import describe, kernel_breakdown

    found = {}
    for c in (c for c in results if c.preset == "qwen3-30b-a3b" and c.M == 1):
        timed = [r for r in c.rows if r.us is not None]
        picks = {r.variant for r in timed[:1] + sorted(timed[1:], key=lambda r: r.us)[:1]}
        base = tuned(c.dtype, shape_of(c.preset), c.M, dev)
        for v in (v for v in variants(c.dtype, c.preset, c.M) if v.name in picks and elapsed() < DEADLINE_S + 10):
            t = make_sets_once(shape_of(c.preset), c.M, dev)
            line = describe(kernel_breakdown(lambda: run_variant(v, c.dtype, base, t, weights[(c.dtype, c.preset)])))
            found[f"{c.dtype} {c.preset} {c.M} {v.name}"] = line
            print(f"kernels {c.dtype} {c.preset} M={c.M} {v.name}: {line}", flush=True)
    return found


def make_sets_once(s, m: int, dev):
    from moekit.bench.cells import make_sets

    return make_sets(s, m, 1, torch.bfloat16, dev)[0]


def measure_copy(dev) -> float:
    from moekit.bench.timing import time_calls

    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev).random_()
    dst = torch.empty_like(src)
    tbps = 2 * src.numel() / (time_calls([lambda: dst.copy_(src)], dev, budget_s=0.1) * 1e-6) / 1e12
    del src, dst
    return tbps


def print_cell(c: Cell) -> None:
    d = next((r for r in c.rows if r.variant == "default"), None)
    for r in c.rows:
        us = f"{r.us:8.1f}" if r.us is not None else "       -"
        pct = f"{r.pct_floor:4.0f}%" if r.pct_floor is not None else "    -"
        vs = f"{r.us / d.us:6.3f}" if r.us is not None and d is not None and d.us else "     -"
        spread = f"{min(r.samples):.1f}-{max(r.samples):.1f}" if r.samples else "-"
        eager = f"{r.eager_us:7.1f}/{r.host_us:5.1f}" if r.eager_us is not None else "      -/    -"
        eq = {True: "=", False: "~", None: " "}[r.equal_default]
        err = f"{r.rel_l2_ref:.1e}" if r.rel_l2_ref is not None else "-"
        print(f"{c.dtype:<5}{c.preset:<14}{c.M:>3} {r.variant:<16}{us}{pct} x{vs} [{spread:>11}] eager {eager} "
              f"{err:>8}{eq} {r.status}", flush=True)


def main() -> int:
    dev = torch.device("cpu" if SMOKE else "cuda")
    procs = start_workers(1 if SMOKE else WORKERS)
    import triton

    from moekit.bench.cells import make_sets, measured_experts_touched

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    weights = {}
    for dtype, preset, _ in cells():
        if (dtype, preset) not in weights:
            weights[(dtype, preset)] = make_weights(dtype, shape_of(preset), dev)
    print(f"[{elapsed():5.1f}s] weights built", flush=True)
    copy_tbps = 1.0 if SMOKE else measure_copy(dev)
    status = collect_workers(procs, lambda: WORKER_DEADLINE_S - elapsed())
    print(f"[{elapsed():5.1f}s] compiled {sum(v == 'ok' for v in status.values())} of {len(status)}; copy "
          f"{copy_tbps:.2f} TB/s; others: {sorted(set(status.values()) - {'ok'})}"[:600], flush=True)
    results = []
    for ci, (dtype, preset, m) in enumerate(cells()):
        s, cell = shape_of(preset), Cell(dtype, preset, m)
        results.append(cell)
        vs, base, w = variants(dtype, preset, m), tuned(dtype, shape_of(preset), m, dev), weights[(dtype, preset)]
        once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
        sets = make_sets(s, m, 1 if SMOKE else max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
        cell.touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
        cell.floor_us = floor_us(dtype, s, m, cell.touched, copy_tbps)
        timed = check_cell(cell, vs, base, sets, w, status, ci)
        if not SMOKE:
            time_cell(cell, timed, base, sets, w, dev)
        print(f"[{elapsed():5.1f}s]", flush=True)
        print_cell(cell)
    exact = {(c.dtype, c.preset, c.M, v.name): v.exact for c in results for v in variants(c.dtype, c.preset, c.M)}
    kernels = {} if SMOKE else breakdowns(results, weights, dev)
    failed = [f"{c.dtype} {c.preset} M={c.M} {r.variant}" for c in results for r in c.rows
              if r.status.startswith(("FAIL", "error")) or (r.equal_default is False
                                                            and exact[(c.dtype, c.preset, c.M, r.variant)])]
    print("\nall cells (graph µs median of rounds, % of byte floor, x default, [round min-max], eager wall/host µs, "
          "rel L2 vs reference, = bit-equal to default)")
    for c in results:
        print_cell(c)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_q3.json").write_text(json.dumps(
            {"device": name, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": copy_tbps,
             "cells": [asdict(c) for c in results], "kernels": kernels, "failed": failed, "seconds": elapsed()},
            indent=1) + "\n")
    print(f"FAILED (error, over tolerance, or an exact variant not bit-equal to default): {failed or 'none'}  "
          f"({elapsed():.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker_main([tuple(t) for t in json.loads(sys.argv[2])])
    else:
        sys.exit(main())

"""Issue 15, session 31 (branch `f8pp31`): the fp8 Gluon GEMMs with the pipelined per-128 promotion
(``Fp8GluonTile.pipelined``: two wgmmas in flight, one's part folded in while the other runs) against the route, at
fp8 Mixtral-8x7B M = 1024 / 512 and DeepSeek-V3 M = 4096.

    PYTHONPATH=$PWD timeout 78 python3 benchmarks/f8pp_device_check.py --out $OUT/f8pp31 --deadline 64
        [--cells fp8:mixtral-8x7b:1024 ...] [--rounds 5] [--worker-deadline 34]

1. Two compile workers (this script with --worker plans / pipes, in parallel) run once each, on zero weights of the
   real shapes: per preset the route, the lean Gluon call with the plan's tiles ("gluon") and the GEMMs alone; and
   the pipelined calls ("pipe": the down GEMM pipelined) and GEMMs, then the odd-K shapes. What a
   worker did not finish is not run here (a hang in the new barrier walk must not take the run with it). Then the
   ceilings of this run: copy bandwidth, the fp8 mm rate.
2. Odd K (E = 4, K = 256, N = 384 and 128: a pair and an odd down step, an odd step alone): gluon, pipe
   against the fp8 Gluon path's torch twin (PASS / FAIL), the pipelined ones against gluon bit for bit (reported).
3. Per cell (the bench's weights quantized, uniform routing seeded by M): route, gluon, pipe the same way;
   whole calls in --rounds CUDA-graph rounds interleaved replay by replay (``f8pre_device_check.replay_rounds``);
   then the GEMMs alone on the cell's layout (gate-up, down, down pipe) in the same kind of rounds, and
   their outputs pipelined against the plan's (PASS / FAIL).
The table is printed last: median µs, % of the byte-model floor (and its 90% target) or % of the fp8 mm rate, x the
route (x gluon) / x the plan's GEMM, rounds >= 3% faster. JSON to --out/f8pp.json after each cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import prefill_device_check as pdc  # noqa: E402
from bench_rounds import versus  # noqa: E402
from f8mid8_device_check import build_cell  # noqa: E402
from f8pre_device_check import floor_us, replay_rounds  # noqa: E402
from prefill_variants import Variant  # noqa: E402

CELLS = ("fp8:mixtral-8x7b:1024", "fp8:mixtral-8x7b:512", "fp8:deepseek-v3:4096")
ODD = ((4, 256, 384), (4, 256, 128))  # (E, K, N) of the odd-K checks: 3 K-steps of the down GEMM, 1
RESULTS: dict = {"cells": [], "odd": {}}
log = pdc.log


def calls(q: tuple) -> list[Variant]:
    """The route (the ``triton`` backend), the lean Gluon call with the plan's tiles (since session 32 the pipelined
    down from 256 rows an expert) and with the pipelined down ("pipe"). (Session 31's "pipe2", the gate-up in
    pipelined halves too, lost 0.77-0.81x on the H200 and was removed with its tile: history c7e4995.)"""
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.experts.triton_gluon_fp8_launch import PIPELINED_DOWN_TILE
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    return [Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            Variant("gluon", "gluon", lambda x, i, r: experts_gluon_fp8(x, *q, i, r)),
            Variant("pipe", "gluon", lambda x, i, r: experts_gluon_fp8(x, *q, i, r, down=PIPELINED_DOWN_TILE))]


def gemms_alone(x: torch.Tensor, ids: torch.Tensor, q: tuple) -> tuple[list[Variant], dict]:
    """The cell's GEMMs alone on its layout: the plan's gate-up (run once here: it writes the h the down GEMMs
    read), the plan's down and the pipelined one (each its own output); and {GEMM: (the plan's output, the
    pipelined one's)}."""
    from moekit.experts.triton_gluon_fp8 import gluon_fp8_layout
    from moekit.experts.triton_gluon_fp8_launch import (
        PIPELINED_DOWN_TILE, launch_gemm_fp8, plan_gluon_fp8,
    )

    w13_q, w13_s, w2_q, w2_s = q
    num_experts, hidden, inter = w2_q.shape
    plan = plan_gluon_fp8(x.shape[0], ids.shape[1], num_experts, hidden, inter=inter)
    lay = gluon_fp8_layout(x, ids, num_experts, gather_groups=plan.gather_groups)
    rows = lay.x_q.shape[0]
    h_q = torch.zeros(rows, inter, device=x.device, dtype=torch.float8_e4m3fn)  # [R, N]
    h_s = torch.ones(rows, inter // 128, device=x.device, dtype=torch.float32)  # [R, N/128]
    y, y_pipe = x.new_empty(rows, hidden), x.new_empty(rows, hidden)  # [R, K]
    common = (lay.block_experts, lay.rows_used)

    def up(tile, out, out_s):
        launch_gemm_fp8(lay.x_q, lay.x_s, w13_q, w13_s, out, out_s, *common, tile, True, inter)

    up(plan.up, h_q, h_s)
    outs = {"down": (y, y_pipe), "rows_used": lay.rows_used}
    return [Variant("gate-up", "gemm", lambda *_: up(plan.up, h_q, h_s)),
            Variant("down", "gemm", lambda *_: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y, None, *common, plan.down,
                                                               False)),
            Variant("down pipe", "gemm", lambda *_: launch_gemm_fp8(h_q, h_s, w2_q, w2_s, y_pipe, None, *common,
                                                                    PIPELINED_DOWN_TILE, False))], outs


def compare_gemms(name: str, outs: dict) -> dict:
    """Each GEMM alone, pipelined against the plan's (after the rounds: both ran on the same inputs) on the rows in
    use (the padding rows of a used block too): bit-equal, rel L2 (PASS / FAIL at 1e-2; h as its e4m3 values)."""
    got, used = {}, int(outs["rows_used"].item())
    for gemm, (plan, pipe) in ((k, v) for k, v in outs.items() if k != "rows_used"):
        a, b = plan[:used].float(), pipe[:used].float()
        finite = torch.isfinite(a) & torch.isfinite(b)  # padding rows may hold what the buffers held (NaN codes)
        same_finite = torch.equal(finite, torch.isfinite(a))
        a, b = a[finite], b[finite]
        err = float((a - b).norm() / a.norm().clamp_min(1e-30)) if same_finite else float("inf")
        got[gemm] = {"bit_equal": same_finite and torch.equal(a, b), "rel_l2": err}
        log(f"{'PASS' if err < 1e-2 else 'FAIL'} {name} {gemm} alone, pipelined vs the plan's: bit-equal "
            f"{got[gemm]['bit_equal']}, rel L2 {err:.2e}")
        if err >= 1e-2:
            pdc.FAILED.append(f"{name} {gemm} alone")
    return got


def odd_problem(e: int, k: int, n: int, dev) -> tuple:
    """x [64, K] bf16, the quantized weights of E experts (K hidden, N inter), top-2 routing."""
    g = torch.Generator(device=dev).manual_seed(n)
    x = torch.randn(64, k, device=dev, generator=g).bfloat16()
    q13 = pdc.quantize_chunked(torch.randn(e, 2 * n, k, device=dev, generator=g).bfloat16() / k**0.5)
    q2 = pdc.quantize_chunked(torch.randn(e, k, n, device=dev, generator=g).bfloat16() / n**0.5)
    ids = torch.rand(64, e, device=dev, generator=g).topk(2, dim=1).indices.int()
    return x, (*q13, *q2), ids, torch.rand(64, 2, device=dev, generator=g)


def check_odd(dev) -> None:
    """pipe against gluon (bit for bit, reported) and the twin (PASS / FAIL) where the down GEMM's K-steps are odd."""
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    for e, k, n in ODD:
        x, q, ids, rw = odd_problem(e, k, n, dev)
        ref = experts_gluon_fp8_twin(x, *q, ids, rw)
        outs: dict = {}
        name = f"odd K E={e} K={k} N={n}"
        ok = [pdc.check(name, v, x, ids, rw, ref, "fp8", outs) for v in calls(q)[1:]]
        RESULTS["odd"][name] = {"pass": all(ok), "bit_equal": bit_equal(name, outs)}


def bit_equal(name: str, outs: dict) -> dict:
    """Each pipelined call's output against gluon's, bit for bit (the same parts folded in the same order), logged."""
    same = {n: torch.equal(outs[n], outs["gluon"]) for n in ("pipe",) if n in outs and "gluon" in outs}
    log(f"{name} vs gluon, bit-equal: {same}")
    return same


def run_cell(spec: str, ceil, opts) -> None:
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    preset, m, s, q, ids, rw, x = build_cell(spec, torch.device("cuda"))
    name = f"fp8 {preset} M={m}"
    ref = experts_gluon_fp8_twin(x, *q, ids, rw)
    outs: dict = {}
    ran = [v for v in calls(q) if f"{preset} {v.name}" in opts.ran]
    passing = [v for v in ran if pdc.check(name, v, x, ids, rw, ref, "fp8", outs)]
    same = bit_equal(name, outs)
    del ref, outs
    a = m * s.top_k
    cell = {"cell": spec, "floor_us": floor_us(s, m, ids, ceil), "mm_TFLOPs": ceil.fp8_mm_TFLOPs,
            "copy_TBps": ceil.copy_TBps, "pipe_bit_equal": same, "passing": [v.name for v in passing],
            "gemm_flops": {"gate-up": 4 * a * s.n * s.k, "down": 2 * a * s.n * s.k}}
    cell["rounds_us"] = replay_rounds(name, passing, x, ids, rw, opts.rounds, opts.deadline - 8)
    if time.perf_counter() - pdc.T0 < opts.deadline - 6:
        gemms, gemm_outs = gemms_alone(x, ids, q)
        gemms = [v for v in gemms if v.name == "gate-up" or f"{preset} {v.name}" in opts.ran]
        cell["gemm_rounds_us"] = replay_rounds(f"{name} GEMMs", gemms, x, ids, rw, opts.rounds, opts.deadline - 4)
        torch.cuda.synchronize()
        if "down pipe" in {v.name for v in gemms}:
            cell["gemms_alone_vs_plan"] = compare_gemms(name, gemm_outs)
    summarize(name, cell)
    RESULTS["cells"].append(cell)
    (opts.out / "f8pp.json").write_text(json.dumps(RESULTS, indent=1))


def summarize(name: str, cell: dict) -> None:
    for rounds, base in ((cell["rounds_us"], "route"), (cell.get("gemm_rounds_us", {}), "down")):
        for n, t in rounds.items():
            if not t:
                continue
            med = statistics.median(t)
            line = f"{name:24s} {n:12s} {med:8.1f} us"
            if base == "route":
                line += f" {100 * cell['floor_us'] / med:5.1f}% floor"
            else:
                flops = cell["gemm_flops"][n.split(" ")[0]]
                line += f" {100 * flops / (med * 1e-6) / 1e12 / cell['mm_TFLOPs']:5.1f}% mm"
            peer = base if base == "route" else n.split(" ")[0]  # a GEMM alone against the plan's
            if n != peer and rounds.get(peer):
                line += f"  vs {peer} {versus(t, rounds[peer])}"
            if n.startswith("pipe") and rounds.get("gluon"):
                line += f"  vs gluon {versus(t, rounds['gluon'])}"
            pdc.SUMMARY.append(line)
    pdc.SUMMARY.append(f"{name:24s} floor {cell['floor_us']:.1f} us (target, 90%: {cell['floor_us'] / 0.9:.1f} us)")


def worker(group: str, cells: list) -> int:
    """Each call and GEMM of ``group`` once on zero weights (the odd-K shapes on random ones), printing "OK <key>"
    after each: the keys ``main`` runs. "plans": the route, the plan's tiles; "pipes": the pipelined GEMMs at the
    real shapes, then the odd-K shapes (their own compiles: a hang there leaves the plans' worker done)."""
    from f8mid8_variants import zero_weights

    from moekit.bench.cells import Shape, uniform_routing

    dev = torch.device("cuda")
    plans, pipes = [], []
    for preset, m in {c.split(":")[1]: c.split(":")[2] for c in reversed(cells)}.items():  # each preset's first
        s, q = Shape.from_preset(preset), zero_weights(preset, dev)
        routing = uniform_routing(int(m), s, dev, seed=int(m))
        x = torch.randn(int(m), s.k, device=dev, dtype=torch.bfloat16)
        run = {v.name: (lambda v=v, x=x, r=routing: v.call(x, r.topk_ids, r.topk_weights)) for v in calls(q)}
        run |= {v.name: (lambda v=v: v.call()) for v in gemms_alone(x, routing.topk_ids, q)[0]}
        plans += [(f"{preset} {n}", run[n]) for n in ("route", "gluon", "down")]
        pipes += [(f"{preset} {n}", run[n]) for n in ("pipe", "down pipe")]

    def odd():
        for shape in ODD:
            x, q, ids, rw = odd_problem(*shape, dev)
            for v in calls(q)[1:]:
                v.call(x, ids, rw)

    for key, fn in plans if group == "plans" else pipes + [("odd", odd)]:
        try:
            fn()
            torch.cuda.synchronize()  # a fault shows here, before the OK
        except Exception as exc:  # noqa: BLE001 (a compile error leaves the rest; a fault fails them too)
            print(f"FAIL {key}: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
            continue
        print(f"OK {key}", flush=True)
    return 0


def run_workers(cells: list, until: float, script: str = __file__, groups: tuple = ("plans", "pipes")) -> set:
    """The keys the compile workers (``script --worker GROUP CELLS...``, one a group, in parallel, logging to /tmp)
    finished, each waited for until ``until`` s into the run (then killed)."""
    procs, done = [], set()
    for group in groups:
        path = Path(f"/tmp/{Path(script).stem}_worker_{group}.log")
        with open(path, "w") as f:
            procs.append((subprocess.Popen([sys.executable, script, "--worker", group, *cells], stdout=f,
                                           stderr=subprocess.STDOUT), path))
    for proc, path in procs:
        try:
            proc.wait(timeout=max(0.1, until - (time.perf_counter() - pdc.T0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        lines = path.read_text(errors="replace").strip().splitlines()
        for line in (ln for ln in lines if ln.startswith("FAIL ")):
            log(f"worker {path.name}: {line[:700]}")
        log(f"worker {path.name}: rc {proc.returncode}, {(lines or ['(no output)'])[-1][-300:]}")
        done |= {ln[3:] for ln in lines if ln.startswith("OK ")}
    return done


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=64.0, help="seconds: no new cell or timing after ~this")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="*", default=list(CELLS))
    parser.add_argument("--worker-deadline", type=float, default=34.0)
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    pdc.STALL_S = 40.0
    threading.Thread(target=pdc.watchdog, daemon=True).start()
    from moekit.bench.ceilings import measure_ceilings, measure_fp8_mm

    dev = torch.device("cuda")
    opts.ran = run_workers(opts.cells, opts.worker_deadline)  # the ceilings measured on a GPU the workers have left
    ceil = measure_ceilings(dev)
    ceil = replace(ceil, fp8_mm_TFLOPs=measure_fp8_mm(dev).TFLOPs)
    RESULTS["ceilings"] = {"copy_TBps": ceil.copy_TBps, "fp8_mm_TFLOPs": ceil.fp8_mm_TFLOPs}
    log(f"copy {ceil.copy_TBps:.2f} TB/s, fp8 mm {ceil.fp8_mm_TFLOPs:.0f} TFLOP/s; torch {torch.__version__}")
    if "odd" in opts.ran:
        check_odd(dev)
    else:
        log("FAIL odd K: the worker did not finish it (not run)")
        pdc.FAILED.append("odd K")
    pdc.RUN.each_cell(opts.cells, lambda spec: run_cell(spec, ceil, opts), opts.deadline - 12, pdc.free_memory)
    missing = [k for s in opts.cells for k in ("pipe", "down pipe")
               if f"{s.split(':')[1]} {k}" not in opts.ran]
    if missing:
        log(f"FAIL the worker did not finish {len(missing)} pipelined runs (not run)")
        pdc.FAILED.append("pipe worker")
    (opts.out / "f8pp.json").write_text(json.dumps(RESULTS, indent=1))
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], sys.argv[3:]))
    sys.exit(main())

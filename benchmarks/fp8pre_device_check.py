"""Issue 15 at prefill (branch `fp8pre`): where an fp8_block call at M >= 4096 loses the fp8 matmul rate, and the down
GEMM on [128, 256] tiles (``Fp8GluonTile.wide``) against today's [128, 128].

    PYTHONPATH=$PWD python3 benchmarks/fp8pre_device_check.py --out $OUT/fp8pre [--deadline-s 130] [--rounds 5]
        [--cells fp8:qwen3-30b-a3b:4096 fp8:deepseek-v3:16384] [--no-dense] [--no-kernels] [--no-gemms]
        [--variants route,lean,...]

1. Dense block-scaled fp8 GEMMs (``fp8pre_dense``): the fp8 Gluon kernel on one expert holding every row at each
   cell's two GEMM shapes and at 8192^3 (down plain / wide, gate-up), torch's block-scaled mm where this torch has
   one, torch's per-tensor mm with and without fast accumulation; each checked on its first rows against a float32
   product (PASS/FAIL), then timed (CUDA-graph replay, 3 interleaved rounds, median): µs, TFLOP/s, % of the fp8 mm
   rate.
2. Per cell (uniform routing, seeded; ``prefill_device_check``'s harness): the route, "lean" (the fp8 Gluon path's
   lean launch with the plan's tiles), "lean wide" (its down GEMM on wide tiles) and "lean gq4" (the gather-quantize
   kernel taking 4 column groups per program) and both ("lean gq4 wide"), each bit for bit equal to "lean" (which pins
   session 24's kernels: 1 group, [128, 128] down tiles), against the torch twin (rel L2 < 1e-2); the route's kernels (profiler µs: alignment, gather-quant, gate-up, down,
   combine); whole calls in interleaved graph rounds; each GEMM alone under uniform and balanced routing with the
   rows computed per real row.
JSON to ``--out``/fp8pre.json after each part; the table is printed last. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import fp8pre_dense as fd  # noqa: E402
import prefill_device_check as pdc  # noqa: E402
import prefill_variants as pv  # noqa: E402

CELLS = ("fp8:qwen3-30b-a3b:4096", "fp8:deepseek-v3:16384")
DENSE = {  # name: (rows T, reduce R, weight rows W_ROWS, gated)
    "qwen3 4096 gate-up": (32768, 2048, 1536, True), "qwen3 4096 down": (32768, 768, 2048, False),
    "dsv3 16384 gate-up": (131072, 7168, 4096, True), "dsv3 16384 down": (131072, 2048, 7168, False),
    "8192^3 down": (8192, 8192, 8192, False), "8192^3 gate-up": (8192, 8192, 16384, True),
}
RESULTS: dict = {"dense": {}, "cells": []}
log = pdc.log


def dense_part(mm: float, rounds: int, stop_at: float, out_dir: Path) -> None:
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE, WIDE_DOWN_TILE

    dev = torch.device("cuda")
    for name, (rows, reduce_dim, w_rows, gated) in DENSE.items():
        if time.perf_counter() - pdc.T0 > stop_at:
            log(f"SKIP dense {name}: deadline")
            continue
        p = fd.make_dense(name, rows, reduce_dim, w_rows, gated, dev)
        want = fd.expected(p)
        calls = {}
        tiles = {"gluon": UP_TILE} if gated else {"gluon": DOWN_TILE, "gluon wide": WIDE_DOWN_TILE}
        for label, tile in tiles.items():
            try:
                launch, result = fd.gluon_call(p, tile)
                launch()
                torch.cuda.synchronize()
                err = pdc.rel_l2(result(), want)
            except Exception as exc:  # noqa: BLE001
                log(f"FAIL dense {name} {label}: {type(exc).__name__}: {str(exc)[-400:]}")
                pdc.FAILED.append(f"dense {name} {label}")
                continue
            tol = 6e-2 if gated else 1e-2  # gated: h rounded to e4m3
            ok = err < tol
            log(f"{'PASS' if ok else 'FAIL'} dense {name} {label}: rel L2 {err:.2e} (< {tol:g})")
            if ok:
                calls[label] = launch
            else:
                pdc.FAILED.append(f"dense {name} {label}")
        if not gated:
            how, fn = fd.torch_blockwise(p)
            log(f"dense {name} torch block-scaled: {how}")
            if fn is not None:
                calls["torch blockwise"] = fn
            a, w = p.a, p.w[0]
            one = torch.ones((), device=dev)
            for fast in (True, False):
                calls[f"torch tensorwise{' fast' if fast else ''}"] = (
                    lambda fast=fast: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                       use_fast_accum=fast))
        per = interleaved(calls, rounds)
        got = {}
        for label, t in per.items():
            us = statistics.median(t)
            tf = p.flops / (us * 1e-6) / 1e12
            got[label] = {"us": us, "rounds": t, "TFLOPs": tf, "pct_fp8_mm": 100 * tf / mm}
            pdc.SUMMARY.append(f"dense {name:20s} {label:24s} {us:9.1f} us {tf:7.0f} TFLOP/s {100 * tf / mm:5.1f}% mm")
            log(pdc.SUMMARY[-1])
        if "gluon" in per and "gluon wide" in per:
            wins = sum(b / v >= 1.03 for b, v in zip(per["gluon"], per["gluon wide"]))
            pdc.SUMMARY.append(f"dense {name:20s} wide vs plain x{got['gluon']['us'] / got['gluon wide']['us']:.3f}"
                               f" (>=3% in {wins}/{len(per['gluon'])})")
        RESULTS["dense"][name] = got
        (out_dir / "fp8pre.json").write_text(json.dumps(RESULTS, indent=1))
        del calls, p, want
        torch.cuda.empty_cache()


def interleaved(calls: dict, rounds: int) -> dict:
    """label -> µs per round (CUDA-graph replay; each round starts with the next label)."""
    graphs = {label: pdc.capture(fn) for label, fn in calls.items()}
    per = {label: [] for label in graphs}
    for r in range(rounds):
        order = list(graphs)
        for label in order[r % len(order):] + order[:r % len(order)]:
            per[label].append(pdc.replay_us(graphs[label]))
    return per


def fp8_variants(q: tuple) -> list:
    from moekit.experts import run_experts
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8
    from moekit.experts.triton_gluon_fp8_launch import DOWN_TILE, UP_TILE, WIDE_DOWN_TILE
    from moekit.quant.fp8_block import Fp8BlockWeight

    w13 = Fp8BlockWeight(q=q[0], scale=q[1], block_shape=(128, 128))
    w2 = Fp8BlockWeight(q=q[2], scale=q[3], block_shape=(128, 128))
    def lean(groups: int, down):
        return with_gather_groups(groups, lambda x, i, r: experts_gluon_fp8(x, *q, i, r, up=UP_TILE, down=down))

    return [pv.Variant("route", "route", lambda x, i, r: run_experts(x, w13, w2, i, r, backend="triton")),
            pv.Variant("lean", "gluon", lean(1, DOWN_TILE), (UP_TILE, DOWN_TILE)),  # session 24's kernels
            pv.Variant("lean wide", "gluon", lean(1, WIDE_DOWN_TILE), (UP_TILE, WIDE_DOWN_TILE), same_as="lean"),
            pv.Variant("lean gq4", "gluon", lean(4, DOWN_TILE), same_as="lean"),
            pv.Variant("lean gq4 wide", "gluon", lean(4, WIDE_DOWN_TILE), same_as="lean")]


def with_gather_groups(groups: int, call):
    """``call`` with the gather-quantize kernel taking ``groups`` 128-column groups per program (the lean plans built
    for it and dropped after it: GATHER_GROUPS is not in a plan's key)."""
    from moekit.experts import triton_gluon_fp8_launch as fl, triton_gluon_lean as lean

    def run(*args):
        old = fl.GATHER_GROUPS
        fl.GATHER_GROUPS = groups
        lean._PLANS.clear()
        lean._SEQUENCES.clear()
        try:
            return call(*args)
        finally:
            fl.GATHER_GROUPS = old
            lean._PLANS.clear()
            lean._SEQUENCES.clear()

    return run


def run_cell(spec: str, mm: float, rounds: int, stop_at: float, out_dir: Path, opts) -> None:
    from moekit.bench.cells import Shape, make_weights, uniform_routing
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    dev = torch.device("cuda")
    _, preset, m = spec.split(":")
    m = int(m)
    s = Shape.from_preset(preset)
    w = make_weights(s, torch.bfloat16, dev)
    q = (*pdc.quantize_chunked(w.w13), *pdc.quantize_chunked(w.w2))
    del w
    log(f"{spec}: weights quantized")
    routing = uniform_routing(m, s, dev, seed=m)
    ids, rw = routing.topk_ids, routing.topk_weights
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    ref = experts_gluon_fp8_twin(x, *q, ids, rw)
    log(f"{spec}: twin done")
    name = f"fp8 {preset} M={m}"
    variants = [v for v in fp8_variants(q) if not opts.variants or v.name in opts.variants.split(",")]
    outs: dict = {}
    passing = [v for v in variants if pdc.check(name, v, x, ids, rw, ref, "fp8", outs)]
    del ref, outs
    cell = {"cell": spec, "mm_TFLOPs": mm, "flops": 6 * m * s.top_k * s.n * s.k}
    for v in passing if opts.kernels else []:
        cell[f"{v.name} kernels"] = pdc.route_kernels(f"{name} {v.name}", v, x, ids, rw)
    cell["rounds_us"] = pdc.whole_calls(name, passing, x, ids, rw, rounds, stop_at)
    RESULTS["cells"].append(cell)
    (out_dir / "fp8pre.json").write_text(json.dumps(RESULTS, indent=1))
    pdc.summarize(name, cell)
    rounds_us = cell["rounds_us"]
    for other in ("lean wide", "lean gq4", "lean gq4 wide"):
        if rounds_us.get("lean") and rounds_us.get(other):
            base, t = rounds_us["lean"], rounds_us[other]
            wins = sum(b / v >= 1.03 for b, v in zip(base, t))
            pdc.SUMMARY.append(f"{name:34s} {other} vs lean x{statistics.median(base) / statistics.median(t):.3f} "
                               f"(>=3% in {wins}/{len(t)})")
    if opts.gemms and time.perf_counter() - pdc.T0 < stop_at:
        cell["gemms"] = pdc.gemms_apart(name, s, x, ids, passing, q, "fp8", mm, stop_at)
        (out_dir / "fp8pre.json").write_text(json.dumps(RESULTS, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=130.0, help="no new timing after this many seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="*", default=list(CELLS))
    parser.add_argument("--no-dense", action="store_true")
    parser.add_argument("--no-kernels", dest="kernels", action="store_false", help="no profiler breakdown")
    parser.add_argument("--no-gemms", dest="gemms", action="store_false", help="no GEMMs alone")
    parser.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pdc.STALL_S = 90.0  # a hung kernel: the table so far, inside the run's limit
    threading.Thread(target=pdc.watchdog, daemon=True).start()
    from moekit.bench.ceilings import measure_fp8_mm

    dev = torch.device("cuda")
    mm = measure_fp8_mm(dev).TFLOPs
    RESULTS["fp8_mm_TFLOPs"] = mm
    log(f"fp8 mm {mm:.0f} TFLOP/s (torch._scaled_mm 8192^3, fast accumulation); torch {torch.__version__}")
    if not args.no_dense:
        try:
            dense_part(mm, min(args.rounds, 3), args.deadline_s, args.out)
        except Exception as exc:  # noqa: BLE001 (the cells still run)
            log(f"FAIL dense: {type(exc).__name__}: {str(exc)[-800:]}")
            pdc.FAILED.append("dense")
        pdc.free_memory()
    for spec in args.cells:
        if time.perf_counter() - pdc.T0 > args.deadline_s:
            log(f"SKIP {spec}: deadline")
            pdc.SUMMARY.append(f"{spec}: not reached")
            continue
        try:
            run_cell(spec, mm, args.rounds, args.deadline_s, args.out, args)
        except Exception as exc:  # noqa: BLE001
            log(f"FAIL {spec}: {type(exc).__name__}: {str(exc)[-800:]}")
            pdc.FAILED.append(spec)
        pdc.free_memory()
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

"""Issues 19 / 15: where a decode call's CUDA-graph time goes, kernel by kernel, on the default path.

    PYTHONPATH=$PWD timeout 90 python3 benchmarks/decode_phases_device_check.py --out $OUT/phases   # H200, < 80 s
    PYTHONPATH=$PWD python benchmarks/decode_phases_device_check.py --smoke                        # CPU, no timing

Each cell's call is split into its launches as the plan binds them (fp8: quantize x, gate-up, down, k-sum; bf16:
gate-up, down, k-sum; the tiny-batch layout: no alignment; as under a graph capture: x quantized in its own kernel,
no folded k-sum), and each prefix of them (the first 1, 2, ... launches) is timed as a CUDA graph over rotated
inputs, the prefixes interleaved over ROUNDS rounds, median. A prefix's µs minus the one before is what that kernel
adds to the call with programmatic dependent launch on (its overlap with the kernel before included). Correctness
first: the whole sequence's output bit-equal to the backend's own call, and within 2e-2 of the reference. Run-1
context (raw/*-87cea24-decode_pdl.*): fp8 Qwen3 M=1 19.9 µs whole; eager per kernel (fp8_small run 2) quantize
1.1, gate-up 9.2, down 8.9 µs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from decode_q3_device_check import floor_us, make_weights, measure_copy, reference, rel_l2, shape_of  # noqa: E402

T0 = time.perf_counter()
ROUNDS = 5
ROTATION_BYTES = 256 << 20
Q3 = "qwen3-30b-a3b"
# DeepSeek-V3: the same launches at 9x the bytes
CELLS = (("fp8", Q3, 1), ("bf16", Q3, 1), ("fp8", Q3, 2), ("bf16", "deepseek-v3", 1))


def elapsed() -> float:
    return time.perf_counter() - T0


def launch_list(dtype: str, t, w, out: torch.Tensor) -> list:
    """The call's launches, each (name, BoundLaunch, pointers), from the plan the backend builds for this call (the
    tuned entry; x quantized in its own kernel, as under a capture), on a workspace of its own (no k-sum counters)."""
    from moekit.experts.triton_launch import LaunchOptions

    if dtype == "fp8":
        from moekit.experts.triton_fp8 import _DESCRIPTORS, fp8_launches
        from moekit.experts.triton_fp8_plan import plan_for

        w13, w13_s, w2, w2_s = w[0].q, w[0].scale, w[1].q, w[1].scale
        plan = plan_for(t.x, w13, w13_s, w2, w2_s, t.topk_ids, t.topk_weights, None, (128, 128), None,
                        LaunchOptions(), x_in_gate_up=False)
        w13_arg, w2_arg = w13, w2
        if plan.descriptor_key is not None:
            pair = _DESCRIPTORS.get(w13, w2, plan.descriptor_key)
            w13_arg, w2_arg = pair.w13, pair.w2
        launches = fp8_launches(plan, plan.workspace.allocate(t.x.device), t.x, w13_arg, w13_s, w2_arg, w2_s,
                                t.topk_ids, t.topk_weights, None, out)
    else:
        from moekit.experts.triton import _DESCRIPTORS
        from moekit.experts.triton_plan import plan_for, plan_launches

        plan = plan_for(t.x, w[0], w[1], t.topk_ids, t.topk_weights, None, "silu", None, LaunchOptions())
        args = (w[0], None, w[1])
        if plan.descriptor_key is not None:
            pair = _DESCRIPTORS.get(w[0], w[1], plan.descriptor_key)
            args = (pair.w13, pair.w13_up, pair.w2)
        launches = plan_launches(plan, plan.workspace.allocate(t.x.device), t.x, *args, None, None, t.topk_ids,
                                 t.topk_weights, None, out, None)
    return [(launch.kernel.fn.__name__, launch, pointers) for launch, pointers in launches]


def backend_call(dtype: str, t, w) -> torch.Tensor:
    if dtype == "fp8":
        from moekit.experts.triton_fp8 import fused_experts_fp8_launch

        return fused_experts_fp8_launch(t.x, w[0].q, w[0].scale, w[1].q, w[1].scale, t.topk_ids, t.topk_weights,
                                        x_in_gate_up=False)
    from moekit.experts.triton import fused_experts

    return fused_experts(t.x, w[0], w[1], t.topk_ids, t.topk_weights)


def run_prefix(seq: list, k: int) -> None:
    for _, launch, pointers in seq[:k]:
        launch(*pointers)


def measure(dtype: str, preset: str, m: int, dev, copy_tbps: float, deadline: float) -> dict:
    from moekit.bench.cells import make_sets, measured_experts_touched
    from moekit.bench.timing import time_calls

    s = shape_of(preset)
    w = make_weights(dtype, s, dev)
    once = max(1, min(s.num_experts, m * s.top_k)) * 3 * s.n * s.k
    sets = make_sets(s, m, 1 if SMOKE else max(2, min(8, math.ceil(ROTATION_BYTES / once))), torch.bfloat16, dev)
    outs = [torch.empty_like(t.x) for t in sets]
    seqs = [launch_list(dtype, t, w, o) for t, o in zip(sets, outs)]
    run_prefix(seqs[0], len(seqs[0]))
    want = backend_call(dtype, sets[0], w)
    err = rel_l2(outs[0], reference(dtype, sets[0], w))
    status = "PASS" if torch.equal(outs[0], want) and err < 2e-2 else f"FAIL (equal {torch.equal(outs[0], want)})"
    names = [name for name, _, _ in seqs[0]]
    touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
    row = dict(dtype=dtype, preset=preset, M=m, kernels=names, status=status, rel_l2_ref=err,
               floor_us=floor_us(dtype, s, m, touched, copy_tbps), samples=[[] for _ in names])
    print(f"[{elapsed():5.1f}s] {dtype} {preset} M={m}: {' -> '.join(names)}: {status} (rel L2 {err:.1e})", flush=True)
    if SMOKE:
        return row
    for _ in range(ROUNDS):
        for k in range(1, len(names) + 1):
            if elapsed() > deadline:
                break
            fns = [lambda q=q, k=k: run_prefix(q, k) for q in seqs]
            row["samples"][k - 1].append(time_calls(fns, dev, graph=True, budget_s=0.012, min_reps=3, max_reps=10))
    row["prefix_us"] = [statistics.median(x) if x else None for x in row["samples"]]
    del w
    return row


def print_row(r: dict) -> None:
    us, before, parts = r.get("prefix_us") or [], 0.0, []
    for name, v in zip(r["kernels"], us):
        parts.append(f"{name} +{v - before:.1f}" if v is not None else f"{name} -")
        before = v if v is not None else before
    whole = (f"{us[-1]:.1f} µs ({100 * r['floor_us'] / us[-1]:.0f}% of floor {r['floor_us']:.1f})" if us and us[-1]
             else "-")
    print(f"{r['dtype']:<5}{r['preset']:<14} M={r['M']}  whole {whole}; prefixes "
          f"{[round(v, 1) if v else v for v in us]}; added per kernel: {', '.join(parts)}  {r['status']}", flush=True)


def main(args) -> int:
    import triton

    dev = torch.device("cpu" if SMOKE else "cuda")
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    copy_tbps = 1.0 if SMOKE else measure_copy(dev)
    rows = []
    for dtype, preset, m in CELLS[:2] if SMOKE else CELLS:
        if elapsed() > args.deadline:
            print(f"deadline: {dtype} {preset} M={m} not run", flush=True)
            continue
        rows.append(measure(dtype, preset, m, dev, copy_tbps, args.deadline))
        if not SMOKE:
            torch.cuda.empty_cache()
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "decode_phases.json").write_text(json.dumps(
                {"device": name, "triton": triton.__version__, "copy_TBps": copy_tbps, "cells": rows}, indent=1) + "\n")
    print("\ngraph µs of each launch prefix (median of rounds) and what each kernel adds; copy "
          f"{copy_tbps:.2f} TB/s")
    for r in rows:
        print_row(r)
    failed = [f"{r['dtype']} {r['preset']} M={r['M']}" for r in rows if r["status"] != "PASS"]
    print(f"FAILED: {failed or 'none'}  ({elapsed():.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for decode_phases.json")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds after which no timing starts")
    p.add_argument("--smoke", action="store_true", help="CPU: the interpreter, tiny shapes, no timing")
    sys.exit(main(p.parse_args()))

"""A/B of the CPU split loop (``cpu_gemm="onednn_packed_split"``) at Qwen3-30B-A3B expert shapes against
another checkout's, interleaved in one process.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/cpu_split_ab.py --batches 512 --rounds 9 --baseline /work/main

Variants: ``this`` (this checkout's ``moekit.experts.cpu_packed``), ``baseline`` (the same two files,
``cpu_packed.py`` and ``cpu_workers.py``, of the ``--baseline`` checkout, loaded under other module names)
and ``this_wW`` (this checkout with W workers; W = 1: one worker on every thread). Every round calls each
once, the order rotated; prints the median ms, GFLOP/s and % of the dense oneDNN rate measured in the same
rounds, the process CPU time (all threads: what the call costs whatever the neighbours take) and the max
abs difference from the first variant.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

from moekit.activations import ActivationSpec
from moekit.bench.cpu_measure import ExpertsShape, expert_weights, problem
from moekit.experts import cpu_packed


def load_baseline(root: str):
    """``root``'s cpu_packed module, importing ``root``'s cpu_workers in place of this checkout's."""
    def load(name: str, path: str):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    workers = load("baseline_cpu_workers", os.path.join(root, "moekit/experts/cpu_workers.py"))
    saved = sys.modules["moekit.experts.cpu_workers"]
    sys.modules["moekit.experts.cpu_workers"] = workers
    try:
        return load("baseline_cpu_packed", os.path.join(root, "moekit/experts/cpu_packed.py"))
    finally:
        sys.modules["moekit.experts.cpu_workers"] = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="512")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--variants", default="baseline,this")
    ap.add_argument("--baseline", default="/work/main")
    ap.add_argument("--shape", default="128,768,2048,8")
    args = ap.parse_args()
    shape = ExpertsShape.parse(args.shape)
    gen = torch.Generator().manual_seed(0)
    w13, w2 = expert_weights(shape, gen)
    names = args.variants.split(",")
    base = load_baseline(args.baseline) if "baseline" in names else None
    workers = torch.get_num_threads()
    print(f"threads {workers} loadavg {os.getloadavg()}")
    for m in [int(b) for b in args.batches.split(",")]:
        p = problem(m, w13, w2, shape.top_k, gen)
        ex = cpu_packed.ExpertParams(w13, w2, None, None, ActivationSpec("silu"))
        cache = cpu_packed.packed_weight_cache()
        a_rows = torch.randn(p.ids.numel(), shape.hidden)
        dense_w = w13[0].clone()

        def call(name):
            module = base if name == "baseline" else cpu_packed
            count = int(name[len("this_w"):]) if name.startswith("this_w") else workers
            return module.experts_cpu_fused(p.x, ex, p.ids, p.weights, None, cache, workers=count)

        calls = {n: (lambda n=n: call(n)) for n in names}
        calls["dense"] = lambda: torch.ops.mkldnn._linear_pointwise(a_rows, dense_w, None, "none", [], "")
        outs = {n: calls[n]() for n in calls}  # warm-up (packs on the first call)
        ref = outs[names[0]]
        samples = {n: [] for n in calls}
        cpu = {n: [] for n in calls}
        keys = list(calls)
        for r in range(args.rounds):
            for n in keys[r % len(keys):] + keys[:r % len(keys)]:
                t0, c0 = time.perf_counter(), time.process_time()
                calls[n]()
                samples[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
        flops = 6 * shape.intermediate * shape.hidden * p.ids.numel()
        dense = 4 * shape.intermediate * shape.hidden * p.ids.numel() / statistics.median(samples["dense"]) / 1e9
        print(f"M={m} dense {dense:.1f} GFLOP/s")
        for n in names:
            med = statistics.median(samples[n])
            again = calls[n]()
            rate = flops / med / 1e9
            print(f"  {n:24s} {med * 1e3:8.2f} ms {rate:7.1f} GFLOP/s {100 * rate / dense:5.1f}% "
                  f"min {min(samples[n]) * 1e3:.2f} cpu {statistics.median(cpu[n]) * 1e3:.0f} ms "
                  f"maxdiff {float((outs[n] - ref).abs().max()):.2e} rerun_equal {torch.equal(again, outs[n])}")
    print(f"loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()

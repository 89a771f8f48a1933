"""Where the Triton experts path spends its time, per kernel (torch.profiler), and how the heuristic
default compares with the tuned configs (run on the device).

    PYTHONPATH=. python benchmarks/triton_breakdown.py [--batches 1,8,1024,16384] [--heuristic]
"""

from __future__ import annotations

import argparse
import collections

import torch

from moekit.bench.cells import PRESETS, Shape, make_sets, make_weights
from moekit.bench.timing import time_calls
from moekit.bench.tuning import TUNE_BATCHES
from moekit.experts.configs import device_key, get_config, heuristic_config
from moekit.experts.triton import fused_experts


def kernel_times(fn, reps: int = 5) -> dict[str, float]:
    """Mean device µs per call of each kernel fn launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            times[evt.name.split("(")[0][:40]] += evt.device_time / reps
    return dict(times)


def breakdown(batches):
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        w13, w2 = make_weights(s, torch.bfloat16, torch.device("cuda"))
        for m in batches:
            x, ids, w = make_sets(s, m, 1, torch.bfloat16, torch.device("cuda"))[0]
            t = kernel_times(lambda: fused_experts(x, w13, w2, ids, w))
            parts = "  ".join(f"{k}={v:.1f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
            print(f"{preset:14s} M={m:<6d} sum={sum(t.values()):8.1f} µs  {parts}", flush=True)
        del w13, w2
        torch.cuda.empty_cache()


def heuristic_vs_tuned(batches):
    dev = torch.device("cuda")
    worst = 10.0
    for preset in PRESETS:
        s = Shape.from_preset(preset)
        w13, w2 = make_weights(s, torch.bfloat16, dev)
        for m in batches:
            sets = make_sets(s, m, 2, torch.bfloat16, dev)
            res = {}
            for name, cfg in (("tuned", get_config(m, s.num_experts, s.n, s.k, s.top_k, torch.bfloat16, device_key(dev))),
                              ("heuristic", heuristic_config(m, s.num_experts, s.n, s.k, s.top_k))):
                calls = [lambda st=st, c=cfg: fused_experts(st[0], w13, w2, st[1], st[2], config=c) for st in sets]
                res[name] = time_calls(calls, dev, graph=m <= 1024, budget_s=0.1)
            speed = res["tuned"] / res["heuristic"]
            worst = min(worst, speed)
            print(f"{preset:14s} M={m:<6d} tuned {res['tuned']:9.1f} µs  heuristic {res['heuristic']:9.1f} µs  "
                  f"heuristic at {100 * speed:.0f}% of tuned speed", flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    print(f"worst: heuristic at {100 * worst:.0f}% of the tuned speed")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8,1024,16384")
    p.add_argument("--heuristic", action="store_true")
    a = p.parse_args()
    if a.heuristic:
        heuristic_vs_tuned(TUNE_BATCHES)
    else:
        breakdown([int(v) for v in a.batches.split(",")])

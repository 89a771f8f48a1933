"""How many kernels one eager Triton experts call launches, which, and its host time (issue 13's <= 40 µs).

    PYTHONPATH=$PWD OUT=/tmp/lc python benchmarks/launch_census.py [--presets P ...] [--dtypes D ...]
        [--batches 1 8 ...] [--deadline-s 200]

For each (preset, dtype, M) of ``moekit bench``'s grid, weights quantized as the bench does: one call is
profiled (``torch.profiler``, CUDA activity: kernel launches and their names in order) after warm-up, then
``moekit.bench.timing.time_eager`` gives ``host_rest_us`` (the steady issue cost per call). A line per cell
as it goes; JSON to $OUT/launch_census.json; a table last (launches, host µs, µs per launch, kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

import torch

from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.timing import time_eager
from moekit.experts import backend_fn, call_backend
from moekit.quant import quantize

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
DTYPES = ("bfloat16", "fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4")
BATCHES = (1, 8, 64, 1024, 4096, 16384)


def kernels_of_one_call(call) -> list[str]:
    """The CUDA kernels one call launches, in order (names shortened to 60 characters)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    return [e.name[:60] for e in kernels]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--deadline-s", type=float, default=200.0)
    args = parser.parse_args()
    out_dir = os.environ.get("OUT", "launch_census_out")
    os.makedirs(out_dir, exist_ok=True)
    device, start, rows = torch.device("cuda"), time.perf_counter(), []
    fn = backend_fn("triton", device)
    for preset in args.presets:
        shape = Shape.from_preset(preset)
        base = make_weights(shape, torch.bfloat16, device)
        for dtype in args.dtypes:
            w13, w2 = (base.w13, base.w2) if dtype == "bfloat16" else (quantize(base.w13, dtype),
                                                                       quantize(base.w2, dtype))
            for m in args.batches:
                if time.perf_counter() - start > args.deadline_s:
                    break
                sets = make_sets(shape, m, 2, torch.bfloat16, device)
                calls = [lambda s=s: call_backend(fn, s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
                for c in calls * 3:
                    c()
                torch.cuda.synchronize()
                names = kernels_of_one_call(calls[0])
                timing = time_eager(calls, device)
                row = dict(preset=preset, dtype=dtype, M=m, launches=len(names), host_rest_us=timing.host_rest_us,
                           host_us=timing.host_us, eager_us=timing.eager_us, kernels=dict(Counter(names)))
                rows.append(row)
                print(f"{preset} {dtype} M={m}: {len(names)} launches, host_rest {timing.host_rest_us:.1f} µs, "
                      f"eager {timing.eager_us:.1f}  [{time.perf_counter() - start:.0f} s]", flush=True)
            del w13, w2
        del base
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "launch_census.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    print(f"{'preset':14} {'dtype':11} {'M':>6} {'launch':>6} {'host':>6} {'µs/l':>5}  kernels")
    for r in rows:
        per = r["host_rest_us"] / max(r["launches"], 1)
        names = ", ".join(f"{n.split('(')[0][:28]}x{c}" if c > 1 else n.split('(')[0][:28] for n,
                          c in r["kernels"].items())
        print(f"{r['preset'][:14]:14} {r['dtype'][:11]:11} {r['M']:6d} {r['launches']:6d} {r['host_rest_us']:6.1f} "
              f"{per:5.1f}  {names}")


if __name__ == "__main__":
    main()

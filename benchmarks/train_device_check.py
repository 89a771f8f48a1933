"""GPU run of issue #17's training measurements: ``moekit bench --train``'s rows and a short ``moekit train``.

    PYTHONPATH=. python benchmarks/train_device_check.py [bench] [train]

Steps (all by default):
  bench   ``moekit.bench.train_measure.measure_train`` on CUDA: forward + backward of the experts path,
          routing included, at the Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 expert shapes x M in
          {4096, 16384}, bf16, for every moekit backend and transformers' grouped_mm experts; per row
          ms, TFLOP/s (3x forward expert FLOPs), % of the bf16 matmul rate measured in the same run,
          peak and activation memory above the step's start, gradient agreement with transformers
          (rel. L2 of dx and of the gate's gradient). A backend without a backward is an error row.
  train   ``moekit train --device cuda`` for 30 steps at the default model: the three runs' loss and
          load imbalance (the Triton experts path when its backward is registered, else an error line)
Prints one line per row, the speed-up table last; writes $OUT/train_device_check.json when OUT is set;
exit 1 when a step raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from moekit.bench.train_measure import measure_train
from moekit.train import TrainSettings, load_stdlib_bytes, train_side_by_side
from moekit.train.curves import summary


def bench_step() -> dict:
    doc = measure_train("cuda", on_progress=lambda line: print(line, flush=True))
    print("\nshape, M, impl: speed-up over transformers:grouped_mm")
    for s in doc["speedups"]:
        print(f"  {s['shape']:>14} M={s['tokens']:>5} {s['impl']:>18}: {s['speedup_vs_transformers']:.2f}x")
    return doc


def train_step() -> dict:
    t0 = time.perf_counter()
    result = train_side_by_side(TrainSettings(steps=30, device="cuda"), load_stdlib_bytes())
    ends = summary(result)
    for method, s in ends.items():
        print(f"train {method:>4}: loss {s['loss']:.3f}, max/mean load {s['imbalance']:.2f}")
    print(f"train: 3 runs x 30 steps in {time.perf_counter() - t0:.1f} s")
    return {"summary": ends, "curves": result.to_dict()}


STEPS = {"bench": bench_step, "train": train_step}


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    names = argv or list(STEPS)
    unknown = sorted(set(names) - set(STEPS))
    if unknown:
        print(f"unknown steps {unknown}; choose from {list(STEPS)}")
        return 2
    out, failed = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}, []
    for name in names:
        try:
            out[name] = STEPS[name]()
        except Exception:  # noqa: BLE001 - report and go on: the next step may still say something
            failed.append(name)
            out[name] = {"error": traceback.format_exc()}
            print(f"{name}: FAILED\n{out[name]['error']}", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "train_device_check.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

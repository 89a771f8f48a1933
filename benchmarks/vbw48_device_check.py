"""Session 48 (brief vbw48): the Triton backend trains its variants through a recomputing backward
(``triton_backward_recompute``: the forward on the Triton kernels, the backward one grouped_mm forward + backward).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/vbw48_device_check.py --out $OUT/vbw48 --deadline 60    # GPU
    PYTHONPATH=$PWD python3 benchmarks/vbw48_device_check.py --smoke    # CPU, interpreted, tiny shapes

Layers (bf16, a few experts' worth of each model):
  gpt_oss   gpt-oss-20b-like: E = 8 (of 32), top-4, K = N = 2880, expert biases, interleaved SwiGLU, alpha 1.702,
            limit 7.0, up_shift 1.0
  step37    Step-3.7-like: E = 16 (of 288), top-8, K = 4096, N = 1280, the clamp after the activation at 1.0 (bites
            on unit-variance gate-up sums; act48's choice)
  plain     the step37 shape with plain silu: the fused Triton backward, for scale (what the variants' recompute
            costs against it)
Phase "checks" (M = 256): the gradients of x, w13, w2, topk_weights (and b13, b2) of backend triton against
grouped_mm's (rel-L2 <= TOL), and both against the float32 reference backend's autograd on the same bf16 inputs
(triton's no further off than grouped_mm's). Phase "time"
(M = 256, 4096): wall µs of one eager training step (forward + ``torch.autograd.grad`` of every input), triton
against grouped_mm, interleaved rounds (order turned each round), medians. Table last; JSON <out>/vbw48.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rounds import turned  # noqa: E402
from bench_run import RunLog, phase_args, rel_l2, run_info, run_phases  # noqa: E402
from train_step_inputs import layer_inputs, step_grads  # noqa: E402

from moekit.activations import ActivationSpec  # noqa: E402

GPT_OSS = ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0)
STEP37 = ActivationSpec("silu", limit=1.0, limit_after_act=True)
# name -> (E, top_k, K, N, spec, biases)
LAYERS = {
    "gpt_oss": (4, 2, 64, 32, GPT_OSS, True) if SMOKE else (8, 4, 2880, 2880, GPT_OSS, True),
    "step37": (4, 2, 64, 32, STEP37, False) if SMOKE else (16, 8, 4096, 1280, STEP37, False),
    "plain": (4, 2, 64, 32, "silu", False) if SMOKE else (16, 8, 4096, 1280, "silu", False),
}
CHECK_M, TIME_MS = (8, (8,)) if SMOKE else (256, (256, 4096))
TOL, ROUNDS, CALLS = 2e-2, 5, 3
RUN = RunLog("vbw48: wall µs of one eager training step (fwd + grads of every input), triton vs grouped_mm, bf16")


def problem(layer: str, m: int, dev, seed: int) -> dict:
    """The layer's inputs by name (``train_step_inputs.layer_inputs``)."""
    return layer_inputs(LAYERS[layer], m, dev, seed)


def step(backend: str, layer: str, p: dict, dtype=None) -> dict:
    """One training step's gradients on ``backend``: name -> grad of every input the layer has (cast to ``dtype``)."""
    from moekit.experts import backend_fn

    return step_grads(backend_fn(backend, p["x"].device), LAYERS[layer][4], p, dtype)


def checks(dev) -> None:
    """Each layer's triton gradients against grouped_mm's (rel-L2 <= TOL) and, against the float32 reference
    backend's, no further than grouped_mm's are (1.5x + 1e-3: a clamp's kink makes bf16 rounding flip some
    slots' derivatives, in both), at M = CHECK_M."""
    for layer in LAYERS:
        p = problem(layer, CHECK_M, dev, seed=1)
        want = step("reference", layer, p, torch.float32)
        got = {backend: step(backend, layer, p) for backend in ("triton", "grouped_mm")}
        ref = {b: {n: rel_l2(g[n].float(), want[n].float()) for n in want} for b, g in got.items()}
        apart = {n: rel_l2(got["triton"][n].float(), got["grouped_mm"][n].float()) for n in want}
        ok = all(apart[n] <= TOL and ref["triton"][n] <= 1.5 * ref["grouped_mm"][n] + 1e-3 for n in want)
        RUN.check(f"{layer} triton grads M={CHECK_M}", ok, "vs grouped_mm / vs f32 (triton, grouped_mm): " + ", ".join(
            f"{n} {apart[n]:.1e} / {ref['triton'][n]:.1e}, {ref['grouped_mm'][n]:.1e}" for n in want))


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_steps(dev, result: dict, stop: float) -> None:
    """Wall µs of one training step, triton against grouped_mm, per layer and M: ROUNDS interleaved rounds of
    CALLS steps (the order turned each round), medians; stops cleanly at ``stop`` (time.time())."""
    for m in TIME_MS:
        for layer in LAYERS:
            if time.time() > stop:
                RUN.summary.append(f"{layer} M={m}: not timed (deadline)")
                continue
            p = problem(layer, m, dev, seed=2)
            runs = {b: (lambda b=b: step(b, layer, p)) for b in ("triton", "grouped_mm")}
            for run in runs.values():  # warm-up: compiles, autotunes, allocator
                run()
            samples = {b: [] for b in runs}
            for r in range(ROUNDS):
                if r and time.time() > stop:
                    break
                for b in turned(r, list(runs)):
                    sync(dev)
                    t0 = time.perf_counter()
                    for _ in range(CALLS):
                        runs[b]()
                    sync(dev)
                    samples[b].append((time.perf_counter() - t0) * 1e6 / CALLS)
            med = {b: statistics.median(s) for b, s in samples.items()}
            ratio = med["grouped_mm"] / med["triton"]
            RUN.summary.append(f"{layer:8s} M={m:5d}: triton {med['triton']:9.1f} µs, grouped_mm "
                               f"{med['grouped_mm']:9.1f} µs, grouped_mm / triton x{ratio:.2f}"
                               f" ({len(samples['triton'])} rounds)")
            result["cells"].append({"layer": layer, "M": m, "wall_us": samples, "median_us": med})
            RUN.log(f"timed {layer} M={m}")


def main() -> int:
    dev, result = torch.device("cpu" if SMOKE else "cuda"), {"cells": []}
    phases = {"checks": lambda: checks(dev), "time": lambda: time_steps(dev, result, stop_at)}
    args = phase_args(__doc__, phases, "vbw48.json")
    stop_at = time.time() + args.deadline - 4 - RUN.elapsed()
    result.update(run_info(), layers={k: list(map(str, v)) for k, v in LAYERS.items()})
    RUN.log(f"layers {list(LAYERS)}; {run_info()}")
    return run_phases(RUN, phases, args.phases, args.deadline, {"checks": 10, "time": 6}, args.path, result)


if __name__ == "__main__":
    sys.exit(main())

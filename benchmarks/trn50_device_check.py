"""Session 50 (brief trn50): where ``backend="auto"``'s plain training rule (``moekit.experts.auto_train``) should turn
from grouped_mm to triton by expert width, and the fused backward's tile candidates (``triton_backward_candidates``)
at the classes the H200 tuning left to the heuristic or where triton lost on the H100 (Mixtral's width).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/trn50_device_check.py --out $OUT/trn50 --deadline 75    # GPU
    PYTHONPATH=$PWD python3 benchmarks/trn50_device_check.py --smoke                                     # CPU
    ... --phases time,tiles --cells hunyuan:16384,phi35:1024    # a later run: some phases, some grid cells

Layers (bf16, gated silu, no biases: the fused backward's "plain" kind), the real models' E / top-k / K:
  qwen3     Qwen3-30B-A3B: E 128, top-8, K 2048, N 768
  dsv2lite  DeepSeek-V2-Lite: E 64, top-6, K 2048, N 1408
  dsv3      DeepSeek-V3's routed experts: E 64 (of 256: one rank of EP 4), top-8, K 7168, N 2048
  hunyuan   Hunyuan-A13B: E 64, top-8, K 4096, N 3072
  w4096     Phi-3.5-MoE's E 16, top-2, K 4096 at N 4096 (no model at this width: the rule's gap between 3072 and 6400)
  phi35     Phi-3.5-MoE: E 16, top-2, K 4096, N 6400
  mixtral   Mixtral-8x7B: E 8, top-2, K 4096, N 14336
Phase "checks" (M = 256; PASS / FAIL): per layer new here (CHECKED; auto49 checked the others on the same kernels),
triton's and grouped_mm's gradients of every input (x, w13, w2,
topk_weights) against the float32 reference backend's: each within TOL, triton no further off than 1.5x grouped_mm's.
Phase "time" (GRID, unmeasured cells first): one eager training step (forward + ``torch.autograd.grad`` of every
input) on triton and grouped_mm, ROUNDS interleaved rounds (order turned each round) of one step, wall µs
(perf_counter, synchronised) and CUDA-event µs, medians; each cell's first steps' gradients, triton against
grouped_mm, must agree within TOL (a FAIL line where not); the backend auto as committed trains the cell on.
Phase "tiles" (TILE_CELLS): per cell, the tiles the backward takes now ("default") and each candidate of its
``shape_class``: every candidate's gradients (``experts_backward(tiles=...)``) against the float32 reference's first
(PASS / FAIL); then interleaved rounds of (a) the whole training step on triton with ``TUNED`` given the candidate
for the run, and on grouped_mm, and (b) the backward alone per tile set, its parts timed by CUDA events around each
launch function (grad: grad_gate_up; dx: dX's GEMM + the k-sum; dw13, dw2: the weight grads with their
permutes; other: the rest: align, permuting x and dout, the d-weight sum). Medians. Table last; JSON
<out>/trn50.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, begin_layers_run, phase_args, run_phases, smoke_mode  # noqa: E402

SMOKE = smoke_mode()
ONLY_CELLS = None  # --cells name:M,...: the grid's cells to run (all by default)
if "--cells" in sys.argv:
    at = sys.argv.index("--cells")
    ONLY_CELLS = tuple((c.split(":")[0], int(c.split(":")[1])) for c in sys.argv[at + 1].split(",") if c)
    del sys.argv[at:at + 2]

import torch  # noqa: E402

from bench_rounds import eager_rounds, turned_rounds  # noqa: E402
from train_step_inputs import (auto_pick, check_device, free, grads_apart, layer_inputs, step_grads,  # noqa: E402
                               sync)

# name -> (E, top_k, K, N, activation, biases)
LAYERS = {
    "qwen3": (128, 8, 2048, 768, "silu", False),
    "dsv2lite": (64, 6, 2048, 1408, "silu", False),
    "dsv3": (64, 8, 7168, 2048, "silu", False),
    "hunyuan": (64, 8, 4096, 3072, "silu", False),
    "w4096": (16, 2, 4096, 4096, "silu", False),
    "phi35": (16, 2, 4096, 6400, "silu", False),
    "mixtral": (8, 2, 4096, 14336, "silu", False),
}
# the rule's unmeasured widths at 1024 / 4096 tokens, then every width at 16384, then auto49's cells again (this
# machine against that one; Mixtral's at 1024 / 4096 the tiles phase times too, with its candidates)
GRID = (*((name, m) for m in (1024, 4096) for name in ("dsv2lite", "hunyuan", "w4096", "phi35")),
        *((name, 16384) for name in ("qwen3", "dsv2lite", "dsv3", "hunyuan", "w4096", "phi35", "mixtral")),
        *((name, m) for m in (1024, 4096) for name in ("qwen3", "dsv3", "mixtral")))
# (layer, M, its shape_class: checked against ``shape_class`` on the GPU; named so the smoke run meets candidates)
TILE_CELLS = (("mixtral", 1024, "wide/few"), ("mixtral", 4096, "wide/some"))
if SMOKE:
    LAYERS = {name: (4, 2, 64, 32 if name != "mixtral" else 48, "silu", False) for name in LAYERS}
    GRID, TILE_CELLS = (("dsv2lite", 8), ("mixtral", 8)), (("mixtral", 8, "wide/few"),)
CHECK_M = 8 if SMOKE else 256
CHECKED = ("dsv2lite", "hunyuan", "w4096", "phi35")  # the tiles phase checks Mixtral against the reference too
TOL, ROUNDS = 2e-2, 5
TILES_RESERVE_S = 0 if SMOKE else 24  # the grid stops this long before the deadline when the tiles phase runs after
BACKENDS = ("triton", "grouped_mm")
PARTS = ("grad", "dx", "dw13", "dw2", "other")
RUN = RunLog("trn50: µs of one eager training step (fwd + grads of every input), bf16, triton vs grouped_mm; "
             "the fused backward's tile candidates", stall_s=600.0 if SMOKE else 60.0)


def problem(layer: str, m: int, dev, seed: int) -> dict:
    return layer_inputs(LAYERS[layer], m, dev, seed)


def step(fn, p: dict, dtype=None) -> dict:
    return step_grads(fn, "silu", p, dtype)


def shape_class_of(layer: str, m: int) -> str:
    from moekit.experts.triton_backward_launch import shape_class

    e, top_k, _, n = LAYERS[layer][:4]
    return shape_class(m * top_k, e, n)


def checks(dev, result: dict) -> None:
    from moekit.experts import backend_fn

    for layer in CHECKED:
        p = problem(layer, CHECK_M, dev, seed=1)
        want = step(backend_fn("reference", dev), p, torch.float32)
        off = {b: grads_apart(step(backend_fn(b, dev), p), want) for b in BACKENDS}
        ok = all(off["triton"][n] <= TOL and off["grouped_mm"][n] <= TOL
                 and off["triton"][n] <= 1.5 * off["grouped_mm"][n] + 1e-3 for n in want)
        RUN.check(f"{layer} grads M={CHECK_M} vs f32 reference", ok, "(triton, grouped_mm): " + ", ".join(
            f"{n} {off['triton'][n]:.1e}, {off['grouped_mm'][n]:.1e}" for n in want))
        result["checks"][layer] = off
        del p, want
        free(dev)


def medians(samples: dict) -> dict:
    return {name: [statistics.median(w), statistics.median(e)] for name, (w, e) in samples.items()}


def time_grid(dev, result: dict, stop: float) -> None:
    from moekit.experts import backend_fn

    cells = [c for c in GRID if ONLY_CELLS is None or c in ONLY_CELLS]
    for layer, m in cells:
        if time.time() > stop:
            RUN.summary.append(f"{layer} M={m}: not timed (deadline)")
            continue
        p = problem(layer, m, dev, seed=2)
        runs = {b: (lambda fn=backend_fn(b, dev): step(fn, p)) for b in BACKENDS}
        first = {b: run() for b, run in runs.items()}  # compiles, plans, allocator; the grads compared
        apart = grads_apart(first["triton"], first["grouped_mm"])
        RUN.check(f"{layer} M={m} triton vs grouped_mm grads", max(apart.values()) <= TOL,
                  ", ".join(f"{n} {v:.1e}" for n, v in apart.items()))
        del first
        samples = eager_rounds(runs, dev, ROUNDS, stop)
        med, pick, cls = medians(samples), auto_pick(dev, p, m), shape_class_of(layer, m)
        t, g = med["triton"], med["grouped_mm"]
        RUN.summary.append(f"{layer:8s} N={LAYERS[layer][3]:5d} M={m:5d} [{cls:11s}]: wall triton {t[0]:9.1f} "
                           f"grouped_mm {g[0]:9.1f} x{g[0] / t[0]:.2f} | event x{g[1] / t[1]:.2f} | auto now {pick} "
                           f"({len(samples['triton'][0])} rounds; x = grouped_mm / triton)")
        result["cells"].append({"layer": layer, "M": m, "N": LAYERS[layer][3], "class": cls, "median_us": med,
                                "samples_wall_event_us": samples, "auto_now": pick, "grads_apart": apart})
        RUN.log(f"timed {layer} M={m}")
        del p, runs
        free(dev)


class PartTimer:
    """Events (or perf_counter on the CPU) around the backward's launch functions, by part; installed on the
    modules ``experts_backward`` looks them up in at call time. A subclass times other functions: its ``WRAPPED``
    (module, function, part) and ``PARTS`` (every part, "other" last)."""

    PARTS = PARTS
    WRAPPED = (("triton_backward_launch", "grad_gate_up", "grad"), ("triton_backward_sorted", "grad_gate_up_sorted",
               "grad"), ("triton_backward_launch", "gather_gemm", "dx"), ("triton_backward_sorted", "dx_sorted", "dx"),
               ("triton_backward_launch", "sum_slots", "dx"), ("triton_backward_launch", "weight_grad", "dw"))

    def __init__(self, dev):
        import importlib

        self.cuda, self.marks, self.saved = dev.type == "cuda", [], []
        for module, name, part in self.WRAPPED:
            mod = importlib.import_module(f"moekit.experts.{module}")
            self.saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, self._wrap(getattr(mod, name), part))

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _wrap(self, fn, part: str):
        def timed(*args, **kwargs):
            start = self._mark()
            out = fn(*args, **kwargs)
            self.marks.append((part, start, self._mark()))
            return out
        return timed

    def _us(self, a, b) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6

    def run(self, fn) -> dict:
        """fn() once -> part -> µs (dw13 the first weight grad, dw2 the second; other: total minus the parts)."""
        self.marks.clear()
        begin = self._mark()
        fn()
        end = self._mark()
        if self.cuda:
            torch.cuda.synchronize()
        parts, weight = dict.fromkeys(self.PARTS, 0.0), iter(("dw13", "dw2"))
        for part, a, b in self.marks:
            parts[next(weight) if part == "dw" else part] += self._us(a, b)
        total = self._us(begin, end)
        parts["other"] = total - sum(parts[p] for p in self.PARTS[:-1])
        return {"total": total, **parts}

    def remove(self) -> None:
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)


def with_tiles(cls: str, tiles, fn):
    """fn with ``TUNED[cls]`` = ``tiles`` for the call (``tiles`` None: as it is), restored after."""
    import moekit.experts.triton_backward_launch as bl

    def run():
        had, old = cls in bl.TUNED, bl.TUNED.get(cls)
        if tiles is not None:
            bl.TUNED[cls] = tiles
        try:
            return fn()
        finally:
            if had:
                bl.TUNED[cls] = old
            elif tiles is not None:
                del bl.TUNED[cls]
    return run


def tile_cell(dev, layer: str, m: int, cls: str, stop: float, result: dict) -> None:
    import moekit.experts.triton_backward_launch as bl
    from moekit.experts import backend_fn
    from moekit.experts.triton_backward_candidates import candidates_for

    if not SMOKE:
        RUN.check(f"{layer} M={m} is {cls}", shape_class_of(layer, m) == cls, shape_class_of(layer, m))
    sets = {"default": None, **candidates_for(cls)}
    p = problem(layer, m, dev, seed=3)
    want = step(backend_fn("reference", dev), p, torch.float32)
    gmm_off = grads_apart(step(backend_fn("grouped_mm", dev), p), want)

    def backward(tiles):
        g = bl.experts_backward(p["dout"], p["x"], p["w13"], p["w2"], p["ids"], p["topk_weights"], None, None,
                                "silu", (True,) * 4, tiles=tiles)
        return {"x": g.x, "w13": g.w13, "w2": g.w2, "topk_weights": g.topk_weights}

    for name, tiles in sets.items():
        off = grads_apart(backward(tiles), want)
        RUN.check(f"{layer} M={m} [{cls}] tiles {name} vs f32 reference",
                  all(off[n] <= TOL and off[n] <= 1.5 * gmm_off[n] + 1e-3 for n in want),
                  ", ".join(f"{n} {off[n]:.1e} (gmm {gmm_off[n]:.1e})" for n in want))
    del want
    free(dev)
    RUN.log(f"tiles {layer} M={m}: checked")

    triton_fn = backend_fn("triton", dev)
    steps = {f"step {name}": with_tiles(cls, tiles, lambda: step(triton_fn, p)) for name, tiles in sets.items()}
    steps["step grouped_mm"] = lambda: step(backend_fn("grouped_mm", dev), p)
    for run in steps.values():
        run()
    samples = eager_rounds(steps, dev, ROUNDS, stop)
    RUN.log(f"tiles {layer} M={m}: steps timed")
    timer = PartTimer(dev)
    try:
        parts = {name: [] for name in sets}
        for name in turned_rounds(list(sets), ROUNDS, stop):
            sync(dev)
            parts[name].append(timer.run(lambda tiles=sets[name]: backward(tiles)))
    finally:
        timer.remove()
    med = medians(samples)
    part_med = {name: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for name, rows in parts.items()}
    gmm = med["step grouped_mm"][0]
    RUN.summary.append(f"{layer} M={m} [{cls}] step wall µs: " + ", ".join(
        f"{name.removeprefix('step ')} {w:.0f}" + ("" if name == "step grouped_mm" else f" (x{gmm / w:.2f})")
        for name, (w, _) in med.items()) + f" ({len(samples['step grouped_mm'][0])} rounds; x = grouped_mm / it)")
    for name, pm in part_med.items():
        RUN.summary.append(f"    backward {name:13s}: " + " ".join(f"{k} {v:7.0f}" for k, v in pm.items()))
    result["tiles"].append({"layer": layer, "M": m, "class": cls, "step_median_us": med, "step_samples": samples,
                            "backward_parts_median_us": part_med, "backward_parts": parts,
                            "grouped_mm_vs_f32": gmm_off, "sets": {k: str(v) for k, v in sets.items()}})


def time_tiles(dev, result: dict, stop: float) -> None:
    for layer, m, cls in TILE_CELLS:
        if time.time() > stop:
            RUN.summary.append(f"tiles {layer} M={m}: not timed (deadline)")
            continue
        tile_cell(dev, layer, m, cls, stop, result)
        RUN.log(f"tiles {layer} M={m}")
        free(dev)


def main() -> int:
    dev, result = check_device(SMOKE), {"checks": {}, "cells": [], "tiles": []}
    phases = {"checks": lambda: checks(dev, result),
              "time": lambda: time_grid(dev, result, stop_at - (TILES_RESERVE_S if "tiles" in args.phases else 0)),
              "tiles": lambda: time_tiles(dev, result, stop_at)}
    args = phase_args(__doc__, phases, "trn50.json")
    stop_at = time.time() + args.deadline - 4 - RUN.elapsed()
    begin_layers_run(RUN, result, LAYERS)
    return run_phases(RUN, phases, args.phases, args.deadline, {"checks": 20, "time": 6, "tiles": 8}, args.path,
                      result)


if __name__ == "__main__":
    sys.exit(main())

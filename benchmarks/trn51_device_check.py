"""Session 51 (brief trn51): the Triton training step with the gate-up product kept from the forward
(``BackwardOptions(recompute=False)``: h_p [P, 2N] and x_p kept, the backward reads h_p) against the recomputing
one (backend "triton", what ``backend="auto"`` trains on) and grouped_mm, at Mixtral's width below 16384 tokens
and the plain rule's narrow cells.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/trn51_device_check.py --out $OUT/trn51 --deadline 75    # GPU
    PYTHONPATH=$PWD python3 benchmarks/trn51_device_check.py --smoke                                     # CPU
    ... --phases time,parts --cells phi35:1024,mixtral:16384    # a later run: some phases, other cells

Layers (bf16, gated silu, no biases: the fused backward's "plain" kind):
  mixtral   Mixtral-8x7B: E 8, top-2, K 4096, N 14336
  dsv2lite  DeepSeek-V2-Lite: E 64, top-6, K 2048, N 1408
  qwen3     Qwen3-30B-A3B: E 128, top-8, K 2048, N 768
  and for ``--cells``: dsv3 (E 64 of 256, top-8, K 7168, N 2048), hunyuan (64, 8, 4096, 3072), w4096 (Phi-3.5-MoE's
  16, 2, 4096 at N 4096), phi35 (16, 2, 4096, 6400)
Variants: recompute (``backend_fn("triton")``: the ``triton_experts`` op, the inference forward, the fused backward
recomputing gate and up), kept (``experts_triton_train(backward=BackwardOptions(recompute=False))``), grouped_mm.
Phase "checks" (M = 256, the first three layers; PASS / FAIL): every variant's gradients of x, w13, w2, topk_weights
against the float32 reference backend's, each within TOL and no further than 1.5x grouped_mm's (+1e-3); kept against
recompute.
Phase "time" (CELLS or ``--cells``, in order until the deadline): per cell, each variant's first step's grads against
grouped_mm's (within TOL), its memory (MiB held after the forward above the inputs, the step's peak above them), then
ROUNDS interleaved rounds (order turned each round) of the eager step (forward + ``torch.autograd.grad`` of every
input) and of the forward alone, wall µs (perf_counter, synchronised) and CUDA-event µs, medians.
Phase "parts" (PART_CELLS; not in ck1's run): the backward alone by part (trn50's ``PartTimer``: grad, dx, dw13, dw2,
other) recomputing, and keeping with the grad tile as ``kept_tiles`` makes it and KEPT_COLS wide; the kept step with
each width (its grads against grouped_mm's first). Table last; JSON <out>/trn51.json.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, begin_layers_run, phase_args, run_phases, smoke_mode  # noqa: E402

SMOKE = smoke_mode()

import torch  # noqa: E402

from bench_rounds import eager_rounds, turned_rounds  # noqa: E402
from train_step_inputs import (auto_pick, check_device, free, grads_apart, layer_inputs, step_grads,  # noqa: E402
                               sync)

# name -> (E, top_k, K, N, activation, biases)
LAYERS = {
    "mixtral": (8, 2, 4096, 14336, "silu", False),
    "dsv2lite": (64, 6, 2048, 1408, "silu", False),
    "qwen3": (128, 8, 2048, 768, "silu", False),
    "dsv3": (64, 8, 7168, 2048, "silu", False),  # DeepSeek-V3's routed experts, E 64 of 256 (one rank of EP 4)
    "hunyuan": (64, 8, 4096, 3072, "silu", False),  # Hunyuan-A13B
    "w4096": (16, 2, 4096, 4096, "silu", False),  # Phi-3.5-MoE's E / top-k / K at N 4096
    "phi35": (16, 2, 4096, 6400, "silu", False),  # Phi-3.5-MoE
}
CELLS = (("mixtral", 1024), ("mixtral", 4096), ("mixtral", 8192), ("dsv2lite", 1024), ("qwen3", 4096),
         ("dsv2lite", 4096))
CHECKED = ("mixtral", "dsv2lite", "qwen3")  # the checks phase's layers
if "--cells" in sys.argv:  # --cells name:M,...: the time phase's cells instead of CELLS
    at = sys.argv.index("--cells")
    CELLS = tuple((c.split(":")[0], int(c.split(":")[1])) for c in sys.argv[at + 1].split(",") if c)
    del sys.argv[at:at + 2]
if SMOKE:
    LAYERS = {name: (4, 2, 64, 48, "silu", False) for name in LAYERS}
    CELLS = (("mixtral", 8), ("qwen3", 8))
PART_CELLS = (("mixtral", 1024), ("mixtral", 4096), ("dsv2lite", 1024))
KEPT_COLS = (64, 256)  # the kept grad tile's widths tried beside the one ``kept_tiles`` takes (the shape's grad cols)
if SMOKE:
    PART_CELLS, KEPT_COLS = (("mixtral", 8),), (16,)
CHECK_M = 8 if SMOKE else 256
TOL, ROUNDS = 2e-2, 5
VARIANTS = ("recompute", "kept", "grouped_mm")
RUN = RunLog("trn51: one eager training step (fwd + grads of every input), bf16: triton recomputing gate-up / "
             "triton keeping it / grouped_mm", stall_s=600.0 if SMOKE else 60.0)


def variant_fns(dev) -> dict:
    from moekit.experts import backend_fn
    from moekit.experts.triton_backward import BackwardOptions, experts_triton_train

    def kept(x, w13, w2, ids, weights, *, activation="silu", b13=None, b2=None):
        return experts_triton_train(x, w13, w2, ids, weights, activation=activation, b13=b13, b2=b2,
                                    backward=BackwardOptions(recompute=False))

    return {"recompute": backend_fn("triton", dev), "kept": kept, "grouped_mm": backend_fn("grouped_mm", dev)}


def checks(dev, result: dict) -> None:
    from moekit.experts import backend_fn

    fns = variant_fns(dev)
    for layer in CHECKED:
        p = layer_inputs(LAYERS[layer], CHECK_M, dev, seed=1)
        want = step_grads(backend_fn("reference", dev), "silu", p, torch.float32)
        got = {v: step_grads(fn, "silu", p) for v, fn in fns.items()}
        off = {v: grads_apart(g, want) for v, g in got.items()}
        for v in ("recompute", "kept"):
            ok = all(off[v][n] <= TOL and off[v][n] <= 1.5 * off["grouped_mm"][n] + 1e-3 for n in want)
            RUN.check(f"{layer} M={CHECK_M} {v} grads vs f32 reference", ok, ", ".join(
                f"{n} {off[v][n]:.1e} (gmm {off['grouped_mm'][n]:.1e})" for n in want))
        apart = grads_apart(got["kept"], got["recompute"])
        RUN.check(f"{layer} M={CHECK_M} kept vs recompute grads", max(apart.values()) <= TOL,
                  ", ".join(f"{n} {v:.1e}" for n, v in apart.items()))
        result["checks"][layer] = {"vs_f32": off, "kept_vs_recompute": apart}
        del p, want, got
        free(dev)


def leaves_of(p: dict) -> dict:
    return {n: p[n].detach().requires_grad_() for n in ("x", "w13", "w2", "topk_weights")}


def memory_mib(fn, p: dict, dev) -> dict:
    """MiB above the inputs: held after the forward (the output and what autograd saved) and the step's peak."""
    if dev.type != "cuda":
        return {"after_forward": float("nan"), "peak": float("nan")}
    sync(dev)
    free(dev)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    leaves = leaves_of(p)
    out = fn(leaves["x"], leaves["w13"], leaves["w2"], p["ids"], leaves["topk_weights"], activation="silu")
    sync(dev)
    held = torch.cuda.memory_allocated() - base
    grads = torch.autograd.grad(out, list(leaves.values()), p["dout"])
    sync(dev)
    peak = torch.cuda.max_memory_allocated() - base
    del out, grads, leaves
    return {"after_forward": held / 2**20, "peak": peak / 2**20}


def time_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    fns = variant_fns(dev)
    p = layer_inputs(LAYERS[layer], m, dev, seed=2)
    first = {v: step_grads(fn, "silu", p) for v, fn in fns.items()}  # compiles, plans; the grads compared
    for v in ("recompute", "kept"):
        apart = grads_apart(first[v], first["grouped_mm"])
        RUN.check(f"{layer} M={m} {v} vs grouped_mm grads", max(apart.values()) <= TOL,
                  ", ".join(f"{n} {a:.1e}" for n, a in apart.items()))
    del first
    memory = {v: memory_mib(fn, p, dev) for v, fn in fns.items()}
    leaves = leaves_of(p)

    def forward(fn):
        return lambda: fn(leaves["x"], leaves["w13"], leaves["w2"], p["ids"], leaves["topk_weights"],
                          activation="silu")

    runs = {**{f"step {v}": (lambda fn=fn: step_grads(fn, "silu", p)) for v, fn in fns.items()},
            **{f"fwd {v}": forward(fn) for v, fn in fns.items()}}
    samples = eager_rounds(runs, dev, ROUNDS, stop)
    med = {name: [statistics.median(w), statistics.median(e)] for name, (w, e) in samples.items()}
    gmm, pick = med["step grouped_mm"][0], auto_pick(dev, p, m)
    RUN.summary.append(
        f"{layer:8s} N={LAYERS[layer][3]:5d} M={m:5d}: step wall µs " + ", ".join(
            f"{v} {med[f'step {v}'][0]:.0f} (x{gmm / med[f'step {v}'][0]:.2f})" for v in VARIANTS)
        + " | fwd " + ", ".join(f"{v} {med[f'fwd {v}'][0]:.0f}" for v in VARIANTS)
        + " | MiB held/peak " + ", ".join(f"{v} {memory[v]['after_forward']:.0f}/{memory[v]['peak']:.0f}"
                                          for v in VARIANTS)
        + f" | auto now {pick} ({len(samples['step kept'][0])} rounds; x = grouped_mm / it)")
    result["cells"].append({"layer": layer, "M": m, "N": LAYERS[layer][3], "median_wall_event_us": med,
                            "samples_wall_event_us": samples, "memory_mib": memory, "auto_now": pick})
    del p, leaves, runs
    free(dev)


def each_cell(cells, run_cell, label: str, dev, result: dict, stop: float, run: RunLog = RUN) -> None:
    """``run_cell(dev, layer, m, stop, result)`` for each of ``cells`` that starts before ``stop``, logged on
    ``run``."""
    for layer, m in cells:
        if time.time() > stop:
            run.summary.append(f"{label} {layer} M={m}: not timed (deadline)")
            continue
        run_cell(dev, layer, m, stop, result)
        run.log(f"{label} {layer} M={m}")


def kept_cols(cols: int | None, fn):
    """fn with the kept path's grad tile ``cols`` wide (None: as ``kept_tiles`` makes it), restored after."""
    import dataclasses

    import moekit.experts.triton_backward as tb
    import moekit.experts.triton_backward_sorted as bs

    real = bs.kept_tiles

    def patched(tiles):
        t = real(tiles)
        return dataclasses.replace(t, grad=dataclasses.replace(t.grad, cols=cols))

    def run():
        if cols is None:
            return fn()
        tb.kept_tiles = bs.kept_tiles = patched
        try:
            return fn()
        finally:
            tb.kept_tiles = bs.kept_tiles = real
    return run


def part_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    """The backward alone by part (``trn50_device_check.PartTimer``): recompute and kept with each grad tile width,
    and the whole step of each kept width; medians of interleaved rounds."""
    import moekit.experts.triton_backward_launch as bl
    import moekit.experts.triton_backward_sorted as bs
    from moekit.experts.triton_train_forward import sorted_forward
    from trn50_device_check import PartTimer

    p, fns = layer_inputs(LAYERS[layer], m, dev, seed=3), variant_fns(dev)
    e, _, _, n = LAYERS[layer][:4]
    widths = {"kept": None, **{f"kept{c}": c for c in KEPT_COLS}}

    def backward(cols):
        def run():
            kept = None
            if cols != "recompute":
                tiles = bs.kept_tiles(bl.backward_tiles(p["ids"].numel(), e, n, p["x"].dtype, p["x"].device))
                kept = sorted_forward(p["x"], p["w13"], p["w2"], p["ids"], p["topk_weights"], None, "silu", tiles,
                                      keep_h=True)
            return lambda: bl.experts_backward(p["dout"], p["x"], p["w13"], p["w2"], p["ids"], p["topk_weights"],
                                               None, kept and kept.h_p, "silu", (True,) * 4,
                                               x_p=kept and kept.x_p)
        return run

    runs = {"recompute": backward("recompute")(), **{name: kept_cols(c, backward(c))() for name, c in widths.items()}}
    steps = {name: kept_cols(c, lambda: step_grads(fns["kept"], "silu", p)) for name, c in widths.items()}
    for name, c in widths.items():
        off = grads_apart(steps[name](), step_grads(fns["grouped_mm"], "silu", p))
        RUN.check(f"{layer} M={m} {name} step vs grouped_mm grads", max(off.values()) <= TOL,
                  ", ".join(f"{k} {v:.1e}" for k, v in off.items()))
    step_med = {k: statistics.median(v[0]) for k, v in eager_rounds(steps, dev, ROUNDS, stop).items()}
    timer, parts = PartTimer(dev), {name: [] for name in runs}
    try:
        for name in turned_rounds(list(runs), ROUNDS, stop):
            sync(dev)
            parts[name].append(timer.run(kept_cols(widths.get(name), runs[name])))
    finally:
        timer.remove()
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in parts.items()}
    RUN.summary.append(f"{layer} M={m} kept step wall µs by grad width: " + ", ".join(
        f"{name} {w:.0f}" for name, w in step_med.items()))
    for name, pm in med.items():
        RUN.summary.append(f"    backward {name:9s}: " + " ".join(f"{k} {v:7.0f}" for k, v in pm.items()))
    result["parts"].append({"layer": layer, "M": m, "kept_step_median_wall_us": step_med, "backward_parts_us": med})
    del p, runs, steps
    free(dev)


def main() -> int:
    dev, result = check_device(SMOKE), {"checks": {}, "cells": [], "parts": []}
    phases = {"checks": lambda: checks(dev, result),
              "time": lambda: each_cell(CELLS, time_cell, "time", dev, result, stop_at),
              "parts": lambda: each_cell(PART_CELLS, part_cell, "parts", dev, result, stop_at)}
    args = phase_args(__doc__, phases, "trn51.json")
    stop_at = time.time() + args.deadline - 4 - RUN.elapsed()
    begin_layers_run(RUN, result, LAYERS)
    return run_phases(RUN, phases, args.phases, args.deadline, {"checks": 20, "time": 6, "parts": 6}, args.path,
                      result)


if __name__ == "__main__":
    sys.exit(main())

"""Session 52 (brief trn52): the kept training forward's tiles (``triton_kept_forward``: ``BackwardOptions(
recompute=False)``'s forward on permuted rows that stores h_p) per shape class: session 51's one tile ("kept",
``KEPT_FORWARD``), the inference forward's config of the shape ("inference") and the measured pairs of
``CANDIDATES``, against each other; trn51's peaks after its materialized-zeros fix.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/trn52_device_check.py --out $OUT/trn52 --deadline 75 \
        --phases cells,peaks                                                                              # GPU
    PYTHONPATH=$PWD python3 benchmarks/trn52_device_check.py --smoke                                     # CPU
    ... --phases step,peaks --cells qwen3:1024 --sources kept,rule    # a later run: some phases, cells, sources

Layers (bf16, gated silu, no biases): trn51's (``trn51_device_check.LAYERS``). Sources: SOURCES (``--sources``);
"rule" is ``FORWARD_RULE`` as committed (its class's source; "kept" where the rule has none).
Phase "checks" (M = 256, CHECKED; PASS / FAIL): per source, the kept step's gradients of x, w13, w2, topk_weights
against the float32 reference backend's, each within TOL and no further than 1.5x grouped_mm's (+1e-3), and against
the recomputing path's (``backend_fn("triton")``) within TOL.
Phase "fwd" (CELLS): per source, the kept forward's output against the inference forward's (within TOL); then
ROUNDS interleaved rounds (order turned) of the kept forward per source and of the inference forward ("infer": what
recompute runs), CUDA events around the call and around each launch function (``FwdTimer``: permute, gate_up, down,
sum, other); medians.
Phase "step" (CELLS): per source, the first kept step's gradients against grouped_mm's (TOL); then ROUNDS interleaved
rounds of the eager step (forward + ``torch.autograd.grad`` of every input), wall µs and CUDA-event µs, medians, and
the rounds each source beat "kept" in.
Phase "cells": per cell, "step" then "fwd" (a deadline loses whole cells, not a phase).
Phase "kernels" (CELLS): per source and "infer", one forward under ``torch.profiler`` (CUDA activity): each GPU
kernel's µs (what the forward's time is made of, kernel by kernel, host gaps left out).
Phase "peaks" (CELLS): MiB above the inputs held after the forward and at the step's peak, kept ("rule") /
recompute / grouped_mm (``trn51_device_check.memory_mib``). Table last; JSON <out>/trn52.json.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_run import RunLog, begin_layers_run, phase_args, run_phases, smoke_mode  # noqa: E402

SMOKE = smoke_mode()


def _option(name: str, default: tuple, parse) -> tuple:
    """``--name a,b`` taken out of argv (before trn50's / trn51's modules read it), else ``default``."""
    if name not in sys.argv:
        return default
    at = sys.argv.index(name)
    values = tuple(parse(v) for v in sys.argv[at + 1].split(",") if v)
    del sys.argv[at:at + 2]
    return values


CELLS = _option("--cells", (("dsv2lite", 1024), ("qwen3", 1024), ("dsv2lite", 4096), ("hunyuan", 1024),
                            ("dsv3", 1024), ("qwen3", 4096), ("mixtral", 1024)),
                lambda c: (c.split(":")[0], int(c.split(":")[1])))
SOURCES = _option("--sources", ("kept", "inference", "s3", "n64", "m64", "rule"), str)

import torch  # noqa: E402

from bench_rounds import eager_rounds, faster_rounds, turned_rounds  # noqa: E402
from train_step_inputs import check_device, free, grads_apart, layer_inputs, step_grads, sync  # noqa: E402
from trn50_device_check import PartTimer  # noqa: E402
from trn51_device_check import LAYERS, each_cell, leaves_of, memory_mib, variant_fns  # noqa: E402

if SMOKE:
    LAYERS = {name: (4, 2, 64, 48, "silu", False) for name in LAYERS}
    CELLS = (("dsv2lite", 8), ("mixtral", 8))
CHECKED = ("dsv2lite", "qwen3", "mixtral")
CHECK_M = 8 if SMOKE else 256
TOL, ROUNDS = 2e-2, 5
CLASSES = tuple(f"{w}/{r}" for w in ("narrow", "mid", "wide") for r in ("few", "some", "many"))
RUN = RunLog("trn52: the kept forward's tiles by source (kept = session 51's one tile); bf16, eager",
             stall_s=600.0 if SMOKE else 60.0)


class FwdTimer(PartTimer):
    """``PartTimer`` around the kept forward's launch functions (``triton_train_forward``)."""

    PARTS = ("permute", "gate_up", "down", "sum", "other")
    WRAPPED = (("triton_train_forward", "permute_rows", "permute"), ("triton_train_forward", "_gate_up", "gate_up"),
               ("triton_train_forward", "_down", "down"), ("triton_train_forward", "sum_slots", "sum"))


@contextlib.contextmanager
def source_rule(source: str):
    """``FORWARD_RULE`` naming ``source`` for every class ("rule": as committed), restored after."""
    from moekit.experts import triton_kept_forward as kf

    saved = dict(kf.FORWARD_RULE)
    if source != "rule":
        kf.FORWARD_RULE.update(dict.fromkeys(CLASSES, source))
    try:
        yield
    finally:
        kf.FORWARD_RULE.clear()
        kf.FORWARD_RULE.update(saved)


def under(source: str, fn):
    def run():
        with source_rule(source):
            return fn()
    return run


def kept_fn(dev):
    return variant_fns(dev)["kept"]


def picked(p: dict, source: str) -> str:
    """The tiles ``source`` gives the kept forward at ``p``'s shapes, in words."""
    from moekit.experts.triton_backward import sorted_forward_tiles

    with source_rule(source):
        t = sorted_forward_tiles(p["x"], p["w13"], p["w2"], p["ids"], True)
    return " / ".join(f"{f.rows or t.block_m}x{f.cols}x{f.red} w{f.num_warps} s{f.num_stages} g{f.group}"
                      for f in (t.fwd13, t.fwd2))


def checks(dev, result: dict) -> None:
    from moekit.experts import backend_fn

    kept = kept_fn(dev)
    for layer in CHECKED:
        p = layer_inputs(LAYERS[layer], CHECK_M, dev, seed=1)
        want = step_grads(backend_fn("reference", dev), "silu", p, torch.float32)
        gmm = grads_apart(step_grads(backend_fn("grouped_mm", dev), "silu", p), want)
        recompute = step_grads(backend_fn("triton", dev), "silu", p)
        for source in SOURCES:
            got = under(source, lambda: step_grads(kept, "silu", p))()
            off, apart = grads_apart(got, want), grads_apart(got, recompute)
            ok = all(off[n] <= TOL and off[n] <= 1.5 * gmm[n] + 1e-3 for n in want)
            RUN.check(f"{layer} M={CHECK_M} {source} ({picked(p, source)}) grads vs f32 reference", ok,
                      ", ".join(f"{n} {off[n]:.1e} (gmm {gmm[n]:.1e})" for n in want))
            RUN.check(f"{layer} M={CHECK_M} {source} vs recompute grads", max(apart.values()) <= TOL,
                      ", ".join(f"{n} {v:.1e}" for n, v in apart.items()))
            result["checks"].append({"layer": layer, "M": CHECK_M, "source": source, "vs_f32": off,
                                     "vs_recompute": apart, "gmm_vs_f32": gmm})
        del p, want, recompute
        free(dev)


def fwd_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    from moekit.experts import backend_fn

    p, kept, infer = layer_inputs(LAYERS[layer], m, dev, seed=2), kept_fn(dev), backend_fn("triton", dev)
    leaves = leaves_of(p)

    def forward(fn):
        return lambda: fn(leaves["x"], leaves["w13"], leaves["w2"], p["ids"], leaves["topk_weights"],
                          activation="silu")

    runs = {"infer": forward(infer), **{s: under(s, forward(kept)) for s in SOURCES}}
    with torch.no_grad():
        want = runs["infer"]()
        for source in SOURCES:
            apart = grads_apart({"out": runs[source]()}, {"out": want})["out"]
            RUN.check(f"{layer} M={m} {source} forward vs the inference forward", apart <= TOL, f"{apart:.1e}")
    del want
    timer, parts = FwdTimer(dev), {name: [] for name in runs}
    try:
        for name in turned_rounds(list(runs), ROUNDS, stop):
            sync(dev)
            parts[name].append(timer.run(runs[name]))
    finally:
        timer.remove()
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in parts.items()}
    base = [r["total"] for r in parts["kept"]] if "kept" in parts else None
    line = f"fwd {layer:8s} M={m:5d} event µs: infer {med['infer']['total']:.0f}"
    for source in SOURCES:
        won = f" {faster_rounds([r['total'] for r in parts[source]], base, 1.0)}/{len(base)}" if base else ""
        line += (f" | {source} {med[source]['total']:.0f}{won} (gate_up {med[source]['gate_up']:.0f} down "
                 f"{med[source]['down']:.0f} permute {med[source]['permute']:.0f} sum {med[source]['sum']:.0f})")
    RUN.summary.append(line)
    result["fwd"].append({"layer": layer, "M": m, "tiles": {s: picked(p, s) for s in SOURCES},
                          "median_event_us": med, "rounds_us": parts})
    del p, leaves, runs
    free(dev)


def step_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    from moekit.experts import backend_fn

    p, kept = layer_inputs(LAYERS[layer], m, dev, seed=3), kept_fn(dev)
    runs = {s: under(s, lambda: step_grads(kept, "silu", p)) for s in SOURCES}
    gmm = step_grads(backend_fn("grouped_mm", dev), "silu", p)
    for source, run in runs.items():
        apart = grads_apart(run(), gmm)
        RUN.check(f"{layer} M={m} {source} step vs grouped_mm grads", max(apart.values()) <= TOL,
                  ", ".join(f"{n} {a:.1e}" for n, a in apart.items()))
    del gmm
    samples = eager_rounds(runs, dev, ROUNDS, stop)
    med = {name: [statistics.median(w), statistics.median(e)] for name, (w, e) in samples.items()}
    base = samples["kept"][0] if "kept" in samples else None
    RUN.summary.append(f"step {layer:8s} M={m:5d} wall µs: " + ", ".join(
        f"{s} {med[s][0]:.0f}" + (f" (x{med['kept'][0] / med[s][0]:.3f}, faster in "
                                  f"{faster_rounds(samples[s][0], base, 1.0)}/{len(base)})" if base else "")
        for s in SOURCES))
    result["step"].append({"layer": layer, "M": m, "median_wall_event_us": med, "samples_wall_event_us": samples})
    del p, runs
    free(dev)


def both_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    step_cell(dev, layer, m, stop, result)
    fwd_cell(dev, layer, m, stop, result)


def kernel_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    """Each forward's GPU kernels by name and µs (``torch.profiler``; CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    from moekit.experts import backend_fn

    if dev.type != "cuda":
        RUN.summary.append(f"kernels {layer} M={m}: CUDA only")
        return
    p, kept = layer_inputs(LAYERS[layer], m, dev, seed=5), kept_fn(dev)
    args = (p["x"], p["w13"], p["w2"], p["ids"], p["topk_weights"])
    runs = {"infer": lambda: backend_fn("triton", dev)(*args, activation="silu"),
            **{s: under(s, lambda: kept(*args, activation="silu")) for s in SOURCES}}
    got = {}
    for name, run in runs.items():
        run()
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            sync(dev)
        us = {e.key[:40]: getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0))
              for e in prof.key_averages()}
        got[name] = {k: v for k, v in sorted(us.items(), key=lambda kv: -kv[1]) if v > 0}
        RUN.summary.append(f"kernels {layer:8s} M={m:5d} {name:9s}: total {sum(got[name].values()):.0f} | " + ", ".join(
            f"{k} {v:.0f}" for k, v in list(got[name].items())[:6]))
    result["kernels"].append({"layer": layer, "M": m, "kernel_us": got})
    del p, runs
    free(dev)


def peak_cell(dev, layer: str, m: int, stop: float, result: dict) -> None:
    p = layer_inputs(LAYERS[layer], m, dev, seed=4)
    memory = {v: memory_mib(fn, p, dev) for v, fn in variant_fns(dev).items()}
    RUN.summary.append(f"peaks {layer:8s} M={m:5d} MiB held / peak: " + ", ".join(
        f"{v} {mm['after_forward']:.0f} / {mm['peak']:.0f}" for v, mm in memory.items()))
    result["peaks"].append({"layer": layer, "M": m, "memory_mib": memory})
    del p
    free(dev)


def main() -> int:
    dev, result = check_device(SMOKE), {"checks": [], "fwd": [], "step": [], "kernels": [], "peaks": [],
                                        "sources": SOURCES}
    per_cell = (("cells", both_cell), ("fwd", fwd_cell), ("step", step_cell), ("kernels", kernel_cell),
                ("peaks", peak_cell))
    phases = {"checks": lambda: checks(dev, result),
              **{name: (lambda cell=cell, name=name: each_cell(CELLS, cell, name, dev, result, stop_at, RUN))
                 for name, cell in per_cell}}
    args = phase_args(__doc__, phases, "trn52.json")
    stop_at = time.time() + args.deadline - 4 - RUN.elapsed()
    begin_layers_run(RUN, result, LAYERS)
    needs = {"checks": 20, "cells": 6, "fwd": 6, "step": 6, "kernels": 4, "peaks": 4}
    return run_phases(RUN, phases, args.phases, args.deadline, needs, args.path, result)


if __name__ == "__main__":
    sys.exit(main())

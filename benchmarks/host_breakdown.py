"""Where the host time of one eager Triton experts call goes (issue 13 item 1), piece by piece.

    PYTHONPATH=. OUT=/tmp/hb python benchmarks/host_breakdown.py [--presets qwen3-30b-a3b] [--batches 1 64]
        [--layer]

For each (preset, M), bf16, under no_grad, on one GPU:
  whole call   host µs of ``experts_triton``: 32 calls started on an idle GPU (below the launch queue's
               depth, so no back-pressure), median of 9 rounds; the same measure as host_time.py's host_us;
               "busy": the same behind a ~17 ms kernel (does a launch cost more while the GPU is busy?)
  steps        each step of the host path timed alone (400 calls; launches 32 from idle): the argument
               check, the direct-path test, the plan lookup, the output allocation, the workspace and
               descriptor lookups, the alignment's launches (how many, and µs for all), gate-up, down, k-sum
  align        each alignment plan the options can pick at this size (single program, one launch, hist +
               place, hist + scan + scatter): launches, host µs, GPU µs (a CUDA graph of 20) and whether
               its layout equals the torch twin ``align_block`` element for element at this routing
and once per run a probe of what a launch costs the host when the GPU is busy: one k-sum launch, from an
idle GPU and behind a ~17 ms kernel with 32 or 600 launches queued, with and without programmatic
dependent launch. A cProfile of the whole call (sorted by own time) goes to $OUT; ``--layer`` adds the
MoE layer's at M=1. The tables are printed last; JSON to $OUT/host_breakdown.json. ~1 minute on an H200.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.bench.timing import time_calls
from moekit.experts import check_experts_args
from moekit.experts.triton import _DESCRIPTORS, _WORKSPACES, _runs_directly, experts_triton
from moekit.experts.triton_align import plan_block_rows, run_align
from moekit.experts.triton_launch import LaunchOptions, resolve_launch_options
from moekit.experts.triton_plan import plan_for, plan_key, sum_launch
from moekit.layouts.block_aligned import align_block

REPS = 400  # calls per round of a step that launches nothing
SMOKE_SCALE = 64  # --smoke: N and K divided by this, on the CPU under TRITON_INTERPRET=1
IDLE_CALLS = 32  # calls per round of anything that launches: each round starts on an idle GPU
BUSY_CYCLES = 30_000_000  # torch.cuda._sleep: ~17 ms at the H200's 1.755 GHz
ALIGN_VARIANTS = {  # every alignment plan, forced by the options (where the size allows it)
    "single": LaunchOptions(align_small_max_bins=1 << 20),
    "one": LaunchOptions(align_small_max=0, align_one_launch_max=8192, align_two_launch_max=0),
    "two": LaunchOptions(align_small_max=0, align_one_launch_max=0, align_two_launch_max=1 << 30),
    "three": LaunchOptions(align_small_max=0, align_one_launch_max=0, align_two_launch_max=0),
}


class Run:
    """Where the script runs: the GPU, or the smoke test (CPU interpreter, tiny shapes, few calls)."""

    device = torch.device("cuda")
    scale = 1
    reps = REPS


def _sync() -> None:
    if Run.device.type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, reps: int | None = None, rounds: int = 5, busy: bool = False) -> float:
    """Median over ``rounds`` of host µs per call, each round of ``reps`` calls started on an idle GPU
    (``busy``: behind a ~17 ms kernel, so every launch of the round queues)."""
    reps = min(reps or Run.reps, Run.reps)
    times = []
    for _ in range(rounds):
        _sync()
        if busy and Run.device.type == "cuda":
            torch.cuda._sleep(BUSY_CYCLES)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    _sync()
    return sorted(times)[rounds // 2]


def launch_us(fn, busy: bool = False) -> float:
    return per_call_us(fn, IDLE_CALLS, rounds=9 if Run.device.type == "cuda" else 3, busy=busy)


def steps(shape: Shape, m: int, out_dir: Path) -> dict:
    dev = Run.device
    w = make_weights(shape, torch.bfloat16, dev)
    x = torch.randn(m, shape.k, device=dev, dtype=torch.bfloat16)
    r = uniform_routing(m, shape, dev, seed=m)
    ids, weights = r.topk_ids.contiguous(), r.topk_weights.contiguous()
    args = (x, w.w13, w.w2, ids, weights)
    opts = LaunchOptions()
    for _ in range(5):
        experts_triton(*args)
    plan = plan_for(x, w.w13, w.w2, ids, weights, None, "silu", None, opts)
    b = _WORKSPACES.buffers(plan.workspace, dev)
    pair = _DESCRIPTORS.get(w.w13, w.w2, plan.descriptor_key) if plan.descriptor_key else None
    w13_arg, up_arg, w2_arg = (pair.w13, pair.w13_up, pair.w2) if pair else (w.w13, None, w.w2)
    rows = (None, None, None) if plan.align is None else (b["sorted_ids"], b["expert_ids"], b["num_padded"])
    out = torch.empty_like(x)
    t = {
        "whole call": launch_us(lambda: experts_triton(*args)),
        "whole call busy": launch_us(lambda: experts_triton(*args), busy=True),
        "check_experts_args": per_call_us(lambda: check_experts_args(*args)),
        "_runs_directly": per_call_us(lambda: _runs_directly(x, w.w13, w.w2, weights, None, None)),
        "contiguous x2": per_call_us(lambda: (ids.contiguous(), weights.contiguous())),
        "plan_key": per_call_us(lambda: plan_key(x, w.w13, w.w2, ids, weights, None, "silu", None, opts)),
        "plan_for": per_call_us(lambda: plan_for(x, w.w13, w.w2, ids, weights, None, "silu", None, opts)),
        "torch.empty_like out": per_call_us(lambda: torch.empty_like(x)),
        "workspace buffers": per_call_us(lambda: _WORKSPACES.buffers(plan.workspace, dev)),
    }
    if pair:
        t["descriptors get"] = per_call_us(lambda: _DESCRIPTORS.get(w.w13, w.w2, plan.descriptor_key))
    t["align launches"] = 0.0 if plan.align is None else launch_us(lambda: run_align(plan.align, ids, None, b))
    t["align launch count"] = 0 if plan.align is None else plan.align.launches
    t["gate_up launch"] = launch_us(lambda: plan.gate_up(x, w13_arg, up_arg, None, b["h"], ids, *rows, None))
    t["down launch"] = launch_us(lambda: plan.down(b["h"], w2_arg, None, b["y"], weights, ids, *rows,
                                                           None, None, None))
    t["sum launch"] = launch_us(lambda: plan.sum_slots(b["y"], ids, ids, out))
    t["sum of steps"] = sum(v for k, v in t.items()
                            if k not in ("whole call", "whole call busy", "plan_key", "contiguous x2",
                                         "align launch count"))
    launches = [plan.gate_up, plan.down, plan.sum_slots]
    if plan.align is not None:
        launches += [getattr(plan.align, n) for n in ("small", "naive", "hist", "scan", "scatter", "place")]
    t["all raw"] = all(launch._raw is not None for launch in launches if launch is not None)
    t["align"] = align_variants(shape, ids, plan.config.BLOCK_M, dev)
    profile(lambda: experts_triton(*args), min(200, Run.reps),
            out_dir / f"cprofile_{shape.name.replace('/', '_')}_M{m}.txt")
    return t


def align_variants(shape: Shape, ids: torch.Tensor, block_m: int, dev: torch.device) -> dict:
    """Each alignment plan at this size: launches, host µs, GPU µs, equal to the twin."""
    want = align_block(ids, shape.num_experts, block_m, allow_naive=False)
    result = {}
    for name, options in ALIGN_VARIANTS.items():
        resolved = resolve_launch_options(options, dev)
        plan = plan_block_rows(ids.numel(), shape.num_experts, block_m, None, resolved, shortcut=False).align
        picked = ("single" if plan.small else "one" if plan.place and not plan.hist
                  else "two" if plan.place else "three")
        if picked != name:
            continue  # the options cannot force this plan at this size
        b = {n: torch.empty(s, dtype=d, device=dev) for n, d, s in plan.regions}
        run_align(plan, ids, None, b)
        same = equal_to_twin(b, want)
        result[name] = {"launches": plan.launches, "same": same,
                        "host_us": launch_us(lambda: run_align(plan, ids, None, b)),
                        "gpu_us": gpu_us(lambda: run_align(plan, ids, None, b))}
    return result


def equal_to_twin(b: dict, want) -> bool:
    """The plan's buffers hold the twin's layout: its R rows and R/B blocks first (a plan rounds R up to
    whole blocks), then only the sentinel and -1."""
    rows, blocks = want.sorted_ids.numel(), want.expert_ids.numel()
    return (torch.equal(b["sorted_ids"][:rows], want.sorted_ids)
            and torch.equal(b["expert_ids"][:blocks], want.expert_ids)
            and torch.equal(b["num_padded"], want.num_padded) and torch.equal(b["counts"], want.counts)
            and bool((b["sorted_ids"][rows:] == want.num_assignments).all())
            and bool((b["expert_ids"][blocks:] == -1).all()))


def gpu_us(fn) -> float:
    """GPU µs per call of ``fn``, from a CUDA graph of 20 calls (on the smoke test: one eager round)."""
    if Run.device.type != "cuda":
        return time_calls([fn], Run.device, min_reps=1, max_reps=1)
    return time_calls([fn] * 20, Run.device, graph=True)  # µs per call of fn


def busy_probe(dev: torch.device) -> dict:
    """Host µs of one k-sum launch (Qwen3-30B-A3B M=64 shapes) from an idle GPU and behind a ~17 ms
    kernel with 32 or 600 launches queued, programmatic dependent launch on and off."""
    m, hidden, top_k, num_experts = 64, 2048, 8, 128
    y = torch.zeros(m * top_k, hidden, device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(m, top_k, device=dev, dtype=torch.int64)
    out = torch.empty(m, hidden, device=dev, dtype=torch.bfloat16)
    result = {}
    for pdl in (True, False):
        launch = sum_launch(m, hidden, top_k, num_experts, None,
                            resolve_launch_options(LaunchOptions(dependent_launch=pdl), dev))
        launch(y, ids, ids, out)
        for busy, calls in (("idle", 32), ("busy", 32), ("busy", 600)):
            times = []
            for _ in range(5):
                torch.cuda.synchronize()
                if busy == "busy":
                    torch.cuda._sleep(BUSY_CYCLES)
                t0 = time.perf_counter()
                for _ in range(calls):
                    launch(y, ids, ids, out)
                times.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
            result[f"pdl={pdl} {busy} x{calls}"] = sorted(times)[2]
    return result


def profile(fn, reps: int, path: Path) -> None:
    """A cProfile of ``reps`` calls of fn, sorted by own time, written to ``path``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    _sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def layer_profile(preset: str, m: int, out_dir: Path) -> dict:
    """The whole ``MoE`` layer's eager forward: host µs, and a cProfile sorted by own time."""
    from moekit.config import MoEConfig
    from moekit.layer import MoE

    layer = MoE(MoEConfig.preset(preset), backend="triton", router="auto", dtype=torch.bfloat16,
                device="cuda").eval()
    x = torch.randn(m, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        layer(x)
    gate = layer.gate if hasattr(layer, "gate") else None
    t = {"layer whole call": launch_us(lambda: layer(x))}
    if isinstance(gate, torch.nn.Module):
        t["layer.gate(x)"] = launch_us(lambda: gate(x))
    profile(lambda: layer(x), 200, out_dir / f"cprofile_layer_{preset}_M{m}.txt")
    return t


STEP_COLUMNS = ("whole call", "whole call busy", "sum of steps", "check_experts_args", "plan_for",
                "torch.empty_like out",
                "workspace buffers", "align launches", "align launch count", "gate_up launch", "down launch",
                "sum launch")


def tables(results: dict, probe: dict) -> str:
    short = {"check_experts_args": "check", "torch.empty_like out": "out", "workspace buffers": "wksp",
             "align launches": "align", "align launch count": "#al", "gate_up launch": "gate_up",
             "down launch": "down", "sum launch": "ksum", "sum of steps": "steps", "whole call": "whole",
             "whole call busy": "busy"}
    lines = ["host µs per step (whole: 32 calls from idle; busy: the same behind a ~17 ms kernel; align: all its "
             "launches, #al of them)",
             f"{'cell':<24}" + "".join(f"{short.get(c, c):>9}" for c in STEP_COLUMNS) + "  raw"]
    for cell, t in results.items():
        if "whole call" in t:
            lines.append(f"{cell:<24}" + "".join(f"{t.get(c, float('nan')):>9.1f}" for c in STEP_COLUMNS)
                         + f"  {t['all raw']}")
    lines.append("alignment plans: launches / host µs / GPU µs / equal to the twin")
    for cell, t in results.items():
        for name, v in t.get("align", {}).items():
            lines.append(f"{cell:<24}{name:>7}{v['launches']:>4}{v['host_us']:>9.1f}{v['gpu_us']:>9.1f}"
                         f"  {'PASS' if v['same'] else 'FAIL'}")
    lines.append("one k-sum launch, host µs: " + ", ".join(f"{k} {v:.1f}" for k, v in probe.items()))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    p.add_argument("--layer", action="store_true", help="also the MoE layer's host time and profile at M=1")
    p.add_argument("--smoke", action="store_true", help=f"CPU interpreter, N and K / {SMOKE_SCALE}: checks the script")
    a = p.parse_args()
    if a.smoke:
        Run.device, Run.scale, Run.reps = torch.device("cpu"), SMOKE_SCALE, 2
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())  # what x.device says: one workspace
    out_dir = Path(os.environ.get("OUT", "host_breakdown_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with torch.no_grad():
        probe = busy_probe(Run.device) if Run.device.type == "cuda" else {}
        for preset in a.presets:
            for m in a.batches:
                results[f"{preset} M={m}"] = steps(Shape.from_preset(preset, Run.scale), m, out_dir)
                print(json.dumps({f"{preset} M={m}": results[f"{preset} M={m}"]}), flush=True)
            if a.layer and not a.smoke:
                results[f"{preset} layer M=1"] = layer_profile(preset, 1, out_dir)
            if Run.device.type == "cuda":
                torch.cuda.empty_cache()
    (out_dir / "host_breakdown.json").write_text(json.dumps({"probe": probe, **results}, indent=1))
    print(tables(results, probe))


if __name__ == "__main__":
    main()

"""Where the host time of one eager Triton experts call goes (issue 13 item 1), piece by piece.

    PYTHONPATH=. OUT=/tmp/hb python benchmarks/host_breakdown.py [--presets qwen3-30b-a3b] [--batches 1 64]

For each (preset, M): the whole eager call (``experts_triton``), then each step of its host path timed
alone over many repetitions on an idle GPU (the argument check, the direct-path test, the plan lookup,
the output allocation, the workspace and descriptor lookups, each of the plan's launches), then the
pieces a launch is made of (the current device and stream, Triton's per-launch descriptor encoding)
and a ``cProfile`` of the whole call sorted by own time. The sum of the steps against the whole call
says what the table misses. A short table is printed last; JSON and the profiles go to $OUT.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import json
import os
import pstats
import time
from pathlib import Path

import torch

from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.experts import check_experts_args
from moekit.experts.triton import _DESCRIPTORS, _WORKSPACES, _runs_directly, experts_triton
from moekit.experts.triton_align import run_align
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_plan import plan_for, plan_key

REPS = 400


def per_call_us(fn, reps: int = REPS) -> float:
    """Median over 5 rounds of host µs per call, each round started on an idle GPU."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        rounds.append((time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize()
    return sorted(rounds)[2]


def steps(shape: Shape, m: int, out_dir: Path) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
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
        "whole call": per_call_us(lambda: experts_triton(*args)),
        "check_experts_args": per_call_us(lambda: check_experts_args(*args)),
        "_runs_directly": per_call_us(lambda: _runs_directly(x, w.w13, w.w2, weights, None, None)),
        "contiguous x2": per_call_us(lambda: (ids.contiguous(), weights.contiguous())),
        "plan_key": per_call_us(lambda: plan_key(x, w.w13, w.w2, ids, weights, None, "silu", None, opts)),
        "plan_for": per_call_us(lambda: plan_for(x, w.w13, w.w2, ids, weights, None, "silu", None, opts)),
        "torch.empty out": per_call_us(lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device)),
        "x.new_empty": per_call_us(lambda: x.new_empty(x.shape)),
        "torch.empty_like": per_call_us(lambda: torch.empty_like(x)),
        "workspace buffers": per_call_us(lambda: _WORKSPACES.buffers(plan.workspace, dev)),
    }
    if pair:
        t["descriptors get"] = per_call_us(lambda: _DESCRIPTORS.get(w.w13, w.w2, plan.descriptor_key))
    if plan.align is not None:
        t["align launches"] = per_call_us(lambda: run_align(plan.align, ids, None, b))
    t["gate_up launch"] = per_call_us(lambda: plan.gate_up(x, w13_arg, up_arg, None, b["h"], ids, *rows))
    t["down launch"] = per_call_us(lambda: plan.down(b["h"], w2_arg, None, b["y"], weights, ids, *rows))
    t["sum launch"] = per_call_us(lambda: plan.sum_slots(b["y"], ids, ids, out))
    t["sum of steps"] = sum(v for k, v in t.items()
                            if k not in ("whole call", "plan_key", "contiguous x2", "x.new_empty", "torch.empty_like"))
    t["raw launches"] = str([launch._raw is not None for launch in (plan.gate_up, plan.down, plan.sum_slots)])
    t.update(launch_pieces(plan, pair, dev))
    profile(lambda: experts_triton(*args), REPS, out_dir / f"cprofile_{shape.name}_M{m}.txt")
    return t


def profile(fn, reps: int, path: Path) -> None:
    """A cProfile of ``reps`` calls of fn, sorted by own time: written to ``path`` and printed."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())
    print(text.getvalue()[:6000], flush=True)


def launch_pieces(plan, pair, dev) -> dict:
    """What one launch through the compiled kernel's runner is made of."""
    import triton

    drv = triton.runtime.driver.active
    t = {
        "torch.cuda.current_device": per_call_us(torch.cuda.current_device),
        "torch.cuda.current_stream": per_call_us(lambda: torch.cuda.current_stream()),
        "_cuda_getCurrentRawStream": per_call_us(lambda: torch._C._cuda_getCurrentRawStream(dev.index or 0)),
        "triton get_current_stream": per_call_us(lambda: drv.get_current_stream(dev.index or 0)),
        "knobs launch_enter_hook": per_call_us(lambda: triton.knobs.runtime.launch_enter_hook),
    }
    launcher = plan.gate_up._launcher
    cells = getattr(launcher, "__closure__", None) or ()
    compiled = next((c.cell_contents for c in cells if type(c.cell_contents).__name__ == "CompiledKernel"), None)
    t["launcher"] = type(launcher).__name__ + (" of CompiledKernel" if compiled is not None else "")
    metas = getattr(getattr(compiled, "metadata", None), "tensordesc_meta", None)
    if pair is not None and metas:
        from triton.backends.nvidia import driver as nv

        n_params = len(inspect.signature(nv.make_tensordesc_arg).parameters)
        extra = (None,) * (n_params - 2)
        t["make_tensordesc_arg"] = per_call_us(lambda: nv.make_tensordesc_arg(pair.w13, metas[0], *extra))
    return t


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
    t = {"layer whole call": per_call_us(lambda: layer(x), reps=200)}
    if isinstance(gate, torch.nn.Module):
        t["layer.gate(x)"] = per_call_us(lambda: gate(x), reps=200)
    profile(lambda: layer(x), 200, out_dir / f"cprofile_layer_{preset}_M{m}.txt")
    return t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    a = p.parse_args()
    out_dir = Path(os.environ.get("OUT", "host_breakdown_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    with torch.no_grad():
        for preset in a.presets:
            for m in a.batches:
                results[f"{preset} M={m}"] = steps(Shape.from_preset(preset), m, out_dir)
            results[f"{preset} layer M=1"] = layer_profile(preset, 1, out_dir)
    (out_dir / "host_breakdown.json").write_text(json.dumps(results, indent=1))
    for cell, t in results.items():
        print(f"\n{cell}")
        for k, v in t.items():
            print(f"  {k:<30} {v:>8.2f}" if isinstance(v, float) else f"  {k:<30} {v}")


if __name__ == "__main__":
    main()

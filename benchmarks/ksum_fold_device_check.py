"""The k-sum folded into the down GEMM's epilogue (issue 13 item 1), on the GPU: bit equality with the
separate k-sum launch, and host / eager / GPU time per experts call, folded against the 4-launch path;
then where one launch's host time goes.

    PYTHONPATH=$PWD OUT=/tmp/kf python benchmarks/ksum_fold_device_check.py [--budget-s 70]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/ksum_fold_device_check.py --smoke \
        --presets mixtral-8x7b --batches 8   (CPU, tiny shapes: checks the script)

For Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B experts in bf16 at M = 1, 8, 64, 16, 32, 512, 1024 (that
order, after a throwaway warm cell; no_grad, uniform routing), two ``LaunchOptions``:
  sep   sum_fold_max=0: gate-up, down, then the k-sum's own launch (in slot order: ``ORDERED``)
  fold  sum_fold_max=2**20: the k-sum in the down GEMM's epilogue (KSUM), one launch fewer
per variant (``experts_triton``, the user's eager path): launches per call, host µs per call (7 x 32 calls
started on an idle GPU: median, min), eager wall µs per call (5 x 40 back-to-back calls, one sync: median,
min), GPU µs (a CUDA graph of 16 calls, replayed; fold with counters allocated before the capture, ``fused_experts(counters=...)``), ``ok`` (host <=
40 and eager <= max(1.15 graph, graph + 15)); fold's ``eq``: every one of 24 eager outputs (counters reused
call after call) and of a graph replay equals sep's bit for bit, and the counters are all 0 afterwards. Also
per cell the separate k-sum kernel alone (graph of 16): slot order (``ORDERED``, the new default) against
``tl.sum`` (session 8's). At two cells a per-launch host probe of the fold's down launch (and the 4-launch
path's down and k-sum): the ``BoundLaunch`` call, its C launch called directly with the same arguments,
with every tensor replaced by its ``data_ptr()`` int (the C launcher then skips its ``data_ptr`` call and
``cuPointerGetAttribute``), with PDL off, and an empty kernel with no argument; a control (empty_like).
Checkpoint (H200, ff3d2f0): converting every tensor to an int per call in Python cost more host time than the C
launcher's own lookups (whole call +2 to +5 µs at M <= 8), so the launches pass tensors.
A hard alarm stops the run at --hard-limit-s. JSON to $OUT/ksum_fold.json; the short table is printed last.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import triton

from host_align_device_check import (  # benchmarks/ is on sys.path
    Run, budgeted_cell, run_with_hard_limit, eager_us, gpu_us, host_us, one_at_a_time_us,
)
from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.experts.triton import _DESCRIPTORS, _WORKSPACES, experts_triton, fused_experts
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_plan import plan_for, sum_launch
from moekit.triton_bind import BoundLaunch

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (1, 8, 64, 16, 32, 512, 1024)
SEP, FOLD = LaunchOptions(sum_fold_max=0), LaunchOptions(sum_fold_max=1 << 20)
PROBE_CELLS = {("qwen3-30b-a3b", 8), ("deepseek-v3", 64)}
EQ_CALLS = 24
_WEIGHTS: dict = {}


def _inputs(preset: str, m: int) -> tuple:
    shape = Shape.from_preset(preset, Run.scale)
    if preset not in _WEIGHTS:
        _WEIGHTS[preset] = make_weights(shape, torch.bfloat16, Run.device)
    w = _WEIGHTS[preset]
    x = torch.randn(m, shape.k, device=Run.device, dtype=torch.bfloat16)
    r = uniform_routing(m, shape, Run.device, seed=m)
    return x, w.w13, w.w2, r.topk_ids.contiguous(), r.topk_weights.contiguous()


def _timings(row: dict, call, graph_call=None) -> dict:
    """Host and eager µs of ``call`` (the user's path, ``experts_triton``), GPU µs of ``graph_call`` (or ``call``)."""
    for _ in range(3):
        call()
    row["host_us"], row["eager_us"], row["gpu_us"] = host_us(call), eager_us(call), gpu_us(graph_call or call)
    g, e = row["gpu_us"], row["eager_us"]["median"]
    row["ok"] = row["host_us"]["median"] <= 40.0 and e <= max(1.15 * g, g + 15.0)
    return row


def fold_row(args: tuple, want: torch.Tensor) -> dict:
    """The folded path: equality with ``want`` (eager, reused counters; a graph replay), then timings."""
    plan = plan_for(*args, None, "silu", None, FOLD)
    if plan.down_sum is None:
        return {"error": "the plan has no folded down launch"}
    row = {"launches": 2 + (0 if plan.align is None else plan.align.launches), "counters": plan.workspace.counters}
    outs = [experts_triton(*args, options=FOLD) for _ in range(EQ_CALLS)]
    row["eq_eager"] = all(torch.equal(o, want) for o in outs)
    kept = _WORKSPACES.buffers(plan.workspace, args[0].device)["counters"]
    row["counters_zero_after"] = bool((kept == 0).all()) if Run.device.type == "cuda" else None
    counters = torch.zeros(plan.workspace.counters, dtype=torch.int32, device=args[0].device)
    if Run.device.type == "cuda":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fused_experts(*args, options=FOLD, counters=counters)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            graph_out = fused_experts(*args, options=FOLD, counters=counters)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        row["eq_graph"] = torch.equal(graph_out, want) and bool((counters == 0).all())
    return _timings(row, lambda: experts_triton(*args, options=FOLD),
                    lambda: fused_experts(*args, options=FOLD, counters=counters))


def sum_kernels_gpu(args: tuple) -> dict:
    """The separate k-sum alone, slot order against tl.sum, GPU µs (graph of 16 launches)."""
    x, w13, w2, ids, _ = args
    y = torch.randn(ids.numel(), x.shape[1], device=x.device, dtype=x.dtype)
    out = torch.empty_like(x)
    result = {}
    for name, ordered in (("ordered", True), ("tl_sum", False)):
        launch = sum_launch(x.shape[0], x.shape[1], ids.shape[1], w13.shape[0], None, SEP, ordered=ordered)
        result[name] = gpu_us(lambda: launch(y, ids, ids, out))
    return result


def cell(preset: str, m: int) -> dict:
    args = _inputs(preset, m)
    plan = plan_for(*args, None, "silu", None, SEP)
    sep = {"launches": 3 + (0 if plan.align is None else plan.align.launches)}
    want = fused_experts(*args, options=SEP)
    result = {"A": m * args[3].shape[1], "sep": _timings(sep, lambda: experts_triton(*args, options=SEP))}
    try:
        result["fold"] = fold_row(args, want)
    except Exception as exc:  # a failing variant must not lose the others' numbers
        result["fold"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    try:
        result["sum_kernel_gpu_us"] = sum_kernels_gpu(args)
    except Exception as exc:
        result["sum_kernel_gpu_us"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    if (preset, m) in PROBE_CELLS and Run.device.type == "cuda":
        try:
            result["probe"] = launch_probe(args)
        except Exception as exc:
            result["probe"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return result


def _launch_args(args: tuple) -> dict:
    """name -> (BoundLaunch, its pointer arguments) of one call's launches, as ``triton._run`` passes them."""
    x, w13, w2, ids, weights = args
    fused_experts(*args, options=FOLD)
    plan = plan_for(*args, None, "silu", None, FOLD)
    b = _WORKSPACES.buffers(plan.workspace, x.device)
    pair = _DESCRIPTORS.get(w13, w2, plan.descriptor_key) if plan.descriptor_key else None
    w2_arg = pair.w2 if pair else w2
    rows = (None, None, None) if plan.align is None else (b["sorted_ids"], b["expert_ids"], b["num_padded"])
    out = torch.empty_like(x)
    return {"down_sum": (plan.down_sum, (b["h"], w2_arg, None, b["y"], weights, ids, *rows, out, b["counters"], None)),
            "down": (plan.down, (b["h"], w2_arg, None, b["y"], weights, ids, *rows, None, None, None)),
            "ksum": (plan.sum_slots, (b["y"], ids, ids, out))}


def _c_launch(raw, pointers: tuple, tail: tuple, pdl=None):
    """A zero-argument call of ``raw``'s C launch with its arguments built once (descriptors expanded)."""
    args = tuple(raw._expanded(pointers) if raw.desc_positions else pointers) + tuple(tail)
    g, stream, c = raw.grid, raw.stream(), raw.c_launch
    head = (g[0], g[1], g[2], stream, raw.function, raw.cooperative, raw.pdl if pdl is None else pdl, None, None,
            raw.metadata, None, None, None)
    return lambda: c(*head, *args)


def launch_probe(args: tuple) -> dict:
    """Host µs of single launches (32 from idle, median), split by what the launch does."""
    result = {"control_empty_like": host_us(lambda: torch.empty_like(args[0]), calls=400)}
    for name, (bound, pointers) in _launch_args(args).items():
        for _ in range(2):
            bound(*pointers)
        raw = bound._raw
        row = {"bound": host_us(lambda: bound(*pointers)), "one_at_a_time": one_at_a_time_us(lambda: bound(*pointers)),
               "raw": raw is not None, "args": len(pointers) + len(bound.tail)}
        if raw is not None:
            ints = tuple(p.data_ptr() if isinstance(p, torch.Tensor) else p for p in pointers)
            row["c_launch"] = host_us(_c_launch(raw, pointers, bound.tail))
            row["c_launch_int_pointers"] = host_us(_c_launch(raw, ints, bound.tail))
            row["c_launch_no_pdl"] = host_us(_c_launch(raw, pointers, bound.tail, pdl=False))
            row["tensors"] = sum(isinstance(p, torch.Tensor) for p in pointers)
            row["data_ptr_calls"] = host_us(lambda: [p.data_ptr() for p in pointers if isinstance(p, torch.Tensor)])
        result[name] = row
    result["empty_kernel"] = empty_kernel_probe()
    result["control_empty_like_after"] = host_us(lambda: torch.empty_like(args[0]), calls=400)
    return result


@triton.jit
def nothing():
    pass


def empty_kernel_probe() -> dict:
    """Host µs of a kernel that does nothing, no argument: the floor of one raw launch (PDL on and off)."""
    launch = BoundLaunch(nothing, (1,), 0, (), cached=True, launch_pdl=True)
    launch()
    launch()
    if launch._raw is None:
        return {"bound": host_us(launch)}
    return {"bound": host_us(launch), "c_launch": host_us(_c_launch(launch._raw, (), ())),
            "c_launch_no_pdl": host_us(_c_launch(launch._raw, (), (), pdl=False))}


def table(results: dict) -> str:
    lines = ["host µs (median/min of 7 x 32 calls from idle), eager µs per call (median), GPU µs (graph of 16), L launches;"
             " eq: fold equals sep bit for bit (24 eager calls / graph replay; counters back at 0); sum: k-sum kernel alone,"
             " GPU µs, slot order / tl.sum",
             f"{'cell':<22}{'A':>6} {'sep L   host   min   eager     gpu':<35}{'fold L  host   min   eager     gpu':<35}"
             f" eq  sum"]
    for key, res in results.items():
        if "skipped" in res or "error" in res:
            lines.append(f"{key:<22} {res.get('skipped') or res.get('error')}")
            continue
        parts = []
        for name in ("sep", "fold"):
            v = res.get(name, {})
            if "error" in v:
                parts.append(f"ERROR {v['error'][:60]}")
                continue
            parts.append(f"{v['launches']:>2}{v['host_us']['median']:>7.1f}{v['host_us']['min']:>6.1f}"
                         f"{v['eager_us']['median']:>8.1f}{v['gpu_us']:>8.1f}{'' if v['ok'] else '*':<2}")
        f = res.get("fold", {})
        eq = "yes" if f.get("eq_eager") and f.get("eq_graph", True) and f.get("counters_zero_after") is not False else " NO"
        sk = res.get("sum_kernel_gpu_us", {})
        sums = f"{sk['ordered']:.1f}/{sk['tl_sum']:.1f}" if "ordered" in sk else "-"
        lines.append(f"{key:<22}{res['A']:>6} {parts[0]:<35}{parts[1]:<35} {eq:>3} {sums}")
    lines.append("(* = not ok: host > 40 or eager above max(1.15 gpu, gpu + 15))")
    lines.append("launch probe, host µs median: bound call / C launch / C launch with int pointers / C launch PDL off;"
                 " tensors; data_ptr() calls")
    for key, res in results.items():
        p = res.get("probe")
        if not p or "error" in p:
            if p:
                lines.append(f"{key:<22} probe {p['error']}")
            continue
        for name in ("down_sum", "down", "ksum"):
            r = p[name]
            if r.get("raw"):
                lines.append(f"{key:<22}{name:>9} {r['bound']['median']:.1f} / {r['c_launch']['median']:.1f} / "
                             f"{r['c_launch_int_pointers']['median']:.1f} / {r['c_launch_no_pdl']['median']:.1f};"
                             f" {r['tensors']} tensors, {r['args']} args; data_ptr x{r['tensors']} "
                             f"{r['data_ptr_calls']['median']:.2f}")
            else:
                lines.append(f"{key:<22}{name:>9} {r['bound']['median']:.1f} (NOT RAW)")
        e = p["empty_kernel"]
        lines.append(f"{key:<22}{'empty':>9} " + " / ".join(f"{n} {v['median']:.1f}" for n, v in e.items())
                     + f"; control empty_like {p['control_empty_like']['median']:.2f} -> "
                       f"{p['control_empty_like_after']['median']:.2f}")
    return "\n".join(lines)


def measure(a, start: float, results: dict) -> None:
    with torch.no_grad():
        cell(a.presets[0], 1)  # throwaway: the first cell of a process runs slow (session 8: 54.9 against 31 µs)
        for m in a.batches:
            for preset in a.presets:
                budgeted_cell(results, f"{preset} M={m}", start, a.budget_s, lambda: cell(preset, m))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=70.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=86, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale, Run.samples, Run.one_at_a_time = torch.device("cpu"), 64, (1, 1, 1, 1), 1
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(os.environ.get("OUT", "ksum_fold_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    run_with_hard_limit(a, start, out_dir / "ksum_fold.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()

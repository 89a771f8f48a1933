"""The lean launch (``LaunchOptions.lean_launch``, ``moekit/experts/triton_lean.py``) on the GPU (issue 13
item 1): is its output the current path's bit for bit, and what host, eager and graph time per experts call.

    PYTHONPATH=$PWD OUT=/tmp/hl python benchmarks/host_lean_device_check.py [--budget-s 200]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/host_lean_device_check.py --smoke \
        --presets mixtral-8x7b --batches 1 64   (CPU, tiny shapes: checks the script)

For Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B experts in bf16 at M = 1, 8, 64, 512, 4096, 16384 (under
no_grad, uniform routing; a throwaway cell first: a process's first cell runs slow), three variants:
  current   lean_launch=False: each launch a ``BoundLaunch`` call (``triton_bind.RawLaunch``)
  lean      the defaults: the plan's recorded ``LaunchSequence``
  lean_noscan lean without ``align_scan_fold`` (on by default: hist and scan in one launch past
            align_two_launch_max, at M = 4096 and 16384 here; elsewhere the same launches as lean)
  lean_nofast lean without ``fast_path`` (``triton_fast``: a repeated call skips the check and every lookup),
            so that "lean" against it is the fast path's saving
and, up to M = 512, ``two`` (``two_sets``): lean on two weight sets of the same shape in turn, as a model's
layers run (host µs per call; ``two same``: both outputs equal the current path's bit for bit)
All three share the workspace split above the pool's size (h and y one fresh buffer per call, the alignment's
buffers pooled), so ``current`` here is already faster than main at M >= 4096 (main allocated every region
per call: benchmarks/host_breakdown.py "workspace buffers", 34-56 µs at M = 4096).
Per cell: ``same`` (lean's output equals current's bit for bit, on two routings), ``lean_used`` (a sequence
was recorded for the plan), host µs per call (N calls started on an idle GPU, one sync; the two variants'
samples interleaved, ABBA; median and min), eager µs (back-to-back calls, one sync), graph µs (a CUDA graph of the
calls, replayed: the GPU time, equal for both up to noise), ``lean_raw`` (the sequence calls the C launch
entry and no launch hook is installed). Last of all (a profiler session may slow what follows), the last
preset's M = 1 and 512 again with torch.profiler's self-CPU µs per call. Cells run preset by preset until
--budget-s; the rest are listed as skipped. JSON to $OUT/host_lean.json (./host_lean_out/ without OUT);
the table is printed last (look for: same = yes everywhere, lean host <= nofast host <= current host).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import host_align_device_check as ha
from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.bench.timing import time_calls
from moekit.experts import triton_lean
from moekit.experts.triton import clear_launch_caches, experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_plan import plan_for

PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
BATCHES = (1, 8, 64, 512, 4096, 16384)
VARIANTS = {"current": LaunchOptions(lean_launch=False), "lean": LaunchOptions(),
            "lean_noscan": LaunchOptions(align_scan_fold=False),  # hist and scan as two launches (A > 4096)
            "lean_nofast": LaunchOptions(fast_path=False)}  # lean without the repeated call's fast path
LARGE_M = 4096  # from here on fewer calls per sample (a call is milliseconds of GPU time)
TWO_SETS_MAX_M = 512  # the two-weight-set cell up to here (host-bound sizes)


class Run:
    device = torch.device("cuda")
    scale = 1
    host_samples, host_calls, eager_samples, eager_calls, graph_calls = 15, 32, 3, 40, 16


def counts(m: int) -> tuple[int, int, int, int, int]:
    """(host samples, host calls, eager samples, eager calls, graph calls) at M."""
    if m >= LARGE_M and Run.device.type == "cuda":
        return 5, 12, 2, 8, 2
    return Run.host_samples, Run.host_calls, Run.eager_samples, Run.eager_calls, Run.graph_calls


def host_us(fns: dict, m: int) -> tuple[dict, dict]:
    """Host µs per call of each variant (name -> µs): calls started on an idle GPU, samples interleaved;
    the medians, then the minima."""
    samples, calls = counts(m)[:2]
    times = {name: [] for name in fns}
    for sample in range(samples):
        for name in (list(fns) if sample % 2 == 0 else list(fns)[::-1]):  # ABBA: neither always goes first
            fn = fns[name]
            ha._sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    ha._sync()
    return {name: statistics.median(t) for name, t in times.items()}, {name: min(t) for name, t in times.items()}


def eager_us(fn, m: int) -> float:
    samples, calls = counts(m)[2:4]
    times = []
    for _ in range(samples):
        ha._sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        ha._sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def graph_us(fn, m: int) -> float:
    if Run.device.type != "cuda":
        return float("nan")
    return time_calls([fn] * counts(m)[4], Run.device, graph=True, budget_s=0.2, min_reps=3, max_reps=10)


def profiler_self_cpu_us(fn, calls: int = 20) -> float:
    """torch.profiler's self-CPU µs per call, all events summed."""
    fn()
    ha._sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        ha._sync()
    return sum(e.self_cpu_time_total for e in prof.key_averages()) / calls


def two_sets(args: tuple, other, m: int) -> dict:
    """Two weight sets of one shape in turn (a model's layers), lean: host µs per call, and each output equal
    to the current path's bit for bit (before this branch one sequence per plan was re-recorded every call)."""
    lean, current = VARIANTS["lean"], VARIANTS["current"]
    x, w13, w2, ids, weights = args
    calls = [lambda: experts_triton(*args, options=lean), lambda: experts_triton(x, other.w13, other.w2, ids, weights,
                                                                                  options=lean)]
    for call in calls * 2:  # compiled, recorded
        call()
    same = (torch.equal(calls[0](), experts_triton(*args, options=current))
            and torch.equal(calls[1](), experts_triton(x, other.w13, other.w2, ids, weights, options=current)))
    median, _ = host_us({"two": lambda: (calls[0](), calls[1]())}, m)
    return {"two_same": same, "host_two_us": median["two"] / 2}


def cell(m: int, weights, shape: Shape, profile: bool = False, other=None) -> dict:
    dev = Run.device
    fns, outs = {}, {}
    row = {"same": True}
    for seed in (m, m + 1):  # two routings: the second call of each variant reuses its plan (and sequence)
        x = torch.randn(m, shape.k, device=dev, dtype=torch.bfloat16)
        routing = uniform_routing(m, shape, dev, seed=seed)
        args = (x, weights.w13, weights.w2, routing.topk_ids, routing.topk_weights)
        for name, options in VARIANTS.items():
            fns[name] = lambda a=args, o=options: experts_triton(*a, options=o)  # noqa: E731
            for _ in range(2):
                outs[name] = fns[name]()
        row["same"] = row["same"] and torch.equal(outs["lean"], outs["current"])
        row["noscan_same"] = row.get("noscan_same", True) and torch.equal(outs["lean_noscan"], outs["current"])
        row["nofast_same"] = row.get("nofast_same", True) and torch.equal(outs["lean_nofast"], outs["current"])
    plan = plan_for(*args, None, "silu", None, VARIANTS["lean"])
    row["lean_used"] = any(key[0] is plan for key in triton_lean._SEQUENCES)
    row["launches"] = 3 + (0 if plan.align is None else plan.align.launches) - (plan.down_sum is not None)
    row["host_us"], row["host_min_us"] = host_us(fns, m)
    row["eager_us"] = {name: eager_us(fn, m) for name, fn in fns.items()}
    row["graph_us"] = {name: graph_us(fn, m) for name, fn in fns.items()}
    sequence = next((s for key, s in triton_lean._SEQUENCES.items() if key[0] is plan), None)
    row["lean_raw"] = sequence is not None and sequence.raw and sequence.hooks.idle()  # the C launch entry, taken
    if other is not None:
        row.update(two_sets(args, other, m))
    if profile and m in (1, 512):  # last: a profiler session may leave hooks behind that slow later calls
        row["profiler_self_cpu_us"] = {name: profiler_self_cpu_us(fn) for name, fn in fns.items()}
    return row


def table(results: dict) -> str:
    lines = ["host / eager / graph µs per experts call, current -> lean (same: lean's output equals current's "
             "bit for bit; lean: a recorded sequence ran through the C launch)",
             f"{'cell':26}{'same':>5}{'lean':>5}{'#l':>4}{'host cur':>10}{'host lean':>10}{'eager cur':>10}"
             f"{'eager lean':>11}{'graph':>9}{'min cur':>9}{'min lean':>9}{'prof cur':>9}{'prof lean':>10}"
             f"{'noscan same':>12}{'host noscan':>12}{'graph noscan':>13}{'nofast same':>12}{'host nofast':>12}"
             f"{'two same':>9}{'host two':>9}"]
    for key, r in results.items():
        if "host_us" not in r:
            lines.append(f"{key:26}{next(iter(r.values()))}")
            continue
        prof = r.get("profiler_self_cpu_us", {})
        lines.append(f"{key:26}{ha._yn(r['same']):>5}{ha._yn(r['lean_used'] and r['lean_raw']):>5}{r['launches']:>4}"
                     f"{r['host_us']['current']:>10.1f}{r['host_us']['lean']:>10.1f}{r['eager_us']['current']:>10.1f}"
                     f"{r['eager_us']['lean']:>11.1f}{r['graph_us']['lean']:>9.1f}"
                     f"{r['host_min_us']['current']:>9.1f}{r['host_min_us']['lean']:>9.1f}"
                     f"{prof.get('current', float('nan')):>9.1f}{prof.get('lean', float('nan')):>10.1f}"
                     f"{ha._yn(r['noscan_same']):>12}{r['host_us']['lean_noscan']:>12.1f}"
                     f"{r['graph_us']['lean_noscan']:>13.1f}"
                     f"{ha._yn(r['nofast_same']):>12}{r['host_us']['lean_nofast']:>12.1f}"
                     f"{ha._yn(r['two_same']) if 'two_same' in r else '-':>9}"
                     f"{r.get('host_two_us', float('nan')):>9.1f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=230, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiler cells")
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale = torch.device("cpu"), ha.SMOKE_SCALE
        Run.host_samples, Run.host_calls, Run.eager_samples, Run.eager_calls, Run.graph_calls = 1, 1, 1, 1, 1
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = Run.device
    out_dir = Path(os.environ.get("OUT", "host_lean_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "host_lean.json", lambda results: measure(a, start, results), table)


def measure(a, start: float, results: dict) -> None:
    with torch.no_grad():
        for i, preset in enumerate(a.presets):
            shape = Shape.from_preset(preset, Run.scale)
            weights = make_weights(shape, torch.bfloat16, Run.device)
            other = make_weights(shape, torch.bfloat16, Run.device, seed=1)  # a second layer of the same shape
            if i == 0:
                cell(1, weights, shape)  # throwaway: a process's first cell runs slow
            for m in a.batches:
                ha.budgeted_cell(results, f"{preset} M={m}", start, a.budget_s,
                                 lambda: cell(m, weights, shape, other=other if m <= TWO_SETS_MAX_M else None))
            if a.profile and preset == a.presets[-1]:  # the profiler last of all (see cell)
                for m in [m for m in (1, 512) if m in a.batches]:
                    results[f"{preset} M={m} profiled"] = cell(m, weights, shape, profile=True)
            del weights, other
            clear_launch_caches()
            if Run.device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

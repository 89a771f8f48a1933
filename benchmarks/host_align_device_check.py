"""The alignment folded into the gate-up GEMM (issue 13 item 1), on the GPU: host time, GPU time and eager
wall time per experts call, old path against new, and where the GEMM launches' host time goes.

    PYTHONPATH=$PWD OUT=/tmp/ha python benchmarks/host_align_device_check.py [--budget-s 95]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/host_align_device_check.py --smoke \
        --presets mixtral-8x7b --batches 64   (CPU, tiny shapes: checks the script)

For Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B experts in bf16 at M = 8, 16, 32, 64, 512, 1 (in that
order, after a throwaway cell: the first preset at M = 1; under no_grad, uniform routing), each variant of
``LaunchOptions``:
  old       align_fold_max=0: the alignment's own launch(es) (session 7's path)
  new       the defaults: folded into gate-up up to align_fold_max assignments
  fold_512  align_fold_max=512 (only where the default < A <= 512): the fold where the default stops it
            (the first checkpoint's default; at A = 1024 and 4096 it cost 167 and 513 GPU µs, not measured again)
per variant: host µs per call (32 calls started on an idle GPU; 7 samples: median and min), eager wall µs
per call (40 back-to-back calls, one sync; 5 samples: median and min), GPU µs (a CUDA graph of 16 calls,
replayed), launches per call, ``ok`` (host <= 40 and eager <= max(1.15 graph, graph + 15)), and whether
its output equals old's bit for bit (and, folded, whether the layout the gate-up programs left for the down
GEMM equals the torch twin ``align_block``). At M = 64 and 512 a launch probe: the host µs of each GEMM
launch and the k-sum, 32 from idle and one at a time (sync before each), with PDL on (and off for
Mixtral at M = 64), each launch's raw path, descriptor count and tiles, next to a control that launches
nothing (``torch.empty_like``: is the host slow right now?); the whole call with Python's garbage
collector on and off; and a cProfile of 200 whole calls ($OUT/cprofile_*.txt, top rows in the JSON).
Cells run in priority order until --budget-s has passed (compiles included); the rest are listed as
skipped, and --hard-limit-s stops a cell midway. JSON to $OUT/host_align.json; the short table is printed last.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import signal
import statistics
import time
from pathlib import Path

import torch

from moekit.bench.cells import Shape, make_weights, uniform_routing
from moekit.bench.timing import host_from_idle, time_calls
from moekit.experts.triton import _DESCRIPTORS, _WORKSPACES, experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit.experts.triton_plan import plan_for
from moekit.layouts.block_aligned import align_block

PRESETS = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
BATCHES = (8, 16, 32, 64, 512, 1)  # priority order: the fold's cells first
VARIANTS = {"old": LaunchOptions(align_fold_max=0), "new": LaunchOptions(),
            "fold_512": LaunchOptions(align_fold_max=512)}
HOST_SAMPLES, EAGER_SAMPLES, IDLE_CALLS, EAGER_CALLS = 7, 5, 32, 40
SMOKE_SCALE = 64


class Run:
    device = torch.device("cuda")
    scale = 1
    samples = (HOST_SAMPLES, EAGER_SAMPLES, IDLE_CALLS, EAGER_CALLS)
    one_at_a_time, profile_reps, control_calls = 15, 200, 400


def _sync() -> None:
    if Run.device.type == "cuda":
        torch.cuda.synchronize()


def _stats(samples: list) -> dict:
    return {"median": statistics.median(samples), "min": min(samples)}


def host_us(fn, calls: int | None = None, samples: int | None = None) -> dict:
    """Host µs per call: ``calls`` calls started on an idle GPU, ``samples`` times."""
    calls, samples = calls or Run.samples[2], samples or Run.samples[0]
    return _stats(host_from_idle(fn, Run.device, calls=calls, samples=samples))


def one_at_a_time_us(fn) -> dict:
    """Host µs of one call with the GPU idle before it (sync, call, time), several times."""
    times = []
    for _ in range(Run.one_at_a_time):
        _sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    _sync()
    return _stats(times)


def eager_us(fn) -> dict:
    """Wall µs per call of back-to-back calls and one sync."""
    calls, times = Run.samples[3], []
    for _ in range(Run.samples[1]):
        _sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return _stats(times)


def gpu_us(fn) -> float:
    if Run.device.type != "cuda":
        return float("nan")
    return time_calls([fn] * 16, Run.device, graph=True)


def variant_row(args: tuple, options: LaunchOptions, want: torch.Tensor | None) -> dict:
    x, w13, w2, ids, weights = args

    def call():
        return experts_triton(x, w13, w2, ids, weights, options=options)

    out = call()
    plan = plan_for(x, w13, w2, ids, weights, None, "silu", None, options)
    align = plan.align
    row = {"launches": 3 + (0 if align is None else align.launches), "folded": bool(align and align.folded),
           "same_as_old": None if want is None else torch.equal(out, want)}
    if row["folded"]:
        row["layout_equals_twin"] = layout_equals_twin(plan, ids, w13.shape[0], x.device)
    for _ in range(3):
        call()
    row["host_us"] = host_us(call)
    row["eager_us"] = eager_us(call)
    row["gpu_us"] = gpu_us(call)
    g, e = row["gpu_us"], row["eager_us"]["median"]
    row["ok"] = row["host_us"]["median"] <= 40.0 and e <= max(1.15 * g, g + 15.0)
    row["out"] = out
    return row


def layout_equals_twin(plan, ids: torch.Tensor, num_experts: int, device: torch.device) -> bool:
    """The layout the folded gate-up programs left in the reused workspace equals ``align_block``'s."""
    b = _WORKSPACES.buffers(plan.workspace, device)
    want = align_block(ids, num_experts, plan.config.BLOCK_M, allow_naive=False)
    rows, blocks = want.sorted_ids.numel(), want.expert_ids.numel()
    return (torch.equal(b["sorted_ids"][:rows], want.sorted_ids)
            and torch.equal(b["expert_ids"][:blocks], want.expert_ids)
            and torch.equal(b["num_padded"], want.num_padded) and bool((b["sorted_ids"][rows:] == ids.numel()).all())
            and bool((b["expert_ids"][blocks:] == -1).all()))


def launch_probe(args: tuple, with_no_pdl: bool) -> dict:
    """Host µs of each GEMM launch and the k-sum of the default plan (PDL on, and off: ``with_no_pdl``), next
    to a control."""
    x, w13, w2, ids, weights = args
    result = {"control_empty_like": host_us(lambda: torch.empty_like(x), calls=Run.control_calls)}
    pdl_variants = {"pdl": LaunchOptions(), "no_pdl": LaunchOptions(dependent_launch=False)}
    for name, options in pdl_variants.items() if with_no_pdl else [("pdl", LaunchOptions())]:
        for _ in range(2):
            experts_triton(x, w13, w2, ids, weights, options=options)
        plan = plan_for(x, w13, w2, ids, weights, None, "silu", None, options)
        b = _WORKSPACES.buffers(plan.workspace, x.device)
        pair = _DESCRIPTORS.get(w13, w2, plan.descriptor_key) if plan.descriptor_key else None
        w13_arg, up_arg, w2_arg = (pair.w13, pair.w13_up, pair.w2) if pair else (w13, None, w2)
        rows = (None, None, None) if plan.align is None else (b["sorted_ids"], b["expert_ids"], b["num_padded"])
        out = torch.empty_like(x)
        launches = {"gate_up": (plan.gate_up, lambda: plan.gate_up(x, w13_arg, up_arg, None, b["h"], ids, *rows, None)),
                    "down": (plan.down, lambda: plan.down(b["h"], w2_arg, None, b["y"], weights, ids, *rows)),
                    "ksum": (plan.sum_slots, lambda: plan.sum_slots(b["y"], ids, ids, out))}
        for key, (bound, fn) in launches.items():
            raw = bound._raw
            result[f"{name} {key}"] = {
                "x32_from_idle": host_us(fn), "one_at_a_time": one_at_a_time_us(fn),
                "raw": raw is not None, "descriptors": 0 if raw is None else len(raw.desc_positions),
                "scalars_and_constexprs": len(bound.tail), "grid": bound.grid}
        result[f"{name} config"] = repr(plan.config)
    result["control_empty_like_after"] = host_us(lambda: torch.empty_like(x), calls=Run.control_calls)
    result["whole_call"] = host_us(lambda: experts_triton(*args))
    gc.disable()  # is Python's collector (its cost grows with the objects alive) part of the host time?
    try:
        result["whole_call_gc_off"] = host_us(lambda: experts_triton(*args))
    finally:
        gc.enable()
    result["python_objects"] = len(gc.get_objects())
    return result


def profile(args: tuple, path: Path) -> list:
    """cProfile of 200 whole calls, sorted by own time, to ``path``; the top rows (µs per call)."""
    reps = Run.profile_reps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        experts_triton(*args)
    prof.disable()
    _sync()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(25)
    path.write_text(text.getvalue())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:8]
    return [{"fn": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "calls_per_call": v[1] / reps, "own_us": v[2] / reps * 1e6}
            for k, v in rows]


def cell(preset: str, m: int, out_dir: Path) -> dict:
    shape = Shape.from_preset(preset, Run.scale)
    w = make_weights(shape, torch.bfloat16, Run.device)
    x = torch.randn(m, shape.k, device=Run.device, dtype=torch.bfloat16)
    r = uniform_routing(m, shape, Run.device, seed=m)
    args = (x, w.w13, w.w2, r.topk_ids.contiguous(), r.topk_weights.contiguous())
    result, want = {"A": m * shape.top_k}, None
    for name, options in VARIANTS.items():
        if name == "fold_512" and not LaunchOptions().align_fold_max < m * shape.top_k <= 512:
            continue  # the same plan as "new" or as "old"
        try:
            row = variant_row(args, options, want)
        except Exception as exc:  # a variant that fails must not lose the others' numbers
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        if name == "old":
            want = row["out"]
        row.pop("out")
        result[name] = row
    if m in (64, 512):
        try:
            result["probe"] = launch_probe(args, with_no_pdl=m == 64 and preset == "mixtral-8x7b")  # compiles cost
            result["profile"] = profile(args, out_dir / f"cprofile_{preset}_M{m}.txt")
        except Exception as exc:
            result["probe_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def table(results: dict) -> str:
    lines = ["host µs (median/min of 7 x 32 calls from idle), eager µs per call (median/min), GPU µs (graph),"
             " launches; eq: equal to old bit for bit; tw: folded layout equal to the twin",
             f"{'cell':<22}{'var':>9}{'A':>6}{'L':>3}{'host':>8}{'min':>7}{'eager':>9}{'min':>9}{'gpu':>9}  ok  eq  tw"]
    for key, res in results.items():
        if "skipped" in res or "error" in res:
            lines.append(f"{key:<22} {res.get('skipped') or res.get('error')}")
            continue
        for name in VARIANTS:
            v = res.get(name)
            if v is not None and "error" in v:
                lines.append(f"{key:<22}{name:>9}  {v['error']}")
            if v is None or "error" in v:
                continue
            lines.append(f"{key:<22}{name:>9}{res['A']:>6}{v['launches']:>3}{v['host_us']['median']:>8.1f}"
                         f"{v['host_us']['min']:>7.1f}{v['eager_us']['median']:>9.1f} {v['eager_us']['min']:>8.1f}"
                         f"{v['gpu_us']:>9.1f}  {_yn(v['ok'])} {_yn(v['same_as_old'])} "
                         f"{_yn(v.get('layout_equals_twin'))}")
    lines.append("launch probe, host µs median (32 from idle / one at a time): gate_up, down, ksum; control empty_like")
    for key, res in results.items():
        p = res.get("probe")
        if p:
            for pdl in [v for v in ("pdl", "no_pdl") if f"{v} gate_up" in p]:
                parts = [f"{n} {p[f'{pdl} {n}']['x32_from_idle']['median']:.1f}/"
                         f"{p[f'{pdl} {n}']['one_at_a_time']['median']:.1f}"
                         f"{'' if p[f'{pdl} {n}']['raw'] else ' NOT RAW'}" for n in ("gate_up", "down", "ksum")]
                lines.append(f"{key:<22}{pdl:>7}  " + ", ".join(parts))
            lines.append(f"{key:<22}{'ctl':>7}  {p['control_empty_like']['median']:.2f} -> "
                         f"{p['control_empty_like_after']['median']:.2f}; whole call {p['whole_call']['median']:.1f}, "
                         f"gc off {p['whole_call_gc_off']['median']:.1f}; {p['python_objects']} objects")
    return "\n".join(lines)


def _yn(v) -> str:
    return " - " if v is None else ("yes" if v else " NO")


class OutOfTime(BaseException):
    """Raised by the hard time limit's alarm; not an ``Exception``, so no per-cell handler swallows it."""


def raise_out_of_time(signum, frame):
    raise OutOfTime()


def run_with_hard_limit(a, start: float, out_file: Path, measure, table) -> None:
    """``measure(results)`` under the hard time limit (``a.hard_limit_s``; none in a smoke run: the
    interpreter takes minutes), then the results as JSON to ``out_file`` and ``table(results)`` printed.
    Shared by the host device checks."""
    results = {}
    signal.signal(signal.SIGALRM, raise_out_of_time)
    signal.alarm(0 if a.smoke else a.hard_limit_s)
    try:
        measure(results)
    except OutOfTime:
        results["hard_limit"] = {"skipped": f"stopped at the hard limit ({a.hard_limit_s} s)"}
    signal.alarm(0)
    results["elapsed_s"] = {"skipped": f"{time.perf_counter() - start:.1f} s in all"}
    out_file.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=95.0, help="stop starting cells after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=112, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:
        Run.device, Run.scale, Run.samples = torch.device("cpu"), SMOKE_SCALE, (1, 1, 1, 1)
        Run.one_at_a_time, Run.profile_reps, Run.control_calls = 1, 1, 2
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(os.environ.get("OUT", "host_align_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    run_with_hard_limit(a, start, out_dir / "host_align.json",
                        lambda results: measure_cells(a, start, out_dir, results),
                        table)


def budgeted_cell(results: dict, key: str, start: float, budget_s: float, measure) -> None:
    """results[key] = measure(), printed as one JSON line; a skip note once ``budget_s`` seconds have passed
    since ``start`` (nothing printed), the error's text where it raises (one failing cell must not lose the
    others' numbers). Shared by the host device checks."""
    if time.perf_counter() - start > budget_s:
        results[key] = {"skipped": f"time budget ({budget_s:.0f} s) spent"}
        return
    try:
        results[key] = measure()
    except Exception as exc:  # noqa: BLE001
        results[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    print(json.dumps({key: results[key]}, default=str), flush=True)


def measure_cells(a, start: float, out_dir: Path, results: dict) -> None:
    with torch.no_grad():
        cell(a.presets[0], 1, out_dir)  # throwaway: a process's first cell runs slow (session 8: 54.9 against 31 µs)
        for m in a.batches:
            for preset in a.presets:
                budgeted_cell(results, f"{preset} M={m}", start, a.budget_s, lambda: cell(preset, m, out_dir))
                if Run.device.type == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

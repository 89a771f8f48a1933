"""Host time of the large and quantized eager experts calls (issue 13 item 1, "host_us <= 40 for every triton
cell"), on the GPU: the weight-only scratch decode's cells, main-like against this branch's plain and lean
paths, interleaved in one process, bit-equality, and a torch.profiler table of the worst cell.

    PYTHONPATH=$PWD OUT=/tmp/hl python benchmarks/host_large_device_check.py [--budget-s 120]
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/host_large_device_check.py --smoke   (CPU, tiny shapes)

Cells (random bf16 expert weights quantized once per scheme, uniform routing, no_grad), in priority order,
grouped by preset: the bench's (03a8ff3) worst host_rest cells of the scratch decode (weight-only at large M:
DeepSeek-V3 M=16384 ~15,000 µs, Mixtral M=1024 ~845, Qwen3 M=4096 ~650, ...), each with three variants of
``experts_triton``:
  main     LaunchOptions(lean_launch=False) with the scratch plan rebuilt every call and its chunk maps built
           per call by seven torch kernels each (what main did per call: dequant and k-sum bound anew)
  plain    LaunchOptions(lean_launch=False): this branch's plain path (kept scratch plan, kept chunk maps; a
           fresh scratch, h and y per call; the custom op's path, what graphs and torch.compile run)
  lean     the defaults: a repeated call launches its kept entry's recorded sequence on the kept scratch
and, where the lean call launches more than 16 kernels (DeepSeek-V3's chunks), a probe: the plain call replayed
from a CUDA graph (inputs copied in, one graph launch, the output cloned; not a path of the library),
then the other cells the bench put over 40 µs (fp8_block, bf16: this branch leaves their path unchanged; one
variant, "current", measured for the record).
Per cell and variant: host_rest µs per call (the bench's method: N=16 back-to-back calls after a sync, the host
time to issue calls 2..N before the final sync, over N-1; samples rotated so no variant always goes first;
median), eager µs per call (the same loops, the final sync included), ``same`` (main, plain and lean outputs
bit-equal on two routings), ``hit`` (the lean calls were served by the fast path), ``graph`` (a CUDA graph
of the plain call, captured after the eager calls kept its plan and chunk maps, replays bit-equal), ``#l``
the lean entry's launches per call, ``held`` the MB the lean path keeps (``held_scratch``).
Profiles (torch.profiler, CPU + CUDA activities, N calls after a warm call): main and lean of the first cell
(DeepSeek-V3 int8 M=16384) and of Mixtral int4 M=1024, bf16 Mixtral M=1024: the top CUDA runtime / driver
calls (cuda*/cu*) by total time with counts (cudaMalloc / cudaFree / synchronise / memcpy rows show a
blocking call; many cuLaunchKernel rows with a long total a full launch queue).
Look for: same = yes, hit = yes, lean host_rest <= 40 µs in every weight-only cell; main's profile names what
blocked. JSON to $OUT/host_large.json, the table printed last. --budget-s: no new cell after it.
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
from moekit.experts import triton_quant_fast, triton_wo_scratch_plan
from moekit.experts.triton import clear_launch_caches, experts_triton
from moekit.experts.triton_launch import LaunchOptions
from moekit.quant import quantize

# (preset, scheme, M, profile): scratch-decode cells first (weight-only), grouped by preset
WO_CELLS = {
    "deepseek-v3": [("int8_w8a16", 16384, True), ("mxfp4", 16384, False)],
    "mixtral-8x7b": [("int4_w4a16", 1024, True), ("int8_w8a16", 4096, False), ("mxfp4", 16384, False)],
    "qwen3-30b-a3b": [("mxfp4", 4096, False), ("int4_w4a16", 16384, False), ("int4_w4a16", 4096, False)],
}
OTHER_CELLS = {
    "mixtral-8x7b": [("bfloat16", 1024, True), ("fp8_block", 16384, False)],
    "qwen3-30b-a3b": [("fp8_block", 64, False), ("bfloat16", 4096, False)],
    "deepseek-v3": [("fp8_block", 4096, False), ("bfloat16", 64, False)],
}
PLAIN = LaunchOptions(lean_launch=False)
SMOKE_M = 4


class Run:
    device = torch.device("cuda")
    scale = 1
    samples, calls = 4, 16  # host samples per variant, calls per loop (the bench's EAGER_CALLS)
    profile_calls = 16


HITS = [0]


def _count_hits() -> None:
    real = triton_quant_fast._launch

    def counted(*args):
        HITS[0] += 1
        return real(*args)

    triton_quant_fast._launch = counted


def main_like(args: tuple):
    """A call as main ran it: the scratch plan (dequant and k-sum launches) rebuilt, chunk maps by torch kernels."""
    plans, kept_map = triton_wo_scratch_plan._SCRATCH_PLANS, triton_wo_scratch_plan._kept_chunk_map

    def call():
        plans.clear()
        triton_wo_scratch_plan._kept_chunk_map = lambda *a: None
        try:
            return experts_triton(*args, options=PLAIN)
        finally:
            triton_wo_scratch_plan._kept_chunk_map = kept_map

    return call


def loops(fns: dict) -> dict:
    """name -> {host_rest_us, eager_us}: medians over Run.samples loops of Run.calls calls each, rotated."""
    names, host, eager = list(fns), {n: [] for n in fns}, {n: [] for n in fns}
    for sample in range(Run.samples):
        for name in names[sample % len(names):] + names[:sample % len(names)]:
            fn = fns[name]
            ha._sync()
            t0 = time.perf_counter()
            fn()
            t_first = time.perf_counter()
            for _ in range(Run.calls - 1):
                fn()
            t_issued = time.perf_counter()
            ha._sync()
            t_done = time.perf_counter()
            host[name].append((t_issued - t_first) / max(Run.calls - 1, 1) * 1e6)
            eager[name].append((t_done - t0) / Run.calls * 1e6)
    return {n: {"host_rest_us": statistics.median(host[n]), "eager_us": statistics.median(eager[n])} for n in names}


def profile(fn, rows: int = 12) -> list:
    """Top CUDA runtime / driver calls over Run.profile_calls back-to-back calls: (name, count, total µs)."""
    fn()
    ha._sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if Run.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)  # the runtime / driver API rows come with it
    try:
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(Run.profile_calls):
                fn()
            ha._sync()
    except RuntimeError as exc:  # a profiler that cannot start: the numbers above still stand
        return [(f"profiler failed: {exc}"[:200], 0, 0.0)]
    events = [e for e in prof.key_averages() if e.key.startswith("cu") or e.key.startswith("aten::empty")]
    events.sort(key=lambda e: -e.cpu_time_total)
    return [(e.key, e.count, round(e.cpu_time_total, 1)) for e in events[:rows]]


def graph_same(fn, want: torch.Tensor) -> bool | None:
    """A CUDA graph of ``fn`` (captured after eager warm-up, on a side stream), replayed: its output equals
    ``want`` bit for bit (None off CUDA)."""
    if Run.device.type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    same = torch.equal(out, want)
    del graph, out
    return same


def graphed(args: tuple):
    """A probe, not a path: the call replayed from a CUDA graph of the plain call (static inputs copied in, one
    graph launch, the output cloned): the host time a graph replay would cost where the lean call launches
    dozens of kernels (DeepSeek-V3's 8 chunks). None off CUDA or where the capture fails."""
    if Run.device.type != "cuda":
        return None
    x, q13, q2, ids, weights = args
    static = [t.clone() for t in (x, ids, weights)]
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            experts_triton(static[0], q13, q2, static[1], static[2], options=PLAIN)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts_triton(static[0], q13, q2, static[1], static[2], options=PLAIN)
    except RuntimeError:
        return None

    def call():
        for kept, t in zip(static, (x, ids, weights)):
            kept.copy_(t)
        graph.replay()
        return out.clone()

    return call


def lean_entry(q13):
    for key, entry in triton_quant_fast._MEMO.items():
        if key[0] == id(q13) and entry.w13() is q13:
            return entry
    return None


def inputs(shape: Shape, m: int, seed: int) -> tuple:
    x = torch.randn(m, shape.k, device=Run.device, dtype=torch.bfloat16)
    routing = uniform_routing(m, shape, Run.device, seed=seed)
    return x, routing.topk_ids, routing.topk_weights


def wo_cell(shape: Shape, q13, q2, m: int, profiled: bool) -> dict:
    row, outs = {"same": True}, {}
    for seed in (m, m + 1):  # two routings: the second reuses the kept entry
        x, ids, weights = inputs(shape, m, seed)
        args = (x, q13, q2, ids, weights)
        fns = {"main": main_like(args), "plain": lambda a=args: experts_triton(*a, options=PLAIN),
               "lean": lambda a=args: experts_triton(*a)}
        for name, fn in fns.items():
            for _ in range(3):  # compiles, records, served
                outs[name] = fn()
        hits = HITS[0]
        outs["lean"] = fns["lean"]()
        row["hit"] = HITS[0] > hits
        row["same"] = row["same"] and torch.equal(outs["lean"], outs["plain"]) and torch.equal(outs["main"],
                                                                                             outs["plain"])
    row["graph_same"] = graph_same(fns["plain"], outs["lean"])  # captured with the kept chunk maps and plan
    entry = lean_entry(q13)
    row["launches"] = None if entry is None else len(entry.sequence.steps)
    try:  # many launches: probe a graph replay (a failure must not cost the cell's numbers)
        replay = graphed(args) if (row["launches"] or 0) > 16 else None
        if replay is not None:
            row["graphed_same"] = torch.equal(replay(), outs["lean"])
            fns["graphed"] = replay
    except Exception as exc:  # noqa: BLE001
        replay, row["graphed_error"] = None, f"{type(exc).__name__}: {exc}"[:200]
    row["variants"] = loops(fns)
    fns.pop("graphed", None)
    del replay
    row["held_mb"] = sum(b.numel() for b in triton_wo_scratch_plan.held_scratch().values()) / 2**20
    if profiled:
        row["profile"] = {"main": profile(fns["main"]), "lean": profile(fns["lean"])}
    return row


def other_cell(shape: Shape, w13, w2, m: int, profiled: bool) -> dict:
    x, ids, weights = inputs(shape, m, m)
    fns = {"current": lambda: experts_triton(x, w13, w2, ids, weights)}
    for _ in range(3):
        fns["current"]()
    row = {"variants": loops(fns)}
    if profiled:
        row["profile"] = {"current": profile(fns["current"])}
    return row


def measure(a, start: float, results: dict) -> None:
    _count_hits()
    with torch.no_grad():
        for cells, runner in ((WO_CELLS, wo_cell), (OTHER_CELLS, other_cell)):
            for preset, wanted in cells.items():
                if time.perf_counter() - start > a.budget_s:
                    for scheme, m, _ in wanted:
                        results[f"{preset} {scheme} M={m}"] = {"skipped": f"time budget ({a.budget_s:.0f} s) spent"}
                    continue
                shape = Shape.from_preset(preset, Run.scale)
                weights = make_weights(shape, torch.bfloat16, Run.device)
                for scheme, m, profiled in wanted:
                    m = SMOKE_M if a.smoke else m

                    def one(scheme=scheme, m=m, profiled=profiled):
                        if scheme == "bfloat16":
                            return runner(shape, weights.w13, weights.w2, m, profiled)
                        q13, q2 = quantize(weights.w13, scheme), quantize(weights.w2, scheme)
                        return runner(shape, q13, q2, m, profiled)

                    ha.budgeted_cell(results, f"{preset} {scheme} M={m}", start, a.budget_s, one)
                    clear_launch_caches()
                del weights
                if Run.device.type == "cuda":
                    torch.cuda.empty_cache()


def table(results: dict) -> str:
    lines = ["host_rest / eager µs per call (N=16 back to back; host_rest: calls 2..N before the sync); same: main, "
             "plain, lean bit-equal; hit: lean served; graph: a captured plain call replays bit-equal; #l: lean "
             "launches per call; held: MB kept",
             f"{'cell':36}{'same':>5}{'hit':>4}{'graph':>6}{'main':>9}{'plain':>9}{'lean':>9}{'eager main':>11}"
             f"{'eager lean':>11}{'#l':>4}{'held':>7}"]
    profiles = []
    for key, r in results.items():
        if "variants" not in r:
            lines.append(f"{key:36}{next(iter(r.values()))}")
            continue
        v = r["variants"]
        if "current" in v:
            lines.append(f"{key:36}{'':>9}current host_rest {v['current']['host_rest_us']:.1f}, eager "
                         f"{v['current']['eager_us']:.1f}")
        else:
            lines.append(f"{key:36}{ha._yn(r['same']):>5}{ha._yn(r['hit']):>4}{ha._yn(r['graph_same']):>6}"
                         f"{v['main']['host_rest_us']:>9.1f}"
                         f"{v['plain']['host_rest_us']:>9.1f}{v['lean']['host_rest_us']:>9.1f}"
                         f"{v['main']['eager_us']:>11.1f}{v['lean']['eager_us']:>11.1f}"
                         f"{r['launches'] if r['launches'] is not None else '-':>4}{r['held_mb']:>7.0f}")
        if "graphed" in v:
            lines.append(f"{'':36}graph replay probe: host_rest {v['graphed']['host_rest_us']:.1f}, eager "
                         f"{v['graphed']['eager_us']:.1f}, same {ha._yn(r.get('graphed_same'))}")
        for name, rows in r.get("profile", {}).items():
            profiles.append(f"profile {key} {name}: " + "; ".join(f"{k} x{c} {t:.0f}µs" for k, c, t in rows))
    return "\n".join(profiles + lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budget-s", type=float, default=120.0, help="start no new cell after this many seconds")
    p.add_argument("--hard-limit-s", type=int, default=150, help="stop measuring at once after this many seconds")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter (TRITON_INTERPRET=1), tiny shapes")
    a = p.parse_args()
    start = time.perf_counter()
    if a.smoke:  # every call takes the scratch decode, in chunks of 3 experts
        from moekit.experts import triton_wo, triton_wo_plan, triton_wo_scratch

        triton_wo.SCRATCH_MIN_TOKENS = triton_wo_plan.SCRATCH_MIN_TOKENS = 1
        triton_wo_plan.DECODE_MEASURED = {}
        triton_wo_scratch.SCRATCH_MAX_BYTES = 3 * 2 * 224 * 64 * 4  # three experts of mixtral-8x7b/64 (float32)
        Run.device, Run.scale, Run.samples, Run.calls, Run.profile_calls = torch.device("cpu"), 64, 1, 2, 1
        a.budget_s = float("inf")  # the interpreter takes minutes; the smoke run checks every cell kind
        for cells in (WO_CELLS, OTHER_CELLS):  # mixtral's first cell of each
            first = cells["mixtral-8x7b"][0]
            cells.clear()
            cells["mixtral-8x7b"] = [first]
    else:
        Run.device = torch.device("cuda", torch.cuda.current_device())
    ha.Run.device = Run.device
    out_dir = Path(os.environ.get("OUT", "host_large_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    ha.run_with_hard_limit(a, start, out_dir / "host_large.json", lambda results: measure(a, start, results), table)


if __name__ == "__main__":
    main()

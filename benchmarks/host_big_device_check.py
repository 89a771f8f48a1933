"""Host time per eager experts call (issue 13: <= 40 µs in every triton cell, eager <= max(1.15 x graph,
graph + 15 µs)): why a winners row cost 45 µs more, where the µs go at large M, and why Mixtral bf16 M = 4096
runs slower eagerly than in a graph.

    PYTHONPATH=$PWD python benchmarks/host_big_device_check.py --out $OUT/host [--deadline-s 160]
        [--parts rows phases mixtral]

Parts, in order, each cut by the deadline (a line per cell as it goes, JSON rewritten after each, a table last):
1. rows: Qwen3-30B-A3B int4_w4a16 M = 1, two rows of ``triton_wo_word_winners`` for that cell: ``pick`` (split 4
   folded: the row in run 1) and ``xa2`` (session 21's x tile + words 2 steps ahead, reverted in 7e0083a: the
   merged bench read eager 84.9 / host 79.6 µs against 38.3 / 36.6). First ``moekit bench``'s own cells
   (``sweep.run_cells``, Qwen3 M = 1 then 8, bf16 / int8 / int4 in the bench's order) under each row,
   with the paths each cell's calls took; then the int4 M = 1 cell alone, rows interleaved over 3 rounds (round 1 also
   lists each kept plan's launches: compiled launcher kept, C launch): output
   bit-equal to the plain path (``lean_launch=False``) and near the reference, graph / eager / host / host_rest
   µs, the paths taken per call (``host_big_probe.PathCounts``), synchronisations, and (round 1) the Python
   functions (cProfile) and runtime events (torch.profiler) with the most own time per call.
2. phases: one eager call's host time broken down (the same probes) at Qwen3 / DeepSeek-V3, bf16 and fp8_block,
   M = 1, 64, 1024, 4096, 16384 (above 1024 ``graph_us`` is the bench's events number), then int8 / int4 / mxfp4
   at M = 1, 64; correctness against the reference (``experts_reference``) at M <= 1024.
3. mixtral: Mixtral-8x7B bf16 M = 4096 (against the reference): the bench's number there (events around 2-call
   passes: no graph above M = 1024) against its eager one (16 calls back to back), each call's GPU µs along a
   16-call burst (eager and replayed) with the SM clock before and after, the kernels (name, GPU µs) of one eager
   call and of one graph replay.
Look for: rows: ``fast_quant`` 1.0 a call in both rows, or which counter replaces it in ``xa2`` (the cause);
phases: the functions and events that make up host_rest at M >= 1024; mixtral: a kernel that differs or takes
longer eagerly, or later calls of a burst slower (clocks under sustained load).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import host_big_probe as probe
from moekit.bench.ceilings import Ceilings
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.sweep import GRAPH_MAX_M, SweepPlan, run_cells
from moekit.bench.timing import time_eager, time_stats
from moekit.experts import get_backend
from moekit.experts.configs import clear_config_cache
from moekit.experts.reference import experts_reference
from moekit.experts.triton import clear_launch_caches, experts_triton
from moekit.experts.triton_launch import LaunchOptions
import moekit.experts.triton_wo_word_winners as winners
from moekit.quant import quantize

QWEN3, DEEPSEEK, MIXTRAL = "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"
ROW = ("int4_w4a16", 128, 768, 2048, 1)
A2 = winners.A2
# run 1 (9516268) named the split-4 fold, then the row, "pick"; the x tile + A2 row is the row again since session 22
ROWS = {"pick": winners.WordPick("gemv", 4, fold=True),
        "xa2": winners.WordPick("gemv", 4, 0, A2, A2, fold=True, x_tile=True)}
DEFAULT_ROW = winners.WORD_WINNERS[ROW]
BENCH_DTYPES = ["bfloat16", "int8_w8a16", "int4_w4a16"]  # the bench's order (fp8 and mxfp4 left out: time)
PHASE_BATCHES = (1, 64, 1024, 4096, 16384)
WO_BATCHES = (1, 64)
REF_MAX_M = 1024
MIXTRAL_S = 25  # seconds the last part (mixtral) takes with its compiles: the phases stop that much earlier
TOL = 2e-2  # relative L2 against the reference: bf16 ~1e-3, fp8 (activations quantized) and 4-bit ~3e-3
PLAIN = LaunchOptions(lean_launch=False)
CEILINGS = Ceilings(4.2, 750.0, "bfloat16", 1400.0)  # the bench's floors only (not read here)


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weights(shape: Shape, dtype: str, base):
    if dtype == "bfloat16":
        return base.w13, base.w2
    return quantize(base.w13, dtype), quantize(base.w2, dtype)


def _reference_err(w13, w2, s, max_m: int = REF_MAX_M) -> float | None:
    """Relative L2 of the triton call on set ``s`` against ``experts_reference`` (float32, quantized weights
    dequantized expert by expert); None above ``max_m`` tokens or where the reference runs out of memory."""
    if s.x.shape[0] > max_m:
        return None
    try:
        want = experts_reference(s.x, w13, w2, s.topk_ids, s.topk_weights)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return _rel(experts_triton(s.x, w13, w2, s.topk_ids, s.topk_weights), want)


def measure(calls: list, counts: probe.PathCounts, profile: bool, graph: bool = True) -> dict:
    """graph / eager / host / host_rest µs of ``calls`` as the bench times them (``graph`` off: events around
    plain passes, the bench's number above M = 1024), the paths and syncs a call, and with ``profile`` the
    per-call Python and runtime tables."""
    graph_us = time_stats(calls, torch.device("cuda"), graph=graph, budget_s=0.05).us
    before = counts.snapshot()
    eager = time_eager(calls, torch.device("cuda"))
    n = (len(calls) + max(16, len(calls)) * 5)  # time_eager's warm-up pass and its 5 loops
    row = dict(graph_us=round(graph_us, 1), eager_us=round(eager.eager_us, 1), host_us=round(eager.host_us, 1),
               host_rest_us=round(eager.host_rest_us, 1), paths=counts.delta(before, n), syncs=probe.sync_count(calls))
    bound = max(1.15 * graph_us, graph_us + 15)
    row["eager_ok"] = eager.eager_us <= bound
    if profile:
        row["python"] = probe.python_top(calls)
        row["runtime"] = probe.runtime_top(calls)
    return row


def _print_profile(row: dict) -> None:
    for p in row.get("python", []):
        print(f"      py  {p['own_us']:7.2f} µs own {p['cum_us']:8.2f} cum x{p['calls']:<5} {p['fn']}", flush=True)
    runtime = row.get("runtime")
    if runtime:
        for e in runtime["cpu"]:
            print(f"      rt  {e['self_us']:7.2f} µs self x{e['count']:<5} {e['name']}", flush=True)
        print(f"      kernels a call (GPU {runtime['gpu_us']} µs): {runtime['kernels']}", flush=True)


def _line(tag: str, row: dict) -> str:
    return (f"{tag}: graph {row['graph_us']} eager {row['eager_us']} host {row['host_us']} rest {row['host_rest_us']} "
            f"eager_ok {row['eager_ok']} syncs {row['syncs']} paths {row['paths']}")


def _set_row(name: str | None) -> None:
    """The row ``name`` of ROWS in the winners table (None: the table's own), the plans built again."""
    winners.WORD_WINNERS[ROW] = DEFAULT_ROW if name is None else ROWS[name]
    clear_config_cache()
    clear_launch_caches()


def part_rows(results: dict, counts: probe.PathCounts, deadline: Deadline) -> None:
    device, shape = torch.device("cuda"), Shape.from_preset(QWEN3)
    bench = results.setdefault("rows_bench", {})
    for name in ROWS:
        if deadline.left() < 40:
            return
        _set_row(name)
        plan = SweepPlan([1, 8], ["triton"], ["triton"], BENCH_DTYPES, torch.bfloat16, 0.05)
        last = [counts.snapshot()]

        def on_cell(cell, name=name):
            paths = counts.delta(last[0], 1)
            last[0] = counts.snapshot()
            key = f"{name} {cell.dtype} M={cell.M}"
            bench[key] = dict(us=round(cell.us, 1), eager_us=round(cell.eager_us, 1), host_us=round(cell.host_us, 1),
                              host_rest_us=round(cell.host_rest_us, 1), paths_in_cell=paths)
            print(f"bench {key}: graph {cell.us:.1f} eager {cell.eager_us:.1f} host {cell.host_us:.1f} "
                  f"rest {cell.host_rest_us:.1f}  paths (cell total) {paths}", flush=True)

        run_cells(shape, plan, device, CEILINGS, on_cell)
    base = make_weights(shape, torch.bfloat16, device)
    w13, w2 = _weights(shape, "int4_w4a16", base)
    del base
    sets = make_sets(shape, 1, 8, torch.bfloat16, device)
    fn = get_backend("triton")
    calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
    ab = results.setdefault("rows_ab", {})
    for rnd in range(3):
        for name in ROWS:
            if deadline.left() < 25:
                return
            _set_row(name)
            for c in calls * 3:
                c()
            s = sets[0]
            plain = experts_triton(s.x, w13, w2, s.topk_ids, s.topk_weights, options=PLAIN)
            same = bool(torch.equal(fn(s.x, w13, w2, s.topk_ids, s.topk_weights), plain))
            err = _reference_err(w13, w2, s)
            row = measure(calls, counts, profile=rnd == 0)
            row.update(same_as_plain=same, ref_err=err, ok=same and err is not None and err < TOL)
            if rnd == 0:
                row["launches"] = probe.launch_states()
                for state in row["launches"]:
                    print(f"      launch {state}", flush=True)
            ab.setdefault(name, []).append(row)
            print(("PASS" if row["ok"] else "FAIL") + f" rows {name} round {rnd}: same {same} err {err}  "
                  + _line("", row), flush=True)
            _print_profile(row)
            yield_results(results)
    _set_row(None)


def _phase_cells() -> list[tuple]:
    cells = [(p, d, m) for p in (QWEN3, DEEPSEEK) for d in ("bfloat16", "fp8_block") for m in PHASE_BATCHES]
    cells += [(p, d, m) for p in (QWEN3, DEEPSEEK) for d in ("int8_w8a16", "int4_w4a16", "mxfp4") for m in WO_BATCHES]
    return cells


def part_phases(results: dict, counts: probe.PathCounts, deadline: Deadline) -> None:
    device, fn = torch.device("cuda"), get_backend("triton")
    out = results.setdefault("phases", {})
    held = {}  # (preset, dtype) -> weights, made once
    for preset, dtype, m in _phase_cells():
        if deadline.left() < MIXTRAL_S + (30 if m >= 4096 else 15):  # the mixtral part runs after
            print(f"deadline: phases stop before {preset} {dtype} M={m}", flush=True)
            return
        shape = Shape.from_preset(preset)
        if (preset, dtype) not in held:
            held.clear()
            torch.cuda.empty_cache()
            base = make_weights(shape, torch.bfloat16, device)
            held[(preset, dtype)] = _weights(shape, dtype, base)
            del base
        w13, w2 = held[(preset, dtype)]
        sets = make_sets(shape, m, 2 if m >= 4096 else 4, torch.bfloat16, device)
        calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
        for c in calls * 3:
            c()
        err = _reference_err(w13, w2, sets[0])
        row = measure(calls, counts, profile=True, graph=m <= GRAPH_MAX_M)
        row["ref_err"] = err
        row["ok"] = err is None or err < TOL
        key = f"{preset} {dtype} M={m}"
        out[key] = row
        verdict = "PASS" if row["ok"] else "FAIL"
        print(f"{verdict} {key}: err {err if err is None else f'{err:.2e}'}  " + _line("", row), flush=True)
        _print_profile(row)
        yield_results(results)
        del sets, calls


def _burst_us(calls: list, n: int) -> list[float]:
    """GPU µs of each of ``n`` back-to-back calls (an event between two calls, one sync at the end)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for i in range(n):
        calls[i % len(calls)]()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [round(events[i].elapsed_time(events[i + 1]) * 1e3, 1) for i in range(n)]


def _sm_clock() -> int | None:
    try:
        return torch.cuda.clock_rate()  # MHz (pynvml)
    except Exception:  # noqa: BLE001 (no pynvml: no clock)
        return None


def part_mixtral(results: dict, deadline: Deadline) -> None:
    """Mixtral bf16 M = 4096: the bench's number there is events around 2-call passes (no graph above M = 1024),
    its eager number 16 calls back to back; the same kernels? each call's GPU µs along a 16-call burst (a
    later call slower: clocks under sustained load, not moekit); the kernels of one call eagerly and replayed."""
    if deadline.left() < MIXTRAL_S / 2:
        print("deadline: mixtral skipped", flush=True)
        return
    device, fn, shape = torch.device("cuda"), get_backend("triton"), Shape.from_preset(MIXTRAL)
    base = make_weights(shape, torch.bfloat16, device)
    sets = make_sets(shape, 4096, 2, torch.bfloat16, device)
    calls = [lambda s=s: fn(s.x, base.w13, base.w2, s.topk_ids, s.topk_weights) for s in sets]
    for c in calls * 2:
        c()
    s = sets[0]
    err = _reference_err(base.w13, base.w2, s, max_m=4096)
    row = dict(ref_err=err, events_us=round(time_stats(calls, device, graph=False, budget_s=0.1).us, 1))
    clock0 = _sm_clock()
    row["burst_us"] = _burst_us(calls, 16)
    row["sm_mhz_before_after"] = (clock0, _sm_clock())
    eager = time_eager(calls, device)
    row.update(eager_us=round(eager.eager_us, 1), host_us=round(eager.host_us, 1),
               host_rest_us=round(eager.host_rest_us, 1))
    row["eager_kernels"] = probe.kernel_times(calls[0], 3)
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            calls[0]()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            graph_out = fn(s.x, base.w13, base.w2, s.topk_ids, s.topk_weights)
        graph.replay()
        row["same_eager_graph"] = bool(torch.equal(calls[0](), graph_out))
        row["graph_kernels"] = probe.kernel_times(graph.replay, 3)
        row["graph_burst_us"] = _burst_us([graph.replay], 16)
    except RuntimeError as e:  # a path that cannot be captured: say so
        row["graph_error"] = str(e)[:300]
    results["mixtral"] = row
    ok = err is not None and err < TOL
    print(f"{'PASS' if ok else 'FAIL'} mixtral bf16 M=4096: err {err} events {row['events_us']} eager "
          f"{row['eager_us']} host {row['host_us']} eager==graph {row.get('same_eager_graph')} clocks "
          f"{row['sm_mhz_before_after']}", flush=True)
    print(f"   burst eager µs: {row['burst_us']}", flush=True)
    print(f"   burst graph µs: {row.get('graph_burst_us', row.get('graph_error'))}", flush=True)
    for tag in ("eager", "graph"):
        ks = row.get(tag + "_kernels", [])
        print(f"   {tag} kernels (sum {sum(t for _, t in ks):.1f} µs): " + "; ".join(f"{n} {t}" for n, t in ks),
              flush=True)


_OUT = [None]


def yield_results(results: dict) -> None:
    """Rewrite the JSON (called after every cell: a cut run keeps what it measured)."""
    if _OUT[0] is not None:
        with open(_OUT[0], "w") as f:
            json.dump(results, f, indent=1, default=str)


def table(results: dict) -> None:
    print("\n== host_big: µs a call (graph / eager / host / host_rest; paths a call) ==")
    for name, rows in results.get("rows_ab", {}).items():
        for i, r in enumerate(rows):
            print(f"rows {name:5} r{i} {r['graph_us']:8.1f} {r['eager_us']:8.1f} {r['host_us']:7.1f} "
                  f"{r['host_rest_us']:7.1f}  ok {r['ok']} eager_ok {r['eager_ok']} {r['paths']}")
    for key, r in results.get("phases", {}).items():
        top = r.get("python", [{}])[0].get("fn", "")
        print(f"{key:34} {r['graph_us']:9.1f} {r['eager_us']:9.1f} {r['host_us']:7.1f} {r['host_rest_us']:7.1f}  ok "
              f"{r['ok']} eager_ok {r['eager_ok']} syncs {r['syncs']} {r['paths']}  top: {top}")
    m = results.get("mixtral")
    if m:
        burst = m["burst_us"]
        print(f"mixtral bf16 4096: events {m['events_us']} eager {m['eager_us']} host {m['host_us']}; burst first / "
              f"last {burst[0]} / {burst[-1]} µs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host_big_out"))
    parser.add_argument("--deadline-s", type=float, default=160.0)
    parser.add_argument("--parts", nargs="+", default=["rows", "phases", "mixtral"],
                        choices=["rows", "phases", "mixtral"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    _OUT[0] = os.path.join(args.out, "host_big.json")
    deadline = Deadline(args.deadline_s)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, parts=args.parts)
    import triton

    results["triton"] = triton.__version__
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    counts = probe.PathCounts().install()
    with torch.no_grad():
        for part in args.parts:
            try:
                if part == "rows":
                    part_rows(results, counts, deadline)
                elif part == "phases":
                    part_phases(results, counts, deadline)
                else:
                    part_mixtral(results, deadline)
            except torch.cuda.OutOfMemoryError as e:  # report and go on with the next part
                print(f"FAIL {part}: out of memory: {str(e)[:200]}", flush=True)
                torch.cuda.empty_cache()
            yield_results(results)
    table(results)


if __name__ == "__main__":
    main()

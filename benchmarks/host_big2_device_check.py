"""Second host check (issue 13): the winners row in the bench's full order, why Mixtral bf16 M = 4096 runs ~15%
slower eagerly than replayed, programmatic dependent launch's host cost at M = 1, and the fast-path lookup order A/B.

    PYTHONPATH=$PWD python benchmarks/host_big2_device_check.py --out $OUT/host [--deadline-s 62]
        [--parts mixtral pdl routes rows phases]   (default: all but phases; <= 90 s wall with compiles)

Parts, in order, each cut by the deadline (a line per cell, JSON rewritten after each, a table last):
1. mixtral: Mixtral-8x7B bf16 M = 4096 (the Gluon route; run 1: the two grouped GEMMs 3174 + 1537 µs eagerly against
   2615 + 1342 replayed, the same kernels and grids), variants interleaved over 3 rounds, each an 8-call burst (GPU
   µs per call, median) with the SM clock / power / temperature read mid-burst and the kernels of one call:
   ``lean`` (the default eager call: recorded launches, the pooled workspace), ``plain`` (``experts_gluon(lean=
   False)``: fresh tensors per region, the alignment through its op), ``graph`` (the default call captured and
   replayed), ``align2m`` (the lean call with every workspace region on a 2 MiB boundary). Each output equal to
   ``lean``'s; ``lean`` against ``experts_reference``.
2. pdl: programmatic dependent launch on / off at host-bound M = 1 cells (Qwen3 bf16 / fp8 / int4): host_rest /
   eager / graph µs, 5 interleaved rounds, outputs equal.
3. routes: ``old`` (the Triton entries looked up first on every call, the Gluon entries after a miss: the lookup
   order before this branch, reproduced here) against ``new`` (``triton._run_kept``: one lookup where one can hit),
   interleaved over 5 rounds of 3 loops, host_rest / host / eager µs (the bench's ``time_eager``), at Gluon-route
   cells (Mixtral bf16 4096 and 512, Qwen3 bf16 16384, fp8 4096) and a fused-route cell (Qwen3 bf16 M = 1):
   outputs equal.
4. rows: ``moekit bench``'s own cells (``sweep.run_cells``) at Qwen3 M = 1 in its full order (bf16, fp8, int8, int4,
   mxfp4) under the x tile + A2 row (``xa2``, the table's row again), then the split-4 fold (``pick``): does the
   merged bench's int4 reading of session 21 (eager 84.9 / host 79.6 µs) come back in that order? (Run 1, order
   bf16 / int8 / int4: both rows served by the lean path, host 32.9 vs 35.6.)
5. phases (asked by name only): run 1's probes at DeepSeek-V3 int4 / mxfp4 M = 1, 64.
Look for: mixtral: which variant runs at the graph's speed (the cause); pdl: nopdl's host_rest and eager below
pdl's (then its graph cost decides); routes: new host_rest below old at the Gluon cells (expected 2-5 µs), equal
at M = 1; rows: the int4 cell's host in each pass.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import host_big_device_check as hb
import host_big_probe as probe
from moekit.bench.cells import Shape, make_sets, make_weights
from moekit.bench.sweep import SweepPlan, run_cells
from moekit.bench.timing import time_eager, time_stats
from moekit.experts import get_backend
import moekit.experts.triton as tri
from moekit.quant.fp8_block import Fp8BlockWeight

ORDER = ["bfloat16", "fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4"]
# the lead's second run is <= 90 s wall on a fresh machine: the cells whose kernels the parts before compiled first
ROUTE_CELLS = [(hb.MIXTRAL, "bfloat16", 4096), (hb.QWEN3, "bfloat16", 1), (hb.MIXTRAL, "bfloat16", 512),
               (hb.QWEN3, "bfloat16", 16384), (hb.QWEN3, "fp8_block", 4096)]


def part_rows(results: dict, counts: probe.PathCounts, deadline: hb.Deadline) -> None:
    shape, bench = Shape.from_preset(hb.QWEN3), results.setdefault("rows_bench", {})
    for i, name in enumerate(("xa2", "pick")):
        if deadline.left() < 25:
            return
        hb._set_row(name)
        last = [counts.snapshot()]

        def on_cell(cell, tag=f"{name}#{i}"):
            paths = counts.delta(last[0], 1)
            last[0] = counts.snapshot()
            bench[f"{tag} {cell.dtype}"] = dict(us=round(cell.us, 1), eager_us=round(cell.eager_us, 1),
                                                host_us=round(cell.host_us, 1),
                                                host_rest_us=round(cell.host_rest_us, 1))
            print(f"bench {tag} {cell.dtype} M=1: graph {cell.us:.1f} eager {cell.eager_us:.1f} host "
                  f"{cell.host_us:.1f} rest {cell.host_rest_us:.1f}  paths (cell total) {paths}", flush=True)

        run_cells(shape, SweepPlan([1], ["triton"], ["triton"], ORDER, torch.bfloat16, 0.05), torch.device("cuda"),
                  hb.CEILINGS, on_cell)
        hb.yield_results(results)
    hb._set_row(None)


def _gpu_state() -> dict:
    state = {}
    for name in ("clock_rate", "power_draw", "temperature"):
        try:
            state[name] = getattr(torch.cuda, name)()
        except Exception:  # noqa: BLE001 (no pynvml: not read)
            state[name] = None
    return state


def _burst(run, n: int = 8) -> tuple[float, dict]:
    """Median GPU µs per call over ``n`` back-to-back runs (events between them), and the GPU's state mid-burst."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda.synchronize()
    events[0].record()
    state = None
    for i in range(n):
        run()
        events[i + 1].record()
        if i == n // 2:
            state = _gpu_state()  # read while the queue still holds the other half
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(n)), state


def _captured(run) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``run`` captured in a CUDA graph (warmed on a side stream first), and the graph's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def _mixtral_round(variants: dict, lean, outputs: dict, first: bool) -> dict:
    """One interleaved round: each variant's burst and GPU state (the first round: its kernels too). ``align2m``
    builds the plans again with 2 MiB region offsets, then the default 256 is restored and ``lean`` warmed."""
    from moekit.experts import triton_cache

    this = {}
    for name, run in variants.items():
        if name == "align2m":
            triton_cache.REGION_ALIGN = 2 << 20
            tri.clear_launch_caches()
            for _ in range(2):
                run()
        us, state = _burst(run)
        this[name] = dict(us=round(us, 1), **state)
        if first:
            this[name]["kernels"] = probe.kernel_times(run, 2)
            if name == "align2m":
                outputs[name] = run()
        if name == "align2m":
            triton_cache.REGION_ALIGN = 256
            tri.clear_launch_caches()
            for _ in range(2):
                lean()
    return this


def part_mixtral(results: dict, deadline: hb.Deadline) -> None:
    from moekit.experts.triton_gluon import experts_gluon

    if deadline.left() < 30:
        print("deadline: mixtral skipped", flush=True)
        return
    device, fn, shape = torch.device("cuda"), get_backend("triton"), Shape.from_preset(hb.MIXTRAL)
    base = make_weights(shape, torch.bfloat16, device)
    s = make_sets(shape, 4096, 1, torch.bfloat16, device)[0]
    w13, w2 = base.w13, base.w2

    def lean():  # align2m is this call under 2 MiB region offsets
        return fn(s.x, w13, w2, s.topk_ids, s.topk_weights)

    def plain():
        return experts_gluon(s.x, w13, w2, s.topk_ids, s.topk_weights, lean=False)

    for _ in range(3):
        want = lean()
    err = hb._reference_err(w13, w2, s, max_m=4096)
    graph, graph_out = _captured(lean)
    variants = {"lean": lean, "plain": plain, "graph": graph.replay, "align2m": lean}
    outputs = {"lean": want, "plain": plain(), "graph": graph_out}
    row = {"ref_err": err, "rounds": []}
    for rnd in range(3):
        if deadline.left() < 15:
            break
        this = _mixtral_round(variants, lean, outputs, rnd == 0)
        row["rounds"].append(this)
        print(f"mixtral round {rnd}: " + "  ".join(f"{n} {v['us']} µs ({v['clock_rate']} MHz, {v['power_draw']} mW, "
                                                     f"{v['temperature']} C)" for n, v in this.items()), flush=True)
    torch.cuda.synchronize()
    row["equal_to_lean"] = {n: bool(torch.equal(o, want)) for n, o in outputs.items()}
    ok = err is not None and err < hb.TOL and all(row["equal_to_lean"].values())
    print(f"{'PASS' if ok else 'FAIL'} mixtral variants: err {err} equal to lean {row['equal_to_lean']}", flush=True)
    for name, v in (row["rounds"][0].items() if row["rounds"] else ()):
        ks = v.get("kernels", [])
        print(f"   {name} kernels (sum {sum(t for _, t in ks):.1f}): " + "; ".join(f"{k} {t}" for k, t in ks),
              flush=True)
    results["mixtral_ab"] = row
    hb.yield_results(results)


def old_unchecked(x, w13, w2, ids, weights):
    """The lookup order before ``triton._run_kept``: the Triton entries first, the Gluon ones after a miss."""
    out = tri.run_fast(tri._WORKSPACES, x, w13, w2, ids, weights, "silu", tri._DEFAULT_OPTIONS, checked=False)
    if out is None and w13.__class__ is Fp8BlockWeight:
        from moekit.experts.triton_gluon_fp8 import run_fast_fp8

        out = run_fast_fp8(x, w13, w2, ids, weights, "silu")
    elif out is None:
        from moekit.experts.triton_gluon import run_fast_default_gluon

        out = run_fast_default_gluon(x, w13, w2, ids, weights, "silu")
    if out is not None:
        return out
    return tri._unchecked(x, w13, w2, ids, weights, "silu", None, None, None, tri._DEFAULT_OPTIONS, checked=False)


def _held_weights(held: dict, shape: Shape, preset: str, dtype: str, device: torch.device) -> tuple:
    """The (w13, w2) of ``preset`` in ``dtype``, made once and kept in ``held`` while the next cell shares them
    (one weight set at a time: the previous one is dropped first)."""
    if (preset, dtype) not in held:
        held.clear()
        torch.cuda.empty_cache()
        held[(preset, dtype)] = hb._weights(shape, dtype, make_weights(shape, torch.bfloat16, device))
    return held[(preset, dtype)]


def part_routes(results: dict, deadline: hb.Deadline) -> None:
    device, out = torch.device("cuda"), results.setdefault("routes", {})
    held = {}
    for preset, dtype, m in ROUTE_CELLS:
        if deadline.left() < 10:
            print(f"deadline: routes stop before {preset} {dtype} M={m}", flush=True)
            return
        shape = Shape.from_preset(preset)
        w13, w2 = _held_weights(held, shape, preset, dtype, device)
        sets = make_sets(shape, m, 2, torch.bfloat16, device)
        fns = {"old": old_unchecked, "new": tri.experts_triton_unchecked}
        calls = {n: [lambda s=s, f=f: f(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets] for n,
                 f in fns.items()}
        for c in calls["new"] * 3:
            c()
        same = all(torch.equal(old_unchecked(s.x, w13, w2, s.topk_ids, s.topk_weights),
                               tri.experts_triton_unchecked(s.x, w13, w2, s.topk_ids, s.topk_weights)) for s in sets)
        samples = {n: [] for n in fns}
        for _ in range(5):
            for n in fns:
                samples[n].append(time_eager(calls[n], device, repeats=3))
        row = {n: dict(host_rest_us=round(statistics.median(t.host_rest_us for t in ts), 1),
                       host_us=round(statistics.median(t.host_us for t in ts), 1),
                       eager_us=round(statistics.median(t.eager_us for t in ts), 1),
                       rest_rounds=[round(t.host_rest_us, 1) for t in ts]) for n, ts in samples.items()}
        row["same"] = same
        key = f"{preset} {dtype} M={m}"
        out[key] = row
        wins = sum(a.host_rest_us > b.host_rest_us for a, b in zip(samples["old"], samples["new"]))
        print(f"{'PASS' if same else 'FAIL'} routes {key}: old rest {row['old']['host_rest_us']} new "
              f"{row['new']['host_rest_us']} (new lower in {wins}/5; rounds old {row['old']['rest_rounds']} new "
              f"{row['new']['rest_rounds']}); host {row['old']['host_us']} / {row['new']['host_us']}; eager "
              f"{row['old']['eager_us']} / {row['new']['eager_us']}", flush=True)
        hb.yield_results(results)
        del sets, calls


PDL_CELLS = [(hb.QWEN3, "bfloat16", 1), (hb.QWEN3, "fp8_block", 1), (hb.QWEN3, "int4_w4a16", 1)]


def part_pdl(results: dict, deadline: hb.Deadline) -> None:
    """Programmatic dependent launch on / off (``LaunchOptions.dependent_launch``) at the M = 1 cells where eager
    is host-bound: host_rest, eager and graph µs, interleaved over 5 rounds (run 1: cuLaunchKernelEx 7-40 µs a
    launch under the profiler, every launch of these cells a PDL launch)."""
    from moekit.experts.triton_launch import LaunchOptions

    device, out, held = torch.device("cuda"), results.setdefault("pdl", {}), {}
    variants = {"pdl": LaunchOptions(), "nopdl": LaunchOptions(dependent_launch=False)}
    for preset, dtype, m in PDL_CELLS:
        if deadline.left() < 12:
            print(f"deadline: pdl stops before {preset} {dtype} M={m}", flush=True)
            return
        shape = Shape.from_preset(preset)
        w13, w2 = _held_weights(held, shape, preset, dtype, device)
        sets = make_sets(shape, m, 4, torch.bfloat16, device)
        calls = {n: [lambda s=s, o=o: tri.experts_triton_unchecked(s.x, w13, w2, s.topk_ids, s.topk_weights, options=o)
                     for s in sets] for n, o in variants.items()}
        for n in variants:
            for c in calls[n] * 3:
                c()
        same = all(torch.equal(calls["pdl"][i](), calls["nopdl"][i]()) for i in range(len(sets)))
        samples = {n: [] for n in variants}
        for _ in range(5):
            for n in variants:
                samples[n].append(time_eager(calls[n], device))
        row = {n: dict(host_rest_us=round(statistics.median(t.host_rest_us for t in ts), 1),
                       eager_us=round(statistics.median(t.eager_us for t in ts), 1),
                       graph_us=round(time_stats(calls[n], device, graph=True, budget_s=0.05).us, 1))
               for n, ts in samples.items()}
        row["same"] = same
        key = f"{preset} {dtype} M={m}"
        out[key] = row
        print(f"{'PASS' if same else 'FAIL'} pdl {key}: " + "  ".join(
            f"{n} rest {r['host_rest_us']} eager {r['eager_us']} graph {r['graph_us']}" for n, r in row.items()
            if n != "same"), flush=True)
        hb.yield_results(results)
        del sets, calls


def part_phases(results: dict, counts: probe.PathCounts, deadline: hb.Deadline) -> None:
    cells = [(hb.DEEPSEEK, d, m) for d in ("int4_w4a16", "mxfp4") for m in (1, 64)]
    hb._phase_cells = lambda: cells  # run 1's probes, at the cells it did not reach
    hb.MIXTRAL_S = 0
    hb.part_phases(results, counts, deadline)


def table(results: dict) -> None:
    print("\n== host_big2 ==")
    for key, r in results.get("rows_bench", {}).items():
        print(f"rows {key:28} graph {r['us']:7.1f} eager {r['eager_us']:7.1f} host {r['host_us']:6.1f} rest "
              f"{r['host_rest_us']:6.1f}")
    for i, rnd in enumerate(results.get("mixtral_ab", {}).get("rounds", [])):
        print(f"mixtral r{i} " + "  ".join(f"{n} {v['us']}" for n, v in rnd.items()))
    for key, r in results.get("pdl", {}).items():
        print(f"pdl {key:30} rest {r['pdl']['host_rest_us']:6.1f} / {r['nopdl']['host_rest_us']:6.1f}  eager "
              f"{r['pdl']['eager_us']:7.1f} / {r['nopdl']['eager_us']:7.1f}  graph {r['pdl']['graph_us']:7.1f} / "
              f"{r['nopdl']['graph_us']:7.1f}  same {r['same']}")
    for key, r in results.get("routes", {}).items():
        print(f"routes {key:30} rest old {r['old']['host_rest_us']:6.1f} new {r['new']['host_rest_us']:6.1f}  host "
              f"{r['old']['host_us']:6.1f} / {r['new']['host_us']:6.1f}  same {r['same']}")
    hb.table({"phases": results.get("phases", {})})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "host_big_out"))
    parser.add_argument("--deadline-s", type=float, default=62.0)
    parser.add_argument("--parts", nargs="+", default=["mixtral", "pdl", "routes", "rows"],
                        choices=["rows", "mixtral", "routes", "pdl", "phases"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    hb._OUT[0] = os.path.join(args.out, "host_big2.json")
    deadline = hb.Deadline(args.deadline_s)
    import triton

    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   parts=args.parts)
    print(f"{results['device']} torch {results['torch']} triton {results['triton']}", flush=True)
    counts = probe.PathCounts().install()
    with torch.no_grad():
        for part in args.parts:
            try:
                if part == "rows":
                    part_rows(results, counts, deadline)
                elif part == "mixtral":
                    part_mixtral(results, deadline)
                elif part == "routes":
                    part_routes(results, deadline)
                elif part == "pdl":
                    part_pdl(results, deadline)
                else:
                    part_phases(results, counts, deadline)
            except torch.cuda.OutOfMemoryError as e:
                print(f"FAIL {part}: out of memory: {str(e)[:200]}", flush=True)
                torch.cuda.empty_cache()
            hb.yield_results(results)
    table(results)


if __name__ == "__main__":
    main()

"""Issues 19 / 15 at prefill (branch `prefill`): which kernels each M >= 4096 cell runs, the two GEMMs apart, what the
128-row padding costs, and the tile / pipeline candidates (``prefill_variants``) against today's route.

    PYTHONPATH=$PWD python3 benchmarks/prefill_device_check.py --out $OUT/prefill [--deadline-s 165] [--rounds 5]
        [--cells bf16:qwen3-30b-a3b:4096 fp8:deepseek-v3:16384 ...] [--variants "route,lean g128,lean gather"]

Per cell (dtype, preset, M; uniform routing, seeded):
  1. correctness: every variant's output against the torch twin of the Gluon path (``experts_gluon_twin``, fp8:
     ``experts_gluon_fp8_twin``), rel L2: Gluon bf16 < 2e-3, the route / fused kernels < 1e-2, fp8 < 1e-2 (PASS/FAIL);
     a variant with ``same_as`` must also equal that variant's output bit for bit ("lean gather" vs "lean g128");
  2. the route's kernels (torch.profiler, device µs per kernel);
  3. whole call, CUDA-graph replay, ``--rounds`` interleaved rounds (each variant once per round, each round starting
     with the next variant; ~15 ms of untimed replays, then ~40 ms of back-to-back replays between two events);
  4. each Gluon variant's GEMMs alone (graph replay): µs and % of the mm rate on the real rows, under the uniform
     routing and under a balanced one (no padding rows): the gap is what padding to 128 rows costs.
JSON to ``--out``/prefill.json after every cell; the table is printed last. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from bench_rounds import graph_of, rotated_rounds, versus  # noqa: E402
from bench_run import RunLog, ceilings, rel_l2  # noqa: E402

CELLS = ("bf16:qwen3-30b-a3b:4096", "bf16:deepseek-v3:4096", "fp8:deepseek-v3:4096", "bf16:qwen3-30b-a3b:8192",
         "bf16:deepseek-v3:8192", "bf16:qwen3-30b-a3b:16384", "bf16:deepseek-v3:16384", "fp8:deepseek-v3:16384",
         "fp8:qwen3-30b-a3b:16384", "bf16:mixtral-8x7b:4096")
ROUND_S = 0.04  # timed replays per variant per round
WARM_S = 0.015  # untimed replays before them
STALL_S = 120.0  # the watchdog ends the run (table so far printed) when nothing was logged for this long
RUN = RunLog("whole call, CUDA-graph replay, median of the rounds; x = the route's µs / the variant's")
RESULTS: dict = {"cells": []}
# the run's module state, as the scripts that import this one (``f8pre``, ``padding``) use it
T0, FAILED, SUMMARY, log, print_table = RUN.t0, RUN.failed, RUN.summary, RUN.log, RUN.print_table


def watchdog() -> None:
    """A hung kernel (a new barrier protocol) or a stuck compile must not take the results so far with it."""
    RUN.watchdog(lambda: STALL_S)


def capture(fn) -> torch.cuda.CUDAGraph:
    return graph_of([fn], torch.device("cuda"), warmups=1, replay=False)


def replay_us(graph: torch.cuda.CUDAGraph, budget_s: float = ROUND_S) -> float:
    """µs per replay, the GPU kept busy: ~WARM_S of untimed replays (the SM clock ramps after an idle host gap:
    run 1 read the first variant of every round 10-30% slow), then back-to-back replays between two events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    once_s = max(start.elapsed_time(end) * 1e-3, 1e-6)
    for _ in range(max(2, int(WARM_S / once_s))):
        graph.replay()
    reps = max(3, min(200, int(budget_s / once_s)))
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def make_cell(dtype: str, preset: str, m: int, dev):
    """(shape, x, ids, rw, weights for the variants, the twin's output, variants)."""
    import prefill_variants as pv
    from moekit.bench.cells import Shape, make_weights, uniform_routing

    s = Shape.from_preset(preset)
    w = make_weights(s, torch.bfloat16, dev)
    routing = uniform_routing(m, s, dev, seed=m)
    ids, rw = routing.topk_ids, routing.topk_weights
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    if dtype == "bf16":
        from moekit.experts.triton_gluon import experts_gluon_twin

        return s, x, ids, rw, (w.w13, w.w2), experts_gluon_twin(x, w.w13, w.w2, ids, rw), pv.bf16_variants(w.w13, w.w2)
    from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

    q = (*quantize_chunked(w.w13), *quantize_chunked(w.w2))
    del w
    return s, x, ids, rw, q, experts_gluon_fp8_twin(x, *q, ids, rw), pv.fp8_variants(q)


def quantize_chunked(w: torch.Tensor, experts: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of ``quantize_fp8_block`` a few experts at a time (its float32 copy of DeepSeek-V3's whole w13 is
    28 GiB: run 1's fp8 cells died of it)."""
    from moekit.quant.fp8_block import quantize_fp8_block

    parts = [quantize_fp8_block(w[i:i + experts]) for i in range(0, w.shape[0], experts)]
    return torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts])


def check(name: str, v, x, ids, rw, ref, dtype: str, outs: dict) -> bool:
    try:
        out = v.call(x, ids, rw)
        torch.cuda.synchronize()
        err = rel_l2(out, ref)
    except Exception as exc:  # noqa: BLE001 (a variant that does not build is reported, the rest go on)
        log(f"FAIL {name} {v.name}: {type(exc).__name__}: {str(exc)[-600:]}")
        FAILED.append(f"{name} {v.name}")
        return False
    tol = 2e-3 if dtype == "bf16" and v.kind == "gluon" else 1e-2
    ok = err < tol
    base = outs.get(v.same_as) if v.same_as else None
    if base is not None:  # the same products in the same order: equal bit for bit, or it fails
        same = torch.equal(out, base)
        ok = ok and same
        diff = (out.float() - base.float()).abs().max()
        log(f"{name} {v.name} vs {v.same_as}: bit-equal {same}, max |diff| {diff:.3g}")
    outs[v.name] = out
    log(f"{'PASS' if ok else 'FAIL'} {name} {v.name}: rel L2 vs twin {err:.2e} (< {tol:g})")
    if not ok:
        FAILED.append(f"{name} {v.name}")
    return ok


def whole_calls(name: str, variants, x, ids, rw, rounds: int, stop_at: float) -> dict:
    """name -> per-round µs (graph replay, variants interleaved within each round)."""
    graphs = {}
    for v in variants:
        try:
            graphs[v.name] = capture(lambda v=v: v.call(x, ids, rw))
        except Exception as exc:  # noqa: BLE001
            log(f"capture failed {name} {v.name}: {type(exc).__name__}: {str(exc)[-300:]}")
    per_round = rotated_rounds(name, list(graphs), rounds, lambda n: replay_us(graphs[n]),
                               lambda r: r >= 1 and time.perf_counter() - T0 > stop_at, log)
    del graphs
    return per_round


def gemms_apart(name: str, s, x, ids, variants, weights, dtype: str, mm: float, stop_at: float) -> dict:
    """Each Gluon variant's GEMMs alone, uniform and balanced routing: {variant: {routing: {gemm: µs}}}."""
    import prefill_variants as pv

    bal_ids, _ = pv.balanced_routing(x.shape[0], s.num_experts, s.top_k, x.device)
    flops = {"gate-up": 2 * x.shape[0] * s.top_k * 2 * s.n * s.k, "down": 2 * x.shape[0] * s.top_k * s.n * s.k}
    out, seen = {}, set()
    for v in variants:
        if v.tiles is None or (v.tiles, v.in_loader) in seen:
            continue
        seen.add((v.tiles, v.in_loader))
        out[v.name] = {}
        if time.perf_counter() - T0 > stop_at:
            break
        for routing, r_ids in (("uniform", ids), ("balanced", bal_ids)):
            up, down = v.tiles
            pair = (pv.bf16_gemm_pair(x, r_ids, *weights, up, down, v.in_loader) if dtype == "bf16"
                    else pv.fp8_gemm_pair(x, r_ids, weights, up, down))
            pair.up()
            rows = int(pair.rows_used.item())
            got = {"padded_rows_per_row": rows / (x.shape[0] * s.top_k)}
            for gemm, fn in (("gate-up", pair.up), ("down", pair.down)):
                graph = capture(fn)
                us = statistics.median(replay_us(graph) for _ in range(3))
                got[gemm] = us
                got[f"{gemm} %mm"] = 100 * flops[gemm] / (us * 1e-6) / 1e12 / mm
            out[v.name][routing] = got
            log(f"{name} {v.name} {routing} (rows/real {got['padded_rows_per_row']:.3f}): gate-up {got['gate-up']:.1f} "
                f"us ({got['gate-up %mm']:.1f}% mm), down {got['down']:.1f} us ({got['down %mm']:.1f}% mm)")
            del pair
    return out


def route_kernels(name: str, v, x, ids, rw) -> str:
    from fp8_kernel_breakdown import describe, kernel_breakdown

    line = describe(kernel_breakdown(lambda: v.call(x, ids, rw), calls=5))
    log(f"{name} route kernels: {line}")
    return line


def run_cell(spec: str, dev, ceil: dict, rounds: int, stop_at: float, out_dir: Path, wanted: list) -> None:
    dtype, preset, m = spec.split(":")
    m = int(m)
    mm = ceil["bf16_mm_TFLOPs"] if dtype == "bf16" else ceil["fp8_mm_TFLOPs"]
    s, x, ids, rw, weights, ref, variants = make_cell(dtype, preset, m, dev)
    name = f"{dtype} {preset} M={m}"
    if wanted:
        variants = [v for v in variants if v.name in wanted]
    outs: dict = {}
    passing = [v for v in variants if check(name, v, x, ids, rw, ref, dtype, outs)]
    del ref, outs
    cell = {"cell": spec, "mm_TFLOPs": mm, "flops": 6 * m * s.top_k * s.n * s.k}
    cell["route_kernels"] = route_kernels(name, variants[0], x, ids, rw) if variants[0] in passing else None
    for v in passing:  # the kernels of a variant that must equal another (what it removed or added)
        if v.same_as:
            cell[f"{v.name} kernels"] = route_kernels(f"{name} {v.name}", v, x, ids, rw)
    cell["rounds_us"] = whole_calls(name, passing, x, ids, rw, rounds, stop_at)
    if time.perf_counter() - T0 < stop_at:
        cell["gemms"] = gemms_apart(name, s, x, ids, passing, weights, dtype, mm, stop_at)
    RESULTS["cells"].append(cell)
    (out_dir / "prefill.json").write_text(json.dumps(RESULTS, indent=1))
    summarize(name, cell)
    del x, weights, variants, passing


def free_memory() -> None:
    """Drop the kept plans, workspaces and fast-path entries (they hold buffers and weight references) and the
    cached blocks: run 1's fp8 DeepSeek-V3 cells found 106 GiB still allocated after the bf16 cells."""
    import gc

    from moekit.experts.triton import clear_launch_caches

    clear_launch_caches()
    gc.collect()
    torch.cuda.empty_cache()


def summarize(name: str, cell: dict) -> None:
    """One table line per variant: median µs, % of mm, ratio to the route and the rounds it beat the route by >= 3%."""
    rounds = cell["rounds_us"]
    if "route" not in rounds or not rounds["route"]:
        SUMMARY.append(f"{name}: route not timed")
        return
    for n, t in rounds.items():
        med = statistics.median(t)
        pct = 100 * cell["flops"] / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        against = "lean g128"  # the lean launch of today's kernels: the base of this session's variant
        extra = f"  vs {against} {versus(t, rounds[against])}" if n != against and rounds.get(against) else ""
        SUMMARY.append(f"{name:34s} {n:18s} {med:9.1f} us {pct:5.1f}% mm  {versus(t, rounds['route'])}{extra}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=165.0, help="no new timing after this many seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    threading.Thread(target=watchdog, daemon=True).start()
    ceil = ceilings(dev, fp8=True)
    RESULTS["ceilings"] = ceil
    log(f"ceilings: {ceil}; torch {torch.__version__}")
    wanted = [n.strip() for n in args.variants.split(",") if n.strip()]
    RUN.each_cell(args.cells, lambda spec: run_cell(spec, dev, ceil, args.rounds, args.deadline_s, args.out, wanted),
                  args.deadline_s, free_memory)
    print_table()
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

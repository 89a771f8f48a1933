"""Issue 19, the padding tax at prefill (branch `prefill5`): what an expert's mostly empty last 128-row block costs,
and the Gluon GEMMs that fold it into the tiles of the block before it (``padding_variants``) against the plain ones.

    PYTHONPATH=$PWD python3 benchmarks/padding_device_check.py --out $OUT/prefill5 [--deadline-s 120] [--rounds 7]
        [--cells bf16:deepseek-v3:4096 ...] [--variants "route,fused,lean g128,lean down t64"]

Per cell (bf16, preset, M; uniform routing, seeded; ``prefill_device_check``'s harness):
  1. correctness: every variant against the torch twin of the Gluon path (rel L2 < 2e-3; the route and the fused
     kernels < 1e-2), and "lean down t64" bit for bit against "lean g128" (PASS/FAIL);
  2. whole call, CUDA-graph replay, ``--rounds`` interleaved rounds (median; rounds each variant beat the route /
     lean g128 by >= 3%);
  3. the layout's blocks: used, folded by the tail, rows per real row; the GEMMs alone (graph replay, median of 3):
     the down GEMM plain vs with the tail on the uniform layout; the plain kernels on its mostly empty last blocks
     alone, on the other blocks alone, and under a balanced routing (no padding).
JSON to ``--out``/padding.json after every cell; the table is printed last. Exit 1 when a check fails.
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
import padding_variants as pv  # noqa: E402
import prefill_device_check as pdc  # noqa: E402
from bench_rounds import versus  # noqa: E402
from bench_run import ceilings  # noqa: E402

# DeepSeek-V3 4096 (the route changed: M*k/E = 128), its neighbours 3072 / 6144 (96 / 192 a expert: outside
# TAIL_PER_EXPERT, the route unchanged), Qwen3 and Mixtral 4096 (unchanged)
CELLS = ("bf16:deepseek-v3:4096", "bf16:deepseek-v3:6144", "bf16:deepseek-v3:3072", "bf16:qwen3-30b-a3b:4096",
         "bf16:mixtral-8x7b:4096")
RESULTS: dict = {"cells": []}
SUMMARY = pdc.SUMMARY  # the table (``prefill_device_check``'s run log prints it, its watchdog too)
log = pdc.log


def check(name: str, v, x, ids, rw, ref, outs: dict) -> bool:
    try:
        out = v.call(x, ids, rw)
        torch.cuda.synchronize()
        err = pdc.rel_l2(out, ref)
    except Exception as exc:  # noqa: BLE001 (a variant that does not build is reported, the rest go on)
        log(f"FAIL {name} {v.name}: {type(exc).__name__}: {str(exc)[-600:]}")
        pdc.FAILED.append(f"{name} {v.name}")
        return False
    tol = 1e-2 if v.name in ("route", "fused") else 2e-3
    ok = err < tol
    base = outs.get(v.same_as) if v.same_as else None
    if base is not None:
        same = torch.equal(out, base)
        ok = ok and same
        diff = (out.float() - base.float()).abs().max()
        log(f"{name} {v.name} vs {v.same_as}: bit-equal {same}, max |diff| {diff:.3g}")
    outs[v.name] = out
    log(f"{'PASS' if ok else 'FAIL'} {name} {v.name}: rel L2 vs twin {err:.2e} (< {tol:g})")
    if not ok:
        pdc.FAILED.append(f"{name} {v.name}")
    return ok


def time_fn(fn) -> float:
    fn()
    graph = pdc.capture(fn)
    return statistics.median(pdc.replay_us(graph) for _ in range(3))


def gemms(name: str, s, x, ids, w13, w2, mm: float, stop_at: float) -> dict:
    """µs and % of mm (real rows) of each GEMM: the plain down GEMM and the tail one on the uniform layout, the plain
    kernels on the last blocks alone / the other blocks alone / a balanced routing."""
    import prefill_variants as prv
    from moekit.experts.triton_gluon_launch import UP_TILE, down_tile

    flops = {"gate-up": 2 * x.shape[0] * s.top_k * 2 * s.n * s.k, "down": 2 * x.shape[0] * s.top_k * s.n * s.k}
    b = pv.buffers(x, ids, s.num_experts, s.n, s.k)
    classes = pv.block_classes(b)
    log(f"{name} blocks: {classes}")
    out = {"blocks": classes}
    pv.gate_up(b, w13, UP_TILE)  # h of every row for the down GEMMs
    for gemm, kind, fn in (("gate-up", "plain", lambda: pv.gate_up(b, w13, UP_TILE)),
                           ("down", "plain", lambda: pv.down(b, w2, down_tile(s.n))),
                           ("down", "t64", lambda: pv.down(b, w2, down_tile(s.n, True)))):
        if time.perf_counter() - pdc.T0 > stop_at:
            log(f"{name}: deadline in the GEMMs")
            return out
        us = time_fn(fn)
        out[f"{gemm} {kind}"] = us
        log(f"{name} {gemm} {kind}: {us:.1f} us ({100 * flops[gemm] / (us * 1e-6) / 1e12 / mm:.1f}% mm)")
    parts = pv.tail_subsets(b)
    bal_ids, _ = prv.balanced_routing(x.shape[0], s.num_experts, s.top_k, x.device)
    parts["balanced"] = pv.buffers(x, bal_ids, s.num_experts, s.n, s.k)
    for part, pb in parts.items():
        if time.perf_counter() - pdc.T0 > stop_at:
            break
        blocks = int(pb.lay.rows_used.item()) // 128
        if blocks == 0:
            continue
        up_us = time_fn(lambda pb=pb: pv.gate_up(pb, w13, UP_TILE))
        down_us = time_fn(lambda pb=pb: pv.down(pb, w2, down_tile(s.n)))
        out[part] = {"blocks": blocks, "gate-up": up_us, "down": down_us}
        log(f"{name} {part} ({blocks} blocks): gate-up {up_us:.1f} us ({up_us / blocks:.2f} per block), down "
            f"{down_us:.1f} us ({down_us / blocks:.2f} per block)")
    return out


def run_cell(spec: str, dev, ceil: dict, rounds: int, stop_at: float, out_dir: Path, wanted: list) -> None:
    from moekit.bench.cells import Shape, make_weights, uniform_routing
    from moekit.experts.triton_gluon import experts_gluon_twin

    dtype, preset, m = spec.split(":")
    m = int(m)
    mm = ceil["bf16_mm_TFLOPs"]
    s = Shape.from_preset(preset)
    w = make_weights(s, torch.bfloat16, dev)
    routing = uniform_routing(m, s, dev, seed=m)
    ids, rw = routing.topk_ids, routing.topk_weights
    x = torch.randn(m, s.k, device=dev, dtype=torch.bfloat16)
    name = f"{dtype} {preset} M={m}"
    if dtype != "bf16":
        raise ValueError(f"{spec}: bf16 cells only (the fp8 tail consumer was measured in run 1 and removed)")
    ref = experts_gluon_twin(x, w.w13, w.w2, ids, rw)
    variants = pv.variants(w.w13, w.w2)
    variants = [v for v in variants if not wanted or v.name in wanted]
    outs: dict = {}
    passing = [v for v in variants if check(name, v, x, ids, rw, ref, outs)]
    del ref, outs
    cell = {"cell": spec, "mm_TFLOPs": mm, "flops": 6 * m * s.top_k * s.n * s.k}
    cell["rounds_us"] = pdc.whole_calls(name, passing, x, ids, rw, rounds, stop_at)
    RESULTS["cells"].append(cell)
    (out_dir / "padding.json").write_text(json.dumps(RESULTS, indent=1))
    summarize(name, cell)
    if time.perf_counter() - pdc.T0 < stop_at:
        cell["gemms"] = gemms(name, s, x, ids, w.w13, w.w2, mm, stop_at)
        (out_dir / "padding.json").write_text(json.dumps(RESULTS, indent=1))


def summarize(name: str, cell: dict) -> None:
    rounds = cell["rounds_us"]
    for n, t in rounds.items():
        if not t:
            continue
        med = statistics.median(t)
        pct = 100 * cell["flops"] / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        line = f"{name:30s} {n:10s} {med:9.1f} us {pct:5.1f}% mm"
        for base in ("route", "fused", "lean g128"):
            if n != base and rounds.get(base):
                line += f"  vs {base} {versus(t, rounds[base])}"
        SUMMARY.append(line)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=120.0, help="no new timing after this many seconds")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--variants", default="", help="comma-separated variant names to run (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    pdc.STALL_S = 60.0  # a new kernel's barrier protocol that hangs: the table so far, well inside the run's limit
    threading.Thread(target=pdc.watchdog, daemon=True).start()
    ceil = ceilings(dev)
    RESULTS["ceilings"] = ceil
    log(f"ceilings: {ceil}; torch {torch.__version__}")
    wanted = [n.strip() for n in args.variants.split(",") if n.strip()]
    pdc.RUN.each_cell(args.cells,
                      lambda spec: run_cell(spec, dev, ceil, args.rounds, args.deadline_s, args.out, wanted),
                      args.deadline_s, pdc.free_memory)
    pdc.print_table()
    return 1 if pdc.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

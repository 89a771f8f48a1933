"""GPU check of the int4 ring decode (issue 16, session 25 brief w5; ``moekit/experts/triton_wo_ring.py``): a loader
warp keeps a TMA ring of packed weight tiles full, the decode warps read it from shared memory.

    PYTHONPATH=$PWD timeout 200 python3 benchmarks/wo_ring_device_check.py --out $OUT/w5 --deadline 140   # H200
    PYTHONPATH=$PWD python3 benchmarks/wo_ring_device_check.py --smoke   # CPU: the twin against the reference only

Cells (--cells preset:M[:scheme]; default DeepSeek-V3 int4 M = 1, 8, mxfp4 M = 1), each in a child process:
int4_w4a16 g 128 (random codes, scales and zeros) or mxfp4 (random codes, e8m0 scales; raw plans only). Variants:
"pick" (``run_experts_wo`` with the chooser's fused decode and config: the default before the ring), "default"
(``run_experts_wo`` left to choose: the ring where ``triton_wo_ring_route.RING_MEASURED`` takes the call) and
"ring <plan>" (gate-up ring, down ring, torch sum over k; plan "BMxWARPS sSTAGES", "2/SM" two programs an SM,
"gTM" slots grouped by expert into items of up to TM, their rows read once: ``ring_items``, torch ops in the call;
"w ..." the word decode, ``gluon_wo_ring_words``, its x prepared by torch ops in the call; "raw ..." the raw word
decode, ``gluon_wo_raw``: moekit's own scales and zeros, raw x), every one against the torch twin (rel-L2 < TOL:
PASS/FAIL; the ring's h also against the twin's). Launches alone (first plan): "up" / "down" and their
loader-only forms "up-lo" / "down-lo" (the decode warps release each stage at once: what the ring delivers).
CUDA-graph replay over SETS input sets, the variants interleaved in ROUNDS rounds (median). Whole calls: % of the
packed floor (touched experts' packed bytes, scales, zeros over the measured copy bandwidth).
Launches: TB/s of the bytes they stream (a slot reads its expert's
rows; at M = 8 experts picked twice are read twice). JSON <out>/wo_ring.json; the table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.configs import device_key  # noqa: E402
from moekit.experts.triton import experts_triton  # noqa: E402
from moekit.experts.triton_wo import WoWeight, dequantize_wo, fused_experts_wo_torch, run_experts_wo  # noqa: E402
from moekit.experts.triton_wo import weight_args  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode  # noqa: E402
from moekit.experts.triton_wo_ring import RingPlan, ring_experts, ring_gemv, ring_twin, ring_weight  # noqa: E402
from wo_device_check import copy_tbps, packed_bytes, rel_err  # noqa: E402
from wo_tc_device_check import graph_of  # noqa: E402

CELLS = "deepseek-v3:1,deepseek-v3:8,deepseek-v3:1:mxfp4"  # --cells: preset:M[:scheme], comma separated
PLANS = {"32x4 s8": RingPlan(32, 8, 4), "w 64x4 s8": RingPlan(64, 8, 4, decode="words"),
         "raw 64x4 s8": RingPlan(64, 8, 4, decode="raw"), "raw 32x4 s8": RingPlan(32, 8, 4, decode="raw"),
         "raw 64x4 s8 2/SM": RingPlan(64, 8, 4, 2, decode="raw"), "raw 64x4 s12": RingPlan(64, 12, 4, decode="raw"),
         "raw 64x4 s8 g2": RingPlan(64, 8, 4, group=2, decode="raw")}
WORDS = "raw 64x4 s8"  # the raw-decode plan timed launch by launch too
SETS, ROUNDS, REPLAYS = 3, 5, 5
TOL = 1e-2
START = time.perf_counter()
FAILED: list[str] = []


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    scheme: str
    floor_us: float
    touched: float
    times: dict = dataclasses.field(default_factory=dict)  # variant -> median µs a call
    rounds: dict = dataclasses.field(default_factory=dict)  # variant -> µs each round
    errors: dict = dataclasses.field(default_factory=dict)
    streamed: dict = dataclasses.field(default_factory=dict)  # launch variant -> bytes it streams a call


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def random_int4(e: int, r: int, c: int, dev, seed: int) -> WoWeight:
    """Random codes, zeros 0..15 and scales (about unit-variance products), group 128."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randint(0, 256, (e, r, c // 2), generator=g, device=dev, dtype=torch.uint8)
    zero = torch.randint(0, 16, (e, r, c // 128), generator=g, device=dev, dtype=torch.uint8)
    scale = (0.5 + torch.rand(e, r, c // 128, generator=g, device=dev)) / (6.0 * c**0.5)
    return WoWeight("int4_w4a16", q, scale, zero, 128)


def random_weight(scheme: str, e: int, r: int, c: int, dev, seed: int) -> WoWeight:
    """``random_int4``, or for mxfp4 random codes and e8m0 scales (2^-1 .. 2^1 around unit-variance products)."""
    if scheme == "int4_w4a16":
        return random_int4(e, r, c, dev, seed)
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randint(0, 256, (e, r, c // 2), generator=g, device=dev, dtype=torch.uint8)
    center = round(127 - math.log2(2.9 * c**0.5))  # std(e2m1 value) ~ 2.9
    scale = torch.randint(center - 1, center + 2, (e, r, c // 32), generator=g, device=dev, dtype=torch.uint8)
    return WoWeight("mxfp4", q, scale, None, 32)


def interleaved(fns: dict, calls: int, dev) -> dict:
    """name -> [µs a call, each round]: each graph replayed REPLAYS times a round, the graphs in turn."""
    if dev.type != "cuda":
        return {}
    samples = {name: [] for name in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(ROUNDS):
        for name, g in fns.items():
            start.record()
            for _ in range(REPLAYS):
                g.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e3 / (REPLAYS * calls))
    return samples


def launch_graphs(cell: Cell, s: Shape, m: int, inputs, weights, rings, h_twin, dev) -> dict:
    """Graphs of the launches alone (bytes streamed in cell.streamed); both decodes' h against the twin's."""
    (w13, w2), (r13, r2), c0 = weights, rings, inputs[0]
    graphs = {}
    wplan = PLANS[WORDS]
    plan = next(iter(PLANS.values())) if cell.scheme == "int4_w4a16" else wplan  # mxfp4: the raw decode only
    ids = [c.topk_ids.reshape(-1).to(torch.int32) for c in inputs]
    wts = [c.topk_weights.reshape(-1).float() for c in inputs]
    hs = [torch.randn(m * s.top_k, s.n, device=dev, dtype=torch.bfloat16) for _ in inputs]
    for name, p in (("h", plan), ("raw h", wplan)):
        cell.errors[name] = err = rel_err(ring_gemv(c0.x, r13, ids[0], wts[0], s.top_k, True, p), h_twin)
        check(f"{s.name} M={m} ring {name}", err < TOL, f"rel_err={err:.2e} against the twin's h")
    launches = {"up": lambda i, lo: ring_gemv(inputs[i].x, r13, ids[i], wts[i], s.top_k, True, plan, lo),
                "down": lambda i, lo: ring_gemv(hs[i], r2, ids[i], wts[i], 1, False, plan, lo),
                "raw up": lambda i, lo: ring_gemv(inputs[i].x, r13, ids[i], wts[i], s.top_k, True, wplan, lo),
                "raw down": lambda i, lo: ring_gemv(hs[i], r2, ids[i], wts[i], 1, False, wplan, lo)}
    for name, fn in launches.items():
        per = packed_bytes(w13 if name.endswith("up") else w2)
        for lo in (False, True) if name in ("up", "down") else (False,):
            key = name + ("-lo" if lo else "")
            cell.streamed[key] = m * s.top_k * per
            try:
                graphs[key] = graph_of([lambda i=i, fn=fn, lo=lo: fn(i, lo) for i in range(len(inputs))], dev)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(limit=4)
                check(f"{s.name} M={m} {key}", False, f"raised {type(e).__name__}: {e}")
    return graphs


def run_cell(s: Shape, m: int, scheme: str, dev, bw: float, args) -> Cell:
    w13 = random_weight(scheme, s.num_experts, 2 * s.n, s.k, dev, 1)
    w2 = random_weight(scheme, s.num_experts, s.k, s.n, dev, 2)
    inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    floor_us = (touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2) / (bw * 1e12) * 1e6
    cell = Cell(s.name, m, scheme, floor_us, touched)
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    h_twin, out_twin = ring_twin(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    cell.errors["twin"] = err = rel_err(out_twin, want)
    check(f"{s.name} M={m} twin", err < TOL, f"rel_err={err:.2e} against fused_experts_wo_torch")
    if args.smoke:
        return cell
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    r13, r2 = ring_weight(w13, s.k), ring_weight(w2, s.n)
    decode = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
    cfg = wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), decode)
    calls = {"pick": lambda c: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme,
                                              config=cfg, decode=decode),
             "default": lambda c: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme)}
    for name in args.plans.split(","):
        if scheme == "mxfp4" and PLANS[name].decode != "raw":
            continue
        calls[f"ring {name}"] = lambda c, p=PLANS[name]: ring_experts(c.x, r13, r2, c.topk_ids, c.topk_weights, p, p)
    if s.name in args.bf16.split(","):  # the experts dequantized to bf16, moekit's bf16 path (Qwen3's target: a ratio)
        b13, b2 = (dequantize_wo(w, cols).to(torch.bfloat16) for w, cols in ((w13, s.k), (w2, s.n)))
        calls["bf16"] = lambda c: experts_triton(c.x, b13, b2, c.topk_ids, c.topk_weights)
    graphs = {}
    for name, fn in calls.items():
        tag = f"{s.name} {scheme} M={m} {name}"
        try:
            cell.errors[name] = err = rel_err(fn(c0), want)
            check(tag, err < TOL, f"rel_err={err:.2e}" + (f" ({decode})" if name == "pick" else ""))
            if err < TOL:
                graphs[name] = graph_of([lambda c=c, fn=fn: fn(c) for c in inputs], dev)
        except Exception as e:  # noqa: BLE001 (one variant's failure never loses the cell)
            traceback.print_exc(limit=4)
            check(tag, False, f"raised {type(e).__name__}: {e}")
    if args.launches:
        graphs |= launch_graphs(cell, s, m, inputs, (w13, w2), (r13, r2), h_twin, dev)
    cell.rounds = interleaved(graphs, len(inputs), dev)
    cell.times = {name: statistics.median(v) for name, v in cell.rounds.items()}
    print(f"  {s.name} M={m} floor {floor_us:.1f}: " + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()),
          flush=True)
    return cell


def table(cells: list[Cell]) -> str:
    lines = []
    for c in cells:
        lines.append(f"{c.preset} {c.scheme} M={c.m}: floor {c.floor_us:.1f} µs ({c.touched:.1f} experts touched)")
        pick = c.times.get("pick", float("nan"))
        for k, v in c.times.items():
            if k in c.streamed:
                lines.append(f"  {k:<18} {v:8.1f} µs  {c.streamed[k] / v / 1e6:5.2f} TB/s streamed")
            else:
                wins = sum(a <= 0.97 * b for a, b in zip(c.rounds[k], c.rounds.get("pick", ())))
                bf16 = f"  {v / c.times['bf16']:4.2f}x bf16" if "bf16" in c.times else ""
                lines.append(f"  {k:<18} {v:8.1f} µs  {100 * c.floor_us / v:4.0f}% of floor  {pick / v:4.2f}x pick"
                             f"  wins {wins}/{ROUNDS}{bf16}")
    return "\n".join(lines)


def dump(out: str, name: str, cells: list[Cell], bw: float) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        json.dump({"device": device, "torch": torch.__version__, "copy_TBps": bw,
                   "cells": [dataclasses.asdict(c) for c in cells], "failed": FAILED}, f, indent=1)


def cells_of(args) -> list[tuple[str, int, str]]:
    """--cells as (preset, M, scheme): preset:M[:scheme], scheme int4_w4a16 where not given."""
    return [(*cell.split(":")[:1], int(cell.split(":")[1]), (cell.split(":") + ["int4_w4a16"])[2])
            for cell in args.cells.split(",")]


def child(index: int, args) -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bw = copy_tbps(dev) if dev.type == "cuda" else float("nan")
    preset, m, scheme = cells_of(args)[index]
    s = Shape("tiny", 8, 128, 256, 2) if args.smoke else Shape.from_preset(preset)
    cell = run_cell(s, m, scheme, dev, bw, args)
    dump(args.out, f"wo_ring-{index}.json", [cell], bw)
    return 1 if FAILED else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/wo_ring")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--deadline", type=float, default=140.0, help="wall-clock seconds; cells past it are skipped")
    p.add_argument("--cell-timeout", type=float, default=80.0, help="seconds a cell may take (a hang loses one cell)")
    p.add_argument("--cell", type=int, help="run one cell in this process (the parent starts one per cell)")
    p.add_argument("--cells", default=CELLS, help="preset:M, comma separated")
    p.add_argument("--plans", default=",".join(PLANS), help="ring plans (names of PLANS), comma separated")
    p.add_argument("--no-launches", dest="launches", action="store_false", help="skip the launches-alone graphs")
    p.add_argument("--bf16", default="", help="presets (comma separated) whose cells also time moekit's bf16 "
                   "experts on the dequantized weights")
    args = p.parse_args(argv)
    unknown = [name for name in args.plans.split(",") if name not in PLANS]
    if unknown:
        p.error(f"unknown plans {unknown}; known: {list(PLANS)}")
    if args.cell is not None:
        return child(args.cell, args)
    import triton

    print(torch.__version__, "triton", triton.__version__, flush=True)
    cells, skipped = [], []
    for i, (preset, m, scheme) in enumerate(cells_of(args)):
        left = args.deadline - (time.perf_counter() - START)
        if left < 20:
            skipped.append(f"{preset} {scheme} M={m}")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--cell", str(i), "--out", args.out, "--cells", args.cells,
               "--plans", args.plans] + ([] if args.launches else ["--no-launches"]) + ["--bf16", args.bf16]
        try:
            limit = min(left, args.cell_timeout)
            rc = subprocess.run(cmd + (["--smoke"] if args.smoke else []), timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        path = os.path.join(args.out, f"wo_ring-{i}.json")
        got = json.load(open(path)) if os.path.exists(path) else {"cells": [], "failed": []}
        cells += [Cell(**c) for c in got["cells"]]
        FAILED.extend(got["failed"] + ([f"{preset} {scheme} M={m}: child exit {rc}"] if rc not in (0, 1) else []))
        print(f"-- cell {i} done at {time.perf_counter() - START:.1f} s (exit {rc})", flush=True)
    dump(args.out, "wo_ring.json", cells, float("nan"))
    print(f"total {time.perf_counter() - START:.1f} s; FAILED:", FAILED or "none", "; SKIPPED:", skipped or "none")
    print(table(cells), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

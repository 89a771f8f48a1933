"""GPU check of the int4 word decode at M = 1 and 8 (issue #16 targets 1-2, session 27, brief dec7): the decode
ladder and the wide steps.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/dec7_device_check.py --out $OUT/dec7 --deadline 70   # H200
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/dec7_device_check.py --smoke                 # CPU

Cells (int4_w4a16, g 128; the deadline cuts the last): DeepSeek-V3, Qwen3-30B-A3B, Mixtral-8x7B at M = 1, then
DeepSeek-V3 M = 8; then Mixtral M = 8 on the mma decode (its pick; the merged run's "mu2" / "mu2s3", two 16-word
steps a loop iteration at 2 / 3 stages, offline sm_90 int4 gate-up 2.83 / 2.91 instructions a weight, 8 / 6 programs
an SM, against 2.70 and 12, timed out unmeasured: the option is removed); then mxfp4 DeepSeek-V3 M = 1 (the pick;
"gs", the pick with the removed group_select, lost); each in a child process. Per cell:
- the ladder (``dec7_kernels.geom_read_kernel``, two launches: gate-up rows, then down rows) in a variant's own
  geometry (tile, warps, splits, words ahead; READS): "rd0" a pure read of the words (xor-folded), "rd1" + every
  int4 value decoded as the gemv does and summed. Checked: rd0's xor of its parts against the host's xor of every
  touched word, rd1's sum against the exact sum of the decoded values (float64 from the bytes). Run 1 (CK1, 9e61726):
  the pick's 64 x 16-word tiles (64-byte row segments a step) read at 59% of the packed floor, 16 x 64 words at 99%.
  Also reads in the mma decode's geometry (MMA_READS), for the cells it picks at M = 2-64.
- the whole call (``run_experts_wo``, decode "gemv") against the torch twin (rel-L2 < TOL): "pick" (today's
  config). The wide steps' geometries (WIDE, 128-byte row segments a step: "g32" 32 x 32 words in 2 warps with the
  x tile, "g64" 64 x 32 in 4 warps; the gate-up split scaled so the programs stay about the pick's) are read by the
  ladder only: their whole calls took the removed ``group_select`` (a step of 2-4 whole groups, scales selected per
  word column) and lost 0/5 in every cell, 3 runs; "r168" (the removed register cap, maxnreg 168, split 3) lost
  14-230%.
Timing: CUDA-graph replay over SETS rotated input sets, every graph in turn, ROUNDS interleaved rounds (median); %
of the packed floor (touched experts' packed bytes, scales, zeros, x and out over the copy rate measured in the
same process) and TB/s (those bytes over the time); "wins": rounds a variant took <= 0.97 x the pick. JSON
<out>/dec7-<cell>.json and <out>/dec7.json; the table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.configs import device_key  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts.triton_wo_plan import wo_plan_for  # noqa: E402
from bench_rounds import graph_of, interleaved, medians, wins  # noqa: E402
from bench_run import RunLog, cells_in_children, run_info, write_json  # noqa: E402
from dec7_kernels import GeomPlan, launch_geom  # noqa: E402
from wo_device_check import _warm, copy_tbps, packed_bytes, quantized, rel_err  # noqa: E402

CELLS = (("deepseek-v3", 1), ("qwen3-30b-a3b", 1), ("mixtral-8x7b", 1), ("deepseek-v3", 8),
         ("mixtral-8x7b", 8, "int4_w4a16", "mma"), ("deepseek-v3", 1, "mxfp4"))
DECODE = "gemv"  # the cell's decode (its child sets it, with SCHEME)
SCHEME, SETS, ROUNDS, REPLAYS, TOL = "int4_w4a16", 3, 5, 5, 1e-2
# the wide steps' geometries (read by the ladder): name -> (rows, words a step, warps, x tile (None: the pick's), the
# pick's gate-up split divided by this: about the pick's programs)
# (CK1b also ran "g32n" (g32 with the pick's x tile setting) and "g16" (16 x 64 in 2 warps, split / 4): 1.04-1.09x and
# 1.5-2.0x the pick's time; dropped)
WIDE = {"g32": (32, 32, 2, True, 2), "g64": (64, 32, 4, True, 1)}
READS = (("rd0", "pick", 0), ("rd0-g32", "g32", 0), ("rd0-g64", "g64", 0), ("rd1-g32", "g32", 1))
# reads in the mma decode's geometry (``decode="mma"``, the pick at 2-64 rows an expert: 32 rows x 16 words in 1 warp,
# 64-byte row segments a step), in the same with 32-word steps, and with 32-word steps as two 16-word loads issued
# back to back (HALVES: two sub-steps a loop step), at the pick's splits: name -> (rows, words, warps, halves)
MMA_READS = {"rd0-m16": (32, 16, 1, False), "rd0-m32": (32, 32, 1, False), "rd0-m32h": (32, 32, 1, True)}
RUN = RunLog()
KEPT: list = []  # what a captured read graph points at (its ids and parts), alive until the process ends


@dataclasses.dataclass
class Cell:
    preset: str
    m: int
    floor_us: float
    bytes: float
    copy_tbps: float
    scheme: str = "int4_w4a16"
    times: dict = dataclasses.field(default_factory=dict)  # graph -> median µs a call
    rounds: dict = dataclasses.field(default_factory=dict)  # graph -> µs a call, each round
    configs: dict = dataclasses.field(default_factory=dict)  # variant -> config dict / read plans


def pick(s: Shape, m: int, dev) -> WordConfig:
    """The cell's config (the whole call's, module doc)."""
    base = wo_config(m, s.num_experts, s.n, s.k, s.top_k, SCHEME, device_key(dev), DECODE)
    return base if isinstance(base, WordConfig) else WordConfig(base.BLOCK_M, base.up, base.down)


def geometries(base: WordConfig) -> dict:
    """name -> WordConfig whose geometry the ladder reads: the pick's and the wide steps' (WIDE; gemv only)."""
    out = {"pick": base}
    if DECODE == "mma":
        return out
    for name, (rows, words, warps, x_tile, div) in WIDE.items():
        up, down = (dataclasses.replace(t, BLOCK_N=rows, BLOCK_K=words * 8, num_warps=warps)
                    for t in (base.up, base.down))
        out[name] = dataclasses.replace(base, up=up, down=down, up_split=max(1, base.up_split // div),
                                        x_tile=base.x_tile if x_tile is None else x_tile)
    return {k: v for k, v in out.items() if SCHEME != "mxfp4" or k in ("pick", "g32")}


def read_plans(cfg: WordConfig, down_split: int, s: Shape, level: int) -> tuple[GeomPlan, GeomPlan]:
    """(gate-up, down) reads in the geometry of ``cfg`` (tiles, warps, words ahead) and its splits."""
    up, down = cfg.up, cfg.down
    return (GeomPlan(s.n, s.n, up.BLOCK_N, up.BLOCK_K // 8, up.num_warps, cfg.up_split, min(up.num_stages, 2), level),
            GeomPlan(s.k, 0, down.BLOCK_N, down.BLOCK_K // 8, down.num_warps, down_split, min(down.num_stages, 2),
                     level))


def expected(words13, words2, ids: list[int], plans: tuple[GeomPlan, GeomPlan]) -> float:
    """What the two reads' parts fold to: the xor of every word (LEVEL 0, as an int), or the exact sum of the
    decoded values plus 8.0 a masked word (LEVEL 1)."""
    total = 0
    for words, plan in zip((words13, words2), plans):
        kw, sw = words.shape[2], plan.split_words(words.shape[2])
        for e in ids:
            if plan.level == 0:
                total ^= int(np.bitwise_xor.reduce(words[e].cpu().numpy().reshape(-1)))
                continue
            b = words[e].view(torch.uint8).to(torch.int64)
            total += b.numel() * 2 + (b & 15).sum().item() / 128 + (b >> 4).sum().item() / 2048
        steps = sum(-(-max(0, min((i + 1) * sw, kw) - i * sw) // plan.bkw) for i in range(plan.split))
        read = (2 if plan.half else 1) * plan.rows * kw
        if plan.level == 1:
            total += 8.0 * len(ids) * (plan.tiles() * steps * plan.bn * plan.bkw * (2 if plan.half else 1) - read)
    return total


def check_read(tag: str, parts: list, want, level: int) -> None:
    if level == 0:
        got = 0
        for p in parts:
            got ^= int(np.bitwise_xor.reduce(p.cpu().numpy()))
        RUN.check(tag, got == want, f"xor {got:#x} want {want:#x}")
    else:
        got = sum(p.double().sum().item() for p in parts)
        RUN.check(tag, abs(got - want) <= 1e-5 * abs(want), f"sum {got:.6e} want {want:.6e}")


def ladder(geoms: dict, down_splits: dict, s: Shape) -> dict:
    """name -> (gate-up, down) read plans of the ladder (READS: a variant's geometry and splits, the level)."""
    reads = {name: read_plans(geoms[v], down_splits[v], s, level) for name, v, level in READS if v in geoms}
    for name, (rows, words, warps, halves) in MMA_READS.items():
        up, down = (dataclasses.replace(t, BLOCK_N=rows, BLOCK_K=words * 8, num_warps=warps, num_stages=2)
                    for t in (geoms["pick"].up, geoms["pick"].down))
        plans = read_plans(dataclasses.replace(geoms["pick"], up=up, down=down), down_splits["pick"], s, 0)
        reads[name] = tuple(dataclasses.replace(p, halves=halves) for p in plans)
    return reads


def add_reads(cell: Cell, graphs: dict, w13, w2, inputs, reads: dict, s: Shape, dev) -> None:
    """The ladder's read graphs, each checked on the first set."""
    words13, words2 = w13.q.view(torch.int32), w2.q.view(torch.int32)
    ids = [c.topk_ids.reshape(-1).to(torch.int32) for c in inputs]
    if DECODE == "mma":  # its blocks read an expert once for all its rows (the gemv: once an assignment)
        ids = [torch.unique(i) for i in ids]
    for name, plans in reads.items():
        cell.configs[name] = [dataclasses.asdict(p) for p in plans]
        try:
            bufs = [[p.parts(ids[0].numel(), dev) for p in plans] for _ in inputs]

            def run(i, plans=plans, bufs=bufs):
                launch_geom(words13, ids[i], plans[0], bufs[i][0], dev.type == "cuda")
                launch_geom(words2, ids[i], plans[1], bufs[i][1], dev.type == "cuda")

            KEPT.append((ids, bufs))
            run(0)
            check_read(f"{s.name} {name}", bufs[0], expected(words13, words2, ids[0].tolist(), plans), plans[0].level)
            graphs[name] = graph_of([lambda i=i: run(i) for i in range(len(inputs))], dev)
        except Exception as e:  # noqa: BLE001  (one read's failure never loses the cell)
            traceback.print_exc(limit=3)
            RUN.check(f"{s.name} {name}", False, f"raised {type(e).__name__}: {e}")


def precompile_cell(s: Shape, m: int, found: dict, reads: dict, w13, w2, dev) -> None:
    """Every kernel of the cell compiled at once in a thread pool (Triton's AsyncCompileMode): the calls' plans
    (``wo_device_check._warm``) and the reads (``launch_geom``'s warmup)."""
    from triton import AsyncCompileMode

    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    c = make_sets(s, m, 1, torch.bfloat16, dev)[0]
    ids = c.topk_ids.reshape(-1).to(torch.int32)
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for plans in reads.values():
                for words, plan in zip((w13.q.view(torch.int32), w2.q.view(torch.int32)), plans):
                    launch_geom(words, ids, plan, plan.parts(ids.numel(), dev), True, warmup=True)
            for cfg in found.values():
                _warm(wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, SCHEME, "silu", cfg,
                                  LaunchOptions(reuse_workspace=False), None, DECODE), c, a13, a2, dev)
    except Exception as e:  # noqa: BLE001  (the kernels compile, and report, on first use)
        print(f"precompile: {type(e).__name__}: {e}", flush=True)
    print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)


def add_calls(cell: Cell, graphs: dict, a13, a2, w13, w2, inputs, found: dict, s: Shape, dev) -> None:
    """The whole-call graphs of each variant, each checked against the torch twin on the first set."""
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    for name, cfg in found.items():
        cell.configs[name] = cfg.to_dict()

        def call(c, cfg=cfg):
            return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, SCHEME, config=cfg, decode=DECODE)

        try:
            err = rel_err(call(c0), want)
            RUN.check(f"{s.name} M={cell.m} {name}", err < TOL, f"rel_err={err:.2e} ({cfg.to_dict()})")
            if err < TOL:
                graphs[name] = graph_of([lambda c=c: call(c) for c in inputs], dev)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=3)
            RUN.check(f"{s.name} M={cell.m} {name}", False, f"raised {type(e).__name__}: {e}")


def run_cell(s: Shape, m: int, dev, until: float) -> Cell:
    bw = copy_tbps(dev)
    w13 = quantized(SCHEME, s.num_experts, 2 * s.n, s.k, dev, seed=1)
    w2 = quantized(SCHEME, s.num_experts, s.k, s.n, dev, seed=2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    nbytes = touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2
    cell = Cell(s.name, m, nbytes / (bw * 1e12) * 1e6, nbytes, bw, SCHEME)
    found = {"pick": pick(s, m, dev)}
    geoms = geometries(found["pick"])
    c0 = inputs[0]
    down_splits = {v: wo_plan_for(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, SCHEME, "silu", geoms[v],
                                  LaunchOptions(), None, DECODE).down.grid[1] for _, v, _ in READS if v in geoms}
    reads = ladder(geoms, down_splits, s)
    if dev.type == "cuda":
        precompile_cell(s, m, found, reads, w13, w2, dev)
    graphs: dict = {}
    add_reads(cell, graphs, w13, w2, inputs, reads, s, dev)
    add_calls(cell, graphs, a13, a2, w13, w2, inputs, found, s, dev)
    cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS, until)
    cell.times = medians(cell.rounds)
    print(f"  {s.name} M={m} floor {cell.floor_us:.1f} (copy {bw:.2f} TB/s): "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def table(cells: list[Cell]) -> str:
    lines = ["graph µs a call (% of the packed floor, TB/s; whole calls: wins/5 against pick)"]
    for c in cells:
        lines.append(f"{c.preset} {c.scheme} M={c.m}: floor {c.floor_us:.1f} µs ({c.bytes / 1e6:.1f} MB at copy "
                     f"{c.copy_tbps:.2f} TB/s)")
        for k, v in c.times.items():
            won = wins(c.rounds[k], c.rounds.get("pick", ()))
            extra = "" if k.startswith("rd") or k == "pick" else f", wins {won}/{len(c.rounds[k])}"
            lines.append(f"    {k:<9} {v:8.1f}  ({100 * c.floor_us / v:5.1f}%, {c.bytes / (v * 1e-6) / 1e12:.2f}"
                         f"{extra})")
    return "\n".join(lines)


def dump(path: str, cells: list[Cell]) -> None:
    write_json(path, {**run_info(), "cells": [dataclasses.asdict(c) for c in cells], "failed": RUN.failed})


def child(index: int, args) -> int:
    global SCHEME, DECODE
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset, m, SCHEME, DECODE = (*CELLS[index], "int4_w4a16", "gemv")[:4] if len(CELLS[index]) == 2 else \
        (*CELLS[index], "gemv")[:4]
    s = Shape("tiny", 8, 64, 128, 2) if args.smoke else Shape.from_preset(preset)
    dump(os.path.join(args.out, f"dec7-{index}.json"), [run_cell(s, m, dev, args.until)])
    return 1 if RUN.failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/dec7")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--deadline", type=float, default=70.0, help="wall-clock seconds; cells past it are skipped")
    p.add_argument("--cell", type=int, help="run one cell in this process (the parent starts one per cell)")
    p.add_argument("--until", type=float, default=float("inf"), help="(a cell) no timing round begins past this")
    args = p.parse_args(argv)
    if args.cell is not None:
        return child(args.cell, args)
    import triton

    print(torch.__version__, "triton", triton.__version__, flush=True)
    labels = [f"{preset} M={m}" for preset, m, *_ in (CELLS[:1] if args.smoke else CELLS)]
    got, skipped = cells_in_children(__file__, labels, args.out, "dec7", RUN, args.deadline, 12,
                                     lambda left: ["--until", str(time.time() + left - 4)] + ["--smoke"] * args.smoke)
    cells = [Cell(**c) for c in got]
    dump(os.path.join(args.out, "dec7.json"), cells)
    print(f"total {RUN.elapsed():.1f} s; FAILED:", RUN.failed or "none", "; SKIPPED:", skipped or "none")
    print(table(cells), flush=True)
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())

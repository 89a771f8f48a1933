"""GPU check of the word MMA decode in 128- and 256-byte row steps (issue #16 target 1, session 28, brief dec8):
today's pick against ``decode="mma"`` with steps of BLOCK_K 256 (``gemm_wo_mma``'s two dots a step; int8 on it too),
beside pure reads of the same bytes in the same geometry (the cap).

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/dec8_device_check.py --out $OUT/dec8 --deadline 70   # H200
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/dec8_device_check.py --smoke [--groups 2]    # CPU

Groups (one child process each, weights made once for its Ms; the deadline skips the last): GROUPS, in the order
most likely to decide a pick first. Per M:
- the whole call (``run_experts_wo``) against the torch twin (rel-L2 < TOL): "pick" (config and decode chosen as the
  bench's call: ``choose_decode``, ``wo_config``), and the group's VARIANTS: "tile" the tile decode; the mma decode
  with 32-row 1-warp tiles "kB" (BLOCK_K B, 2 stages), "kBsS" (S stages), "d256s3" (gate-up k128, down k256, 3
  stages), "...u2" (the gate-up split in 2, M = 1 only). A step reads BLOCK_K / 2 bytes of a 4-bit row (k128 64
  bytes, k256 128), BLOCK_K of an int8 row (128, 256). Offline sm_90 SASS (Triton 3.6, ``wo_mma_sass_cpu.py``),
  instructions a weight / programs an SM, gate-up and down: int4 k128s3 2.70 / 12, 3.15 / 15; k256 2.52 / 8, 2.82 /
  10; k256s3 2.66 / 6 (104 B spilled, LDL / STL in the loop), 2.92 / 9; mxfp4 k128s3 4.65, 5.19; k256 4.22, 4.62;
  int8 k128s3 2.61 / 9, 2.98 / 14; k256s3 2.54 / 4, 2.83 / 7; k256s4 2.54 / 3, 2.83 / 4. (BLOCK_K 512, "k512s3",
  measured at 9e90a12 1.7x the pick, was removed with the kernel's 4-way split.)
- pure reads (``dec7_kernels.geom_read_kernel``, LEVEL 0: the words xor-folded, checked against the host's xor of
  every touched word) of the touched experts' words in the mma geometry: "rd64B" 32 rows x 16 words a step (64
  bytes a row), "rd128B" x 32 words (128 bytes), 1 warp, the k256 variant's splits: the cap of each geometry.
Timing: CUDA-graph replay over SETS rotated input sets, every graph in turn, ROUNDS interleaved rounds (median); % of
the packed floor (touched experts' packed bytes, scales, zeros, x and out over the copy rate measured in the same
process) and TB/s (those bytes over the time); "wins": rounds a variant took <= 0.97 x the pick. JSON <out>/dec8.json
(the children's under a temporary directory); the table printed last.
"""

from __future__ import annotations

import dataclasses
import json
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
from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode, wo_plan_for  # noqa: E402
from bench_rounds import graph_of, interleaved  # noqa: E402
from bench_run import RunLog, group_args, run_groups  # noqa: E402
from dec7_device_check import expected  # noqa: E402
from dec7_kernels import GeomPlan, launch_geom  # noqa: E402
from wo_device_check import _warm, copy_tbps, packed_bytes, quantized, rel_err  # noqa: E402

# (preset, scheme, Ms, variants): the taken int8 entries against the tile decode they replaced first (CK2: --groups 0
# 1), then CK1c's other cells. A group takes ~13-14 s before its timing. CK1b (7bf25c9) ran Mixtral int4 M=8,
# DeepSeek-V3 int4 M=64 / 1 and int8 M=1 / 64 with k128 / k256 / k256s3 / k256u2: only int8 k256s3 won (DeepSeek-V3
# M=1); CK1c (9e90a12) DeepSeek-V3 / Mixtral int8 M=1 / 8 and Mixtral mxfp4 M=8 (one round): Mixtral int8 M=1 k256s3.
GROUPS = (("deepseek-v3", "int8_w8a16", (1,), ("tile",)), ("mixtral-8x7b", "int8_w8a16", (1,), ("tile",)),
          ("deepseek-v3", "int8_w8a16", (8,), ("tile", "k256s4")),
          ("mixtral-8x7b", "int8_w8a16", (8,), ("k128", "k256s3")),
          ("mixtral-8x7b", "mxfp4", (8,), ("k256s3", "d256s3")),
          ("mixtral-8x7b", "int4_w4a16", (8,), ("d256s3", "k128s4")),
          ("deepseek-v3", "int4_w4a16", (64,), ("d256s3",)))
# name -> (the mma decode's gate-up tile, down tile: (rows, BLOCK_K, warps, stages), gate-up split); "tile": the
# tile decode with its config; a name ending "u2" runs at M = 1 only
VARIANTS = {"tile": None, "k128": ((32, 128, 1, 3), (32, 128, 1, 3), 1),
            "k128s4": ((32, 128, 1, 4), (32, 128, 1, 4), 1),
            "k256": ((32, 256, 1, 2), (32, 256, 1, 2), 1), "k256s3": ((32, 256, 1, 3), (32, 256, 1, 3), 1),
            "k256s4": ((32, 256, 1, 4), (32, 256, 1, 4), 1),
            "k256s3u2": ((32, 256, 1, 3), (32, 256, 1, 3), 2), "d256s3": ((32, 128, 1, 3), (32, 256, 1, 3), 1)}
READS = {"rd64B": 16, "rd128B": 32}  # name -> words a step (32 rows, 1 warp, the k256 variant's splits)
SETS, ROUNDS, REPLAYS, TOL, WIN = 3, 5, 5, 1e-2, 0.97
START = time.perf_counter()
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check
KEPT: list = []  # what a captured read graph points at (its ids and parts), alive until the process ends


@dataclasses.dataclass
class Cell:
    preset: str
    scheme: str
    m: int
    floor_us: float
    bytes: float
    copy_tbps: float
    pick: str = ""  # the decode today's chooser takes
    times: dict = dataclasses.field(default_factory=dict)  # graph -> median µs a call
    rounds: dict = dataclasses.field(default_factory=dict)  # graph -> µs a call, each round
    configs: dict = dataclasses.field(default_factory=dict)  # variant -> config dict / read plans


def variants(m: int, names: tuple) -> dict:
    """name -> (decode, config): the pick (None, None: the chooser's) and the group's VARIANTS at this M."""
    out = {"pick": (None, None)}
    for name in names:
        if name.endswith("u2") and m != 1:
            continue
        if VARIANTS[name] is None:
            out[name] = (name, None)
            continue
        up, down, split = VARIANTS[name]
        out[name] = ("mma", WordConfig(16, GemmTile(up[0], up[1], 1, *up[2:]), GemmTile(down[0], down[1], 1, *down[2:]),
                                       up_split=split))
    return out


READ_CONFIG = WordConfig(16, GemmTile(32, 256, 1, 1, 3), GemmTile(32, 256, 1, 1, 3))  # the reads' splits: its plan's


def read_plans(s: Shape, plan, words: int) -> tuple[GeomPlan, GeomPlan]:
    """(gate-up, down) pure reads of 32 rows x ``words`` a step in 1 warp, at ``plan``'s splits (a WoPlan)."""
    up_split, down_split = plan.gate_up.grid[1] if len(plan.gate_up.grid) > 1 else 1, plan.down.grid[1]
    return (GeomPlan(s.n, s.n, 32, words, 1, up_split, 1, 0), GeomPlan(s.k, 0, 32, words, 1, down_split, 1, 0))


def add_reads(cell: Cell, graphs: dict, w13, w2, inputs, plan, s: Shape, dev, reads: dict) -> None:
    """The pure reads' graphs (``reads``: name -> words a step; the experts each set touches, once each), checked
    on the first set."""
    words13, words2 = w13.q.view(torch.int32), w2.q.view(torch.int32)
    ids = [torch.unique(c.topk_ids.reshape(-1).to(torch.int32)) for c in inputs]
    for name, words in reads.items():
        plans = read_plans(s, plan, words)
        cell.configs[name] = [dataclasses.asdict(p) for p in plans]
        try:
            bufs = [[p.parts(ids[i].numel(), dev) for p in plans] for i in range(len(inputs))]

            def run(i, plans=plans, bufs=bufs):
                launch_geom(words13, ids[i], plans[0], bufs[i][0], dev.type == "cuda")
                launch_geom(words2, ids[i], plans[1], bufs[i][1], dev.type == "cuda")

            KEPT.append((ids, bufs))
            run(0)
            got, want = 0, expected(words13, words2, ids[0].tolist(), plans)
            for part in bufs[0]:
                got ^= int(np.bitwise_xor.reduce(part.cpu().numpy()))
            check(f"{s.name} {cell.scheme} M={cell.m} {name}", got == want, f"xor {got:#x} want {want:#x}")
            graphs[name] = graph_of([lambda i=i: run(i) for i in range(len(inputs))], dev)
        except Exception as e:  # noqa: BLE001  (one read's failure never loses the cell)
            traceback.print_exc(limit=3)
            check(f"{s.name} {cell.scheme} M={cell.m} {name}", False, f"raised {type(e).__name__}: {e}")


def add_calls(cell: Cell, graphs: dict, a13, a2, w13, w2, inputs, found: dict, s: Shape, dev) -> None:
    """The whole-call graphs of each variant, each checked against the torch twin on the first set."""
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    for name, (decode, cfg) in found.items():
        cell.configs[name] = {"decode": decode or cell.pick, "config": None if cfg is None else cfg.to_dict()}

        def call(c, cfg=cfg, decode=decode):
            return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, cell.scheme, config=cfg,
                                  decode=decode)

        try:
            err = rel_err(call(c0), want)
            check(f"{s.name} {cell.scheme} M={cell.m} {name}", err < TOL, f"rel_err={err:.2e} {cell.configs[name]}")
            if err < TOL:
                graphs[name] = graph_of([lambda c=c: call(c) for c in inputs], dev)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=3)
            check(f"{s.name} {cell.scheme} M={cell.m} {name}", False, f"raised {type(e).__name__}: {e}")


def precompile(s: Shape, scheme: str, ms: tuple, names: tuple, w13, w2, dev, variants_of=None, reads=None) -> None:
    """Every call's kernels of the group, and the reads', compiled at once in a thread pool (Triton's
    AsyncCompileMode); ``variants_of`` / ``reads``: the script's ``variants`` / READS (default this one's)."""
    from triton import AsyncCompileMode

    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for m in ms:
                c = make_sets(s, m, 1, torch.bfloat16, dev)[0]
                ids = torch.unique(c.topk_ids.reshape(-1).to(torch.int32))
                for name, (decode, cfg) in (variants_of or variants)(m, names).items():
                    plan = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", cfg,
                                       LaunchOptions(reuse_workspace=False), None, decode)
                    _warm(plan, c, a13, a2, dev)
                    if name == "pick":
                        for words in (reads or READS).values():
                            read = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu",
                                               READ_CONFIG, LaunchOptions(reuse_workspace=False), None, "mma")
                            for q, p in zip((w13.q, w2.q), read_plans(s, read, words)):
                                launch_geom(q.view(torch.int32), ids, p, p.parts(ids.numel(), dev), True, warmup=True)
    except Exception as e:  # noqa: BLE001  (the kernels compile, and report, on first use)
        print(f"precompile: {type(e).__name__}: {e}", flush=True)
    print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)


def run_cell(s: Shape, scheme: str, m: int, names: tuple, w13, w2, bw: float, dev, until: float, variants_of=None,
             reads=None) -> Cell:
    """One M of a group: the reads, the pick and the variants (``variants_of`` / ``reads``: as ``precompile``'s)
    checked and timed."""
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    nbytes = touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2
    cell = Cell(s.name, scheme, m, nbytes / (bw * 1e12) * 1e6, nbytes, bw,
                choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k))
    found, c0 = (variants_of or variants)(m, names), inputs[0]
    plan = wo_plan_for(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, scheme, "silu", READ_CONFIG,
                       LaunchOptions(), None, "mma")
    graphs: dict = {}
    add_reads(cell, graphs, w13, w2, inputs, plan, s, dev, reads or READS)
    add_calls(cell, graphs, a13, a2, w13, w2, inputs, found, s, dev)
    cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS, until)
    cell.times = {name: statistics.median(v) for name, v in cell.rounds.items()}
    print(f"  {s.name} {scheme} M={m} floor {cell.floor_us:.1f} (copy {bw:.2f} TB/s), pick {cell.pick}: "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def wins(cell: Cell, name: str) -> int:
    return sum(v <= WIN * p for v, p in zip(cell.rounds.get(name, ()), cell.rounds.get("pick", ())))


def table(cells: list[Cell]) -> str:
    lines = ["graph µs a call (% of the packed floor, TB/s of its bytes; calls: x the pick, wins/rounds >= 3%)"]
    for c in cells:
        lines.append(f"{c.preset} {c.scheme} M={c.m}: floor {c.floor_us:.1f} µs ({c.bytes / 1e6:.1f} MB at copy "
                     f"{c.copy_tbps:.2f} TB/s), pick {c.pick}")
        for k, v in c.times.items():
            extra = ""
            if not (k.startswith("rd") or k == "pick") and "pick" in c.times:
                extra = f", x{v / c.times['pick']:.3f}, wins {wins(c, k)}/{len(c.rounds[k])}"
            lines.append(f"    {k:<7} {v:8.1f}  ({100 * c.floor_us / v:5.1f}%, {c.bytes / (v * 1e-6) / 1e12:.2f}"
                         f"{extra})")
    return "\n".join(lines)


def dump(path: str, cells: list[Cell]) -> None:
    import triton

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                   "cells": [dataclasses.asdict(c) for c in cells], "failed": FAILED}, f, indent=1)


def child(args, groups: tuple, tag: str = "dec8", smoke: Shape = Shape("tiny", 8, 128, 256, 2), variants_of=None,
          reads=None) -> int:
    """Group ``args.group`` of ``groups`` in this process: its weights once, its Ms in turn (no M begins past
    --until), the cells so far in <args.cells>/<tag>-<group>.json after each; ``smoke`` the --smoke shape,
    ``variants_of`` / ``reads``: the script's ``variants`` / READS (default this one's)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset, scheme, ms, names = groups[args.group]
    s = smoke if args.smoke else Shape.from_preset(preset)
    ms = ms[:1] if args.smoke else ms
    bw = copy_tbps(dev)
    w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
    w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
    if dev.type == "cuda":
        precompile(s, scheme, ms, names, w13, w2, dev, variants_of, reads)
    cells = []
    for m in ms:
        if cells and time.time() > args.until - 6:
            print(f"deadline: {s.name} {scheme} M={m} skipped", flush=True)
            break
        cells.append(run_cell(s, scheme, m, names, w13, w2, bw, dev, args.until, variants_of, reads))
        dump(os.path.join(args.cells, f"{tag}-{args.group}.json"), cells)
    return 1 if FAILED else 0


def finish(path: str, cells: list[dict]) -> int:
    """The parent's end: the cells' JSON at ``path``, the table; 1 if any check failed."""
    cells = [Cell(**c) for c in cells]
    dump(path, cells)
    print(table(cells), flush=True)
    return 1 if FAILED else 0


def main(argv=None) -> int:
    args = group_args("dec8", argv)
    if args.group is not None:
        return child(args, GROUPS)
    return finish(os.path.join(args.out, "dec8.json"), run_groups(__file__, "dec8", GROUPS, args, START, FAILED))


if __name__ == "__main__":
    sys.exit(main())

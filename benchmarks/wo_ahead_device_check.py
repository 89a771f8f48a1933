"""GPU check of the word decode with more words in flight a program (issue #16, brief item 1): the gemv kernels'
AHEAD (a tile's num_stages: each program loads step s + AHEAD's words before it decodes step s, in registers)
against the chooser's pick at the 4-bit decode cells, with the gate-up launch timed alone too.

    PYTHONPATH=$PWD timeout 280 python3 benchmarks/wo_ahead_device_check.py --out $OUT/wo4     # H200, <= 200 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/wo_ahead_device_check.py --smoke [--isolate]  # CPU, tiny

Cells (in this order; the time limit cuts the last): Qwen3-30B-A3B, DeepSeek-V3, Mixtral-8x7B x int4_w4a16 (g 128),
mxfp4, int8_w8a16 x M = 1, 8; on the GPU each preset in a child process of its own (run 1 lost the whole run to one
illegal address during graph replay, in the first cell with an alignment: the gate-up-alone graphs now run only on
the shortcut's calls, where the gate-up is the first launch). Variants: "pick" (the chooser's decode and config:
what a call runs now; since run 2 its winners are ``triton_wo_word_winners`` rows, so a rerun times them as the
pick), "g" (the gemv with its winners row or heuristic, where the pick is another decode), then on the gemv config
(its splits and fold kept):
"x" (x and h read as one [words, 8] tile a step instead of 8 strided 2-byte loads: ``WordConfig.x_tile``; sm_90
SASS, Triton 3.9, int4 gate-up split 4: loop 1170 -> 876 instructions at 64 x 16 words, 843 -> 513 at 32 x 16),
"xa2" (and both GEMMs' words 2 steps ahead: 64 x 16 words without the x tile spill there, with it 245 registers),
"r32x" / "r32xa2" (32-row 16-word 2-warp tiles: twice the programs, 128 / 168 registers), "w4x" (64 x 16 words
in 4 warps with the x tile: 128 registers, 3.90 instructions a weight against 3.41 in 2 warps at 254); at M = 1
"r32x2s" ("r32x" with twice the gemv config's gate-up splits, at least 2: twice the programs again).
Run 1 (ae506b6, Qwen3 int4 M=1 only): pick 20.0 µs (gate-up 10.1), x 20.7, xa2 / r32x / r32xa2 19.2.
Each variant against the torch twin (rel-L2 < TOL, PASS/FAIL); then CUDA-graph replay of the whole call and of
the gate-up launch alone ("<name>:up", calls without an alignment) over rotated input sets, every
graph replayed in turn in ROUNDS interleaved rounds (median), % of the packed-byte floor. Look for: every line
PASS; a variant's whole-call µs under the pick's in all 5 rounds by >= 3% (the ``wins`` column: rounds won).
JSON to <out>/wo_ahead.json; the table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.configs import device_key  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args, wo_launches  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.experts.triton_wo_gemv import PER, WordConfig  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode, wo_plan_for  # noqa: E402
from moekit.experts.triton_wo_word_winners import word_config  # noqa: E402
import bench_rounds  # noqa: E402
from wo_device_check import bf16_times, copy_tbps, packed_bytes, precompile, quantized, rel_err  # noqa: E402
from bench_run import RunLog  # noqa: E402

PRESET_ORDER = ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
SCHEMES = ("int4_w4a16", "mxfp4", "int8_w8a16")
BATCHES = (1, 8)
SETS, ROUNDS, REPLAYS = 4, 5, 6  # rotated input sets per graph; interleaved rounds; replays a round
TOL = 1e-2
WIN = 0.97  # a round won: variant <= 0.97 x pick
LIMIT_S = 200.0
RESERVE_S = 45.0  # seconds kept for each preset still to run (``isolated``)
START = time.perf_counter()
# name -> (rows, words a step, warps, AHEAD, x_tile); rows None: the gemv config's own tiles
TILES = {"x": (None, None, None, 1, True), "xa2": (None, None, None, 2, True), "r32x": (32, 16, 2, 1, True),
         "r32xa2": (32, 16, 2, 2, True), "w4x": (64, 16, 4, 1, True)}
RUN = RunLog()  # its ``check``: the PASS / FAIL lines, the failed names in FAILED
FAILED, check = RUN.failed, RUN.check
SKIPPED: list[str] = []


@dataclasses.dataclass
class Cell:
    preset: str
    scheme: str
    m: int
    bf16_us: float
    floor_us: float
    times: dict = dataclasses.field(default_factory=dict)  # graph name -> median µs a call
    rounds: dict = dataclasses.field(default_factory=dict)  # graph name -> µs a call, each round
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> rel-L2 against the twin
    configs: dict = dataclasses.field(default_factory=dict)  # variant -> (decode, config dict)


def left_s() -> float:
    return LIMIT_S - (time.perf_counter() - START)


def with_tiles(cfg, rows, words, warps, ahead, x_tile, scheme):
    """``cfg`` (a gemv config) as a WordConfig with both GEMMs' tiles replaced where ``rows`` is given,
    num_stages = ``ahead``, and ``x_tile``."""
    def tile(t):
        if rows is None:
            return dataclasses.replace(t, num_stages=ahead)
        return dataclasses.replace(t, BLOCK_N=rows, BLOCK_K=words * PER[scheme], num_warps=warps, num_stages=ahead)

    if not isinstance(cfg, WordConfig):
        cfg = WordConfig(cfg.BLOCK_M, cfg.up, cfg.down)
    return dataclasses.replace(cfg, up=tile(cfg.up), down=tile(cfg.down), x_tile=x_tile)


def variants(s: Shape, scheme: str, m: int, smoke: bool) -> dict:
    """name -> (decode, config): the pick, the gemv's own config where the pick is another decode, TILES'."""
    decode = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
    out = {"pick": (decode, wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(DEV), decode))}
    gemv = out["pick"][1] if decode == "gemv" else word_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, "gemv")
    if decode != "gemv":
        out["g"] = ("gemv", gemv)
    tiles = {"xa2": (None, None, None, 2, True), "r32xa2": (16, 4, 1, 2, True)} if smoke else TILES
    for name, (rows, words, warps, ahead, x_tile) in tiles.items():
        if x_tile and scheme == "int8_w8a16":  # the x tile reads 8-value words (run 2 timed an int8 form: removed)
            continue
        out[name] = ("gemv", with_tiles(gemv, rows, words, warps, ahead, x_tile, scheme))
    if m == 1 and scheme != "int8_w8a16":  # the 32-row x tile, twice the gate-up splits (at least 2), no fold change
        split = 2 * getattr(gemv, "up_split", 1)
        out["r32x2s"] = ("gemv", dataclasses.replace(out["r32x" if not smoke else "r32xa2"][1], up_split=split))
    return out


def graph_of(fns, tag: str):
    """The calls captured in one CUDA graph (warmed on a side stream first) and replayed once, ``tag`` printed
    first (a fault in a replay then names its graph), or None off the GPU."""
    if DEV.type != "cuda":
        return None
    print(f"    graph {tag}", flush=True)
    return bench_rounds.graph_of(fns, DEV)


def up_prefix(plan, c, a13, a2):
    """A function that runs ``plan``'s launches up to and including the gate-up (own workspace), for one input set."""
    b, out = plan.workspace.allocate(c.x.device), torch.empty_like(c.x)
    launches = wo_launches(plan, b, c.x, a13, a2, c.topk_ids, c.topk_weights, None, out)
    names = [launch.kernel.fn.__name__ for launch, _ in launches]
    first = [i for i, n in enumerate(names) if n.startswith("gate_up")][0]
    chosen = launches[:first + 1]

    def run():
        for launch, pointers in chosen:
            launch(*pointers)

    return run


def run_cell(s: Shape, scheme: str, m: int, w13, w2, inputs, bf16_us: float, bw: float, smoke: bool) -> Cell:
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    floor_us = (touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2) / (bw * 1e12) * 1e6
    cell = Cell(s.name, scheme, m, bf16_us, floor_us)
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    options = LaunchOptions(reuse_workspace=False)  # the custom op's
    graphs = {}
    for name, (decode, cfg) in variants(s, scheme, m, smoke).items():
        tag = f"{s.name} {scheme} M={m} {name}"
        cell.configs[name] = (decode, cfg.to_dict())

        def call(c, decode=decode, cfg=cfg):
            return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=cfg, decode=decode)

        try:
            cell.errors[name] = err = rel_err(call(c0), want)
            check(tag, err < TOL, f"rel_err={err:.2e} ({decode})")
            if err < TOL:
                graphs[name] = graph_of([lambda c=c: call(c) for c in inputs], tag)
                plan = wo_plan_for(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, scheme, "silu", cfg, options,
                                   None, decode)
                if plan.align is None:  # the shortcut's calls: the gate-up is the first launch
                    ups = [up_prefix(plan, c, a13, a2) for c in inputs]
                    ups[0]()  # runs here too under the interpreter (graph_of does nothing off the GPU)
                    graphs[name + ":up"] = graph_of(ups, tag + ":up")
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the run)
            traceback.print_exc(limit=3)
            check(tag, False, f"raised {type(e).__name__}: {e}")
    cell.rounds = bench_rounds.interleaved(graphs, len(inputs), DEV, ROUNDS, REPLAYS)
    cell.times = {name: statistics.median(v) for name, v in cell.rounds.items()}
    print(f"  {s.name} {scheme} M={m}: " + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def shape_cells(s: Shape, bw: float, smoke: bool) -> list[Cell]:
    batches = (1,) if smoke else BATCHES
    sets = {m: make_sets(s, m, SETS, torch.bfloat16, DEV, seed=m) for m in batches}
    bf16 = bf16_times(s, sets, DEV)
    cells = []
    for scheme in (("int4_w4a16", "int8_w8a16") if smoke else SCHEMES):
        if left_s() < 0:
            SKIPPED.append(f"{s.name} {scheme}")
            continue
        w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, DEV, seed=1)
        w2 = quantized(scheme, s.num_experts, s.k, s.n, DEV, seed=2)
        cells += [run_cell(s, scheme, m, w13, w2, sets[m], bf16[m], bw, smoke) for m in batches]
        del w13, w2
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    return cells


def wins(cell: Cell, name: str) -> int:
    """Rounds in which ``name``'s whole call took <= WIN x the pick's."""
    return sum(v <= WIN * p for v, p in zip(cell.rounds.get(name, ()), cell.rounds.get("pick", ())))


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<14} {'scheme':<10} {'M':>3} {'bf16':>6} {'floor':>6} {'pick':>6} {'pick:up':>7} "
             f"{'best':>6} {'variant':<7} {'b:up':>6} {'wins':>4} {'%fl':>4} {'x bf16':>6}"]
    for c in cells:
        whole = {k: v for k, v in c.times.items() if ":" not in k}
        if not whole:
            continue
        best = min(whole, key=whole.get)
        lines.append(f"{c.preset:<14} {c.scheme:<10} {c.m:>3} {c.bf16_us:6.1f} {c.floor_us:6.1f} "
                     f"{whole.get('pick', float('nan')):6.1f} {c.times.get('pick:up', float('nan')):7.1f} "
                     f"{whole[best]:6.1f} {best:<7} {c.times.get(best + ':up', float('nan')):6.1f} {wins(c, best):>4} "
                     f"{100 * c.floor_us / whole[best]:3.0f}% {whole[best] / c.bf16_us:6.2f}")
    return "\n".join(lines)


def run_presets(names: list[str], args, bw: float) -> list[Cell]:
    """This process's cells: ``names``' shapes in order (the smoke: the tiny one), JSON rewritten after each shape."""
    shapes = [Shape("tiny", 8, 64, 128, 2) if n == "tiny" else Shape.from_preset(n) for n in names]
    if DEV.type == "cuda":
        t0 = time.perf_counter()
        jobs = [(s, scheme, m, decode, cfg, None) for s in shapes for scheme in SCHEMES for m in BATCHES
                for decode, cfg in variants(s, scheme, m, args.smoke).values()]
        precompile(jobs, DEV)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    cells = []
    for s in shapes:
        if left_s() < 0:
            SKIPPED.append(s.name)
            continue
        cells += shape_cells(s, bw, args.smoke)
        print(f"-- {s.name} done at {time.perf_counter() - START:.1f} s", flush=True)
        dump(args.out, f"wo_ahead-{'-'.join(names)}.json", cells, bw)
    return cells


def dump(out: str | None, name: str, cells: list[Cell], bw: float) -> None:
    if out:
        import triton

        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            device = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu"
            json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__, "copy_TBps": bw,
                       "cells": [dataclasses.asdict(c) for c in cells], "failed": FAILED, "skipped": SKIPPED}, f,
                      indent=1)


def isolated(names: list[str], args) -> list[Cell]:
    """Each preset in a child process of its own (a fault in one, e.g. an illegal address, loses only its
    cells: run 1 lost the whole run to one), each given the time left minus RESERVE_S per preset after it;
    their JSON read back."""
    import subprocess

    cells = []
    for i, name in enumerate(names):
        limit = LIMIT_S - (time.perf_counter() - START) - RESERVE_S * (len(names) - 1 - i)
        if limit < 15:
            SKIPPED.append(name)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--preset", name, "--limit", f"{limit:.0f}",
               "--out", args.out]
        try:
            rc = subprocess.run(cmd + (["--smoke"] if args.smoke else []), timeout=limit + 60).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        path = os.path.join(args.out, f"wo_ahead-{name}.json")
        got = json.load(open(path)) if os.path.exists(path) else {"cells": [], "failed": [], "skipped": []}
        cells += [Cell(**c) for c in got["cells"]]
        FAILED.extend(got["failed"] + ([f"{name} child exit {rc}"] if rc not in (0, 1) else []))
        SKIPPED.extend(got["skipped"])
    return cells


def main(argv=None) -> int:
    global DEV, LIMIT_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/wo_ahead")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--limit", type=float, default=LIMIT_S, help="wall-clock seconds before cells are skipped")
    parser.add_argument("--preset", help="this process runs one preset's cells (the parent starts one per preset)")
    parser.add_argument("--isolate", action="store_true", help="a child process per preset (the GPU default)")
    args = parser.parse_args(argv)
    LIMIT_S = 1e9 if args.smoke else args.limit
    DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    names = ["tiny"] if args.smoke else list(PRESET_ORDER)
    if args.preset is None and (args.isolate or DEV.type == "cuda"):
        print(torch.__version__, "triton", triton.__version__, flush=True)
        cells = isolated(names, args)
        dump(args.out, "wo_ahead.json", cells, float("nan"))
    else:
        print(torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name() if DEV.type == "cuda"
              else "cpu", flush=True)
        bw = copy_tbps(DEV)
        print(f"copy bandwidth {bw:.2f} TB/s (read + write)", flush=True)
        cells = run_presets([args.preset] if args.preset else names, args, bw)
    print(f"total {time.perf_counter() - START:.1f} s; FAILED:", FAILED or "none", "; SKIPPED:", SKIPPED or "none")
    print(table(cells), flush=True)
    return 1 if FAILED else 0


DEV = torch.device("cpu")

if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the word MMA decode's gate-up with its gate rows and up rows in separate programs (issue #16 target 1,
session 29, brief dec9: ``WordConfig.halves``, ``gemm_wo_mma.gate_up_halves_wo_mma_kernel``): one accumulator and one
word tile a program, so 256-column (128-byte) int4 steps at 3 stages fit in registers (offline sm_90, Triton 3.6:
184 registers, no spill, 9 programs an SM, against the two-sided kernel's 255 and 104 B spilled), the float32
pre-activation halves activated by the split_glu launch.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/dec9_device_check.py --out $OUT/dec9 --deadline 70   # H200
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/dec9_device_check.py --smoke [--groups 2]    # CPU

Groups (one child process each, weights made once for its Ms; the deadline skips the last), per M: the whole call
(``run_experts_wo``) against the torch twin (rel-L2 < TOL): "pick" (today's chooser and config) and the group's
VARIANTS (the mma decode, 32-row 1-warp tiles): "hBsS" the halves at BLOCK_K B and S stages in both GEMMs with the
split_glu launch, "...u2" the gate-up split in 2 along K too, "...d4" the down GEMM split in 4, "h128w2" 64 rows
in 2 warps, "hg256" / "hd256" 256 columns in the gate-up / the down GEMM only, "kB..." the two-sided gate-up (the
kernel before), "tile64" the tile decode in the 64-row tiles of Mixtral's old M=64 row; beside "rd128B", a pure
read of the touched experts'
words in 32-row 1-warp steps of 128 bytes a row (``dec8_device_check.add_reads``: the geometry's cap). Timing, the
floor (touched packed bytes, scales, zeros, x and out over the copy rate measured in the same process), the table and
the JSON (<out>/dec9.json) as ``dec8_device_check``'s; "wins": rounds a variant took <= 0.97 x the pick.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.configs import GemmTile  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import weight_args  # noqa: E402
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode, wo_plan_for  # noqa: E402
from moekit.experts.triton_wo_winners import tile  # noqa: E402
from bench_rounds import interleaved  # noqa: E402
from dec7_kernels import launch_geom  # noqa: E402
from dec8_device_check import FAILED, READ_CONFIG, Cell, add_calls, add_reads, dump, read_plans, table  # noqa: E402
from wo_device_check import _warm, copy_tbps, packed_bytes, quantized  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Variant:
    """A mma-decode config: both GEMMs' tiles (rows, BLOCK_K, warps, stages), the gate-up's K splits, its halves
    apart, the down GEMM's splits (0: the plan's), and the Ms it runs at (empty: all)."""

    up: tuple
    down: tuple
    up_split: int = 1
    halves: bool = True
    down_split: int = 0
    ms: tuple = ()

    def config(self) -> WordConfig:
        up, down = (GemmTile(t[0], t[1], 1, *t[2:]) for t in (self.up, self.down))
        return WordConfig(16, up, down, up_split=self.up_split, down_split=self.down_split, halves=self.halves)


K256, K128 = (32, 256, 1, 3), (32, 128, 1, 3)
VARIANTS = {"h256s3": Variant(K256, K256), "h128s3": Variant(K128, K128),
            "h256s3u2": Variant(K256, K256, 2, ms=(1,)), "h256s3d4": Variant(K256, K256, down_split=4, ms=(1,)),
            "k256s3u2": Variant(K256, K256, 2, halves=False, ms=(1,)), "k128": Variant(K128, K128, halves=False),
            "h128s4": Variant((32, 128, 1, 4), K128), "h128w2": Variant((64, 128, 2, 3), K128),
            "hg256": Variant(K256, K128), "hd256": Variant(K128, K256)}
TILE64 = tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4))  # "tile64": Mixtral int4's M=64 winners row before session 29
# (preset, scheme, Ms, variants). CK1 (99118a9) ran Mixtral int4 M=8 / 1 (h256s3, h128s3, h256s3u2, h256s3d4),
# DeepSeek-V3 int4 M=64 / 8 / 1 (h256s3, h128s3, h256s3u2), Mixtral int8 M=1 (k256s3u2, h256s3, h256s3d4, and the
# since removed fold h256s3f: 2.9x) and Mixtral int4 M=64 (h256s3): h128s3 won DeepSeek-V3 M=64. CK1b (fdff4b0): that
# pick against the two-sided "k128" at M = 32 / 64 / 128, "h128s4", "h128w2"; Mixtral M=64 / 16 (k128, h128s3), Qwen3
# M=64 (h128s3), Mixtral M=8 (h128s4, h128w2, hg256, hd256): taken DeepSeek-V3 M=32..128 h128s3, Mixtral M=4..16
# h128w2 (``triton_wo_configs.MMA_HALVES``), Mixtral M=32..127 the mma decode (``triton_wo_winners``). CK2 (merged
# main): the taken picks against what they replaced, and Mixtral M=96 / 16 (covered, not measured before)
GROUPS = (("deepseek-v3", "int4_w4a16", (64,), ("k128",)),
          ("mixtral-8x7b", "int4_w4a16", (8, 16), ("k128", "h128s3")),
          ("mixtral-8x7b", "int4_w4a16", (64, 96), ("tile64",)))
READS = {"rd128B": 32}  # name -> words a step (32 rows, 1 warp): the 128-byte geometry's cap
SETS, ROUNDS, REPLAYS = 3, 5, 5
START = time.perf_counter()


def variants(m: int, names: tuple) -> dict:
    """name -> (decode, config): the pick (None, None: the chooser's) and the group's VARIANTS that run at this M."""
    out = {"pick": (None, None)}
    out.update({name: ("tile", TILE64) if name == "tile64" else ("mma", VARIANTS[name].config()) for name in names
                if name == "tile64" or not VARIANTS[name].ms or m in VARIANTS[name].ms})
    return out


def precompile(s: Shape, scheme: str, ms: tuple, names: tuple, w13, w2, dev) -> None:
    """Every call's kernels of the group (and the reads') compiled at once in a thread pool (AsyncCompileMode)."""
    from triton import AsyncCompileMode

    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(os.cpu_count() or 1) as pool, AsyncCompileMode(pool, ignore_errors=True):
            for m in ms:
                c = make_sets(s, m, 1, torch.bfloat16, dev)[0]
                for decode, cfg in variants(m, names).values():
                    plan = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", cfg,
                                       LaunchOptions(reuse_workspace=False), None, decode)
                    _warm(plan, c, a13, a2, dev)
            ids = torch.unique(c.topk_ids.reshape(-1).to(torch.int32))
            read = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", READ_CONFIG,
                               LaunchOptions(reuse_workspace=False), None, "mma")
            for words in READS.values():
                for q, p in zip((w13.q, w2.q), read_plans(s, read, words)):
                    launch_geom(q.view(torch.int32), ids, p, p.parts(ids.numel(), dev), True, warmup=True)
    except Exception as e:  # noqa: BLE001  (the kernels compile, and report, on first use)
        print(f"precompile: {type(e).__name__}: {e}", flush=True)
    print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)


def run_cell(s: Shape, scheme: str, m: int, names: tuple, w13, w2, bw: float, dev, until: float) -> Cell:
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    nbytes = touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2
    cell = Cell(s.name, scheme, m, nbytes / (bw * 1e12) * 1e6, nbytes, bw,
                choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k))
    c0 = inputs[0]
    plan = wo_plan_for(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, scheme, "silu", READ_CONFIG,
                       LaunchOptions(), None, "mma")
    graphs: dict = {}
    add_reads(cell, graphs, w13, w2, inputs, plan, s, dev, READS)
    add_calls(cell, graphs, a13, a2, w13, w2, inputs, variants(m, names), s, dev)
    cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS, until)
    cell.times = {name: statistics.median(v) for name, v in cell.rounds.items()}
    print(f"  {s.name} {scheme} M={m} floor {cell.floor_us:.1f} (copy {bw:.2f} TB/s), pick {cell.pick}: "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def child(index: int, args) -> int:
    """One group in this process: its weights once, its Ms in turn (no M begins past --until)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset, scheme, ms, names = GROUPS[index]
    s = Shape("tiny", 8, 128, 512, 2) if args.smoke else Shape.from_preset(preset)  # K 512: two 256-column steps
    ms = ms[:1] if args.smoke else ms
    bw = copy_tbps(dev)
    w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
    w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
    if dev.type == "cuda":
        precompile(s, scheme, ms, names, w13, w2, dev)
    cells = []
    for m in ms:
        if cells and time.time() > args.until - 6:
            print(f"deadline: {s.name} {scheme} M={m} skipped", flush=True)
            break
        cells.append(run_cell(s, scheme, m, names, w13, w2, bw, dev, args.until))
        dump(os.path.join(args.cells, f"dec9-{index}.json"), cells)
    return 1 if FAILED else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/dec9")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--deadline", type=float, default=70.0, help="wall-clock seconds; groups past it are skipped")
    p.add_argument("--group", type=int, help="run one group in this process (the parent starts one per group)")
    p.add_argument("--groups", type=int, nargs="+", help="the GROUPS to run, in this order (default: all; --smoke: 0)")
    p.add_argument("--cells", help="(a group) where its JSON goes")
    p.add_argument("--until", type=float, default=float("inf"), help="(a group) no timing round begins past this")
    args = p.parse_args(argv)
    if args.group is not None:
        return child(args.group, args)
    import triton

    print(torch.__version__, "triton", triton.__version__, flush=True)
    cells, skipped, tmp = [], [], tempfile.mkdtemp(prefix="dec9-")
    order = args.groups or ([0] if args.smoke else range(len(GROUPS)))
    for i, (preset, scheme, ms, _) in ((i, GROUPS[i]) for i in order):
        left = args.deadline - (time.perf_counter() - START)
        if left < 12:
            skipped.append(f"{preset} {scheme} M={ms}")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--group", str(i), "--cells", tmp,
               "--until", str(time.time() + left - 4)] + ["--smoke"] * args.smoke
        try:
            rc = subprocess.run(cmd, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        path = os.path.join(tmp, f"dec9-{i}.json")
        got = json.load(open(path)) if os.path.exists(path) else {"cells": [], "failed": []}
        cells += [Cell(**c) for c in got["cells"]]
        broken = rc not in (0, 1) or (rc == 1 and not got["failed"])  # 1 with no failed line: it raised
        FAILED.extend(got["failed"] + ([f"{preset} {scheme}: child exit {rc}"] if broken else []))
        print(f"-- group {i} done at {time.perf_counter() - START:.1f} s (exit {rc})", flush=True)
    dump(os.path.join(args.out, "dec9.json"), cells)
    print(f"total {time.perf_counter() - START:.1f} s; FAILED:", FAILED or "none", "; SKIPPED:", skipped or "none")
    print(table(cells), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

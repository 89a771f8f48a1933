"""GPU check of the weight-only decode at M <= 64 against the packed floor, the cells closest to 80% first (issue #16
target 1, session 32, brief wo32): per cell, where the route's call spends its time kernel by kernel (graph prefixes)
and the knobs that exist (decode, BN, BLOCK_K, stages, warps, splits, halves) against it.

    PYTHONPATH=$PWD timeout 85 python3 benchmarks/wo32_device_check.py --out $OUT/wo32 --deadline 70   # H200
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/wo32_device_check.py --smoke [--groups 1]    # CPU

Groups (one child process each, weights made once; the deadline skips the last), per M:
- "pick": the route's call (``run_experts_wo``, chooser and config) and the group's VARIANTS (decode, config), each
  checked against the torch twin ``fused_experts_wo_torch`` (rel-L2 < TOL) on the first input set.
- "pick:i": the first i launches of the pick's plan (``wo_launches``: alignment, gate-up, glu, down, k-sum), as one
  graph each; a prefix's µs minus the one before is what that kernel adds (the whole sequence is checked too).
- "rd128B" / "rd128B+": pure reads of the touched experts' words in 32-row 1-warp steps of 128 bytes a row
  (``dec8_device_check.add_reads``) at the pick's splits / at the splits of the variant named in READ_SPLITS: the
  geometry's cap.
- eager (groups running a name of EAGER, the configs the route replaced): host / wall µs a call of the pick and that
  config through ``run_experts_wo`` and of the route's own ``fused_experts_wo`` (``bench_rounds.eager_us``).
Groups 0-3 ran as CK1 (6f48529), 4-6 as CK2 (e28dabb, group 6 not reached): what they took is in
``triton_wo_configs.MMA_CONFIGS`` and ``triton_wo_winners`` (Mixtral int8 M = 64); the tables in triton-notes.md.
Timing: CUDA-graph replay over SETS rotated input sets, ``bench_rounds.settled`` (each graph after one replay of
itself, shuffled order), ROUNDS rounds, median; the floor: the touched experts' packed bytes, scales, zeros, x and out
over the copy rate measured in the same process; "wins": rounds a variant took <= 0.97 x the pick. JSON
<out>/wo32.json, the table printed last.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from moekit.bench.cells import Shape, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts.configs import GemmTile, KernelConfig  # noqa: E402
from moekit.experts.triton_launch import LaunchOptions  # noqa: E402
from moekit.experts.triton_wo import (  # noqa: E402
    fused_experts_wo, fused_experts_wo_torch, run_experts_wo, weight_args, wo_launches,
)
from moekit.experts.triton_wo_gemv import WordConfig  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode, wo_plan_for  # noqa: E402
from bench_rounds import eager_us, graph_of, settled, shuffled  # noqa: E402
from bench_run import group_args, run_groups  # noqa: E402
from dec8_device_check import FAILED, READ_CONFIG, Cell, add_calls, add_reads, check, dump, precompile  # noqa: E402
from dec8_device_check import table as call_table  # noqa: E402
from wo_device_check import copy_tbps, packed_bytes, quantized, rel_err  # noqa: E402


def mma(up: tuple, down: tuple, up_split: int = 1, down_split: int = 0, halves: bool = False,
        group_m: int = 1, block_m: int = 16) -> tuple:
    """("mma", config): tiles (rows, BLOCK_K, warps, stages), the gate-up's K splits, the down GEMM's (0: the plan's),
    the gate-up's gate and up rows in separate programs, GROUP_M (the M-blocks that sweep the N tiles together), the
    rows (tokens) of a block."""
    t_up, t_down = (GemmTile(t[0], t[1], group_m, *t[2:]) for t in (up, down))
    return "mma", WordConfig(block_m, t_up, t_down, up_split=up_split, down_split=down_split, halves=halves)


def tile(block_m: int, up: tuple, down: tuple, group_m: int = 1) -> tuple:
    """("tile", config): the tile decode, tiles (BLOCK_N, BLOCK_K, warps, stages), GROUP_M."""
    t_up, t_down = (GemmTile(t[0], t[1], group_m, *t[2:]) for t in (up, down))
    return "tile", KernelConfig(block_m, t_up, t_down)


K256, K128, N16, W2K128 = (32, 256, 1, 3), (32, 128, 1, 3), (16, 256, 1, 3), (64, 128, 2, 3)
# M = 1: the int8 gate-up's 32 x 256 tile holds 4 programs an SM (48 KB of stages), 16 x 256 7 (offline sm_90, Triton
# 3.6: 2.81 instructions a weight against 2.54, 127 registers, 32 KB); the down GEMM's 32 x 256 tile 7 (110 registers)
T16 = ((64, 128, 4, 4), (128, 128, 4, 4))  # the tile decode's 16-row heuristic tiles (M = 8)
# At M = 64 on Mixtral (~16 rows an expert, 8 experts) 16-row blocks give ~1.45 blocks an expert: with GROUP_M 1 the
# second block of an expert runs num_pid_n programs after the first and reads its weights from HBM again; "g8":
# GROUP_M 8, eight consecutive M-blocks sweep each N tile together (a repeated expert's tile from L2); "m32": 32-row
# blocks, one an expert, each weight decoded once for 32 rows (offline sm_90, Triton 3.6, instructions a weight /
# registers / programs an SM, 32-row 1-warp tiles: int4 halves k128 3.80 / 196 / 10, down 3.85 / 214 / 9, two-sided
# k128 3.46 / 255 + 112 B spilled / 8; int8 k256 2.98 / 208 / 3, down 3.46 / 138 / 4; int8 k128 3.06 / 160 / 7, down
# 3.61 / 117 / 9; mxfp4 k256 3.67 / 250 / 4, down 4.23 / 168 / 5; mxfp4 halves k128 4.32 / 135 / 11, down 4.33 / 132
# / 11; against 16-row blocks x ~1.45 blocks an expert: int4 k128 2.70 and 3.15 a block)
VARIANTS = {
    # the down GEMM's reduction split at M = 1 (Mixtral: 2 experts x 128 one-warp programs unsplit)
    "d2": mma(K256, K256, down_split=2), "d4": mma(K256, K256, down_split=4), "d8": mma(K256, K256, down_split=8),
    "k128d4": mma(K128, K128, down_split=4), "u2d4": mma(K256, K256, 2, 4),
    "h256": mma(K256, K256, halves=True), "n16": mma(N16, K256), "n16d4": mma(N16, K256, down_split=4),
    # M = 64: the mma decode's and the tile decode's 16-row blocks, GROUP_M 1 or 8
    "k256": mma(K256, K256), "k256g8": mma(K256, K256, group_m=8), "k128g8": mma(K128, K128, group_m=8),
    "h128g8": mma(K128, K128, halves=True, group_m=8), "h128w2g8": mma(W2K128, K128, halves=True, group_m=8),
    "m32k128": mma(K128, K128, block_m=32), "m32k256": mma(K256, K256, block_m=32),
    "m32h128": mma(K128, K128, halves=True, block_m=32),
    "tile16": tile(16, *T16), "tile16g8": tile(16, *T16, group_m=8), "tile32s4": tile(32, *T16),
    # CK2: the routes CK1's picks replaced ("old1": Mixtral int8 M <= 2, "old64": Mixtral mxfp4 M = 64..127), and more
    # of each winner's neighbourhood
    "old1": ("mma", KernelConfig(16, GemmTile(*K256[:2], 1, 1, 3), GemmTile(*K256[:2], 1, 1, 3))),
    "old64": ("mma", KernelConfig(16, GemmTile(*K256[:2], 1, 1, 3), GemmTile(*K256[:2], 1, 1, 3))),
    "k128d2": mma(K128, K128, down_split=2), "k128d8": mma(K128, K128, down_split=8),
    "mixd4": mma(K128, K256, down_split=4), "tile16g2": tile(16, *T16, group_m=2),
    "m32h128d256": mma(K128, K256, halves=True, block_m=32), "dk128": mma(K256, K128),
}
ONLY_AT = {**{name: (1,) for name in ("d2", "d4", "d8", "k128d4", "u2d4", "h256", "n16", "n16d4", "k128d2", "k128d8",
                                      "mixd4", "dk128")},
           "old1": (1, 2), **{name: (64,) for name in ("tile16", "tile16g8", "tile16g2", "tile32s4", "m32h128d256")}}
EAGER = ("old1", "old64")  # where a group runs one of these: eager wall of the pick and it (run_experts_wo) and the
# route's own call (fused_experts_wo)
# (preset, scheme, Ms, variants), the cells nearest the line first; Mixtral int8 M = 1 and 64 share one process
GROUPS = (("mixtral-8x7b", "int8_w8a16", (1, 64), ("d2", "d4", "d8", "k128d4", "u2d4", "n16d4", "tile16",
                                                   "tile16g8", "tile32s4", "k256", "k256g8", "m32k128", "m32k256")),
          ("mixtral-8x7b", "int4_w4a16", (64,), ("k128g8", "h128g8", "h128w2g8", "m32h128", "m32k128")),
          ("mixtral-8x7b", "mxfp4", (64,), ("k256g8", "h128g8", "m32k256", "m32h128")),
          ("deepseek-v3", "int8_w8a16", (1,), ("d2", "n16", "h256")),
          # CK2 (after CK1 took Mixtral int8 M <= 2 and mxfp4 M = 64..127, ``MMA_CONFIGS``): the new route against the
          # one it replaced, M = 2 / 96 covered but not measured, the neighbours; int8 M = 64 again (tile16g8: 4/5)
          ("mixtral-8x7b", "int8_w8a16", (1, 2, 64), ("old1", "k128d2", "k128d8", "mixd4", "tile16g8", "tile16g2",
                                                      "tile32s4")),
          ("mixtral-8x7b", "mxfp4", (64, 96), ("old64", "m32h128d256")),
          ("deepseek-v3", "int8_w8a16", (1,), ("dk128",)))
READ_SPLITS = "d4"  # "rd128B+": the reads at this variant's splits, where the group runs it
SETS, ROUNDS, REPLAYS, TOL = 3, 5, 5, 1e-2
START = time.perf_counter()


def variants(m: int, names: tuple) -> dict:
    """name -> (decode, config): the pick (None, None: the chooser's) and the group's VARIANTS that run at M (ONLY_AT:
    those Ms only; the others at every M but 1)."""
    at = {name: ONLY_AT.get(name, range(2, 1 << 20)) for name in names}
    return {"pick": (None, None), **{name: VARIANTS[name] for name in names if m in at[name]}}


def pick_launches(cell: Cell, a13, a2, c, dev) -> tuple[list, torch.Tensor]:
    """The pick's launches (``wo_launches`` on a fresh workspace: the separate k-sum, as ``run_experts_wo``) and
    the output they write."""
    plan = wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, cell.scheme, "silu", None, LaunchOptions())
    out = torch.empty_like(c.x)
    b = plan.workspace.allocate(dev)
    return wo_launches(plan, b, c.x, a13, a2, c.topk_ids, c.topk_weights, None, out), out


def add_prefixes(cell: Cell, graphs: dict, a13, a2, w13, w2, inputs, s: Shape, dev) -> None:
    """The pick's launch prefixes, one graph each ("pick:i" the first i launches); the whole sequence checked against
    the twin on the first set."""
    try:
        runs = [pick_launches(cell, a13, a2, c, dev) for c in inputs]
        names = [launch.kernel.fn.__name__ for launch, _ in runs[0][0]]
        cell.configs["prefixes"] = names
        for launch, pointers in runs[0][0]:
            launch(*pointers)
        c0 = inputs[0]
        err = rel_err(runs[0][1], fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights))
        check(f"{s.name} {cell.scheme} M={cell.m} pick launches {names}", err < TOL, f"rel_err={err:.2e}")
        for i in range(1, len(names) + 1):
            graphs[f"pick:{i}"] = graph_of([lambda r=r, i=i: [f(*p) for f, p in r[0][:i]] for r in runs], dev)
    except Exception as e:  # noqa: BLE001  (the breakdown's failure never loses the cell)
        traceback.print_exc(limit=3)
        check(f"{s.name} {cell.scheme} M={cell.m} pick launches", False, f"raised {type(e).__name__}: {e}")


def read_plan(a13, a2, c, scheme: str, found: dict):
    """The plan whose splits the "rd128B+" reads take (READ_SPLITS' variant's), or None where the group lacks it."""
    if READ_SPLITS not in found:
        return None
    cfg = found[READ_SPLITS][1]
    return wo_plan_for(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, "silu", cfg, LaunchOptions(), None,
                       "mma")


def add_eager(cell: Cell, a13, a2, w13, w2, inputs, found: dict, dev) -> None:
    """Where the cell runs a name of EAGER: eager (host µs, wall µs) a call of the pick and it through
    ``run_experts_wo`` (the same launch path) and of the route's own call ``fused_experts_wo`` ("route": the lean
    path), ROUNDS interleaved rounds of 6 calls over the input sets; in cell.configs["eager"]."""
    old = [name for name in EAGER if name in found]
    if not old or dev.type != "cuda":
        return

    def plain(decode, cfg):
        return [lambda c=c: run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, cell.scheme, config=cfg,
                                           decode=decode) for c in inputs]

    calls = {name: plain(*found[name]) for name in ["pick", *old]}
    calls["route"] = [lambda c=c: fused_experts_wo(c.x, w13, w2, c.topk_ids, c.topk_weights) for c in inputs]
    try:
        for fns in calls.values():
            fns[0]()
        cell.configs["eager"] = eager_us(calls, ROUNDS, 6)
    except Exception as e:  # noqa: BLE001  (the eager figures never lose the cell's graph timings)
        traceback.print_exc(limit=3)
        print(f"  eager: raised {type(e).__name__}: {e}", flush=True)


def run_cell(s: Shape, scheme: str, m: int, names: tuple, w13, w2, bw: float, dev, until: float) -> Cell:
    """One M of a group: the reads, the prefixes, the pick and the variants, checked and timed."""
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    nbytes = touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2
    cell = Cell(s.name, scheme, m, nbytes / (bw * 1e12) * 1e6, nbytes, bw,
                choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k))
    found, c0 = variants(m, names), inputs[0]
    graphs: dict = {}
    plan = wo_plan_for(c0.x, a13, a2, c0.topk_ids, c0.topk_weights, None, scheme, "silu", READ_CONFIG,
                       LaunchOptions(), None, "mma")
    add_reads(cell, graphs, w13, w2, inputs, plan, s, dev, {"rd128B": 32})
    more = read_plan(a13, a2, c0, scheme, found)
    if more is not None:
        add_reads(cell, graphs, w13, w2, inputs, more, s, dev, {"rd128B+": 32})
    add_prefixes(cell, graphs, a13, a2, w13, w2, inputs, s, dev)
    add_calls(cell, graphs, a13, a2, w13, w2, inputs, found, s, dev)
    entries = {name: (g, None) for name, g in graphs.items()}
    cell.rounds = settled(entries, len(inputs), dev, ROUNDS, REPLAYS, until, order=shuffled)
    cell.times = {name: statistics.median(v) for name, v in cell.rounds.items()}
    add_eager(cell, a13, a2, w13, w2, inputs, found, dev)
    print(f"  {s.name} {scheme} M={m} floor {cell.floor_us:.1f} (copy {bw:.2f} TB/s), pick {cell.pick}: "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def child(args) -> int:
    """Group ``args.group`` in this process: its weights once, its Ms in turn, the cells so far in
    <args.cells>/wo32-<group>.json after each."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset, scheme, ms, names = GROUPS[args.group]
    s = Shape("tiny", 8, 1024, 512, 2) if args.smoke else Shape.from_preset(preset)
    bw = copy_tbps(dev)
    w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
    w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
    if dev.type == "cuda":
        precompile(s, scheme, ms, names, w13, w2, dev, variants, {"rd128B": 32})
    cells = []
    for m in ms:
        if cells and time.time() > args.until - 6:
            print(f"deadline: {s.name} {scheme} M={m} skipped", flush=True)
            break
        cells.append(run_cell(s, scheme, m, names, w13, w2, bw, dev, args.until))
        dump(os.path.join(args.cells, f"wo32-{args.group}.json"), cells)
    return 1 if FAILED else 0


def prefix_lines(cell: Cell) -> list[str]:
    """What each launch of the pick adds: prefix i's median minus prefix i - 1's, and its share of the whole."""
    names, times = cell.configs.get("prefixes", []), cell.times
    if not names or f"pick:{len(names)}" not in times:
        return []
    whole, parts, before = times[f"pick:{len(names)}"], [], 0.0
    for i, name in enumerate(names, 1):
        now = times.get(f"pick:{i}", float("nan"))
        parts.append(f"{name} {now - before:.1f} ({100 * (now - before) / whole:.0f}%)")
        before = now
    eager = cell.configs.get("eager", {})
    return [f"  {cell.preset} {cell.scheme} M={cell.m} pick by launch (µs added): " + ", ".join(parts)] + (
        [f"  {cell.preset} {cell.scheme} M={cell.m} eager (host, wall) µs a call: "
         + ", ".join(f"{k} {h:.1f} / {w:.1f}" for k, (h, w) in eager.items())] if eager else [])


def main(argv=None) -> int:
    args = group_args("wo32", argv)
    if args.group is not None:
        return child(args)
    cells = [Cell(**c) for c in run_groups(__file__, "wo32", GROUPS, args, START, FAILED)]
    dump(os.path.join(args.out, "wo32.json"), cells)
    print(call_table(cells), flush=True)
    print("\n".join(line for c in cells for line in prefix_lines(c)), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

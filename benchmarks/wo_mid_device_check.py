"""Weight-only experts at mid batches on the device (issue #16's M >= 1024 target: no weight-only cell
slower than 0.9x moekit's bf16 cell, i.e. wo µs <= bf16 µs / 0.9 = 1.11x): the fused tile decode under
CANDIDATES' tile configs (tall tiles, deeper pipelines, AHEAD: the next step's dequant overlapping the
dot, ``_kernels/gemm_wo``), against the scratch decode, the chooser's default and moekit's bf16 path.
Prints per cell the best variant and its ratio to bf16, then the rows of
``moekit.experts.triton_wo_winners.WO_WINNERS`` ready to paste (the chooser reads them from there).

    PYTHONPATH=$PWD python benchmarks/wo_mid_device_check.py            # JSON to $OUT/wo_mid.json if OUT is set
    PYTHONPATH=$PWD python benchmarks/wo_mid_device_check.py --smoke    # CPU: Triton's interpreter, tiny shapes
    PYTHONPATH=$PWD python benchmarks/wo_mid_device_check.py --presets deepseek-v3   # one shape alone

Cells: Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 (in that order) x int4_w4a16 (group 128, zero points),
int8_w8a16, mxfp4 x M in {1024, 4096}. Weights: random bf16 quantized by ``moekit.quant.quantize`` (the
DeepSeek-V3 ones, 22.5 GB in bf16, built once, each scheme's quantized copy freed after it); x and
routing as ``moekit bench`` makes them. Each variant's output against the ``reference`` backend on the
same quantized weights (in chunks of experts, ``reference``; rel L2 < TOL, printed), then timed with
``triton.testing.do_bench`` (median, eager calls). A candidate runs where its tile height suits the
rows per expert (``suits``). All kernels compile at the start in a thread pool
(``wo_device_check.precompile``). Hard limits: no timing starts after DEADLINE_S, DeepSeek-V3 starts
only before DEEPSEEK_BY_S (the cells left print as skipped), so the run ends inside 240 s on an H200.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:  # before any kernel module is imported: Triton decides at decoration time
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, astuple, dataclass, field  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_wo import WoWeight, fused_experts_wo, run_experts_wo  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode, weight_args  # noqa: E402
from moekit.experts.triton_wo_winners import WoTileConfig, tile  # noqa: E402
from moekit.quant import quantize  # noqa: E402
from wo_bench_common import bf16_baseline, do_bench_us  # noqa: E402
from wo_device_check import FAILED, check, precompile, rel_err  # noqa: E402

T0 = time.perf_counter()
DEADLINE_S = 205.0  # no timing starts after this (one DeepSeek-V3 timing: < 2 s)
DEEPSEEK_BY_S = 120.0  # DeepSeek-V3 (weights ~10 s to build, 6 cells) starts only before this
SCHEMES = {"int4_w4a16": {"group_size": 128}, "int8_w8a16": {}, "mxfp4": {}}
GROUP = {"int4_w4a16": 128, "int8_w8a16": 0, "mxfp4": 32}
PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
BATCHES = (1024, 4096)
TOL = 1e-2  # rel L2 against the reference
REF_EXPERTS = 3 if SMOKE else 32  # experts per chunk of the reference (32 of DeepSeek-V3: 5.6 GB in float32)
WARMUP_MS, REP_MS = 5, 25
# name -> a tile-decode config: tile(BLOCK_M, gate-up (BLOCK_N, BLOCK_K, GROUP_M, warps, stages), down (..), AHEAD).
# "m128" and "m64" are the heuristic's; the others taller, wider, deeper or with AHEAD.
CANDIDATES = {
    "m128": tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3)),
    "m128a": tile(128, (64, 64, 8, 8, 3), (128, 64, 8, 8, 3), True),
    "m128s4": tile(128, (64, 64, 8, 8, 4), (128, 64, 8, 8, 4)),
    "m128s4a": tile(128, (64, 64, 8, 8, 4), (128, 64, 8, 8, 4), True),
    "m128k128a": tile(128, (64, 128, 8, 8, 3), (128, 128, 8, 8, 3), True),
    "m128n256a": tile(128, (128, 64, 8, 8, 3), (256, 64, 8, 8, 3), True),
    "m256": tile(256, (32, 64, 8, 8, 3), (128, 64, 8, 8, 3)),
    "m256a": tile(256, (32, 64, 8, 8, 3), (128, 64, 8, 8, 3), True),
    "m256n64a": tile(256, (64, 64, 8, 8, 3), (64, 64, 8, 8, 4), True),
    "m64": tile(64, (64, 64, 1, 4, 4), (64, 64, 1, 4, 4)),  # the heuristic's at 32-64 rows per expert
    "m64a": tile(64, (64, 64, 8, 4, 4), (64, 64, 8, 4, 4), True),
    "m64n128a": tile(64, (128, 64, 8, 4, 3), (128, 64, 8, 4, 3), True),
}
SKIPPED: list[str] = []


@dataclass
class Cell:
    shape: str
    scheme: str
    e: int
    n: int
    k: int
    m: int
    bf16_us: float
    default: str  # the chooser's decode (``choose_decode``)
    times: dict = field(default_factory=dict)  # variant ("default", "scratch", a CANDIDATES name) -> µs
    errors: dict = field(default_factory=dict)  # variant -> rel L2 against the reference

    def best_tile(self) -> str | None:
        tiles = [v for v in self.times if v in CANDIDATES and self.errors[v] < TOL]
        return min(tiles, key=self.times.get) if tiles else None

    def winner(self) -> str | None:
        """The fastest correct variant of the decodes the chooser can name: a candidate, or "scratch"."""
        named = [v for v in self.times if v != "default" and self.errors[v] < TOL]
        return min(named, key=self.times.get) if named else None


def elapsed() -> float:
    return time.perf_counter() - T0


def bench_us(fn) -> float:
    return do_bench_us(fn, WARMUP_MS, REP_MS)


def suits(config: WoTileConfig, rows_per_expert: float) -> bool:
    """Whether a tile height suits a cell: at most twice the mean rows per expert (else mostly padding),
    and 64-row tiles only up to 128 rows per expert (above, taller tiles reuse each dequantized tile
    more). The smoke run tries every candidate."""
    if SMOKE:
        return True
    return config.BLOCK_M <= 2 * rows_per_expert and (config.BLOCK_M > 64 or rows_per_expert <= 128)


def wo_weight(w) -> WoWeight:
    """``moekit.quant``'s weight as the raw tensors the weight-only kernels read."""
    return WoWeight(w.scheme, w.q, w.scale, getattr(w, "zero", None), GROUP[w.scheme])


def candidates(s: Shape, m: int) -> dict:
    return {name: c for name, c in CANDIDATES.items() if suits(c, m * s.top_k / s.num_experts)}


def reference(c, q13, q2) -> torch.Tensor:
    """The ``reference`` backend's output [M, K] in float32, summed over chunks of REF_EXPERTS experts (an
    expert map routes only the chunk's; the backend dequantizes a whole weight in float32, DeepSeek-V3's
    w13 and w2 alone 45 GB)."""
    e, dev = q13.num_experts, c.x.device
    ids = torch.arange(e, device=dev)
    out = torch.zeros(c.x.shape, dtype=torch.float32, device=dev)  # [M, K]
    for e0 in range(0, e, REF_EXPERTS):
        part = slice(e0, min(e0 + REF_EXPERTS, e))
        expert_map = torch.where((ids >= part.start) & (ids < part.stop), ids - e0, -1).int()
        out += experts_reference(c.x.float(), q13.select_experts(part), q2.select_experts(part), c.topk_ids,
                                 c.topk_weights, expert_map=expert_map)
    return out


def run_variant(cell: Cell, name: str, call, ref: torch.Tensor) -> None:
    """One variant: checked against the reference, then timed (under the interpreter the checked call is
    the timed one)."""
    if elapsed() > DEADLINE_S:
        SKIPPED.append(f"{cell.shape} {cell.scheme} M={cell.m} {name}")
        return
    try:
        t = time.perf_counter()
        out = call()
        once_us = (time.perf_counter() - t) * 1e6
        cell.errors[name] = rel_err(out, ref)
        check(f"{cell.shape} {cell.scheme} M={cell.m} {name} vs reference", cell.errors[name] < TOL,
              f"rel_err={cell.errors[name]:.2e}")
        cell.times[name] = once_us if SMOKE else bench_us(call)
    except Exception as e:  # noqa: BLE001  (reported, the run goes on)
        check(f"{cell.shape} {cell.scheme} M={cell.m} {name}", False, f"raised {type(e).__name__}: {e}")


def scheme_cells(s: Shape, scheme: str, w13f, w2f, sets: dict, bf16: dict) -> list[Cell]:
    """Every M of one shape and scheme: the default, the scratch decode and each suiting candidate."""
    q13, q2 = quantize(w13f, scheme, **SCHEMES[scheme]), quantize(w2f, scheme, **SCHEMES[scheme])
    w13, w2 = wo_weight(q13), wo_weight(q2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    cells = []
    for m, c in sets.items():
        if elapsed() > DEADLINE_S:
            SKIPPED.append(f"{s.name} {scheme} M={m}")
            continue
        cell = Cell(s.name, scheme, s.num_experts, s.n, s.k, m, bf16[m],
                    choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k))
        ref = reference(c, q13, q2)
        run_variant(cell, "scratch", lambda: fused_experts_wo(c.x, w13, w2, c.topk_ids, c.topk_weights,
                                                              decode="scratch"), ref)
        if cell.default == "scratch" and "scratch" in cell.times:
            cell.times["default"], cell.errors["default"] = cell.times["scratch"], cell.errors["scratch"]
        else:
            run_variant(cell, "default", lambda: fused_experts_wo(c.x, w13, w2, c.topk_ids, c.topk_weights), ref)
        for name, config in candidates(s, m).items():
            run_variant(cell, name, lambda config=config: run_experts_wo(
                c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=config, decode="tile"), ref)
        del ref
        print(line(cell), flush=True)
        cells.append(cell)
    return cells


def line(c: Cell) -> str:
    best, win = c.best_tile(), c.winner()
    parts = [f"{v} {us:.0f}" for v, us in sorted(c.times.items(), key=lambda kv: kv[1])]
    head = f"{c.shape} {c.scheme} M={c.m}: bf16 {c.bf16_us:.0f} µs; " + ", ".join(parts)
    if win is None:
        return head + f"  [{elapsed():.0f} s]"
    tile_part = f"best tile {best} {c.times[best] / c.bf16_us:.2f}x" if best else "no tile"
    return (head + f"; default ({c.default}) {c.times.get('default', float('nan')) / c.bf16_us:.2f}x bf16, "
            f"{tile_part}, winner {win} {c.times[win] / c.bf16_us:.2f}x  [{elapsed():.0f} s]")


def shape_cells(s: Shape, batches: tuple, dev) -> list[Cell]:
    base = bf16_baseline(s, batches, dev, bench_us)
    w13f, w2f, sets, bf16 = base.w13, base.w2, base.sets, base.us
    print(f"{s.name}: bf16 " + ", ".join(f"M={m} {us:.0f} µs" for m, us in bf16.items()) + f"  [{elapsed():.0f} s]",
          flush=True)
    cells = []
    for scheme in SCHEMES:
        if elapsed() > DEADLINE_S:
            SKIPPED.append(f"{s.name} {scheme}")
            continue
        try:
            cells += scheme_cells(s, scheme, w13f, w2f, sets, bf16)
        except Exception as e:  # noqa: BLE001  (reported, the run goes on)
            check(f"{s.name} {scheme}", False, f"raised {type(e).__name__}: {e}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    del w13f, w2f, base
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return cells


def tile_expr(config: WoTileConfig) -> str:
    return f"tile({config.BLOCK_M}, {astuple(config.up)}, {astuple(config.down)}, {config.ahead})"


def winners_table(cells: list[Cell]) -> str:
    """The WO_WINNERS rows of the measured cells (``moekit/experts/triton_wo_winners.py``), one a line."""
    lines = []
    for c in cells:
        win, best = c.winner(), c.best_tile()
        if win is None:
            continue
        decode = "scratch" if win == "scratch" else "tile"
        row = f'WoWinner("{decode}", {tile_expr(CANDIDATES[best])})' if best else f'WoWinner("{decode}")'
        times = ", ".join(f"{v} {c.times[v]:.0f}" for v in ([best] if best else []) + ["scratch", "default"]
                          if v in c.times)
        lines.append(f'    ("{c.scheme}", {c.e}, {c.n}, {c.k}, {c.m}): {row},  # {c.shape} µs: {times}, '
                     f"bf16 {c.bf16_us:.0f}; {c.times[win] / c.bf16_us:.2f}x bf16")
    return "\n".join(lines)


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<14} {'scheme':<10} {'M':>5} {'bf16 µs':>8} {'default':>8} {'def/bf16':>8} "
             f"{'scr/bf16':>8} {'best tile':>10} {'tile/bf16':>9} {'winner':>10} {'win/bf16':>8} {'max err':>7}  "
             "target <= 1.11"]
    for c in cells:
        best, win = c.best_tile(), c.winner()
        ratio = (lambda v: c.times[v] / c.bf16_us if v in c.times else float("nan"))
        won = ratio(win) if win else float("nan")
        lines.append(f"{c.shape:<14} {c.scheme:<10} {c.m:>5} {c.bf16_us:>8.0f} {c.default:>8} "
                     f"{ratio('default'):>8.2f} {ratio('scratch'):>8.2f} {best or '-':>10} "
                     f"{ratio(best) if best else float('nan'):>9.2f} {win or '-':>10} {won:>8.2f} "
                     f"{max(c.errors.values(), default=float('nan')):>7.1e}  {'met' if won <= 1 / 0.9 else 'MISSED'}")
    return "\n".join(lines)


def compile_all(shapes: list[Shape], batches: tuple, dev) -> None:
    """Every candidate's and the default's tile GEMMs of these shapes, compiled at once (thread pool)."""
    jobs = [(s, scheme, m, "tile", config, None) for s in shapes for scheme in SCHEMES for m in batches
            for config in [None, *candidates(s, m).values()]]
    precompile(jobs, dev)
    print(f"precompiled {len(jobs)} plans  [{elapsed():.0f} s]", flush=True)


def main() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    print(torch.__version__, "triton", triton.__version__, name, flush=True)
    if SMOKE:
        shapes, batches = [Shape("tiny", 8, 64, 96, 2)], (48,)
    else:
        args = [a for a in sys.argv[1:] if a != "--smoke"]
        presets = args[args.index("--presets") + 1:] if "--presets" in args else PRESETS
        shapes, batches = [Shape.from_preset(p) for p in presets], BATCHES
    if dev.type == "cuda":
        compile_all(shapes, batches, dev)
    cells = []
    for s in shapes:
        if s.name == "deepseek-v3" and len(shapes) > 1 and elapsed() > DEEPSEEK_BY_S:
            SKIPPED.append(f"{s.name} (past {DEEPSEEK_BY_S:.0f} s)")
            continue
        cells += shape_cells(s, batches, dev)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "wo_mid.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                       "candidates": {k: c.to_dict() for k, c in CANDIDATES.items()},
                       "cells": [asdict(c) for c in cells], "failed": FAILED, "skipped": SKIPPED,
                       "seconds": elapsed()}, f, indent=1)
    print(f"FAILED: {FAILED or 'none'}   SKIPPED: {SKIPPED or 'none'}   total {elapsed():.0f} s")
    print("WO_WINNERS rows (moekit/experts/triton_wo_winners.py):")
    print(winners_table(cells))
    print(table(cells), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

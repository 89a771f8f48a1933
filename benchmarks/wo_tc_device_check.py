"""GPU check of the register decode on tensor cores at the 4-bit decode cells (issue #16, session 24 brief w4
item b): SWAP_AB (``KernelConfig.swap_ab``: each chunk computes W @ a^T, the decoded weight tile the MMA's M side,
so a 16-row block can run on Hopper's wgmma with the weights as its register operand) against the unswapped order
and the chooser's pick (the gemv word decode at DeepSeek-V3 M = 1, 8).

    PYTHONPATH=$PWD timeout 200 python3 benchmarks/wo_tc_device_check.py --out $OUT/w4       # H200, <= 150 s
    PYTHONPATH=$PWD TRITON_INTERPRET=1 python3 benchmarks/wo_tc_device_check.py --smoke      # CPU, tiny shapes

Cells (in this order; the deadline cuts the last): int4_w4a16 (g 128) Mixtral-8x7B M = 8, DeepSeek-V3 M = 64
(aligned blocks), Qwen3-30B-A3B M = 64 (the register decode picked at all three: swapped by default since this
branch), DeepSeek-V3 M = 8, mxfp4 DeepSeek-V3 M = 1, 8, int4 DeepSeek-V3 M = 1, Qwen3 M = 8, 1, each in a child
process of its own (a fault loses only its cell). Run 1
(0bdc803, the first four variants, DeepSeek-V3 int4 M=8, mxfp4 M=1/8, Mixtral int4 M=8): swap_ab won Mixtral int4
M=8 (420 vs 482 µs, 5/5) and lost every mxfp4 cell; 128-row and 256-wide swapped register tiles lost everywhere.
Variants: "pick" (what a call runs now), "prev" (the decode picked before this branch, where PREVIOUS names one),
"reg" (the register decode, its heuristic config unswapped), "sw" (that config with swap_ab: the int4 default at
16-row blocks since this branch). The merged run (e3434b4) also ran a word
MMA decode ("mma", ``gemm_wo_mma``: 1.3-3.2x slower than the pick in every cell; removed, history at 1fa2c6c).
Each variant against the torch twin (rel-L2 < TOL, PASS/FAIL); then
CUDA-graph replay of the whole call over rotated input sets, every graph in turn in ROUNDS interleaved rounds
(median), % of the packed-byte floor (the touched experts' packed bytes, scales and zeros over the measured copy
bandwidth). Look for: every line PASS; "wins" (rounds a variant took <= 0.97 x the pick). JSON <out>/wo_tc.json;
the table printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from moekit.bench.cells import Shape  # noqa: E402
from moekit.experts.configs import device_key  # noqa: E402
from moekit.experts.triton_wo_configs import wo_config  # noqa: E402
from moekit.experts.triton_wo_plan import choose_decode  # noqa: E402
from bench_rounds import wins  # noqa: E402
from bench_run import RunLog, cells_in_children  # noqa: E402
from wo_cells import ROUNDS, Cell, child, dump, measure_cell  # noqa: E402

CELLS = (("mixtral-8x7b", "int4_w4a16", 8), ("deepseek-v3", "int4_w4a16", 64), ("qwen3-30b-a3b", "int4_w4a16", 64),
         ("deepseek-v3", "int4_w4a16", 8), ("deepseek-v3", "mxfp4", 1), ("deepseek-v3", "mxfp4", 8),
         ("deepseek-v3", "int4_w4a16", 1), ("qwen3-30b-a3b", "int4_w4a16", 8), ("qwen3-30b-a3b", "int4_w4a16", 1))
# (preset, scheme, M) -> the decode the chooser picked there before this branch's DECODE_MEASURED rows ("prev":
# timed against the new pick; empty while no default changed)
PREVIOUS: dict[tuple, str] = {}
RUN = RunLog()


def variants(s: Shape, scheme: str, m: int, dev) -> dict:
    """name -> (decode, config)."""
    decode = choose_decode(scheme, m, s.num_experts, s.n, s.k, s.top_k)
    out = {"pick": (decode, wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), decode))}
    prev = PREVIOUS.get((s.name, scheme, m))
    if prev is not None:
        out["prev"] = (prev, wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), prev))
    reg = wo_config(m, s.num_experts, s.n, s.k, s.top_k, scheme, device_key(dev), "register")
    out["reg"] = ("register", dataclasses.replace(reg, swap_ab=False))  # unswapped (int4's default swaps since 24)
    out["sw"] = ("register", dataclasses.replace(reg, swap_ab=True))
    return out


def table(cells: list[Cell]) -> str:
    lines = [f"{'shape':<13} {'scheme':<10} {'M':>2} {'floor':>6} {'pick':>7}  variants µs (% floor, wins/{ROUNDS})"]
    for c in cells:
        pick = c.times.get("pick", float("nan"))
        rest = "  ".join(f"{k} {v:.1f} ({100 * c.floor_us / v:.0f}%, {wins(c.rounds[k], c.rounds.get('pick', ()))})"
                         for k, v in c.times.items() if k != "pick")
        lines.append(f"{c.preset:<13} {c.scheme:<10} {c.m:>2} {c.floor_us:6.1f} {pick:7.1f}  {rest}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/wo_tc")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--deadline", type=float, default=150.0, help="wall-clock seconds; cells past it are skipped")
    p.add_argument("--cell", type=int, help="run one cell in this process (the parent starts one per cell)")
    args = p.parse_args(argv)
    if args.cell is not None:
        return child(CELLS[args.cell], args, "wo_tc", args.cell, lambda s, scheme, m, dev, bw: measure_cell(
            s, scheme, m, dev, bw, variants(s, scheme, m, dev), RUN), RUN)
    import triton

    print(torch.__version__, "triton", triton.__version__, flush=True)
    labels = [f"{preset} {scheme} M={m}" for preset, scheme, m in (CELLS[:2] if args.smoke else CELLS)]
    got, skipped = cells_in_children(__file__, labels, args.out, "wo_tc", RUN, args.deadline, 20,
                                     lambda left: ["--smoke"] * args.smoke)
    cells = [Cell(**c) for c in got]
    dump(os.path.join(args.out, "wo_tc.json"), cells, float("nan"), RUN)
    print(f"total {RUN.elapsed():.1f} s; FAILED:", RUN.failed or "none", "; SKIPPED:", skipped or "none")
    print(table(cells), flush=True)
    return 1 if RUN.failed else 0


if __name__ == "__main__":
    sys.exit(main())

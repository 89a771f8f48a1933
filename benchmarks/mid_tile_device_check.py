"""Tile and schedule variants of the bf16 Triton experts kernels at issue 19's mid cells, on the device.

    PYTHONPATH=$PWD OUT=... python benchmarks/mid_tile_device_check.py          # H200, <= 150 s
    PYTHONPATH=$PWD python benchmarks/mid_tile_device_check.py --smoke          # CPU, TRITON_INTERPRET=1
    PYTHONPATH=$PWD OUT=... python benchmarks/mid_tile_device_check.py --confirm FILE

Cells (bf16, uniform routing, two routing sets per cell): Qwen3-30B-A3B M = 1 and 1024, Mixtral-8x7B
M = 512 and 1024. Per cell, the tuned default and variants of it (``mid_tile_variants``): one field of one
GEMM's tile at a time (BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M), BLOCK_M 64 / 256 with tiles
that fit the registers, then the best gate-up-only and
the best down-only change together ("combo"); the default again at the end (the noise). Each variant:
  - correctness: its output on set 0 against ``experts_reference`` (float32 accumulation) at the real
    shape, rel L2 < 1e-2 (the default lands near 5e-3), PASS / FAIL;
  - µs per call: CUDA-graph replay of both sets, median (``moekit.bench.timing``), and % of the cell's
    floor (max(bytes / copy, FLOPs / mm), copy and mm measured in this run).
SM clock and board power during the mid cells' default and a compute-only matmul (``mid_tile_clocks``).
Variants not started by the cell's budget are listed as "skipped". ``--confirm FILE``: an interleaved A/B of
chosen configs only (``confirm_rows``; FILE maps "preset:M" to {name: config}, e.g. run 2's
``results/raw/mid_tile_confirm-cc77e90-input.json``). The table is printed last, JSON to $OUT/mid_tile.json (or
mid_tile_confirm.json). Exit 1 when a variant that ran gave a wrong output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

T0 = time.perf_counter()
TOLERANCE = 1e-2
DEADLINE_S = 112.0  # variants of the main process not started by then are skipped
CELL_BUDGET_S = 23.0  # a cell's variants stop this long after its start (COMBO_RESERVE_S early: combo, default again)
COMBO_RESERVE_S = 3.0
# the mid cells first (the lead's priority); Qwen3 M = 1 last
CELLS = (("mixtral-8x7b", 512), ("mixtral-8x7b", 1024), ("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 1))
SMOKE_CELLS = (("smoke-mixtral", 8), ("smoke-qwen", 1))
CLOCKS: dict[str, dict] = {}  # "mm" and each mid cell's default: SM MHz and board W while it runs (mid_tile_clocks)


@dataclass
class Row:
    cell: str
    variant: str
    config: dict | None
    us: float | None
    pct_floor: float | None
    err: float | None
    status: str  # PASS, FAIL (wrong output), ERROR (raised), skipped
    part: str = ""  # the variant's GEMM ("up", "down", "both"; "" for the default and combos)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def setup(smoke: bool):
    """(device, ceilings); the smoke run times the interpreter against fixed ceilings."""
    import torch

    from moekit.bench.ceilings import Ceilings, measure_ceilings

    if smoke:
        return torch.device("cpu"), Ceilings(copy_TBps=0.01, mm_TFLOPs=0.01, mm_dtype="float32")
    dev = torch.device("cuda")
    return dev, measure_ceilings(dev)


def cell_shape(preset: str):
    from moekit.bench.cells import Shape

    if preset == "smoke-qwen":
        return Shape(preset, 16, 32, 64, 4)
    if preset == "smoke-mixtral":
        return Shape(preset, 4, 64, 32, 2)
    return Shape.from_preset(preset)


def default_config(shape, m: int, dev):
    """The tuned config of the cell (interpreter-sized tiles on the CPU)."""
    import torch

    from moekit.experts.configs import GemmTile, KernelConfig, device_key, get_config

    if dev.type == "cpu":
        return KernelConfig(16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))
    return get_config(m, shape.num_experts, shape.n, shape.k, shape.top_k, torch.bfloat16, device_key(dev))


class Cell:
    """One (shape, M): weights, two routing sets, set 0's reference, the floor."""

    def __init__(self, preset: str, m: int, dev, ceilings, smoke: bool):
        import torch

        from moekit.bench.cells import cell_model, make_sets, make_weights, measured_experts_touched
        from moekit.experts.reference import experts_reference

        self.name, self.m, self.dev = f"{preset} M={m}", m, dev
        self.shape = s = cell_shape(preset)
        self.dtype = torch.float32 if smoke else torch.bfloat16
        weights = make_weights(s, self.dtype, dev)
        self.w13, self.w2 = weights.w13, weights.w2
        self.sets = make_sets(s, m, 2, self.dtype, dev)
        x, ids, w = self.sets[0].x, self.sets[0].topk_ids, self.sets[0].topk_weights
        self.ref = experts_reference(x, self.w13, self.w2, ids, w).float()
        touched = sum(measured_experts_touched(c.topk_ids, s.num_experts) for c in self.sets) / len(self.sets)
        self.floor_us = cell_model(s, m, touched, 2, ceilings.copy_TBps, ceilings.mm_TFLOPs).floor_us

    def default_config(self):
        return default_config(self.shape, self.m, self.dev)

    def call(self, config, inputs):
        from moekit.experts.triton import fused_experts

        return fused_experts(inputs.x, self.w13, self.w2, inputs.topk_ids, inputs.topk_weights, config=config)

    def measure(self, variant: str, config) -> Row:
        import torch

        from moekit.bench.timing import time_calls

        try:
            out = self.call(config, self.sets[0]).float()
            err = float(torch.linalg.vector_norm(out - self.ref) / torch.linalg.vector_norm(self.ref))
            fns = [lambda c=c: self.call(config, c) for c in self.sets]
            cuda = self.dev.type == "cuda"  # the interpreter: one pass (the smoke run checks plumbing only)
            us = time_calls(fns, self.dev, graph=cuda, budget_s=0.12 if cuda else 0.0, min_reps=5 if cuda else 1,
                            max_reps=40 if cuda else 1)
        except Exception as e:  # a tile that does not compile or launch: reported, the run goes on
            log(f"  {self.name} {variant}: {type(e).__name__}: {str(e)[:300]}")
            return Row(self.name, variant, config.to_dict(), None, None, None, "ERROR")
        status = "PASS" if err < TOLERANCE else "FAIL"
        row = Row(self.name, variant, config.to_dict(), us, 100.0 * self.floor_us / us, err, status)
        log(f"  {self.name} {variant:22s} {us:9.1f} µs {row.pct_floor:6.1f}% floor  err {err:.1e} {status}")
        return row


def run_cell(cell: Cell, variants, deadline_s: float, cell_budget_s: float) -> list[Row]:
    """The default, each variant, the combo of the best up-only and down-only changes, the default again;
    variants not started by the cell's budget (or the run's deadline) are listed as skipped."""
    from mid_tile_variants import combine

    deadline_s = min(deadline_s, time.perf_counter() - T0 + cell_budget_s)
    default = cell.default_config()
    rows = [cell.measure("default", default)]
    if cell.dev.type == "cuda" and cell.m > 1 and rows[0].us:  # decode cells are too short to sample
        from mid_tile_clocks import graph_clocks

        try:
            CLOCKS[cell.name] = asdict(graph_clocks(lambda: cell.call(default, cell.sets[0]), rows[0].us))
        except Exception as e:  # a diagnostic only
            CLOCKS[cell.name] = dict(sm_mhz=None, power_w=None, source=f"{type(e).__name__}: {str(e)[:100]}")
        log(f"  {cell.name} default clocks: {CLOCKS[cell.name]} (mm: {CLOCKS.get('mm')})")
    for v in variants:
        if time.perf_counter() - T0 > deadline_s - COMBO_RESERVE_S:
            rows.append(Row(cell.name, v.name, v.config.to_dict(), None, None, None, "skipped"))
            continue
        row = cell.measure(v.name, v.config)
        row.part = v.part
        rows.append(row)
    ok = [r for r in rows[1:] if r.status == "PASS"]
    best = {part: min((r for r in ok if r.part == part), key=lambda r: r.us, default=None)
            for part in ("up", "down")}
    if best["up"] and best["down"] and rows[0].us and max(best["up"].us, best["down"].us) < rows[0].us:
        combo = combine(default, best["up"].config, best["down"].config)
        rows.append(cell.measure(f"combo({best['up'].variant}+{best['down'].variant})", combo))
    rows.append(cell.measure("default(again)", default))
    return rows


def main_rows(cells, smoke: bool, deadline_s: float, cell_budget_s: float) -> list[Row]:
    """Every cell's rows."""
    import torch

    from mid_tile_variants import variants_for

    dev, ceilings = setup(smoke)
    if not smoke:
        log(f"copy {ceilings.copy_TBps:.2f} TB/s, mm {ceilings.mm_TFLOPs:.0f} TFLOP/s")
        from mid_tile_clocks import matmul_clocks

        try:
            CLOCKS["mm"] = asdict(matmul_clocks())
        except Exception as e:  # a diagnostic only
            CLOCKS["mm"] = dict(sm_mhz=None, power_w=None, source=f"{type(e).__name__}: {str(e)[:100]}")
    rows = []
    for preset, m in cells:
        if time.perf_counter() - T0 > deadline_s:
            rows.append(Row(f"{preset} M={m}", "all", None, None, None, None, "skipped"))
            continue
        variants = variants_for(preset, m, default_config(cell_shape(preset), m, dev), smoke=smoke)
        cell = Cell(preset, m, dev, ceilings, smoke)
        log(f"{cell.name}: floor {cell.floor_us:.1f} µs, default {cell.default_config().to_dict()}")
        rows += run_cell(cell, variants, deadline_s, cell_budget_s)
        del cell
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def confirm_rows(path: str, smoke: bool, rounds: int = 3) -> list[Row]:
    """A/B of chosen configs: FILE is {"preset:M": {"name": KernelConfig dict, ...}}; per cell the default and
    each candidate, interleaved ``rounds`` times; one row per timing and a median row per candidate."""
    import statistics

    from moekit.experts.configs import KernelConfig

    dev, ceilings = setup(smoke)
    rows = []
    for key, candidates in json.loads(Path(path).read_text()).items():
        preset, m = key.rsplit(":", 1)
        cell = Cell(preset, int(m), dev, ceilings, smoke)
        configs = [("default", cell.default_config())] + [(n, KernelConfig.from_dict(d)) for n, d in candidates.items()]
        timed = {name: [] for name, _ in configs}
        for r in range(rounds):
            for name, config in configs:
                row = cell.measure(f"{name} r{r + 1}", config)
                rows.append(row)
                if row.us is not None:
                    timed[name].append(row)
        for name, got in timed.items():
            if got:
                us = statistics.median(r.us for r in got)
                status = "PASS" if all(r.status == "PASS" for r in got) else "FAIL"
                rows.append(Row(cell.name, f"{name} (median of {len(got)})", got[0].config, us,
                                100.0 * cell.floor_us / us, max(r.err for r in got), status))
        del cell
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| cell | variant | µs | % of floor | err | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        us = f"{r.us:.1f}" if r.us is not None else "-"
        pct = f"{r.pct_floor:.1f}" if r.pct_floor is not None else "-"
        err = f"{r.err:.1e}" if r.err is not None else "-"
        lines.append(f"| {r.cell} | {r.variant} | {us} | {pct} | {err} | {r.status} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--cells", default="", help="a subset, e.g. mixtral-8x7b:1024,qwen3-30b-a3b:1")
    ap.add_argument("--confirm", default=None, help="A/B only: JSON {'preset:M': {name: config dict}} (confirm_rows)")
    ap.add_argument("--rounds", type=int, default=5, help="--confirm: interleaved rounds")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.confirm:
        rows = confirm_rows(args.confirm, args.smoke, args.rounds)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
            Path(os.environ["OUT"], "mid_tile_confirm.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        print(table(rows))
        return 1 if any(r.status == "FAIL" for r in rows) else 0
    cells = SMOKE_CELLS if args.smoke else CELLS
    if args.cells:
        cells = [c for c in cells if f"{c[0]}:{c[1]}" in args.cells.split(",")]
    rows = main_rows(cells, args.smoke, 1e9 if args.smoke else DEADLINE_S, 1e9 if args.smoke else CELL_BUDGET_S)
    result = dict(rows=[asdict(r) for r in rows], clocks=CLOCKS, wall_s=time.perf_counter() - T0, smoke=args.smoke)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "mid_tile.json").write_text(json.dumps(result, indent=1))
    log(f"done in {result['wall_s']:.1f} s")
    print(table(rows))
    if CLOCKS:
        print("clocks (SM MHz, board W, while running):", "; ".join(
            f"{name} {c['sm_mhz']} MHz {c['power_w']} W" for name, c in CLOCKS.items()))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

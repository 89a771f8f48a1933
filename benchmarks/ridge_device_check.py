"""Issue 19 / 15 at the ridge: Mixtral-8x7B and Qwen3-30B-A3B at M = 512 / 1024, bf16 and fp8_block, on the device.

    PYTHONPATH=$PWD OUT=... python benchmarks/ridge_device_check.py            # H200, <= 150 s
    PYTHONPATH=$PWD python benchmarks/ridge_device_check.py --smoke            # CPU, TRITON_INTERPRET=1, no Gluon
    PYTHONPATH=$PWD OUT=... python benchmarks/ridge_device_check.py --cells mixtral-8x7b:1024 --rounds 5 \
        --names "g128,h128 skip"                                             # a subset, more rounds

Per cell (uniform routing, two routing sets, x bf16; DeepSeek-V3 M = 1024 last, as a guard) and dtype:
  1. correctness of every call (``ridge_variants``: today's route, the fused Triton kernels forced, the Gluon
     paths with other tiles) on set 0 against the torch twin of the Gluon path at the real shape
     (``experts_gluon_twin``, ``experts_gluon_fp8_twin``): rel L2 < 2e-3 for the bf16 Gluon calls (they round
     h and y like the twin), < 1e-2 for the other bf16 calls, < 2e-2 for fp8; a failing call is not timed;
  2. µs per call: CUDA-graph replay of both sets (``moekit.bench.timing.time_calls``), ROUNDS rounds with the
     calls interleaved (the same config reads 5-9% apart between runs), median; % of the cell's floor
     (max(bytes / copy, FLOPs / mm): bf16 mm, or the fp8 mm rate with fp8 bytes) and of the mm rate, all
     three ceilings measured in this run.
Budget: a cell gets CELL_BUDGET_S x its preset's weight (BUDGET_WEIGHT; x FIRST_CELL_WEIGHT for a shape's
first), bf16 BF16_SHARE of it (its Gluon kernels compile per shape; the fp8 ones once), checks until
TIMING_RESERVE_S before a dtype's end (at least 30% of its time), timing rounds in the rest; what is not started
by then, or cells past DEADLINE_S, are listed as skipped (the variants run most promising first:
``ridge_variants``). Progress
lines as it goes; the table last (per cell: the route first, then the fastest first), JSON to $OUT/ridge.json
(rewritten after each cell); then, per cell and dtype with time left, the breakdown of the Gluon call (layout,
GEMMs with the plan's tiles and their skip twins, combine: ``ridge_breakdown``). Exit 1 when a call that ran
gave a wrong output. A watchdog ends the run (exit 3,
the JSON and table of what ran written first) when one call's check or timing takes over HANG_S: a new Gluon
kernel that deadlocks on the device must not take the run's whole time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

T0 = time.perf_counter()
DEADLINE_S = 140.0
CELL_BUDGET_S = 26.0
BUDGET_WEIGHT = {"mixtral-8x7b": 1.25, "qwen3-30b-a3b": 0.85, "deepseek-v3": 0.55}
BF16_SHARE = 0.6
TIMING_RESERVE_S = 7.0  # of a dtype's time, kept for the timing rounds (checks, which compile, get the rest)
ROUNDS = 5
# a shape's first cell compiles its kernels (FIRST_CELL_WEIGHT more time); Mixtral 512 first: its route moved
CELLS = (("mixtral-8x7b", 512), ("mixtral-8x7b", 1024), ("qwen3-30b-a3b", 1024), ("qwen3-30b-a3b", 512),
         ("deepseek-v3", 1024))
FIRST_CELL_WEIGHT = 1.6
GUARD = {"deepseek-v3"}  # the route, the fused kernels and the Gluon plan only
GUARD_NAMES = ("g128", "h128 skip", "gf8", "gf8 skip")
SMOKE_CELLS = (("smoke", 8),)
TOLERANCE = {"gluon-bf16": 2e-3, "bf16": 1e-2, "fp8": 2e-2}
ONLY: dict = {}  # "names": the Gluon variants to run (--names), besides the route and the fused kernels
HANG_S = 45.0  # one call's compile + check, or one timing, past this: the watchdog ends the run
STATE = {"step": "", "since": time.perf_counter(), "rows": [], "floors": {}, "ceil": None, "smoke": False}
BREAKDOWN: dict = {}  # "cell dtype" -> {part: µs, "<gemm> %mm": %}: the Gluon call's launches alone (ridge_breakdown)
BREAKDOWN_RESERVE_S = 3.0  # a dtype's time left after its rounds that a breakdown needs


@dataclass
class Row:
    cell: str
    dtype: str
    variant: str
    kind: str
    us: float | None = None  # median over the rounds
    rounds_us: list = field(default_factory=list)
    pct_floor: float | None = None
    pct_mm: float | None = None
    err: float | None = None
    status: str = "skipped"  # PASS, FAIL (wrong output), ERROR (raised), skipped


def step(name: str) -> None:
    STATE["step"], STATE["since"] = name, time.perf_counter()


def watchdog() -> None:
    """A daemon thread: past HANG_S in one step, the rows so far to JSON and stdout, then exit 3."""
    while True:
        time.sleep(1.0)
        if time.perf_counter() - STATE["since"] > HANG_S:
            log(f"WATCHDOG: '{STATE['step']}' has run {HANG_S:.0f} s: a hang? ending the run")
            if STATE["ceil"] is not None:
                write_json(STATE["rows"], STATE["floors"], STATE["ceil"], STATE["smoke"])
            pending = [r for r in STATE.get("pending", []) if r not in STATE["rows"]]
            print(table(STATE["rows"] + pending, STATE["floors"]), flush=True)
            os._exit(3)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


@dataclass(frozen=True)
class Ceilings:
    copy_TBps: float
    mm_TFLOPs: float  # bf16 8192^3
    fp8_mm_TFLOPs: float | None  # torch._scaled_mm e4m3 8192^3


def ceilings(dev, smoke: bool) -> Ceilings:
    if smoke:  # the interpreter: fixed stand-ins (the smoke run checks plumbing only)
        return Ceilings(0.01, 0.01, 0.01)
    from moekit.bench.ceilings import measure_ceilings, measure_fp8_mm

    c = measure_ceilings(dev)
    return Ceilings(c.copy_TBps, c.mm_TFLOPs, measure_fp8_mm(dev).TFLOPs)


def cell_shape(preset: str):
    from moekit.bench.cells import Shape

    return Shape(preset, 4, 128, 256, 2) if preset == "smoke" else Shape.from_preset(preset)


def smoke_configs():
    """Interpreter-sized tiles of the fused bf16 and fp8 kernels (the fp8 ones take BLOCK_K = 128)."""
    from moekit.experts.configs import GemmTile, KernelConfig

    return (KernelConfig(16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2)),
            KernelConfig(16, GemmTile(32, 128, 1, 4, 2), GemmTile(32, 128, 1, 4, 2)))


def rel_l2(out, ref) -> float:
    import torch

    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


class Cell:
    """One (shape, M): bf16 weights, their fp8_block quantization, two routing sets, floors per dtype."""

    def __init__(self, preset: str, m: int, dev, ceil: Ceilings, smoke: bool):
        import torch

        from moekit.bench.cells import cell_model, make_sets, make_weights, measured_experts_touched

        sys.path.insert(0, str(Path(__file__).parent))
        from fp8_device_check import quantize_blocks

        self.name, self.m, self.dev, self.smoke = f"{preset} M={m}", m, dev, smoke
        self.guard = preset in GUARD
        self.shape = s = cell_shape(preset)
        w = make_weights(s, torch.bfloat16, dev)
        self.w13, self.w2 = w.w13, w.w2
        self.q = (*quantize_blocks(self.w13), *quantize_blocks(self.w2))
        self.sets = make_sets(s, m, 2, torch.bfloat16, dev)
        touched = sum(measured_experts_touched(c.topk_ids, s.num_experts) for c in self.sets) / len(self.sets)
        scales = 4 * (2 * s.n * s.k + s.k * s.n) // (128 * 128)
        self.floor = {"bf16": cell_model(s, m, touched, 2, ceil.copy_TBps, ceil.mm_TFLOPs),
                      "fp8": cell_model(s, m, touched, 2, ceil.copy_TBps, ceil.fp8_mm_TFLOPs or ceil.mm_TFLOPs,
                                        expert_bytes=3 * s.n * s.k + scales)}
        self.mm = {"bf16": ceil.mm_TFLOPs, "fp8": ceil.fp8_mm_TFLOPs}
        counts = torch.bincount(self.sets[0].topk_ids.flatten().long(), minlength=s.num_experts)
        # GEMM rows per real row with every expert's run padded to b rows (the tensor work on padding)
        self.padding = {b: float(((counts + b - 1) // b * b).sum()) / (m * s.top_k) for b in (16, 64, 128)}

    def twin(self, dtype: str):
        from moekit.experts.triton_gluon import experts_gluon_twin
        from moekit.experts.triton_gluon_fp8 import experts_gluon_fp8_twin

        c = self.sets[0]
        if dtype == "bf16":
            return experts_gluon_twin(c.x, self.w13, self.w2, c.topk_ids, c.topk_weights).float()
        return experts_gluon_fp8_twin(c.x, *self.q, c.topk_ids, c.topk_weights).float()

    def variants(self, dtype: str):
        from ridge_variants import bf16_variants, fp8_variants

        gluon = not self.smoke
        names = GUARD_NAMES if self.guard else ONLY.get("names")
        bf16_cfg, fp8_cfg = smoke_configs() if self.smoke else (None, None)
        if dtype == "bf16":
            return bf16_variants(self.w13, self.w2, gluon, bf16_cfg, names)
        return fp8_variants(self.q, gluon, fp8_cfg, names)

    def check(self, v, dtype: str, ref) -> Row:
        row = Row(self.name, dtype, v.name, v.kind)
        c = self.sets[0]
        step(f"{self.name} {dtype} {v.name} check")
        try:
            row.err = rel_l2(v.call(c.x, c.topk_ids, c.topk_weights), ref)
        except Exception as e:  # a tile that does not compile or launch: reported, the run goes on
            log(f"  {self.name} {dtype} {v.name}: ERROR {type(e).__name__}: {str(e)[:400]}")
            row.status = "ERROR"
            return row
        tol = TOLERANCE["gluon-bf16" if dtype == "bf16" and v.kind == "gluon" else dtype]
        row.status = "PASS" if row.err < tol else "FAIL"
        log(f"  {self.name} {dtype} {v.name:18s} err {row.err:.1e} {row.status}")
        return row

    def time(self, v) -> float | None:
        from moekit.bench.timing import time_calls

        cuda = self.dev.type == "cuda"
        fns = [lambda c=c: v.call(c.x, c.topk_ids, c.topk_weights) for c in self.sets]
        step(f"{self.name} {v.name} timing")
        try:
            return time_calls(fns, self.dev, graph=cuda, budget_s=0.06 if cuda else 0.0, min_reps=5 if cuda else 1,
                              max_reps=40 if cuda else 1)
        except Exception as e:  # reported; the call's row keeps its other rounds
            log(f"  {self.name} {v.name}: timing ERROR {type(e).__name__}: {str(e)[:300]}")
            return None


def run_dtype(cell: Cell, dtype: str, rounds: int, start: float, stop_at: float) -> list[Row]:
    """Check the calls (until TIMING_RESERVE_S before stop_at), then ROUNDS interleaved timings of those that
    passed; medians, % of floor and mm."""
    ref = cell.twin(dtype)
    calls = cell.variants(dtype)
    check_stop = max(start + 0.3 * (stop_at - start), stop_at - TIMING_RESERVE_S)
    rows = []
    for v in calls:
        rows.append(cell.check(v, dtype, ref) if time.perf_counter() - T0 < check_stop else
                    Row(cell.name, dtype, v.name, v.kind))
    del ref
    STATE["pending"] = rows  # the watchdog's table shows them too
    timed = [(v, r) for v, r in zip(calls, rows) if r.status == "PASS"]
    for k in range(rounds):
        for v, row in timed:
            if time.perf_counter() - T0 > stop_at:
                break
            us = cell.time(v)
            if us is not None:
                row.rounds_us.append(us)
        log(f"  {cell.name} {dtype} round {k + 1}: " + ", ".join(
            f"{v.name} {r.rounds_us[-1]:.0f}" for v, r in timed if len(r.rounds_us) > k))
    if not cell.smoke and not cell.guard and stop_at - (time.perf_counter() - T0) > BREAKDOWN_RESERVE_S:
        breakdown(cell, dtype)
    floor, mm = cell.floor[dtype], cell.mm[dtype]
    for row in rows:
        if row.rounds_us:
            row.us = statistics.median(row.rounds_us)
            row.pct_floor = 100.0 * floor.floor_us / row.us
            row.pct_mm = 100.0 * floor.flops / (row.us * 1e-6) / (mm * 1e12) if mm else None
    return rows


def smoke_gluon_host() -> bool:
    """CPU: the Gluon variants' tiles pass ``check_tile`` and the layout (its gather kernel interpreted) holds each
    assignment's row of x on a 128-aligned expert segment."""
    import torch

    from moekit.experts.triton_gluon import gluon_layout
    from ridge_variants import bf16_gluon_tiles, fp8_gluon_tiles

    tiles = {**bf16_gluon_tiles(768), **bf16_gluon_tiles(14336), **fp8_gluon_tiles()}
    x = torch.randn(24, 128)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(24)]).to(torch.int32)
    lay = gluon_layout(x, ids, 4)
    used = int(lay.rows_used)
    ok = used % 128 == 0 and used <= lay.x_perm.shape[0]
    for t in range(24):
        for j in range(2):
            r = int(lay.src_to_dst[t, j])
            ok &= torch.equal(lay.x_perm[r], x[t]) and int(lay.block_experts[r // 128]) == int(ids[t, j])
    log(f"smoke: {len(tiles)} Gluon tile pairs fit; layout ({used} rows used): {'PASS' if ok else 'FAIL'}")
    return ok


def breakdown(cell: Cell, dtype: str) -> None:
    """The Gluon call's launches alone (``ridge_breakdown``) on set 0, into BREAKDOWN; a failure is reported."""
    from ridge_breakdown import bf16_parts, fp8_parts

    c = cell.sets[0]
    step(f"{cell.name} {dtype} breakdown")
    try:
        got = (bf16_parts(c.x, cell.w13, cell.w2, c.topk_ids, c.topk_weights.contiguous(), cell.mm["bf16"])
               if dtype == "bf16" else fp8_parts(c.x, cell.q, c.topk_ids, c.topk_weights.contiguous(), cell.mm["fp8"]))
    except Exception as e:  # a diagnostic only
        got = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    BREAKDOWN[f"{cell.name} {dtype}"] = got
    log(f"  {cell.name} {dtype} breakdown: " + ", ".join(
        f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in got.items()))


def main_rows(cells, smoke: bool, rounds: int, deadline_s: float, cell_budget_s: float, dtypes) -> tuple:
    import torch

    dev = torch.device("cpu" if smoke else "cuda")
    ceil = ceilings(dev, smoke)
    log(f"copy {ceil.copy_TBps:.2f} TB/s, bf16 mm {ceil.mm_TFLOPs:.0f} TFLOP/s, fp8 mm {ceil.fp8_mm_TFLOPs}")
    rows, floors = STATE["rows"], STATE["floors"]
    STATE["ceil"], STATE["smoke"] = ceil, smoke
    for preset, m in cells:
        start = time.perf_counter() - T0
        if start > deadline_s:
            rows += [Row(f"{preset} M={m}", d, "all", "") for d in dtypes]
            continue
        step(f"{preset} M={m} setup")
        cell = Cell(preset, m, dev, ceil, smoke)
        floors[cell.name] = {d: asdict(f) for d, f in cell.floor.items()}
        log(f"{cell.name}: floor bf16 {cell.floor['bf16'].floor_us:.1f} µs, fp8 {cell.floor['fp8'].floor_us:.1f} µs; "
            f"the route takes Gluon: {route_paths(cell.shape, m)}; GEMM rows per assignment padded to 16 / 64 / "
            f"128: {' / '.join(f'{v:.2f}' for v in cell.padding.values())}")
        floors[cell.name]["padding"] = cell.padding
        first = all(not name.startswith(preset) for name in floors if name != cell.name)
        budget = cell_budget_s * BUDGET_WEIGHT.get(preset, 1.0) * (FIRST_CELL_WEIGHT if first else 1.0)
        for dtype in dtypes:  # each dtype its share of the cell's budget, from when it starts
            begin = time.perf_counter() - T0
            share = budget * (BF16_SHARE if dtype == "bf16" and len(dtypes) > 1 else 1.0)
            stop = budget + start if dtype == dtypes[-1] else begin + share
            step(f"{preset} M={m} {dtype} twin")
            rows += run_dtype(cell, dtype, rounds, begin, min(deadline_s, stop))
        del cell
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write_json(rows, floors, ceil, smoke)
    return rows, floors, ceil


def route_paths(s, m: int) -> dict:
    """Whether today's route sends the cell to the Gluon path, per dtype (the choosers' size rules)."""
    from moekit.experts.triton_gluon import DEFAULT_CHOICE
    from moekit.experts.triton_gluon_fp8 import DEFAULT_FP8_CHOICE

    return {"bf16": DEFAULT_CHOICE.wants(m, s.n), "fp8": DEFAULT_FP8_CHOICE.wants(m, s.top_k, s.n, s.k, s.num_experts)}


def write_json(rows, floors, ceil, smoke: bool) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        result = dict(rows=[asdict(r) for r in rows], floors=floors, ceilings=asdict(ceil), smoke=smoke,
                      breakdown=BREAKDOWN, wall_s=time.perf_counter() - T0)
        Path(os.environ["OUT"], "ridge.json").write_text(json.dumps(result, indent=1))


def table(rows: list[Row], floors: dict) -> str:
    lines = ["| cell | dtype | call | µs (median) | rounds µs | % floor | % mm | vs route | err | status |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.cell, r.dtype), []).append(r)
    for (cell, dtype), got in groups.items():
        route = next((r.us for r in got if r.kind == "route" and r.us), None)
        got = sorted(got, key=lambda r: (r.kind != "route", r.us is None, r.us or 0.0))
        for r in got:
            us = f"{r.us:.1f}" if r.us else "-"
            rounds = "/".join(f"{u:.0f}" for u in r.rounds_us) or "-"
            pct = f"{r.pct_floor:.1f}" if r.pct_floor else "-"
            pmm = f"{r.pct_mm:.1f}" if r.pct_mm else "-"
            vs = f"{route / r.us:.3f}x" if route and r.us else "-"
            err = f"{r.err:.1e}" if r.err is not None else "-"
            lines.append(f"| {cell} | {dtype} | {r.variant} | {us} | {rounds} | {pct} | {pmm} | {vs} | {err} | "
                         f"{r.status} |")
    floor_line = "; ".join(f"{c}: bf16 {f['bf16']['floor_us']:.0f} µs, fp8 {f['fp8']['floor_us']:.0f} µs, "
                           f"rows/assignment at 64 / 128: {f['padding'][64]:.2f} / {f['padding'][128]:.2f}" for c,
                           f in floors.items())
    return "\n".join(lines) + f"\nfloors: {floor_line}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1, tiny shapes, no Gluon")
    ap.add_argument("--cells", default="", help="a subset, e.g. mixtral-8x7b:1024,qwen3-30b-a3b:512")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    ap.add_argument("--names", default="", help="only these Gluon variants, e.g. 'g128,h128 skip,gf8,gf8 skip'")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S)
    ap.add_argument("--cell-budget-s", type=float, default=CELL_BUDGET_S)
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.names:
        ONLY["names"] = tuple(n.strip() for n in args.names.split(","))
    sys.path.insert(0, str(Path(__file__).parent))
    cells = SMOKE_CELLS if args.smoke else CELLS
    if args.cells:
        cells = [c for c in cells if f"{c[0]}:{c[1]}" in args.cells.split(",")]
    budget = 1e9 if args.smoke else args.cell_budget_s
    if args.smoke and not smoke_gluon_host():
        return 1
    if not args.smoke:
        import threading

        step("ceilings")
        threading.Thread(target=watchdog, daemon=True).start()
    rows, floors, ceil = main_rows(cells, args.smoke, 1 if args.smoke else args.rounds,
                                   1e9 if args.smoke else args.deadline_s, budget, args.dtypes.split(","))
    write_json(rows, floors, ceil, args.smoke)
    log(f"done in {time.perf_counter() - T0:.1f} s")
    print(table(rows, floors))
    for name, got in BREAKDOWN.items():  # the Gluon calls' launches alone
        print(f"breakdown {name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in got.items()))
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

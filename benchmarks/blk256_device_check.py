"""Issue 19 (branch `blk256`): the bf16 Gluon gate-up GEMM whose tile covers up to 256 rows of one expert in four
64-row sub-tiles, padding sub-tiles skipped (``GluonTile.blk256``), against the route at the ridge and small-prefill
cells; since CK1 the route's gate-up tile at Mixtral M = 512 (``triton_gluon_launch.up_tile``).

    PYTHONPATH=$PWD timeout 75 python3 benchmarks/blk256_device_check.py --out $OUT/blk256 --deadline 58   # H200
    (--cells mixtral-8x7b:512 --only "lean g128": the route against the route before it, no parts)

``mid7_device_check``'s machinery (its ``RunLog``: log, watchdog, table; PASS/FAIL against the twin, interleaved
graph rounds; its module state is this run's), no compile workers. First the ceilings (the bench's: copy, bf16 mm
8192^3). Per cell (the bench's weights, two uniform routing sets; ``blk256_variants`` names every call):
  1. correctness: the gate-up GEMM's h at each 256-row tile against g128's on every real row of set 0 (bit-equal?
     rel L2 < 2e-3; rows a tile leaves unwritten are NaN), then every whole call against the Gluon twin
     (``experts_gluon_twin``; rel L2 < 5e-3, the route < 1e-2), PASS / FAIL; a failing call is not timed;
  2. whole calls: CUDA-graph replay over both sets, ``--rounds`` interleaved rounds (each starting one further
     along), median; x = route / variant and the rounds it won by >= 3%; % of the floor (``cell_model``: max(bytes /
     copy, FLOPs / mm) on this run's ceilings) and % of mm (the call's FLOPs at this run's mm rate);
  3. each GEMM alone (graph replay, 3 rounds, median; not with ``--only``): 128 / 256-row gate-up tiles under uniform
     and balanced routing, the route's down GEMM, cuBLAS bmm; % of copy (touched weights once) and % of mm (real
     rows; rows multiplied at 128-row blocks).
Prints as it goes, JSON to ``--out``/blk256.json after each cell, the table LAST. Exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import mid7_device_check as md  # noqa: E402  (log, checks, rounds, table: its module state is the run's)

CELLS = ("mixtral-8x7b:512", "deepseek-v3:4096", "mixtral-8x7b:1024", "qwen3-30b-a3b:4096")
H_TOLERANCE = 2e-3  # h at blk256 against g128 on the real rows: the same products, the K steps in the same order


def check_h(name: str, c: dict) -> dict:
    """PASS / FAIL of the gate-up GEMM's h at each 256-row tile against g128's on the real rows
    (``blk256_variants.h_check``)."""
    import blk256_variants as bv

    s0, w = c["sets"][0], c["w"]
    try:
        got = bv.h_check(s0.x, s0.topk_ids, w.w13, w.w2)
    except Exception as exc:  # noqa: BLE001 (reported; the whole calls still run)
        md.log(f"FAIL {name} h b256: {type(exc).__name__}: {str(exc)[-600:]}")
        md.FAILED.append(f"{name} h b256")
        return {}
    md.log(f"{name} h: {got['rows']} real rows; rows multiplied b256 {got['b256_rows']} / g128 {got['g128_rows']}")
    for variant in bv.UP_VARIANTS:
        ok = got[variant]["rel_l2"] < H_TOLERANCE
        md.log(f"{'PASS' if ok else 'FAIL'} {name} h {variant} vs g128 on the real rows: rel L2 "
               f"{got[variant]['rel_l2']:.2e} (< {H_TOLERANCE:g}), bit-equal {got[variant]['equal']}")
        if not ok:
            md.FAILED.append(f"{name} h {variant}")
    return got


def run_cell(spec: str, dev, ceil: dict, args) -> None:
    import blk256_variants as bv

    from moekit.bench.cells import cell_model, measured_experts_touched
    from moekit.experts.triton_gluon import experts_gluon_twin

    c = md.cell_inputs(spec, dev)
    s, m, w, sets = c["s"], c["m"], c["w"], c["sets"]
    s0, name = sets[0], spec
    touched = sum(measured_experts_touched(t.topk_ids, s.num_experts) for t in sets) / len(sets)
    model = cell_model(s, m, touched, 2, ceil["copy_TBps"], ceil["bf16_mm_TFLOPs"])
    rows = md.padded_rows(s0.x, s0.topk_ids, s.num_experts)
    cell = {"cell": spec, "floor_us": model.floor_us, "flops": model.flops, "bytes": model.bytes, "touched": touched,
            "rows_multiplied": rows, "assignments": m * s.top_k, "mm_TFLOPs": ceil["bf16_mm_TFLOPs"]}
    mm70_us = model.flops / (0.7 * ceil["bf16_mm_TFLOPs"] * 1e12) * 1e6
    md.log(f"{name}: floor {model.floor_us:.1f} us (bytes {model.bytes / 1e9:.3f} GB, {model.flops / 1e9:.1f} GFLOP), "
           f"90% needs <= {model.floor_us / 0.9:.1f} us, 70% of mm <= {mm70_us:.1f} us; rows multiplied per real row "
           f"{rows / (m * s.top_k):.3f} at 128-row blocks")
    cell["h"] = check_h(name, c)
    variants, parts = bv.calls_for(c)
    variants = [v for v in variants if not args.only or v.name in args.only or v.name in ("route", "g128")]
    parts = {} if args.only else parts
    ref = experts_gluon_twin(s0.x, w.w13, w.w2, s0.topk_ids, s0.topk_weights)
    outs: dict = {}
    passing = [v for v in variants if md.check(name, v, s0, ref, outs)]
    del ref, outs
    share = (args.deadline - (time.perf_counter() - md.T0)) / max(1, len(args.cells) - len(md.RESULTS["cells"]))
    stop = time.perf_counter() - md.T0 + 0.6 * share
    whole = {v.name: [lambda v=v, t=t: v.call(t.x, t.topk_ids, t.topk_weights) for t in sets] for v in passing}
    cell["rounds_us"] = md.rounds_of(name, whole, dev, args.rounds, 0.015, stop)
    part_fns = {k: [f] for k, f in parts.items()}
    cell["parts_us"] = md.rounds_of(f"{name} parts", part_fns, dev, md.PART_ROUNDS, 0.006, stop + 0.35 * share)
    md.RESULTS["cells"].append(cell)
    (args.out / "blk256.json").write_text(json.dumps({**md.RESULTS, "failed": md.FAILED}, indent=1))
    summarize(cell, s, ceil)


def summarize(cell: dict, s, ceil: dict) -> None:
    """The cell's lines of the final table: whole calls (median, % floor, % mm, x route), then the parts alone."""
    rounds, h = cell.get("rounds_us", {}), cell.get("h", {})
    lines = [f"{cell['cell']}: floor {cell['floor_us']:.1f} us, 90% needs <= {cell['floor_us'] / 0.9:.1f}; rows per "
             f"real row {cell['rows_multiplied'] / cell['assignments']:.3f} (128-row blocks), "
             f"{h.get('b256_rows', 0) / cell['assignments']:.3f} (b256)"]
    base = rounds.get("route")
    for n, t in rounds.items():
        med = statistics.median(t)
        vs = ""
        if base and n != "route":
            wins = sum(b >= 1.03 * v for b, v in zip(base, t))
            vs = f" x{statistics.median(base) / med:5.3f} ({wins}/{min(len(t), len(base))} rounds >= 3%)"
        pct_mm = 100 * cell["flops"] / (med * 1e-6) / 1e12 / cell["mm_TFLOPs"]
        lines.append(f"  {n:12s} {med:8.1f} us [{min(t):.0f}-{max(t):.0f}] {100 * cell['floor_us'] / med:5.1f}% floor "
                     f"{pct_mm:5.1f}% mm{vs}")
    for n, t in cell.get("parts_us", {}).items():
        med = statistics.median(t)
        lines.append(f"  alone {n:20s} {med:8.1f} us{md.part_rates(n, med, cell, s, ceil)}")
    md.SUMMARY.extend(lines)
    print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline", type=float, default=60.0, help="no new timing after this many seconds")
    parser.add_argument("--rounds", type=int, default=md.ROUNDS)
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--only", type=lambda t: set(t.split(",")), default=set(),
                        help="comma-separated whole-call variants to time besides route and g128 (no parts alone)")
    args = parser.parse_args()
    args.deadline -= 4.0  # the table and JSON after the last timing
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    md.RUN.stall_s = 30.0  # the watchdog's silence limit (a hung kernel), inside the 70 s budget
    threading.Thread(target=md.RUN.watchdog, kwargs={"poll_s": 1.0}, daemon=True).start()
    import triton

    from bench_run import ceilings

    from moekit.experts.triton import clear_launch_caches

    ceil = ceilings(dev)
    md.RESULTS.update(ceilings=ceil, device=torch.cuda.get_device_name(), torch=torch.__version__,
                      triton=triton.__version__)
    md.log(f"ceilings: {ceil}; torch {torch.__version__}, triton {triton.__version__}")

    def after() -> None:
        clear_launch_caches()
        torch.cuda.empty_cache()

    md.RUN.each_cell(args.cells, lambda spec: run_cell(spec, dev, ceil, args), args.deadline, after)
    md.RUN.print_table()
    return 1 if md.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())

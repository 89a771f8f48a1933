"""dsv52 device check (session 52, issues 19 and 15): the near-miss cells (bf16 DeepSeek-V3 M = 8 at 0.98x its peer,
fp8 DeepSeek-V3 M = 512 / 1024 at 89 / 88% of the floor, bf16 Qwen3-30B-A3B M = 512 at 88%), each broken down by
launch in graph replay against the pure-read bound of its bytes, and candidates against today's pick.

    PYTHONPATH=$PWD timeout 100 python3 benchmarks/dsv52_device_check.py --out $OUT/dsv52 --deadline 80
    PYTHONPATH=$PWD python3 benchmarks/dsv52_device_check.py --smoke --out /tmp/dsv52   (CPU, interpreted, tiny shape)
    --cells 0,2   the cells of ``dsv52_cells.CELLS`` by position (default: all, in order, while the deadline allows)

Per cell (``dsv52_cells.CELLS``; the variants there):
1. PASS / FAIL of every variant against the twin on the touched experts (bf16: ``experts_reference`` in float64,
   rel L2 < 1e-2; fp8: ``fused_experts_fp8_torch`` on the same quantized weights, < 2e-2), and whether each is
   bit-equal to the route; PASS / FAIL of the pure read's sum against the words summed by torch.
2. One CUDA graph per variant over the cell's input sets, and one of the pure read (``dsv52_read``: one launch over
   exactly the touched experts' w13 / w2 bytes, fp8 scales included, many short programs); 5 interleaved rounds
   (``bench_rounds.settled``), medians; % of the floor (touched bytes + x / out at this run's copy rate, as ``moekit
   bench``); x = route / variant and the rounds >= 3% faster; the read's µs and TB/s.
3. The breakdown of the route's graph (and the cell's ``breakdown`` variants) by launch: torch.profiler's kernels of
   one replay, summed by kind (align, quantize, gate-up, down, k-sum, other) per call; "gaps" = the graph's median µs
   a call minus the kernels' (negative where PDL overlaps them).
Prints the device, the ceilings, PASS / FAIL lines, the table last; writes --out/dsv52.json after each cell.
"""

from __future__ import annotations

import sys

from bench_run import RunLog, cells_check, rel_l2, smoke_mode

SMOKE = smoke_mode()  # TRITON_INTERPRET=1 before moekit imports its kernels

import torch  # noqa: E402

import dsv52_cells as dc  # noqa: E402
from bench_rounds import faster_rounds, medians, timed_graphs, variant_lines  # noqa: E402
from dsv52_read import parts_sum, read_bound, read_table, words_sum  # noqa: E402
from moekit.bench import tuning  # noqa: E402
from moekit.bench.cells import cell_model, make_sets, measured_experts_touched  # noqa: E402

ROUNDS = 5
SAMPLE_US = 3000.0  # µs of GPU work a timed sample (replays of the cell's graph)
RUN = RunLog("dsv52: graph µs a call (median of 5 interleaved rounds), % of the floor at this run's copy rate; "
             "x = route / variant, rounds >= 3% faster", stall_s=60.0)
KINDS = (("align", "align"), ("quantize", "quant"), ("gate-up", "gate_up"), ("down", "down"), ("k-sum", "sum"))


def kind_of(kernel: str) -> str:
    """The breakdown's kind of a kernel name: the first of KINDS whose word it holds, else the name itself (the
    Gluon GEMMs' grouped_gemm kernels serve both GEMMs, each launch its own row in the log)."""
    low = kernel.lower()
    for kind, word in KINDS:
        if word in low:
            return kind
    return kernel[:40]


def breakdown(graph, calls: int, graph_us: float) -> dict:
    """Kernel µs a call by kind in one traced replay of ``graph`` (``calls`` calls), and the gaps."""
    from graph_kernels import graph_kernels, op_lines

    ops = graph_kernels(graph)
    for line in op_lines(ops[:12]):
        RUN.log(f"  {line}")
    by = {}
    for op in ops:
        by[kind_of(op.name)] = by.get(kind_of(op.name), 0.0) + op.us / calls
    by["gaps"] = graph_us - sum(by.values())
    by["launches"] = len(ops) / calls
    return by


def check_cell(cell, shape, w, sets, fns: dict, result: dict) -> dict:
    """PASS / FAIL of each variant against the twin; bit-equality with the route; the read's sum."""
    ref = dc.twin(cell, w, sets[0])
    outs = {name: calls[0]() for name, calls in fns.items()}
    for name, out in outs.items():
        err = rel_l2(out, ref)
        same = torch.equal(out, outs["route"])
        result.setdefault("rel_l2", {})[name] = err
        result.setdefault("bit_equal_route", {})[name] = same
        RUN.check(f"{cell.name} {name} vs twin", err < dc.TOL[cell.dtype],
                  f"rel_l2={err:.2e}{' (bit-equal to the route)' if same and name != 'route' else ''}")
    del ref, outs
    for v in cell.variants:
        if v.kind == "options" and v.name in fns:
            RUN.log(f"{cell.name} {v.name}: its plans' alignment launches {dc.alignment_launches(v)}")
    if "aligned" in fns:
        layouts = dc.aligned_layouts()
        RUN.check(f"{cell.name} aligned: its plans align", bool(layouts) and all(layouts), f"{layouts}")
    if "shortcut" in fns:
        layouts = dc.aligned_layouts(dc.SHORTCUT_OPTIONS)
        RUN.check(f"{cell.name} shortcut: its plans take it", bool(layouts) and not any(layouts), f"{layouts}")
    return result


def read_fns(cell, w, sets) -> tuple[list, int]:
    """The pure read's calls (one per set) and the bytes a call reads on average; its sum checked on set 0."""
    parts = dc.read_parts(cell, w)
    tables = [read_table(parts, dc.touched(s.topk_ids)) for s in sets]
    bufs = [read_bound(t) for t in tables]
    RUN.check(f"{cell.name} pure read vs torch's sum", parts_sum(bufs[0]) == words_sum(parts, dc.touched(
        sets[0].topk_ids)), f"{tables[0].nbytes / 1e6:.1f} MB")
    return [lambda t=t, b=b: read_bound(t, b) for t, b in zip(tables, bufs)], sum(t.nbytes for t in tables) / len(sets)


def floor_us(cell, shape, w, sets, copy_TBps: float) -> float:
    """The bench's floor at this run's copy rate: touched experts' bytes (fp8: with scales) + x / out."""
    hit = sum(measured_experts_touched(s.topk_ids, shape.num_experts) for s in sets) / len(sets)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in dc.weight_parts(cell, w))
    return cell_model(shape, cell.m, hit, 2, copy_TBps, float("inf"), expert_bytes).floor_us


def run_cell(cell, weights: dict, dev, ceil: dict, until: float, result: dict) -> None:
    shape = dc.shape_of(cell)
    key = (cell.preset, cell.dtype)
    if key not in weights:
        weights.clear()  # one preset's weights at a time (DeepSeek-V3 bf16: 22.5 GB)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        weights[key] = tuning.scheme_for(cell.dtype).make_weights(shape, dev)
    w = weights[key]
    sets = make_sets(shape, cell.m, cell.sets, torch.bfloat16, dev, seed=52)
    fns = {}
    RUN.log(f"{cell.label}: checks")
    for v in cell.variants:
        call = dc.variant_call(cell, v, shape, w, dev)
        if call is None:
            RUN.log(f"{cell.name} {v.name}: cannot run here (no such entry, or not Hopper): left out")
            continue
        fns[v.name] = [lambda s=s, c=call: c(s) for s in sets]
    res = check_cell(cell, shape, w, sets, fns, {"variants": [v.name for v in cell.variants if v.name in fns]})
    reads, read_bytes = read_fns(cell, w, sets)
    fns["read"] = reads
    graphs, rounds = timed_graphs(RUN.log, cell.name, fns, len(sets), dev, ROUNDS, SAMPLE_US, until)
    med = medians(rounds)
    floor = floor_us(cell, shape, w, sets, ceil["copy_TBps"])
    res |= {"rounds": rounds, "median_us": med, "floor_us": floor, "read_bytes": read_bytes,
            "read_TBps": read_bytes / med["read"] / 1e6 if med["read"] == med["read"] else None,
            "x": {n: med["route"] / med[n] for n in med}, "wins": {n: faster_rounds(rounds[n], rounds["route"])
                                                                  for n in med if n != "route"}}
    if dev.type == "cuda":
        res["breakdown"] = {n: breakdown(graphs[n], len(sets), med[n]) for n in cell.breakdown if n in graphs}
    result["cells"][cell.label] = res
    RUN.summary.extend(table_lines(cell, res))


def table_lines(cell, res: dict) -> list[str]:
    med, floor = res["median_us"], res["floor_us"]
    lines = [f"{cell.label}: floor {floor:.1f} µs; read {med['read']:.1f} µs "
             f"({(res['read_TBps'] or float('nan')):.2f} TB/s, route at {100 * med['read'] / med['route']:.1f}% "
             f"of it)"]
    lines += variant_lines(res, floor)
    for name, by in res.get("breakdown", {}).items():
        lines.append(f"  {name} by launch: " + ", ".join(f"{k} {v:.1f}" for k, v in by.items()))
    return lines


def main() -> int:
    weights: dict = {}  # one preset's weights at a time, kept from cell to cell

    def run_one(cell, dev, ceil: dict, until: float, result: dict) -> None:
        run_cell(cell, weights, dev, ceil, until, result)

    cells = dc.SMOKE_CELLS if SMOKE else dc.CELLS
    return cells_check(RUN, SMOKE, "dsv52", 80.0, {cell.label: cell for cell in cells}, run_one)


if __name__ == "__main__":
    sys.exit(main())

"""f8t51 device check (session 51, issues 15 and 19): the fp8 and bf16 mid-batch entries re-tuned on today's kernels
with ``moekit tune`` (its search now times the fp8 entries' switches and starts from today's entry:
``moekit.bench.tuning_switches``), each tuned entry checked against the torch twin, then timed against the shipped
one in CUDA-graph replay.

    PYTHONPATH=$PWD timeout 290 python3 benchmarks/f8t51_device_check.py --out $OUT/f8t51 --deadline 220
    PYTHONPATH=$PWD timeout 150 python3 benchmarks/f8t51_device_check.py --confirm RUN.json --out $OUT/f8t51 \
        --deadline 120
    PYTHONPATH=$PWD python3 benchmarks/f8t51_device_check.py --smoke --out /tmp/f8t51   (CPU, interpreted, tiny shape)

Groups, in this order, each tuned, then checked and timed, before the next starts (``GROUPS``: a group starts only
with its share of time left; ``tune``'s budget: no new M past it, the M in the order given):
  fp8 Qwen3-30B-A3B M = 1024 512 256 8 128 32 64 (the cells furthest below issue 15's 90% first), fp8 Mixtral-8x7B
  256 128 32, bf16 Qwen3 1024 512, fp8 DeepSeek-V3 512 1024. Mixtral's fp8 512 / 1024 and bf16 512 / 1024 run on the
  Gluon GEMMs (``Fp8GluonChoice`` / ``GluonChoice``): no tuned entry reaches them, so those cells time the route
  against the Triton path's shipped entry only (group "mixtral-gluon", last).
Per cell: PASS / FAIL of each entry timed against the torch twin (fp8: ``fused_experts_fp8_torch`` on the same
quantized weights, rel L2 < 2e-2; bf16: ``experts_reference`` in float64, < 1e-2); then graph µs, 5 interleaved
rounds (``bench_rounds.settled``), medians, % of the floor at this run's copy and matmul rates, x = shipped / tuned
and the rounds the tuned entry took <= 0.97 x the shipped. Tuned files under --out/tuned (``moekit tune``'s own:
"measured" holds us / heuristic_us / current_us), the JSON --out/f8t51.json (per cell the entries as a file writes
them, rounds, medians), the table last.
--confirm FILE (a run's JSON): no tuning; "shipped" = the entries FILE recorded as shipped, "tuned" = today's lookup
(the installed entries), for the cells whose entry differs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench_run import RunLog, rel_l2, run_info, smoke_mode, write_json

SMOKE = smoke_mode()  # TRITON_INTERPRET=1 before moekit imports its kernels

import torch  # noqa: E402

from bench_rounds import event_timer, faster_rounds, graph_of, medians, settled  # noqa: E402
from moekit.bench import tuning, tuning_quant, tuning_switches  # noqa: E402
from moekit.bench.cells import Shape, cell_model, make_sets, measured_experts_touched  # noqa: E402
from moekit.experts import get_backend  # noqa: E402
from moekit.experts.configs import KernelConfig, device_key, read_configs  # noqa: E402
from moekit.experts.reference import experts_reference  # noqa: E402
from moekit.experts.triton_fp8 import fused_experts_fp8_torch  # noqa: E402
from moekit.experts.triton_fp8_plan import read_entries  # noqa: E402

ROUNDS = 5
TOL = {"fp8_block": 2e-2, "bfloat16": 1e-2}
PER_M_S = 15.0  # what one M's search may take past tune's budget (it starts no M past it, finishes the one it is on)
SAMPLE_US = 2000.0  # µs of GPU work per timed sample (graph replays of the cell's input sets)
RUN = RunLog("f8t51: graph µs (median of 5 interleaved rounds), % of floor; x = shipped / tuned, rounds >= 3%",
             stall_s=150.0)


@dataclass(frozen=True)
class Group:
    name: str
    preset: str
    dtype: str  # "fp8_block" or "bfloat16"
    batches: tuple[int, ...]  # tuned in this order
    tune_s: float  # seconds of tuning at most (0: none: the route against the shipped entry)
    share: float  # the fraction of the deadline by which the group starts (else skipped)


GROUPS = (
    Group("qwen3-fp8", "qwen3-30b-a3b", "fp8_block", (1024, 512, 256, 8, 128, 32, 64), 80.0, 0.0),
    Group("mixtral-fp8", "mixtral-8x7b", "fp8_block", (256, 128, 32), 40.0, 0.55),
    Group("qwen3-bf16", "qwen3-30b-a3b", "bfloat16", (1024, 512), 20.0, 0.72),
    Group("deepseek-fp8", "deepseek-v3", "fp8_block", (512, 1024), 25.0, 0.78),
    Group("mixtral-gluon", "mixtral-8x7b", "fp8_block", (512, 1024), 0.0, 0.90),
    Group("mixtral-gluon-bf16", "mixtral-8x7b", "bfloat16", (512, 1024), 0.0, 0.93),
)
SMOKE_SHAPE = Shape("tiny", num_experts=8, n=128, k=256, top_k=2)
SMOKE_GROUPS = (Group("tiny-fp8", "tiny", "fp8_block", (80, 8), 1.0, 0.0),
                Group("tiny-bf16", "tiny", "bfloat16", (80,), 1.0, 0.0))


class Progress:
    """``tune``'s progress, as log lines (the watchdog's heartbeat)."""

    def add_task(self, label, total, completed):
        RUN.log(f"{label}: {completed} of {total} M done before")
        return label

    def update(self, task, advance, description):
        RUN.log(description)


def shape_of(group: Group) -> Shape:
    return SMOKE_SHAPE if SMOKE else Shape.from_preset(group.preset)


def gluon_route(shape: Shape, dtype: str, m: int, dev) -> bool:
    """Whether the ``triton`` backend sends this call to the Gluon GEMMs (its default choices, on Hopper)."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
        return False
    if dtype == "fp8_block":
        from moekit.experts.triton_gluon_fp8 import DEFAULT_FP8_CHOICE

        return DEFAULT_FP8_CHOICE.wants(m, shape.top_k, shape.n, shape.k, shape.num_experts)
    from moekit.experts.triton_gluon import DEFAULT_CHOICE

    return DEFAULT_CHOICE.wants(m, shape.n, shape.top_k, shape.num_experts)


def entry_at(path: Path, dtype: str, m: int, shape: Shape) -> KernelConfig | None:
    """A config file's entry of exactly M, as the candidate that runs it (None: the file has no such M)."""
    if not path.is_file() or str(m) not in json.loads(path.read_text())["configs"]:
        return None
    if dtype == "fp8_block":
        return tuning_switches.candidate_of(read_entries(path)[m], m, shape)
    return read_configs(path)[m]


def recorded_entry(entry: dict, dtype: str, m: int, shape: Shape, where: Path) -> KernelConfig:
    """An entry as a run's JSON recorded it (a file's entry), as the candidate that runs it."""
    path = where / f"m{m}.json"
    path.write_text(json.dumps({"configs": {str(m): entry}}))
    return entry_at(path, dtype, m, shape)


def twin(dtype: str, w, s) -> torch.Tensor:
    if dtype == "fp8_block":
        return fused_experts_fp8_torch(s.x, w.w13.q, w.w13.scale, w.w2.q, w.w2.scale, s.topk_ids, s.topk_weights,
                                       block_shape=tuple(w.w13.block_shape))
    return experts_reference(s.x.double(), w.w13.double(), w.w2.double(), s.topk_ids, s.topk_weights)


def floor_us(group: Group, shape: Shape, m: int, w, sets, ceil: dict) -> float:
    """The cell's floor at this run's copy rate and matmul rate (fp8's for fp8_block), the experts touched counted."""
    touched = sum(measured_experts_touched(s.topk_ids, shape.num_experts) for s in sets) / len(sets)
    if group.dtype == "fp8_block":
        expert_bytes = sum(t.nbytes for q in (w.w13, w.w2) for t in (q.q, q.scale)) / shape.num_experts
        rate = ceil["fp8_mm_TFLOPs"] or ceil["bf16_mm_TFLOPs"]
    else:
        expert_bytes, rate = None, ceil["bf16_mm_TFLOPs"]
    return cell_model(shape, m, touched, 2, ceil["copy_TBps"], rate, expert_bytes).floor_us


def time_cell(group: Group, shape: Shape, m: int, scheme, w, entries: dict, dev, ceil: dict, until: float) -> dict:
    """Checks, then graph rounds, of ``entries`` (name -> candidate, or "route": the backend call) at one M."""
    sets = make_sets(shape, m, 2 if m > 64 else 4, torch.bfloat16, dev, seed=11)
    backend = get_backend("triton")
    fns = {}
    for name, cfg in entries.items():
        if cfg == "route":
            fns[name] = [lambda s=s: backend(s.x, w.w13, w.w2, s.topk_ids, s.topk_weights) for s in sets]
        else:
            fns[name] = [lambda s=s, c=cfg: scheme.call(w, s, c) for s in sets]
    ref = twin(group.dtype, w, sets[0])
    rel = {}
    for name, calls in fns.items():
        rel[name] = rel_l2(calls[0](), ref)
        RUN.check(f"{shape.name} {group.dtype} M={m} {name} vs twin", rel[name] < TOL[group.dtype],
                  f"rel_l2={rel[name]:.2e}")
    del ref
    graphs = {name: graph_of(calls, dev) for name, calls in fns.items()}
    replays = 1
    if dev.type == "cuda":
        first = next(iter(graphs.values()))
        us = event_timer()(first.replay) * 1e3 / len(sets)
        replays = max(1, round(SAMPLE_US / (us * len(sets))))
    rounds = settled({name: (g, None) for name, g in graphs.items()}, len(sets), dev, ROUNDS, replays, until)
    med = medians(rounds)
    floor = floor_us(group, shape, m, w, sets, ceil)
    cell = {"rel": rel, "rounds": rounds, "median_us": med, "floor_us": floor,
            "pct_floor": {name: 100 * floor / us for name, us in med.items()},
            "entries": {name: (cfg if cfg == "route" else cfg.to_dict()) for name, cfg in entries.items()}}
    if "tuned" in rounds:
        cell["x"] = med["shipped"] / med["tuned"]
        cell["wins"] = faster_rounds(rounds["tuned"], rounds["shipped"])
    RUN.summary.append(table_line(shape, group.dtype, m, cell))
    return cell


def table_line(shape: Shape, dtype: str, m: int, cell: dict) -> str:
    med, pct = cell["median_us"], cell["pct_floor"]
    parts = [f"{shape.name:14} {dtype:9} M={m:5}"]
    parts += [f"{name} {med[name]:8.1f} ({pct[name]:5.1f}%)" for name in med]
    if "x" in cell:
        parts.append(f"x{cell['x']:.3f} >=3% in {cell['wins']}/{len(cell['rounds']['tuned'])}")
    return "  ".join(parts)


def run_group(group: Group, args, result: dict, dev, ceil: dict, t_end: float) -> None:
    shape, scheme = shape_of(group), tuning.scheme_for(group.dtype)
    dev_key = device_key(dev)
    tuned_path = None
    if group.tune_s and not args.confirm:
        left = t_end - time.time() - 4.0 * len(group.batches)  # the checks and rounds after it
        budget = max(1.0, min(group.tune_s, left) - PER_M_S)
        t0 = time.time()
        tuned_path = tuning.tune(shape, list(group.batches), group.dtype, device=dev, out_dir=Path(args.out) / "tuned"
                                 if args.out else Path(tempfile.mkdtemp()), budget_s=budget, progress=Progress(),
                                 note=RUN.log)
        result["groups"][group.name] = {"file": str(tuned_path), "tune_s": round(time.time() - t0, 1),
                                        "measured": json.loads(tuned_path.read_text()).get("measured", {})}
    w = scheme.make_weights(shape, dev)
    for m in group.batches:
        if time.time() > t_end:
            RUN.log(f"SKIP {group.name} M={m}: deadline")
            RUN.summary.append(f"{shape.name:14} {group.dtype:9} M={m:5}  not reached")
            continue
        shipped = scheme.current(m, shape, dev_key)
        entries = {"shipped": shipped}
        key = f"{group.preset} {group.dtype} M={m}"
        if args.confirm:
            old = args.recorded.get(key, {}).get("entries", {}).get("shipped")
            if old is None or recorded_entry(old, group.dtype, m, shape, args.scratch) == shipped:
                continue
            entries = {"shipped": recorded_entry(old, group.dtype, m, shape, args.scratch), "tuned": shipped}
        tuned = entry_at(tuned_path, group.dtype, m, shape) if tuned_path is not None and not args.confirm else None
        if tuned is not None and tuned != shipped:
            entries["tuned"] = tuned
        if gluon_route(shape, group.dtype, m, dev):
            entries["route"] = "route"
        if len(entries) == 1 and not args.confirm:
            why = "not tuned (the budget)" if tuned is None else "the tuned entry is the shipped one"
            RUN.summary.append(f"{shape.name:14} {group.dtype:9} M={m:5}  {why}: not timed")
            result["cells"][key] = {"entries": {"shipped": shipped.to_dict()}, "tuned_is_shipped": tuned is not None}
            continue
        result["cells"][key] = time_cell(group, shape, m, scheme, w, entries, dev, ceil, t_end)
        if args.path:
            write_json(args.path, result)
    del w
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--deadline", type=float, default=240.0)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--confirm", default="", help="a run's JSON: its shipped entries against today's lookups")
    p.add_argument("--groups", default="", help="comma-separated names of GROUPS (default: all)")
    args = p.parse_args()
    args.path = args.out and os.path.join(args.out, "f8t51.json")
    args.scratch = Path(tempfile.mkdtemp())
    args.recorded = json.loads(Path(args.confirm).read_text())["cells"] if args.confirm else {}
    os.environ["MOEKIT_CONFIG_DIR"] = tempfile.mkdtemp()  # no user file of this machine in any lookup
    threading.Thread(target=RUN.watchdog, daemon=True).start()
    dev = torch.device("cpu" if SMOKE else "cuda")
    t_start = time.time()
    result = {"run": run_info() | {"smoke": SMOKE, "confirm": args.confirm, "device_key": device_key(dev)},
              "groups": {}, "cells": {}}
    if SMOKE:
        shrink_search()
        ceil = {"copy_TBps": 1.0, "bf16_mm_TFLOPs": 1.0, "fp8_mm_TFLOPs": 1.0}
    else:
        from bench_run import ceilings

        ceil = ceilings(dev, fp8=True)
    result["ceilings"] = ceil
    RUN.log(f"{result['run']} {ceil}")
    groups = SMOKE_GROUPS if SMOKE else [g for g in GROUPS if not args.groups or g.name in args.groups.split(",")]
    for group in groups:
        if time.time() - t_start > group.share * args.deadline and group.share:
            RUN.log(f"SKIP {group.name}: past {group.share:.0%} of the deadline")
            RUN.summary.append(f"{group.name}: not reached")
            continue
        RUN.each_cell([group.name], lambda _, g=group: run_group(g, args, result, dev, ceil,
                                                                t_start + args.deadline), args.deadline)
        if args.path:
            write_json(args.path, result)
    RUN.print_table()
    return 1 if RUN.failed else 0


def shrink_search() -> None:
    """--smoke: the search's timer replaced by a stand-in that favours a candidate with switches (the interpreter
    would run every config many times; the flow is what the smoke checks: tune, file, entries, checks, rounds)."""
    def timer(shape, num_tokens, scheme, device, weights):
        return lambda configs: [100.0 - 10.0 * isinstance(c, tuning_switches.Fp8Candidate) - c.BLOCK_M / 100
                                for c in configs]

    tuning._timer = timer


if __name__ == "__main__":
    sys.exit(main())

"""A weight-only decode cell as ``wo_tc_device_check`` and ``wo_mma_device_check`` measure it: random packed
weights of the scheme (``wo_device_check.quantized``), SETS rotated input sets, the packed-byte floor at this run's
copy rate, each variant (a decode and its config) checked against the torch twin on the first set and captured in
one CUDA graph over all the sets, the graphs timed in interleaved rounds (``bench_rounds``), and where asked each
variant's eager host / wall µs a call. One cell a child process (``child``); its JSON <out>/<tag>-<i>.json.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import traceback

import torch

from bench_rounds import eager_us, graph_of, interleaved, medians
from bench_run import RunLog, run_info, write_json
from wo_device_check import copy_tbps, packed_bytes, precompile, quantized, rel_err

from moekit.bench.cells import Shape, make_sets, measured_experts_touched
from moekit.experts.triton_wo import fused_experts_wo_torch, run_experts_wo, weight_args

SETS, ROUNDS, REPLAYS = 3, 5, 5
TOL = 1e-2  # rel-L2 against the torch twin
SMOKE_SHAPE = Shape("tiny", 8, 64, 128, 2)  # --smoke (the interpreter): every cell at this shape, M = 1


@dataclasses.dataclass
class Cell:
    preset: str
    scheme: str
    m: int
    floor_us: float
    times: dict = dataclasses.field(default_factory=dict)  # variant -> median µs a call
    rounds: dict = dataclasses.field(default_factory=dict)  # variant -> µs a call, each round
    errors: dict = dataclasses.field(default_factory=dict)  # variant -> rel-L2 against the twin
    configs: dict = dataclasses.field(default_factory=dict)  # variant -> (decode, config dict)
    bytes: float = 0.0  # the floor's bytes (touched experts' packed weights, scales, zeros; x and out)
    eager: dict = dataclasses.field(default_factory=dict)  # variant -> {"host_us", "wall_us"} (eager_calls)


def measure_cell(s: Shape, scheme: str, m: int, dev, bw: float, found: dict, run: RunLog, eager_calls: int = 0) -> Cell:
    """The cell of ``s``, ``scheme``, M = m; ``found``: variant -> (decode, config), "pick" first; ``eager_calls``
    > 0: eager host / wall µs a call of that many calls too (on the GPU)."""
    w13 = quantized(scheme, s.num_experts, 2 * s.n, s.k, dev, seed=1)
    w2 = quantized(scheme, s.num_experts, s.k, s.n, dev, seed=2)
    a13, a2 = (weight_args(w.q, w.scale, w.zero, w.group_size) for w in (w13, w2))
    inputs = make_sets(s, m, SETS, torch.bfloat16, dev, seed=m)
    touched = statistics.mean(measured_experts_touched(c.topk_ids, s.num_experts) for c in inputs)
    floor_us = (touched * (packed_bytes(w13) + packed_bytes(w2)) + 2 * m * s.k * 2) / (bw * 1e12) * 1e6
    cell = Cell(s.name, scheme, m, floor_us, bytes=floor_us * bw * 1e6)
    if dev.type == "cuda":
        t0 = time.perf_counter()
        precompile([(s, scheme, m, d, cfg, None) for d, cfg in found.values()], dev)
        print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
    c0 = inputs[0]
    want = fused_experts_wo_torch(c0.x, w13, w2, c0.topk_ids, c0.topk_weights)
    graphs, calls = {}, {}
    for name, (decode, cfg) in found.items():
        tag = f"{s.name} {scheme} M={m} {name}"
        cell.configs[name] = (decode, cfg.to_dict())

        def call(c, decode=decode, cfg=cfg):
            return run_experts_wo(c.x, a13, a2, c.topk_ids, c.topk_weights, None, scheme, config=cfg, decode=decode)

        try:
            cell.errors[name] = err = rel_err(call(c0), want)
            run.check(tag, err < TOL, f"rel_err={err:.2e} ({decode} {cfg.to_dict()})")
            if err < TOL:
                graphs[name] = graph_of([lambda c=c: call(c) for c in inputs], dev)
                calls[name] = [lambda c=c, f=call: f(c) for c in inputs]
        except Exception as e:  # noqa: BLE001  (one variant's failure never loses the cell)
            traceback.print_exc(limit=3)
            run.check(tag, False, f"raised {type(e).__name__}: {e}")
    cell.rounds = interleaved(graphs, len(inputs), dev, ROUNDS, REPLAYS)
    if eager_calls and dev.type == "cuda":  # host µs a call (enqueue only), wall µs
        for name, (host, wall) in eager_us(calls, ROUNDS, eager_calls).items():
            cell.eager[name] = {"host_us": host, "wall_us": wall}
    cell.times = medians(cell.rounds)
    print(f"  {s.name} {scheme} M={m} floor {floor_us:.1f}: "
          + "  ".join(f"{k} {v:.1f}" for k, v in cell.times.items()), flush=True)
    return cell


def dump(path: str, cells: list, bw: float, run: RunLog) -> None:
    cells = [dataclasses.asdict(c) for c in cells]
    write_json(path, {**run_info(), "copy_TBps": bw, "cells": cells, "failed": run.failed})


def child(cell: tuple, args, tag: str, index: int, measure, run: RunLog) -> int:
    """``measure(shape, scheme, m, dev, bw)`` of cell (preset, scheme, M) in this process (--smoke: SMOKE_SHAPE,
    M = 1); its JSON to <args.out>/<tag>-<index>.json. Exit 1 when a check failed."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bw = copy_tbps(dev)
    preset, scheme, m = cell
    s = SMOKE_SHAPE if args.smoke else Shape.from_preset(preset)
    got = measure(s, scheme, 1 if args.smoke and m > 1 else m, dev, bw)
    dump(os.path.join(args.out, f"{tag}-{index}.json"), [got], bw, run)
    return 1 if run.failed else 0

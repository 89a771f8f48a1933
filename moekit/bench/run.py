"""The sweep behind ``moekit bench``: ceilings first, then every (shape, M, backend) cell.

Routing is excluded from the time (it is drawn before), the whole experts path is included
(alignment, GEMMs, combine). On the GPU: bf16, the real presets, CUDA-graph replay for M <= 1024,
inputs rotated over several routings so each call streams its experts' weights from HBM. On the CPU:
float32, presets scaled down by ``CPU_SCALE``, compared with the float32 matmul rate of the same run.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
from dataclasses import asdict, dataclass

import torch

from moekit.bench.ceilings import Ceilings, measure_ceilings
from moekit.bench.cells import (
    CPU_BATCHES, CPU_SCALE, GPU_BATCHES, PRESETS, CellInputs, ExpertWeights, Shape, cell_model, make_sets,
    make_weights, measured_experts_touched,
)
from moekit.bench.report import format_bandwidth, format_flops
from moekit.bench.timing import (
    EAGER_CALLS, MIN_REPEATS, NOISY_SPREAD_PCT, EagerTiming, Timing, time_eager, time_stats,
)
from moekit.experts import available_backends, backend_available, backend_names, get_backend

GRAPH_MAX_M = 1024  # CUDA-graph replay up to here: the decode range, where launch gaps matter
REFERENCE_MAX_M = {"cuda": 8, "cpu": 128}  # the per-expert loop syncs and upcasts: past this it only costs time
ROTATION_BYTES = 256 << 20  # rotate inputs until the weights one pass touches exceed ~4x the H200's L2


@dataclass
class Cell:
    shape: str
    M: int
    backend: str
    us: float  # median µs per call (graph replay where ``graph``, else events / wall clock)
    min_us: float  # fastest of the timed passes, µs per call
    max_us: float  # slowest of the timed passes, µs per call
    spread_pct: float  # interquartile range of the passes / us * 100
    noisy: bool  # spread_pct > timing.NOISY_SPREAD_PCT: the median is not to be trusted to 10%
    repeats: int  # passes timed (>= 5)
    eager_us: float  # back-to-back eager calls, one sync at the end, per call (on the CPU: = us)
    host_us: float  # the host's time to issue those calls, before the sync, per call (on the CPU: = us)
    experts_touched: float  # mean over the rotated routings
    bytes: float  # compulsory bytes of one call
    flops: float  # 6*N*K*M*k
    floor_us: float  # max(bytes / copy BW, flops / matmul rate)
    pct_floor: float  # floor_us / us * 100
    pct_copy_bw: float  # achieved bytes/s over the measured copy bandwidth * 100
    tflops: float  # achieved 1e12 FLOP/s
    pct_mm: float  # achieved FLOP/s over the measured matmul rate * 100
    graph: bool  # timed as CUDA-graph replay
    rel_err_vs_grouped_mm: float | None = None  # sanity check on the first input set (triton only)


@dataclass(frozen=True)
class BenchSetup:
    """What ``moekit bench`` sweeps on a device when not told otherwise."""

    shapes: list[Shape]  # the presets' routed experts; N and K divided by CPU_SCALE on the CPU
    batches: list[int]  # M values: GPU_BATCHES on the GPU, CPU_BATCHES on the CPU
    dtype: torch.dtype  # bf16 on the GPU, float32 on the CPU


def default_setup(device: torch.device) -> BenchSetup:
    """The real presets in bf16 on the GPU, scaled-down presets in float32 on the CPU."""
    if device.type == "cuda":
        return BenchSetup([Shape.from_preset(p) for p in PRESETS], list(GPU_BATCHES), torch.bfloat16)
    return BenchSetup([Shape.from_preset(p, CPU_SCALE) for p in PRESETS], list(CPU_BATCHES), torch.float32)


def commit_id() -> str:
    if os.environ.get("MOEKIT_COMMIT"):
        return os.environ["MOEKIT_COMMIT"]
    try:
        here = os.path.dirname(__file__)
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=os.path.join(here, ".."),
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclass(frozen=True)
class BackendTiming:
    """One backend's timings in one cell."""

    timing: Timing  # the cell's number: graph replay where ``graph``, else events / wall clock
    eager: EagerTiming  # plain eager calls; on the CPU the same number as ``timing.us`` (one clock there)
    graph: bool  # ``timing`` is a CUDA-graph replay


def _time_backend(fn, weights: ExpertWeights, sets: list[CellInputs], device, graph: bool) -> BackendTiming:
    w13, w2 = weights.w13, weights.w2
    calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
    timing = None
    if graph:
        try:
            timing = time_stats(calls, device, graph=True)
        except RuntimeError:  # a backend that syncs cannot be captured: time it with events instead
            torch.cuda.synchronize()
            graph = False
    timing = timing or time_stats(calls, device, graph=False)
    if device.type != "cuda":  # the host does the work: eager, host and the timing are one wall clock
        return BackendTiming(timing, EagerTiming(timing.us, timing.us, timing.spread_pct), False)
    return BackendTiming(timing, time_eager(calls, device), graph)


def _rel_err(name: str, backends, weights: ExpertWeights, first: CellInputs, ref_out):
    """(grouped_mm's output on the first set, kept for the next backend; triton's error against it)."""
    args = (first.x, weights.w13, weights.w2, first.topk_ids, first.topk_weights)
    if name == "grouped_mm":
        return get_backend(name)(*args).float(), None
    if name == "triton" and "grouped_mm" in backends:
        ref_out = ref_out if ref_out is not None else get_backend("grouped_mm")(*args).float()
        out = get_backend(name)(*args).float()
        return ref_out, ((out - ref_out).norm() / ref_out.norm()).item()
    return ref_out, None


def _make_cell(shape: Shape, m: int, name: str, t: BackendTiming, touched: float, model, ceilings: Ceilings,
               err: float | None) -> Cell:
    us = t.timing.us
    return Cell(
        shape=shape.name, M=m, backend=name, us=us, min_us=t.timing.min_us, max_us=t.timing.max_us,
        spread_pct=t.timing.spread_pct, noisy=t.timing.noisy, repeats=t.timing.repeats,
        eager_us=t.eager.eager_us, host_us=t.eager.host_us, experts_touched=touched, bytes=model.bytes,
        flops=model.flops, floor_us=model.floor_us, pct_floor=100 * model.floor_us / us,
        pct_copy_bw=100 * model.bytes / (us * 1e-6) / (ceilings.copy_TBps * 1e12),
        tflops=model.flops / (us * 1e-6) / 1e12,
        pct_mm=100 * model.flops / (us * 1e-6) / (ceilings.mm_TFLOPs * 1e12),
        graph=t.graph, rel_err_vs_grouped_mm=err,
    )


def run_cells(shape: Shape, batches, backends, dtype, device, ceilings: Ceilings, on_cell=None) -> list[Cell]:
    weights = make_weights(shape, dtype, device)
    elem = weights.w13.element_size()
    cells = []
    for m in batches:
        touched_once = max(1, min(shape.num_experts, m * shape.top_k)) * shape.expert_bytes(elem)
        num_sets = max(2, min(8, math.ceil(ROTATION_BYTES / touched_once)))
        sets = make_sets(shape, m, num_sets, dtype, device)
        touched = sum(measured_experts_touched(s.topk_ids, shape.num_experts) for s in sets) / num_sets
        model = cell_model(shape, m, touched, elem, ceilings.copy_TBps, ceilings.mm_TFLOPs)
        ref_out = None
        for name in backends:
            if name == "reference" and m > REFERENCE_MAX_M[device.type]:
                continue
            ref_out, err = _rel_err(name, backends, weights, sets[0], ref_out)
            use_graph = device.type == "cuda" and m <= GRAPH_MAX_M and name != "reference"
            timed = _time_backend(get_backend(name), weights, sets, device, use_graph)
            cell = _make_cell(shape, m, name, timed, touched, model, ceilings, err)
            cells.append(cell)
            if on_cell:
                on_cell(cell)
        del sets
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cells


def geomean_speedup(cells: list[Cell], fast: str = "triton", base: str = "grouped_mm") -> float | None:
    us = {(c.shape, c.M, c.backend): c.us for c in cells}
    ratios = [us[(s, m, base)] / us[(s, m, fast)] for (s, m, b) in us if b == fast and (s, m, base) in us]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def check_args(backends=None, batches=None, device: torch.device | None = None) -> None:
    """Raise ``ValueError`` for an unknown backend, a backend that cannot run on ``device`` here, or a
    batch below one token. Each message begins with the argument's name (``backends: ...``), which is
    also the CLI flag's."""
    unknown = [b for b in backends or () if b not in backend_names()]
    if unknown:
        raise ValueError(f"backends: unknown {unknown}; must be among {backend_names()}")
    if device is not None:
        runnable = runnable_backends(device)
        missing = [b for b in backends or () if b not in runnable]
        if missing:
            hint = " (triton runs off CUDA only interpreted, under TRITON_INTERPRET=1)" if "triton" in missing else ""
            raise ValueError(f"backends: {missing} cannot run on {device.type} here{hint}; "
                             f"available on this device: {runnable}")
    if batches and min(batches) < 1:
        raise ValueError(f"batches: must be >= 1 token, got {list(batches)}")


def runnable_backends(device: torch.device) -> list[str]:
    """Every backend that can run on ``device`` here, by name (``auto``'s list, plus interpreted Triton)."""
    return [b for b in backend_names() if backend_available(b, device)]


@dataclass(frozen=True)
class BenchProgress:
    """What ``run_bench`` reports as it goes: once before and once after the ceilings, once per cell."""

    done: int  # cells timed so far
    total: int  # cells this run times
    message: str  # one line: the ceilings, or the cell just timed


def _cell_line(cell: Cell) -> str:
    noisy = "  NOISY" if cell.noisy else ""
    return (f"{cell.shape} M={cell.M} {cell.backend}: {cell.us:.1f} µs ±{cell.spread_pct:.0f}%, "
            f"{cell.pct_floor:.0f}% of floor, eager {cell.eager_us:.1f} µs, host {cell.host_us:.1f} µs{noisy}")


def run_bench(device: torch.device, shapes=None, batches=None, backends=None, on_progress=None) -> dict:
    """Measure the ceilings, then every cell, calling ``on_progress(BenchProgress)`` as it goes.
    Returns the results document (see ``report.write_json``)."""
    check_args(backends, batches, device)
    setup = default_setup(device)
    shapes = shapes or setup.shapes
    batches = batches or setup.batches
    backends = backends or available_backends(device)
    total = len(shapes) * sum(1 for m in batches for b in backends
                              if b != "reference" or m <= REFERENCE_MAX_M[device.type])
    report = on_progress or (lambda p: None)
    report(BenchProgress(0, total, f"ceilings: measuring copy bandwidth and matmul rate on {device_name(device)}"))
    ceilings = measure_ceilings(device)
    report(BenchProgress(0, total, f"ceilings: copy {format_bandwidth(ceilings.copy_TBps * 1e12)}, "
                                   f"matmul {format_flops(ceilings.mm_TFLOPs * 1e12)} ({ceilings.mm_dtype})"))
    cells: list[Cell] = []
    timed: list[Cell] = []  # grows cell by cell, ``cells`` shape by shape

    def on_cell(cell: Cell):
        timed.append(cell)
        report(BenchProgress(len(timed), total, _cell_line(cell)))

    for shape in shapes:
        cells += run_cells(shape, batches, backends, setup.dtype, device, ceilings, on_cell)
    return _document(device, setup.dtype, ceilings, shapes, cells)


def _document(device, dtype, ceilings: Ceilings, shapes, cells: list[Cell]) -> dict:
    return {
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "ceilings": asdict(ceilings),
        "method": (
            f"routing excluded, alignment included; CUDA-graph replay for M <= {GRAPH_MAX_M}; inputs rotated "
            "over 2-8 routings so each call streams its weights from HBM; us = median of >= "
            f"{MIN_REPEATS} passes, spread_pct = interquartile range / median, noisy above "
            f"{NOISY_SPREAD_PCT:.0f}%; eager_us = {EAGER_CALLS} back-to-back eager calls, one sync at the "
            "end, host_us = their issue time before that sync (both = us on the CPU)"
        ),
        "noisy_spread_pct": NOISY_SPREAD_PCT,
        "cpu_threads": torch.get_num_threads(),  # torch's intra-op threads (OMP_NUM_THREADS): CPU timings depend on it
        "shapes": [asdict(s) for s in shapes],
        "cells": [asdict(c) for c in cells],
        "summary": {"geomean_speedup_triton_vs_grouped_mm": geomean_speedup(cells)},
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None

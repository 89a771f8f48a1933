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
from moekit.bench.timing import time_calls
from moekit.experts import available_backends, backend_names, get_backend

GRAPH_MAX_M = 1024  # CUDA-graph replay up to here: the decode range, where launch gaps matter
REFERENCE_MAX_M = {"cuda": 8, "cpu": 128}  # the per-expert loop syncs and upcasts: past this it only costs time
ROTATION_BYTES = 256 << 20  # rotate inputs until the weights one pass touches exceed ~4x the H200's L2


@dataclass
class Cell:
    shape: str
    M: int
    backend: str
    us: float  # median µs per call
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


def _time_backend(fn, weights: ExpertWeights, sets: list[CellInputs], device, graph: bool) -> tuple[float, bool]:
    w13, w2 = weights.w13, weights.w2
    calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
    if graph:
        try:
            return time_calls(calls, device, graph=True), True
        except RuntimeError:  # a backend that syncs cannot be captured: time it with events instead
            torch.cuda.synchronize()
    return time_calls(calls, device, graph=False), False


def run_cells(shape: Shape, batches, backends, dtype, device, ceilings: Ceilings, on_cell=None) -> list[Cell]:
    weights = make_weights(shape, dtype, device)
    w13, w2 = weights.w13, weights.w2
    elem = w13.element_size()
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
            fn = get_backend(name)
            err = None
            first = sets[0]
            if name == "grouped_mm":
                ref_out = fn(first.x, w13, w2, first.topk_ids, first.topk_weights).float()
            if name == "triton" and "grouped_mm" in backends:
                ref_out = ref_out if ref_out is not None else get_backend("grouped_mm")(
                    first.x, w13, w2, first.topk_ids, first.topk_weights).float()
                out = fn(first.x, w13, w2, first.topk_ids, first.topk_weights).float()
                err = ((out - ref_out).norm() / ref_out.norm()).item()
            use_graph = device.type == "cuda" and m <= GRAPH_MAX_M and name != "reference"
            us, graphed = _time_backend(fn, weights, sets, device, use_graph)
            cell = Cell(
                shape=shape.name, M=m, backend=name, us=us, experts_touched=touched, bytes=model.bytes,
                flops=model.flops, floor_us=model.floor_us, pct_floor=100 * model.floor_us / us,
                pct_copy_bw=100 * model.bytes / (us * 1e-6) / (ceilings.copy_TBps * 1e12),
                tflops=model.flops / (us * 1e-6) / 1e12,
                pct_mm=100 * model.flops / (us * 1e-6) / (ceilings.mm_TFLOPs * 1e12),
                graph=graphed, rel_err_vs_grouped_mm=err,
            )
            cells.append(cell)
            if on_cell:
                on_cell(cell)
        del sets
        ref_out = None
    del weights, w13, w2
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cells


def geomean_speedup(cells: list[Cell], fast: str = "triton", base: str = "grouped_mm") -> float | None:
    us = {(c.shape, c.M, c.backend): c.us for c in cells}
    ratios = [us[(s, m, base)] / us[(s, m, fast)] for (s, m, b) in us if b == fast and (s, m, base) in us]
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def check_args(backends=None, batches=None) -> None:
    """Raise naming the argument for an unknown backend or a batch below one token (a known backend that
    cannot run on the device is skipped by ``run_bench``, not refused)."""
    unknown = [b for b in backends or () if b not in backend_names()]
    if unknown:
        raise ValueError(f"backends must be among {backend_names()}, got unknown {unknown}")
    if batches and min(batches) < 1:
        raise ValueError(f"batches must be >= 1 token, got {list(batches)}")


def run_bench(device: torch.device, shapes=None, batches=None, backends=None, progress=None) -> dict:
    """Measure the ceilings, then every cell. Returns the results document (see ``report.write_json``)."""
    check_args(backends, batches)
    setup = default_setup(device)
    shapes = shapes or setup.shapes
    batches = batches or setup.batches
    dtype = setup.dtype
    backends = [b for b in (backends or available_backends(device)) if b in available_backends(device)]
    ceilings = measure_ceilings(device)
    cells: list[Cell] = []
    total = sum(len(batches) for _ in shapes) * len(backends)
    task = progress.add_task("bench", total=total) if progress else None

    def on_cell(cell: Cell):
        if progress:
            progress.update(task, advance=1, description=f"{cell.shape} M={cell.M} {cell.backend}: {cell.us:.1f} µs")

    for shape in shapes:
        cells += run_cells(shape, batches, backends, dtype, device, ceilings, on_cell)
    if progress:
        progress.update(task, completed=total)
    return {
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "ceilings": asdict(ceilings),
        "method": (
            "routing excluded, alignment included; CUDA-graph replay for M <= %d; inputs rotated over 2-8 "
            "routings so each call streams its weights from HBM; median of repeats" % GRAPH_MAX_M
        ),
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

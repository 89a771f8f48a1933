"""The sweep behind ``moekit bench``: ceilings first, then every (shape, M, dtype, backend) cell.

Routing is excluded from the time (it is drawn before), the whole experts path is included
(alignment, GEMMs, combine). On the GPU: bf16, the real presets, CUDA-graph replay for M <= 1024,
inputs rotated over several routings so each call streams its experts' weights from HBM. On the CPU:
float32, presets scaled down by ``CPU_SCALE``, compared with the float32 matmul rate of the same run.
``dtypes`` adds quantized cells (``quant_cells``: the weights quantized once per shape, held to their
packed bytes and, for fp8_block, the fp8 matmul rate measured in the same run); ``sweep`` runs a shape.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
from dataclasses import asdict, dataclass

import torch

from moekit.bench.ceilings import Ceilings, measure_ceilings, with_fp8_mm
from moekit.bench.cells import CPU_BATCHES, CPU_SCALE, GPU_BATCHES, PRESETS, Cell, Shape
from moekit.bench.quant_cells import FP8, check_dtypes, quantized_backends
from moekit.bench.report import format_bandwidth, format_flops
from moekit.bench.sweep import BUDGET_S, GRAPH_MAX_M, REFERENCE_MAX_M, CellFailure, SweepPlan, cell_count, run_cells
from moekit.bench.timing import EAGER_CALLS, MIN_REPEATS, NOISY_SPREAD_PCT
from moekit.experts import available_backends, backend_available, backend_names
from moekit.quant import SCHEMES

__all__ = ["BUDGET_S", "GRAPH_MAX_M", "REFERENCE_MAX_M", "BenchProgress", "BenchSetup", "Cell", "check_args",
           "commit_id",
           "default_setup", "device_name", "geomean_speedup", "run_bench", "runnable_backends"]


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
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=os.path.join(here, ".."),
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def geomean_speedup(cells: list[Cell], fast: str = "triton", base: str = "grouped_mm") -> float | None:
    """Geometric mean of base's time over fast's, over the (shape, M, dtype) cells both ran."""
    us = {(c.shape, c.M, c.dtype, c.backend): c.us for c in cells}
    ratios = [us[(s, m, d, base)] / us[(s, m, d, fast)] for (s, m, d, b) in us if b == fast and (s, m, d, base) in us]
    return _geomean(ratios)


def geomean_vs_bf16(cells: list[Cell]) -> dict[str, float]:
    """Per quantized dtype: the geometric mean of its cells' ``vs_bf16`` (time over the unquantized cell)."""
    by_dtype: dict[str, list[float]] = {}
    for c in cells:
        if c.vs_bf16 is not None:
            by_dtype.setdefault(c.dtype, []).append(c.vs_bf16)
    return {d: _geomean(r) for d, r in by_dtype.items()}


def _geomean(ratios: list[float]) -> float | None:
    return math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None


def check_args(backends=None, batches=None, device: torch.device | None = None, dtypes=None,
               budget_s: float = BUDGET_S) -> None:
    """Raise ``ValueError`` for an unknown backend, a backend that cannot run on ``device`` here, a
    batch below one token, an unknown dtype or a budget that is not positive. Each message begins with
    the argument's name (``backends: ...``), which is also the CLI flag's."""
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
    quantized = len(check_dtypes(dtypes)) > 1
    if device is not None and quantized:
        chosen = backends or available_backends(device)
        if not quantized_backends(chosen, device, bool(backends)):
            raise ValueError(f"backends: quantized dtypes run on triton on {device.type} (grouped_mm and the reference "
                             f"would dequantize every expert on every call); {list(chosen)} has no triton")
    if not 0 < budget_s < math.inf:
        raise ValueError(f"budget-s: must be a positive number of seconds per cell, got {budget_s}")


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
    vs = f", {cell.vs_bf16:.2f}x the unquantized time" if cell.vs_bf16 is not None else ""
    dtype = f" {cell.dtype}" if cell.dtype in SCHEMES else ""  # unquantized lines read as they always did
    return (f"{cell.shape} M={cell.M} {cell.backend}{dtype}: {cell.us:.1f} µs ±{cell.spread_pct:.0f}%, "
            f"{cell.pct_floor:.0f}% of floor{vs}, eager {cell.eager_us:.1f} µs, host {cell.host_us:.1f} µs "
            f"(after the first call {cell.host_rest_us:.1f}){noisy}")


def _failure_line(f: CellFailure) -> str:
    dtype = f" {f.dtype}" if f.dtype in SCHEMES else ""
    return f"{f.shape} M={f.M} {f.backend}{dtype}: FAILED, {f.reason}; not in the results"


def _ceilings_line(c: Ceilings) -> str:
    line = (f"ceilings: copy {format_bandwidth(c.copy_TBps * 1e12)}, matmul {format_flops(c.mm_TFLOPs * 1e12)} "
            f"({c.mm_dtype})")
    if c.fp8_mm_TFLOPs:
        return line + f", fp8 matmul {format_flops(c.fp8_mm_TFLOPs * 1e12)}"
    return (line if (c.fp8_mm_error or "").startswith("not measured")
            else line + f", fp8 matmul failed: {c.fp8_mm_error}")


def run_bench(device: torch.device, shapes=None, batches=None, backends=None, on_progress=None, dtypes=None,
              budget_s: float = BUDGET_S, on_partial=None) -> dict:
    """Measure the ceilings, then every cell, calling ``on_progress(BenchProgress)`` as it goes and
    ``on_partial(document)`` after each cell (timed or failed) with the document of the cells so far
    (``"partial": True``; ``report.write_partial`` keeps it on disk).
    ``dtypes``: bench dtypes (``quant_cells.BENCH_DTYPES``; default the unquantized cells only);
    ``budget_s``: seconds of timed passes per cell. Returns the results document (see ``report.write_json``)."""
    check_args(backends, batches, device, dtypes, budget_s)
    setup = default_setup(device)
    shapes = shapes or setup.shapes
    dtypes = check_dtypes(dtypes)
    chosen = backends or available_backends(device)
    plan = SweepPlan(list(batches or setup.batches), list(chosen), quantized_backends(chosen, device, bool(backends)),
                     dtypes, setup.dtype, budget_s)
    total = cell_count(shapes, plan, device)
    report = on_progress or (lambda p: None)
    report(BenchProgress(0, total, f"ceilings: measuring copy bandwidth and matmul rate on {device_name(device)}"))
    ceilings = with_fp8_mm(measure_ceilings(device), device, FP8 in dtypes)
    report(BenchProgress(0, total, _ceilings_line(ceilings)))
    cells: list[Cell] = []
    timed: list[Cell | CellFailure] = []  # grows cell by cell, ``cells`` shape by shape
    failed: list[CellFailure] = []
    header = _header(device, plan, ceilings, shapes)  # once: the commit asks git, and a partial's date is the run's

    def keep_partial():
        if on_partial is not None:
            so_far = [c for c in timed if isinstance(c, Cell)]
            on_partial(_document(header, so_far, failed) | {"partial": True})

    def on_cell(cell: Cell):
        timed.append(cell)
        report(BenchProgress(len(timed), total, _cell_line(cell)))
        keep_partial()

    def on_fail(failure: CellFailure):
        timed.append(failure)
        failed.append(failure)
        report(BenchProgress(len(timed), total, _failure_line(failure)))
        keep_partial()

    for shape in shapes:
        cells += run_cells(shape, plan, device, ceilings, on_cell, on_fail)
    return _document(header, cells, failed)


QUANT_METHOD = (
    "; quantized cells: weights quantized once per shape with moekit.quant.quantize's defaults (fp8_block "
    "128x128 blocks, int4_w4a16 groups of 128 with zero points), bytes = touched experts x (packed values + "
    "scales + zero points) + x and out; floor FLOPs at the fp8 matmul rate for fp8_block, the dense rate "
    "for the weight-only schemes; vs_bf16 = us / the unquantized cell's us (same shape, M, backend)"
)


def _header(device, plan: SweepPlan, ceilings: Ceilings, shapes) -> dict:
    """A run's document less its cells: the device, versions, ceilings, method and shapes."""
    method = (
        f"routing excluded, alignment included; CUDA-graph replay for M <= {GRAPH_MAX_M}; inputs rotated "
        "over 2-8 routings so each call streams its weights from HBM; us = median of >= "
        f"{MIN_REPEATS} passes (~{plan.budget_s:g} s per cell), spread_pct = interquartile range / median, "
        f"noisy above {NOISY_SPREAD_PCT:.0f}%; eager_us = {EAGER_CALLS} back-to-back eager calls, one sync at "
        f"the end, {MIN_REPEATS} such loops spread between the timed passes (the same GPU clock for both), "
        "host_us = their issue time before that sync, host_rest_us = the same over the calls after "
        "each loop's first (all = us on the CPU)"
    )
    quantized = len(plan.dtypes) > 1
    return {
        "device": device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": commit_id(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(plan.act_dtype).removeprefix("torch."),
        "ceilings": asdict(ceilings),
        "method": method + (QUANT_METHOD if quantized else ""),
        "noisy_spread_pct": NOISY_SPREAD_PCT,
        "cpu_threads": torch.get_num_threads(),  # torch's intra-op threads (OMP_NUM_THREADS): CPU timings depend on it
        "shapes": [asdict(s) for s in shapes],
    }


def _document(header: dict, cells: list[Cell], failed: list[CellFailure]) -> dict:
    """The results document (see ``report.write_json``): ``header`` with the cells, the failed cells, the summary."""
    return header | {
        "cells": [asdict(c) for c in cells],
        "failed_cells": [asdict(f) for f in failed],  # cells the device could not run (sweep.CellFailure)
        "summary": {"geomean_speedup_triton_vs_grouped_mm": geomean_speedup(cells),
                    "geomean_time_vs_bf16": geomean_vs_bf16(cells)},
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None

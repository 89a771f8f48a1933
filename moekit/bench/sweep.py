"""The cells of one shape: for each M, the inputs once, then every weight dtype x backend timed on them.

    shape --make_weights--> weights --quant_cells.weight_variants--> [baseline, fp8_block, ...] (quantized once)
      for M: rotated input sets --> for each variant, each backend: time, byte model --> Cell
                                                               (out of GPU memory twice --> CellFailure)

The unquantized variant runs first at each M, so each quantized cell's ``vs_bf16`` (its time over the
unquantized cell of the same backend) and ``rel_err_vs_bf16`` (its output's relative L2 error against
that cell's, on the first input set) are known when it is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moekit.bench.ceilings import Ceilings
from moekit.bench.cells import (
    Cell, CellInputs, CellModel, ExpertWeights, Shape, cell_model, make_sets, make_weights, measured_experts_touched,
)
from moekit.bench.config_source import SOURCE_BACKENDS, cell_config_source
from moekit.bench.quant_cells import WeightVariant, weight_variants
from moekit.bench.timing import EagerTiming, Timing, time_paired, time_stats
from moekit.experts import get_backend

GRAPH_MAX_M = 1024  # CUDA-graph replay up to here: the decode range, where launch gaps matter
REFERENCE_MAX_M = {"cuda": 8, "cpu": 128}  # the per-expert loop syncs and upcasts: past this it only costs time
ROTATION_BYTES = 256 << 20  # rotate inputs until the weights one pass touches exceed ~4x the H200's L2
BUDGET_S = 0.3  # seconds of timed passes per cell (at least timing.MIN_REPEATS passes whatever the budget)


@dataclass(frozen=True)
class SweepPlan:
    """What every shape of a run sweeps."""

    batches: list[int]  # M values
    backends: list[str]  # the unquantized cells' backends
    quant_backends: list[str]  # the quantized cells' (quant_cells.quantized_backends)
    dtypes: list[str]  # bench dtypes, quant_cells.BASELINE first
    act_dtype: torch.dtype  # activations and unquantized weights: bf16 on the GPU, float32 on the CPU
    budget_s: float = BUDGET_S  # timed passes per cell, seconds

    def backends_of(self, variant: WeightVariant) -> list[str]:
        return self.quant_backends if variant.quantized else self.backends

    def runs(self, backend: str, m: int, device: torch.device) -> bool:
        """Whether a cell of ``backend`` at M = ``m`` is timed (the reference only at small M)."""
        return backend != "reference" or m <= REFERENCE_MAX_M[device.type]


@dataclass(frozen=True)
class BackendTiming:
    """One backend's timings in one cell."""

    timing: Timing  # the cell's number: graph replay where ``graph``, else events / wall clock
    eager: EagerTiming  # plain eager calls; on the CPU the same number as ``timing.us`` (one clock there)
    graph: bool  # ``timing`` is a CUDA-graph replay


def _time_backend(fn, weights: ExpertWeights, sets: list[CellInputs], device, graph: bool,
                  budget_s: float) -> BackendTiming:
    w13, w2 = weights.w13, weights.w2
    calls = [lambda s=s: fn(s.x, w13, w2, s.topk_ids, s.topk_weights) for s in sets]
    if device.type != "cuda":  # the host does the work: eager, host and the timing are one wall clock
        timing = time_stats(calls, device, budget_s=budget_s)
        return BackendTiming(timing, EagerTiming(timing.us, timing.us, timing.spread_pct, timing.us), False)
    paired = None
    if graph:
        try:
            paired = time_paired(calls, device, graph=True, budget_s=budget_s)
        except RuntimeError:  # a backend that syncs cannot be captured: time it with events instead
            torch.cuda.synchronize()
            graph = False
    paired = paired or time_paired(calls, device, budget_s=budget_s)
    return BackendTiming(paired.timing, paired.eager, graph)


@dataclass
class Outputs:
    """Backend outputs on the first input set of one M, for one variant, computed once when asked."""

    weights: ExpertWeights
    first: CellInputs
    out: dict[str, torch.Tensor] = field(default_factory=dict)  # backend -> [M, K] float32

    def of(self, name: str) -> torch.Tensor:
        if name not in self.out:
            s = self.first
            self.out[name] = get_backend(name)(s.x, self.weights.w13, self.weights.w2, s.topk_ids,
                                               s.topk_weights).float()
        return self.out[name]


@dataclass(frozen=True)
class CellFailure:
    """A cell the device could not run: the run goes on and records it (``failed_cells`` in the JSON)."""

    shape: str
    M: int
    backend: str
    dtype: str
    reason: str


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is the device running out of memory: torch's allocator (``torch.OutOfMemoryError``) or a
    kernel launch that could not get its memory (Triton raises ``RuntimeError: ... CUDA]: out of memory``)."""
    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError) and "out of memory" in str(err))


def _free_cached(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@dataclass(frozen=True)
class AtM:
    """What every cell of one shape at one M shares."""

    shape: Shape
    m: int
    sets: list[CellInputs]  # the rotated inputs
    touched: float  # mean distinct experts over the sets
    ceilings: Ceilings


def _make_cell(at: AtM, v: WeightVariant, name: str, t: BackendTiming, model: CellModel) -> Cell:
    us = t.timing.us
    return Cell(
        shape=at.shape.name, M=at.m, backend=name, dtype=v.dtype, us=us, min_us=t.timing.min_us,
        max_us=t.timing.max_us, spread_pct=t.timing.spread_pct, noisy=t.timing.noisy, repeats=t.timing.repeats,
        eager_us=t.eager.eager_us, host_us=t.eager.host_us, experts_touched=at.touched, bytes=model.bytes,
        flops=model.flops, floor_us=model.floor_us, pct_floor=100 * model.floor_us / us,
        pct_copy_bw=100 * model.bytes / (us * 1e-6) / (at.ceilings.copy_TBps * 1e12),
        tflops=model.flops / (us * 1e-6) / 1e12,
        pct_mm=100 * model.flops / (us * 1e-6) / (v.mm_TFLOPs * 1e12),
        graph=t.graph, mm_dtype=v.mm_dtype, host_rest_us=t.eager.host_rest_us,
    )


def _variant_cells(at: AtM, v: WeightVariant, plan: SweepPlan, device, base: dict, on_cell, on_fail) -> list[Cell]:
    """Every backend of ``v`` at one M. ``base``: the unquantized variant's {"us": {backend: us},
    "outputs": Outputs}, filled by the baseline's call and read by the quantized ones."""
    backends = [b for b in plan.backends_of(v) if plan.runs(b, at.m, device)]
    element_size = plan.act_dtype.itemsize
    model = cell_model(at.shape, at.m, at.touched, element_size, at.ceilings.copy_TBps, v.mm_TFLOPs, v.expert_bytes)
    outputs = Outputs(v.weights, at.sets[0])
    if not v.quantized:
        base["outputs"] = outputs
    cells = []
    for name in backends:
        cell = _backend_cell(at, v, name, backends, plan, device, outputs, model, on_fail)
        if cell is None:
            continue
        if v.quantized and name in base["us"]:
            cell.vs_bf16 = cell.us / base["us"][name]
            cell.rel_err_vs_bf16 = _rel(outputs.of(name), base["outputs"].of(name))
        elif not v.quantized:
            base["us"][name] = cell.us
        cells.append(cell)
        if on_cell:
            on_cell(cell)
    return cells


def _backend_cell(at: AtM, v: WeightVariant, name: str, backends: list[str], plan: SweepPlan, device,
                  outputs: Outputs, model: CellModel, on_fail) -> Cell | None:
    """One backend's cell. Out of device memory, the allocator's cache is emptied and the cell tried once more
    (a launch can fail on memory the cache holds); out of memory again, the cell is reported to ``on_fail`` and
    left out, so one cell too big for the card does not lose the run."""
    for attempt in (1, 2):
        try:
            if name == "grouped_mm" or (not v.quantized and name in plan.quant_backends and len(plan.dtypes) > 1):
                outputs.of(name)  # kept for the errors of triton and of the quantized cells
            err = _rel(outputs.of(name),
                       outputs.of("grouped_mm")) if name == "triton" and "grouped_mm" in backends else None
            use_graph = device.type == "cuda" and at.m <= GRAPH_MAX_M and name != "reference"
            timed = _time_backend(get_backend(name), v.weights, at.sets, device, use_graph, plan.budget_s)
            break
        except RuntimeError as error:
            if not out_of_memory(error):
                raise
        # out of memory: freed outside the handler, whose traceback holds the failed call's tensors
        outputs.out.pop(name, None)
        _free_cached(device)
        if attempt == 2:
            if on_fail:
                on_fail(CellFailure(at.shape.name, at.m, name, v.dtype,
                                    "out of device memory, also after emptying the allocator's cache"))
            return None
    cell = _make_cell(at, v, name, timed, model)
    cell.rel_err_vs_grouped_mm = err
    if name in SOURCE_BACKENDS:
        cell.config = cell_config_source(at.shape, at.m, v.dtype, device)
    return cell


def _inputs_at(shape: Shape, m: int, variants: list[WeightVariant], plan: SweepPlan, device,
               ceilings: Ceilings) -> AtM:
    """The rotated input sets of one M: enough that the smallest variant's weights one pass touches
    exceed ROTATION_BYTES (2 to 8 sets), so every variant streams its weights from HBM."""
    expert_bytes = min(v.expert_bytes for v in variants)
    touched_once = max(1, min(shape.num_experts, m * shape.top_k)) * expert_bytes
    num_sets = max(2, min(8, math.ceil(ROTATION_BYTES / touched_once)))
    sets = make_sets(shape, m, num_sets, plan.act_dtype, device)
    touched = sum(measured_experts_touched(s.topk_ids, shape.num_experts) for s in sets) / num_sets
    return AtM(shape, m, sets, touched, ceilings)


def run_cells(shape: Shape, plan: SweepPlan, device: torch.device, ceilings: Ceilings, on_cell=None,
              on_fail=None) -> list[Cell]:
    """Every (M, dtype, backend) cell of ``shape``; the weights are made and quantized once. A cell the device
    has no memory for goes to ``on_fail(CellFailure)`` (``_backend_cell``), not into the list."""
    variants = weight_variants(make_weights(shape, plan.act_dtype, device), plan.dtypes, ceilings)
    cells = []
    for m in plan.batches:
        at = _inputs_at(shape, m, variants, plan, device, ceilings)
        base = {"us": {}, "outputs": None}
        for v in variants:
            cells += _variant_cells(at, v, plan, device, base, on_cell, on_fail)
        del at, base
    del variants
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return cells


def cell_count(shapes: list[Shape], plan: SweepPlan, device: torch.device) -> int:
    """The cells ``run_cells`` times over ``shapes``."""
    per_m = sum(sum(plan.runs(b, m, device) for b in (plan.quant_backends if d != plan.dtypes[0] else plan.backends))
                for m in plan.batches for d in plan.dtypes)
    return len(shapes) * per_m

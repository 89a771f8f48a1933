"""One analysis of a model on a GPU in a weight format: the batch sweep, the regime markers and the
bills, as plain dataclasses that the CLI prints, serialises to JSON and plots.

Shapes: B = tokens in the batch, E = routed experts, k = experts per token.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import numpy as np

from moekit.analysis.bills import ParamBill, param_bill
from moekit.analysis.formats import FORMATS, WeightFormat, get_format
from moekit.analysis.gpus import GpuSpec, get_gpu
from moekit.analysis.memory import DEFAULT_RESERVE_GIB, DEFAULT_UTILIZATION, Fit, MemoryBill, fit_on_gpus, weight_memory
from moekit.analysis.padding import expected_padding_factor
from moekit.analysis.roofline import (
    BatchCost,
    asymptotic_slope,
    batch_cost,
    dense_step_floor_s,
    intensity_at_batch_one,
    check_inclusion,
    ridge_batch,
)
from moekit.analysis.touch import batch_for_fraction, batch_for_fraction_from_inclusion, experts_touched
from moekit.config import MoEConfig

DEFAULT_BATCHES = (1, 8, 32, 64, 128, 256, 512, 4096)
PADDING_BLOCKS = (16, 64, 128)  # tile heights of the padding columns: Triton's floor, a mid tile, DeepGEMM's


@dataclass(frozen=True)
class SweepRow:
    """One batch size: the byte model of one MoE layer plus whole-model comparisons."""

    cost: BatchCost
    padding: dict[int, float]  # block height -> expected padded rows / real rows (same routing as ``cost``)
    # routed-expert step floor + the other matmul weights (JetMoE's attention experts as touched); None without a bill
    model_step_floor_s: float | None
    dense_same_active_step_floor_s: float | None  # a dense model with this model's active matmul parameters
    dense_same_total_step_floor_s: float | None  # a dense model with all of this model's matmul parameters


@dataclass(frozen=True)
class ModelBills:
    """Whole-model bills, present when the full config is known (a preset or a config.json)."""

    params: ParamBill
    memory: dict[str, MemoryBill]  # format name -> weight memory
    fit: Fit  # the analysed format on ``num_gpus`` of the GPU


@dataclass(frozen=True)
class Report:
    """Everything ``moekit analyze`` shows."""

    model: str  # preset name, config path, or "custom"
    config: MoEConfig
    routing: str  # "uniform", or where the per-expert load came from
    inclusion: np.ndarray | None  # [E] per-token probability of each expert (sums to k); None = uniform
    gpu: GpuSpec
    fmt: WeightFormat
    ridge_intensity: float  # I*: the GPU's FLOP per byte in the format's compute dtype
    intensity_at_batch_one: float  # 2 / b_w
    asymptotic_slope: float  # 2k / (b_w·E), FLOP per byte per token
    half_batch: float  # B_1/2 (inf when skew leaves over half the experts idle)
    batch_95: float  # B_0.95
    ridge_batch: float  # batch where I(B) = I*
    rows: list[SweepRow]
    bills: ModelBills | None
    expert_matrices: int = 3  # one expert's weights in K·N: 3 gated, 2 ungated (a refused family's billed layer)
    note: str | None = None  # what the bill stands for where moekit cannot serve the layer (``BilledLayer.note``)


def analyze(
    config: MoEConfig,
    gpu: GpuSpec | str,
    fmt: WeightFormat | str,
    batches: tuple[int, ...] = DEFAULT_BATCHES,
    hf_config: dict | None = None,
    model: str = "custom",
    num_gpus: int = 1,
    utilization: float = DEFAULT_UTILIZATION,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    inclusion: np.ndarray | None = None,
    routing: str = "uniform",
    expert_matrices: int = 3,
    note: str | None = None,
) -> Report:
    """Sweep ``batches`` for one MoE layer of ``config``; with ``hf_config`` add the whole-model bills.
    ``inclusion`` [E] replaces uniform routing with a measured per-expert load. ``expert_matrices``: an expert's
    weights in K·N (2: ungated experts); ``note``: said with the report (``BilledLayer``'s). ``gpu`` and ``fmt`` are
    specs or their names, as ``moekit analyze --gpu`` / ``--dtype`` take them (``"h100"``, ``"fp8"``; ``KeyError``
    naming the known ones)."""
    if not isinstance(config, MoEConfig):  # else "'NoneType' object has no attribute 'num_experts'"
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
    if isinstance(batches, (str, numbers.Number)) or not all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in batches):  # 1.5 was swept as is
        raise TypeError(f"batches must be a sequence of ints (tokens in a batch), got {batches!r}")
    gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    bills = _bills(hf_config, gpu, fmt, num_gpus, utilization, reserve_gib) if hf_config is not None else None
    e, k = config.num_experts, config.routed_slots_per_token
    if inclusion is not None:
        check_inclusion(config, inclusion)
        half, b95 = (batch_for_fraction_from_inclusion(p, inclusion) for p in (0.5, 0.95))
    else:
        half, b95 = (batch_for_fraction(p, e, k) for p in (0.5, 0.95))
    params = bills.params if bills else None
    return Report(
        model=model,
        config=config,
        routing=routing,
        inclusion=inclusion,
        gpu=gpu,
        fmt=fmt,
        ridge_intensity=gpu.ridge_intensity(fmt.compute_dtype),
        intensity_at_batch_one=intensity_at_batch_one(fmt),
        asymptotic_slope=asymptotic_slope(config, fmt),
        half_batch=half,
        batch_95=b95,
        ridge_batch=ridge_batch(config, fmt, gpu, inclusion),
        rows=[_row(config, b, fmt, gpu, params, inclusion, expert_matrices) for b in batches],
        bills=bills,
        expert_matrices=expert_matrices,
        note=note,
    )


def _bills(hf_config: dict, gpu: GpuSpec, fmt: WeightFormat, num_gpus: int, utilization: float,
           reserve_gib: float) -> ModelBills:
    params = param_bill(hf_config)
    memory = {name: weight_memory(params, f) for name, f in FORMATS.items()}
    fit = fit_on_gpus(memory[fmt.name].total_bytes, gpu, num_gpus, utilization, reserve_gib)
    return ModelBills(params, memory, fit)


def _row(config: MoEConfig, batch: int, fmt: WeightFormat, gpu: GpuSpec, params: ParamBill | None,
         inclusion: np.ndarray | None, expert_matrices: int) -> SweepRow:
    cost = batch_cost(config, batch, fmt, gpu, inclusion, expert_matrices)
    padding = {b: expected_padding_factor(batch, config.num_experts, config.routed_slots_per_token, b, inclusion)
               for b in PADDING_BLOCKS}
    if params is None:
        return SweepRow(cost, padding, None, None, None)
    # attention, dense MLP, shared, router, head: every weight read once a step
    other = params.active_matmul - params.active_routed_experts - params.active_attention_experts
    return SweepRow(
        cost,
        padding,
        model_step_floor_s=(cost.step_time_floor_s + dense_step_floor_s(other, batch, fmt, gpu)
                            + _attention_experts_floor_s(params, config, batch, fmt, gpu)),
        dense_same_active_step_floor_s=dense_step_floor_s(params.active_matmul, batch, fmt, gpu),
        dense_same_total_step_floor_s=dense_step_floor_s(params.total_matmul, batch, fmt, gpu),
    )


def _attention_experts_floor_s(params: ParamBill, config: MoEConfig, batch: int, fmt: WeightFormat,
                               gpu: GpuSpec) -> float:
    """JetMoE's attention experts in a step of ``batch`` tokens: routed by the MLP's E and k (its config's), uniform
    routing touches E·(1 - (1 - k/E)^B) of each layer's E, each read once; 2·B·(k of them) FLOPs. 0 for a model
    without them."""
    if not params.attention_experts:
        return 0.0
    e = config.num_experts
    weights = params.attention_experts * experts_touched(batch, e, config.top_k) / e
    return max(weights * fmt.bytes_per_weight / gpu.bandwidth_bytes_s,
               2.0 * batch * params.active_attention_experts / gpu.flops_per_s(fmt.compute_dtype))


def report_to_json(report: Report) -> dict:
    """The report as JSON-ready data: per row ``batch``, ``experts_touched``, ``flops``, ``weight_bytes``,
    ``intensity``, ``time_floor_s`` (one layer), ``step_time_floor_s`` (all MoE layers), and more."""
    rows = []
    for row in report.rows:
        d = dataclasses.asdict(row.cost)
        d["padding_factor"] = {str(b): f for b, f in row.padding.items()}
        d["model_step_floor_s"] = row.model_step_floor_s
        d["dense_same_active_step_floor_s"] = row.dense_same_active_step_floor_s
        d["dense_same_total_step_floor_s"] = row.dense_same_total_step_floor_s
        rows.append(d)
    out = {
        "model": report.model,
        "config": dataclasses.asdict(report.config),
        "routing": report.routing,
        "inclusion": None if report.inclusion is None else report.inclusion.tolist(),
        "gpu": dataclasses.asdict(report.gpu),
        "dtype": report.fmt.name,
        "bytes_per_weight": report.fmt.bytes_per_weight,
        "compute_dtype": report.fmt.compute_dtype,
        "ridge_intensity": report.ridge_intensity,
        "intensity_at_batch_one": report.intensity_at_batch_one,
        "asymptotic_slope": report.asymptotic_slope,
        "half_batch": _finite_or_none(report.half_batch),
        "batch_95": _finite_or_none(report.batch_95),
        "ridge_batch": report.ridge_batch,
        "rows": rows,
        "bills": None,
        "expert_matrices": report.expert_matrices,
        "note": report.note,
    }
    if report.bills is not None:
        out["bills"] = _bills_to_json(report.bills)
    return out


def _bills_to_json(bills: ModelBills) -> dict:
    return {
        "params": _params_to_json(bills.params),
        "memory": {
            name: {"total_bytes": m.total_bytes, "total_gb": m.total_gb, "total_gib": m.total_gib,
                   "routed_expert_gb": m.routed_expert_gb}
            for name, m in bills.memory.items()
        },
        "fit": {**dataclasses.asdict(bills.fit), "fits": bills.fit.fits},
    }


def _params_to_json(p: ParamBill) -> dict:
    """The bill's parts and totals; an encoder-decoder's ``encoder`` the same (its ``active``: an encoder token's),
    the top level's parts the decoder's and ``total`` the whole model's."""
    out = {**dataclasses.asdict(p), "total": p.total, "active": p.active, "active_matmul": p.active_matmul}
    out["encoder"] = None if p.encoder is None else _params_to_json(p.encoder)
    return out


def _finite_or_none(x: float) -> float | None:
    """JSON has no infinity: an unreachable batch (skewed routing) is written as null."""
    return x if math.isfinite(x) else None

"""One real ``MoE`` layer timed over a batch sweep on the present device, each point beside the byte
model's prediction for the same shapes and device (behind ``moekit analyze --measure``).

Shapes: B = tokens, E = routed experts, k = experts per token, K = hidden, N = expert intermediate.
E and k are kept, because experts touched and padding depend on nothing else; K and N are divided by
a common power of two when one layer's weights would not fit the device budget, and the note says so.
The device's ceilings (copy bandwidth, matmul rate) are measured in the same run with the benchmark
harness, so the prediction is for this device, not for the GPU being analysed.

Each batch's forward is timed two ways on CUDA (``moekit.bench.timing``, the one helper): captured once
in a CUDA graph and replayed (what a serving engine sees at decode sizes: launch gaps gone), and as
back-to-back eager forwards with one sync at the end, with the host's issue time per forward beside
it. On the CPU there is no graph and the host does the work: eager and host are the one wall clock.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from moekit.analysis.formats import WeightFormat
from moekit.analysis.gpus import GIB, GpuSpec
from moekit.analysis.padding import padding_factor, padding_factor_from_counts
from moekit.analysis.report import PADDING_BLOCKS
from moekit.analysis.roofline import batch_cost
from moekit.analysis.touch import experts_touched_from_inclusion, inclusion_from_counts
from moekit.bench.ceilings import measure_ceilings
from moekit.bench.timing import NOISY_SPREAD_PCT, time_eager, time_stats
from moekit.config import MoEConfig
from moekit.layer import MoE

CPU_WEIGHT_BUDGET = 256 * 2**20  # bytes; keeps a 4096-token CPU forward near a second on 2 cores
CUDA_BUDGET_FRACTION = 0.25  # of free device memory: weights, plus room for B·k rows of activations
MIN_WIDTH = 16  # K and N are not scaled below this
CALIBRATION_TOKENS = 16384  # routed once to measure the router's per-expert load; ±1% on a 1/32 share
# Issue 13's bar for the graph-replayed layer: within 15% of the byte model's floor where it is
# memory-bound, which it takes to be B <= 256 (decode batches; past that the GEMMs start to count).
GRAPH_FLOOR_TARGET = 1.15
MEMORY_BOUND_MAX_BATCH = 256
# and its bar for the eager layer's host time per forward (gate, routing, experts) at those batches, judged on the
# calls after each loop's first (``EagerTiming.host_rest_us``: the first after a sync runs several times slower)
HOST_TARGET_S = 60e-6


@dataclass(frozen=True)
class MeasuredRow:
    batch: int
    time_s: float  # = eager_s, kept for readers of the older JSON
    spread_pct: float  # interquartile range of the eager passes / their median * 100
    noisy: bool  # spread_pct > moekit.bench.timing.NOISY_SPREAD_PCT: a busy machine, measure again
    graph_s: float | str | None  # CUDA-graph replay per forward; the capture's error text if it failed; None on CPU
    eager_s: float  # back-to-back eager forwards, one sync at the end, per forward (CPU: wall-clock passes)
    host_s: float  # the host's time to issue one eager forward, before the sync (CPU: = eager_s)
    predicted_time_s: float  # byte-model floor for the measured shapes on the measured ceilings
    graph_over_floor: float | None  # graph_s / predicted_time_s; None where graph_s is not a number
    eager_over_floor: float  # eager_s / predicted_time_s
    graph_within_target: bool | None  # graph_s <= GRAPH_FLOOR_TARGET * floor; None past B = 256 or no graph_s
    experts_touched: int  # from the layer's stats
    predicted_experts_touched: float  # uniform routing
    skew_experts_touched: float  # from the layer's own per-expert load, measured on a calibration batch
    padding: dict[int, float]  # block -> measured padded / real rows
    predicted_padding: dict[int, float]  # block -> expected under uniform routing
    host_rest_s: float | None = None  # host_s over the calls after each loop's first (CUDA); None on the CPU
    host_within_target: bool | None = None  # host_rest_s <= HOST_TARGET_S; None past B = 256 or on the CPU


@dataclass(frozen=True)
class Measurement:
    device: str
    backend: str
    dtype: str
    hidden_size: int  # K as measured (scaled when ``scale`` > 1)
    moe_intermediate_size: int  # N as measured
    scale: int  # K and N were divided by this
    note: str  # what was changed from the analysed shapes, and why
    ceilings: GpuSpec  # measured bandwidth and matmul throughput of this device
    rows: list[MeasuredRow]


def measure(config: MoEConfig, batches: tuple[int, ...], budget_s: float = 0.3,
            on_step: Callable[[str], None] = lambda step: None) -> Measurement:
    """Measure one routed-expert MoE layer of ``config``'s E and k over ``batches`` on the present device;
    ``on_step`` hears what is measured next (the ceilings, then each batch)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_step(f"the copy bandwidth and matmul rate of {device}")
    ceilings = _ceilings(device)
    name = next(iter(ceilings.dense_tflops))  # the harness's matmul dtype: bf16 on CUDA, float32 on the CPU
    dtype = getattr(torch, name)
    fmt = WeightFormat(name, torch.finfo(dtype).bits, 0.0, 1, name)
    cfg, scale = _fit_shapes(config, fmt, device)
    note = "routed experts only (shared expert removed)"
    if scale > 1:
        note += f"; K and N divided by {scale} to fit the {_budget(device) / GIB:.2f} GiB weight budget"
    layer = MoE(cfg, dtype=dtype, device=device)
    on_step("the router's expert-touch calibration")
    inclusion = _calibrate(layer, cfg)
    rows = []
    for i, b in enumerate(batches):
        on_step(f"batch {b} ({i + 1} of {len(batches)})")
        rows.append(_measure_batch(layer, cfg, b, fmt, ceilings, budget_s, inclusion))
    return Measurement(str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
                       layer.resolved_backend(), fmt.name, cfg.hidden_size, cfg.moe_intermediate_size, scale,
                       note, ceilings, rows)


def _budget(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] * CUDA_BUDGET_FRACTION
    return float(CPU_WEIGHT_BUDGET)


def _fit_shapes(config: MoEConfig, fmt: WeightFormat, device: torch.device) -> tuple[MoEConfig, int]:
    """The routed-only config to run, with K and N divided by the smallest power of two that fits (the shared
    expert's combine back to "sum": an averaged or router-weighted one needs the shared expert it weights)."""
    cfg = config.replace(shared_expert_intermediate_size=0, shared_expert_gate=False, shared_expert_combine="sum",
                         shared_activation=None)
    scale = 1
    while (3 * cfg.num_experts * (cfg.hidden_size // scale) * (cfg.moe_intermediate_size // scale)
           * fmt.bytes_per_weight > _budget(device)
           and min(cfg.hidden_size, cfg.moe_intermediate_size) // (2 * scale) >= MIN_WIDTH):
        scale *= 2
    return cfg.replace(hidden_size=cfg.hidden_size // scale,
                       moe_intermediate_size=cfg.moe_intermediate_size // scale), scale


def _ceilings(device: torch.device) -> GpuSpec:
    """This device's ceilings from the benchmark harness (copy bandwidth, square-matmul rate), as a spec."""
    c = measure_ceilings(device)
    memory_gib = torch.cuda.mem_get_info(device)[1] / GIB if device.type == "cuda" else 0.0
    return GpuSpec(f"{device} (measured)", c.copy_TBps, memory_gib, {c.mm_dtype: c.mm_TFLOPs},
                   "measured in this run by moekit.bench.ceilings: copy bandwidth, square matmul rate")


def _calibrate(layer: MoE, cfg: MoEConfig) -> np.ndarray:
    """Per-expert inclusion probabilities [E] of this layer's router, from routing CALIBRATION_TOKENS
    random tokens (routing only, no expert GEMMs): a random gate is not a uniform router."""
    x = torch.randn(CALIBRATION_TOKENS, cfg.hidden_size, dtype=layer.w13.dtype, device=layer.w13.device)
    with torch.no_grad():
        routing = layer.route_tokens(x).routing
    ids = routing.topk_ids.reshape(-1).long()
    counts = torch.bincount(ids[ids >= 0], minlength=cfg.num_experts)  # [E]; identity slots (id -1) run no expert
    return inclusion_from_counts(counts.cpu().numpy(), CALIBRATION_TOKENS)


@dataclass(frozen=True)
class LayerTiming:
    """One batch's forward timed as graph replay and as eager calls, seconds per forward."""

    graph_s: float | str | None  # CUDA-graph replay; the capture's error text if it failed; None on the CPU
    eager_s: float  # back-to-back eager forwards, one sync at the end
    host_s: float  # the host's issue time per eager forward, before the sync
    spread_pct: float  # interquartile range of the eager passes / eager_s * 100
    host_rest_s: float | None = None  # host_s over the calls after each loop's first; None on the CPU


def time_layer(layer: MoE, x: torch.Tensor, budget_s: float = 0.3) -> LayerTiming:
    """Time ``layer(x)`` (x: [B, K]) without autograd: graph replay and eager on CUDA, eager on the CPU."""
    device = x.device
    with torch.no_grad():
        if device.type != "cuda":  # the host does the work: eager and host are the one wall clock
            t = time_stats([lambda: layer(x)], device, budget_s=budget_s)
            return LayerTiming(None, t.us * 1e-6, t.us * 1e-6, t.spread_pct)
        eager = time_eager([lambda: layer(x)], device)
        graph_s = _graph_seconds(layer, x, budget_s)
    return LayerTiming(graph_s, eager.eager_us * 1e-6, eager.host_us * 1e-6, eager.spread_pct,
                       eager.host_rest_us * 1e-6)


def _graph_seconds(layer: MoE, x: torch.Tensor, budget_s: float) -> float | str:
    """Seconds per replay of the forward captured in a CUDA graph, or the error text when capture fails.

    ``time_stats(graph=True)`` warms up on a side stream, captures under ``torch.cuda.graph`` (its own
    side stream) and replays. The graph reads its input from the buffer it was captured on: a serving
    engine copies each step's tokens into that buffer before replay; here every replay runs the same
    tokens, so they are copied in once, before the capture."""
    static_x = torch.empty_like(x)  # [B, K], the graph's input buffer
    static_x.copy_(x)
    current = torch.cuda.current_stream(x.device)
    try:
        # A failed capture leaves torch.cuda.graph's side stream current (its __exit__ raises before
        # restoring the stream); this outer context puts the caller's stream back either way.
        with torch.cuda.stream(current):
            return time_stats([lambda: layer(static_x)], x.device, graph=True, budget_s=budget_s).us * 1e-6
    except RuntimeError as err:  # e.g. a host sync inside the forward: "operation not permitted when capturing"
        torch.cuda.synchronize(x.device)
        while isinstance(err.__context__, RuntimeError):  # capture_end's error hides the cause it follows
            err = err.__context__
        lines = str(err).strip().splitlines() or [""]
        return f"{type(err).__name__}: {lines[0]}"


def graph_within_target(batch: int, graph_s: float | str | None, floor_s: float) -> bool | None:
    """Issue 13's verdict for one batch: graph replay within GRAPH_FLOOR_TARGET of the floor, judged only
    for memory-bound batches (B <= MEMORY_BOUND_MAX_BATCH) that have a replay time."""
    if batch > MEMORY_BOUND_MAX_BATCH or not isinstance(graph_s, float):
        return None
    return graph_s <= GRAPH_FLOOR_TARGET * floor_s


def host_within_target(batch: int, host_rest_s: float | None) -> bool | None:
    """Issue 13's verdict on the eager host time: within HOST_TARGET_S per forward, judged for B <= 256 on CUDA."""
    if batch > MEMORY_BOUND_MAX_BATCH or host_rest_s is None:
        return None
    return host_rest_s <= HOST_TARGET_S


def _measure_batch(layer: MoE, cfg: MoEConfig, batch: int, fmt: WeightFormat, ceilings: GpuSpec,
                   budget_s: float, inclusion: np.ndarray) -> MeasuredRow:
    device, dtype = layer.w13.device, layer.w13.dtype
    x = torch.randn(batch, cfg.hidden_size, dtype=dtype, device=device)  # [B, K]
    timing = time_layer(layer, x, budget_s)
    with torch.no_grad():
        stats = layer(x, return_stats=True).stats
    counts = stats.counts.cpu().numpy()  # [E]
    predicted = batch_cost(cfg, batch, fmt, ceilings)
    floor_s = predicted.time_floor_s
    graph_number = timing.graph_s if isinstance(timing.graph_s, float) else None
    return MeasuredRow(
        batch=batch,
        time_s=timing.eager_s,
        spread_pct=timing.spread_pct,
        noisy=timing.spread_pct > NOISY_SPREAD_PCT,
        graph_s=timing.graph_s,
        eager_s=timing.eager_s,
        host_s=timing.host_s,
        predicted_time_s=floor_s,
        graph_over_floor=None if graph_number is None else graph_number / floor_s,
        eager_over_floor=timing.eager_s / floor_s,
        graph_within_target=graph_within_target(batch, timing.graph_s, floor_s),
        experts_touched=stats.experts_touched,
        predicted_experts_touched=predicted.experts_touched,
        skew_experts_touched=experts_touched_from_inclusion(batch, inclusion),
        padding={b: padding_factor_from_counts(counts, b) for b in PADDING_BLOCKS},
        # k·E/(E + Z) with identity experts: their slots run no expert, so the counts hold none of them
        predicted_padding={b: padding_factor(batch, cfg.num_experts, cfg.routed_slots_per_token, b)
                           for b in PADDING_BLOCKS},
        host_rest_s=timing.host_rest_s,
        host_within_target=host_within_target(batch, timing.host_rest_s),
    )


def measurement_to_json(m: Measurement) -> dict:
    """``m`` as plain JSON types (the padding dicts keyed by the block as a string)."""
    d = dataclasses.asdict(m)
    for row in d["rows"]:
        row["padding"] = {str(b): v for b, v in row["padding"].items()}
        row["predicted_padding"] = {str(b): v for b, v in row["predicted_padding"].items()}
    return d


def overlay_measurement(m: Measurement, ax) -> None:
    """Draw ``m`` on ``moekit.analysis.plots.plot_report``'s panels (its ``overlay``): measured touch and
    padding on the predicted curves (they depend on E, k, B only), and the measured layer's time against
    its own prediction on the measured device in the two extra panels."""
    batches = [r.batch for r in m.rows]
    ax[0].scatter(batches, [r.experts_touched for r in m.rows], color="black", zorder=3, label="measured")
    ax[0].scatter(batches, [r.skew_experts_touched for r in m.rows], marker="+", s=80, color="red", zorder=3,
                  label="predicted from the measured router's load")
    for i, block in enumerate(PADDING_BLOCKS):
        ax[3].scatter(batches, [r.padding[block] for r in m.rows], color=f"C{i}", marker="x", zorder=3,
                      label=f"measured, block {block}")
    ax[4].plot(batches, [r.predicted_time_s * 1e3 for r in m.rows], label="predicted floor")
    ax[4].scatter(batches, [r.eager_s * 1e3 for r in m.rows], color="black", label="measured, eager")
    replayed = [r for r in m.rows if r.graph_over_floor is not None]
    if replayed:
        ax[4].scatter([r.batch for r in replayed], [r.graph_s * 1e3 for r in replayed], color="C1", marker="s",
                      label="measured, CUDA-graph replay")
        ax[5].plot([r.batch for r in replayed], [r.graph_over_floor for r in replayed], marker="s",
                   label="graph replay")
    ax[4].set(xscale="log", yscale="log", xlabel="batch B", ylabel="ms",
              title=f"one layer on {m.device} ({m.dtype}, K={m.hidden_size}, N={m.moe_intermediate_size})")
    ax[5].plot(batches, [r.eager_over_floor for r in m.rows], marker="o", label="eager")
    ax[5].set(xscale="log", yscale="log", xlabel="batch B", ylabel="measured / predicted", title="time ratio")

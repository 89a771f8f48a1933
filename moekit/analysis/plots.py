"""The figure behind ``moekit analyze --plot out.png``: the touch curve, intensity with the ridge, the
step-time floors and the padding factor, over a dense batch grid. matplotlib is imported only when a
figure is drawn, so the byte model itself never needs it.

Measured points are drawn by whoever measured them, through ``overlay`` (``moekit.analysis`` runs no
layer): ``moekit.bench.layer_measure.overlay_measurement`` puts a ``--measure`` sweep on the curves.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from moekit.analysis.padding import expected_padding_factor
from moekit.analysis.report import PADDING_BLOCKS, Report
from moekit.analysis.roofline import BatchCost, batch_cost, dense_step_floor_s

GRID_POINTS = 60  # log-spaced batches per curve: smooth enough, and the padding sums stay fast

# Draws on the panels [touch, intensity, step, padding, extra, extra] (the figure gets the two extra
# panels when an overlay is given).
Overlay = Callable[[Sequence], None]


def plot_report(report: Report, path: str, overlay: Overlay | None = None) -> None:
    """Write the figure to ``path`` (any format matplotlib infers from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, fmt, gpu = report.config, report.fmt, report.gpu
    top = max(8192, int(report.ridge_batch * 2), max(r.cost.batch for r in report.rows))
    grid = np.unique(np.geomspace(1, top, GRID_POINTS).astype(int))  # [G] batches
    costs = [batch_cost(cfg, int(b), fmt, gpu, report.inclusion, report.expert_matrices) for b in grid]  # [G]
    fig, axes = plt.subplots(2, 3 if overlay else 2, figsize=(16 if overlay else 11, 8.5))
    ax = axes.flat
    fig.suptitle(f"{report.model}: E={cfg.num_experts}, k={cfg.top_k} on {gpu.name}, {fmt.name}")
    _touch_panel(ax[0], report, grid, costs)
    _intensity_panel(ax[1], report, grid, costs)
    _step_panel(ax[2], report, grid, costs)
    _padding_panel(ax[3], report, grid)
    if overlay:
        overlay(ax)
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _touch_panel(ax, report: Report, grid: np.ndarray, costs: list[BatchCost]) -> None:
    num_experts = report.config.num_experts
    ax.plot(grid, [c.experts_touched for c in costs], label=f"E_touched(B), {report.routing}")
    ax.axhline(num_experts, color="gray", ls=":", label=f"E = {num_experts}")
    for b, name in ((report.half_batch, "B½"), (report.batch_95, "B95")):
        if not math.isfinite(b):  # inf: a skewed load that never touches that share of the experts
            continue
        ax.axvline(b, color="gray", ls="--", lw=0.8)
        # x in data, y in axes fractions: the label stays inside the panel whatever the y range (small E)
        ax.annotate(f" {name}={b:.1f}", (b, 0.04), xycoords=ax.get_xaxis_transform(), rotation=90, fontsize=8,
                    va="bottom")
    ax.set(xscale="log", xlabel="batch B (tokens)", ylabel="experts touched", title="experts touched")


def _intensity_panel(ax, report: Report, grid: np.ndarray, costs: list[BatchCost]) -> None:
    ax.plot(grid, [c.intensity for c in costs], label="MoE layer I(B)")
    ax.plot(grid, 2.0 * grid / report.fmt.bytes_per_weight, ls=":", label="dense GEMM 2B/b_w")
    ax.axhline(report.ridge_intensity, color="red", ls="--", label=f"ridge I* = {report.ridge_intensity:.0f}")
    ax.axvline(report.ridge_batch, color="red", ls=":", label=f"ridge batch = {report.ridge_batch:,.0f}")
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="FLOP / weight byte", title="arithmetic intensity")


def _step_panel(ax, report: Report, grid: np.ndarray, costs: list[BatchCost]) -> None:
    layers = report.rows[0].cost.num_moe_layers
    ax.plot(grid, [c.memory_time_s * layers * 1e3 for c in costs], label="weight streaming")
    ax.plot(grid, [c.compute_time_s * layers * 1e3 for c in costs], label="compute")
    ax.plot(grid, [c.step_time_floor_s * 1e3 for c in costs], color="black", lw=2, alpha=0.4, label="floor")
    if report.bills is not None:
        p = report.bills.params
        for params, name in ((p.active_matmul, "dense, same active"), (p.total_matmul, "dense, same total")):
            ax.plot(grid, [dense_step_floor_s(params, int(b), report.fmt, report.gpu) * 1e3 for b in grid],
                    ls="--", label=f"{name} ({params / 1e9:.1f}B)")
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="ms",
           title=f"decode step, routed experts of {layers} MoE layer(s)")


def _padding_panel(ax, report: Report, grid: np.ndarray) -> None:
    cfg = report.config
    pad_grid = grid[grid <= 16384]  # the exact binomial sums cost at least O(B) per point
    for block in PADDING_BLOCKS:
        factors = [expected_padding_factor(int(b), cfg.num_experts, cfg.routed_slots_per_token, block, report.inclusion)
                   for b in pad_grid]
        ax.plot(pad_grid, factors, label=f"block {block}")
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="padded rows / real rows", title="padding tax")

"""``moekit analyze --plot out.png``: the touch curve, intensity with the ridge, the step-time floors
and the padding factor, over a dense batch grid, with the sweep's measured points when there are any."""

from __future__ import annotations

import numpy as np

from moekit.analysis.padding import expected_padding_factor
from moekit.analysis.report import PADDING_BLOCKS, Report
from moekit.analysis.roofline import BatchCost, batch_cost, dense_step_floor_s
from moekit.cli._analyze_measure import Measurement

GRID_POINTS = 60  # log-spaced batches per curve: smooth enough, and the padding sums stay fast


def plot_report(report: Report, path: str, measurement: Measurement | None = None) -> None:
    """Write the figure to ``path`` (any format matplotlib infers from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, fmt, gpu = report.config, report.fmt, report.gpu
    top = max(8192, int(report.ridge_batch * 2), max(r.cost.batch for r in report.rows))
    grid = np.unique(np.geomspace(1, top, GRID_POINTS).astype(int))  # [G] batches
    costs = [batch_cost(cfg, int(b), fmt, gpu, report.inclusion) for b in grid]  # [G]
    fig, axes = plt.subplots(2, 3 if measurement else 2, figsize=(16 if measurement else 11, 8.5))
    ax = axes.flat
    fig.suptitle(f"{report.model}: E={cfg.num_experts}, k={cfg.top_k} on {gpu.name}, {fmt.name}")
    _touch_panel(ax[0], report, grid, costs)
    _intensity_panel(ax[1], report, grid, costs)
    _step_panel(ax[2], report, grid, costs)
    _padding_panel(ax[3], report, grid)
    if measurement:
        _overlay(ax, measurement)
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
        ax.axvline(b, color="gray", ls="--", lw=0.8)
        ax.annotate(f"{name}={b:.1f}", (b, num_experts * 0.05), rotation=90, fontsize=8)
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
        factors = [expected_padding_factor(int(b), cfg.num_experts, cfg.top_k, block, report.inclusion)
                   for b in pad_grid]
        ax.plot(pad_grid, factors, label=f"block {block}")
    ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="padded rows / real rows", title="padding tax")


def _overlay(ax, m: Measurement) -> None:
    """Measured touch and padding on the predicted curves (they depend on E, k, B only), and one
    measured layer's time against its own prediction on the measured device."""
    batches = [r.batch for r in m.rows]
    ax[0].scatter(batches, [r.experts_touched for r in m.rows], color="black", zorder=3, label="measured")
    ax[0].scatter(batches, [r.skew_experts_touched for r in m.rows], marker="+", s=80, color="red", zorder=3,
                  label="predicted from the measured router's load")
    for i, block in enumerate(PADDING_BLOCKS):
        ax[3].scatter(batches, [r.padding[block] for r in m.rows], color=f"C{i}", marker="x", zorder=3,
                      label=f"measured, block {block}")
    ax[4].plot(batches, [r.predicted_time_s * 1e3 for r in m.rows], label="predicted floor")
    ax[4].scatter(batches, [r.time_s * 1e3 for r in m.rows], color="black", label="measured")
    ax[4].set(xscale="log", yscale="log", xlabel="batch B", ylabel="ms",
              title=f"one layer on {m.device} ({m.dtype}, K={m.hidden_size}, N={m.moe_intermediate_size})")
    ax[5].plot(batches, [r.time_s / r.predicted_time_s for r in m.rows], marker="o")
    ax[5].set(xscale="log", yscale="log", xlabel="batch B", ylabel="measured / predicted", title="time ratio")

"""Matplotlib figures for a run and for the three exercises (imported only when a plot is asked for)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only; never opens a window
import matplotlib.pyplot as plt  # noqa: E402

from moekit.sim.exercises import Exercise1, Exercise2, Exercise3  # noqa: E402
from moekit.sim.run import SimResult  # noqa: E402


def plot_run(result: SimResult, path: str) -> None:
    """Expert loads with the capacity line (over-capacity part in red) and experts touched per batch."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    experts = range(len(result.loads))
    ax.bar(experts, result.kept, color="#4c72b0", label="processed")
    ax.bar(experts, [l - k for l, k in zip(result.loads, result.kept)], bottom=result.kept, color="#dd4444",
           label="over capacity (dropped)")
    ax.axhline(result.capacity, color="black", linestyle="--", label=f"capacity {result.capacity}")
    ax.set(xlabel="expert", ylabel="assignments",
           title=f"imbalance {result.imbalance:.2f}x, dropped {100 * result.drop_rate:.1f}%")
    ax.legend()
    batches = [str(t.batch) for t in result.touched_by_batch]
    ax2.bar(batches, [t.simulated for t in result.touched_by_batch], color="#4c72b0", label="simulated")
    ax2.plot(batches, [t.predicted for t in result.touched_by_batch], "ko--", label="uniform prediction")
    ax2.set(xlabel="batch", ylabel="experts touched", title="experts touched per batch")
    ax2.legend()
    _save(fig, path)


def plot_exercise1(ex: Exercise1, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = ex.curves[0].batches
    ax.plot(batches, ex.predicted, "k--", label=f"uniform prediction ({_crossing(ex, ex.predicted_first_over)})")
    for c in ex.curves:
        ax.plot(batches, c.simulated, label=f"simulated, skew {c.skew} ({_crossing(ex, c.first_over)})")
    ax.axhline(ex.threshold, color="grey", linewidth=0.8, label=f"threshold {ex.threshold:.0%}")
    ax.set(xscale="log", xlabel="batch size B", ylabel="fraction of experts touched",
           title=f"E={ex.experts}, top-{ex.top_k}: effective sparsity vs batch")
    ax.legend()
    _save(fig, path)


def _crossing(ex: Exercise1, first_over: int | None) -> str:
    """Where a curve first exceeds the threshold, or that it never does within the sweep."""
    if first_over is None:
        return f"never > {ex.threshold:.0%} up to B={ex.curves[0].batches[-1]}"
    return f"> {ex.threshold:.0%} at B={first_over}"


def plot_exercise2(ex: Exercise2, path: str) -> None:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for c in ex.curves:
        cfs = [p.capacity_factor for p in c.points]
        ax.plot(cfs, [p.relative_error for p in c.points], "o-", label=f"skew {c.skew}")
        ax2.plot(cfs, [p.drop_rate for p in c.points], "o-", label=f"skew {c.skew}")
    ax.axhline(ex.tolerance, color="grey", linewidth=0.8, label=f"tolerance {ex.tolerance:.0%}")
    ax.set(xscale="log", xlabel="capacity factor", ylabel="relative output error vs dropless",
           title="output quality vs capacity factor")
    ax2.set(xscale="log", xlabel="capacity factor", ylabel="drop rate", title="dropped assignments")
    ax.legend()
    ax2.legend()
    _save(fig, path)


def plot_exercise3(ex: Exercise3, path: str) -> None:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    skews = [p.skew for p in ex.sweep]
    for i, name in enumerate(("contiguous", "round-robin", "eplb")):
        ax.plot(skews, [p.ep.placements[i].throughput_lost for p in ex.sweep], label=name)
    ax.axhline(ex.analytic_throughput_lost, color="grey", linewidth=0.8, label=f"{ex.target_imbalance:g}x imbalance")
    ax.set(xlabel="router skew", ylabel="throughput lost (1 - mean/max)", title=f"{ex.gpus} GPUs, {ex.experts} experts")
    ax.legend()
    if ex.at_target is not None:
        width = 0.4
        gpus = range(ex.gpus)
        contiguous, eplb = ex.at_target.ep.placements[0], ex.at_target.ep.placements[2]
        ax2.bar([g - width / 2 for g in gpus], contiguous.gpu_loads, width, label="contiguous")
        ax2.bar([g + width / 2 for g in gpus], eplb.gpu_loads, width, label=f"eplb (+{ex.spare_slots} replicas)")
        ax2.axhline(sum(contiguous.gpu_loads) / ex.gpus, color="black", linestyle="--", label="mean")
        ax2.set(xlabel="GPU", ylabel="assignments", title=f"per-GPU work at skew {ex.at_target.skew}")
        ax2.legend()
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

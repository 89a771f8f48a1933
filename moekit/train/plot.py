"""The curves of ``moekit train`` as one PNG: loss and load imbalance per step (and drops when a
capacity factor was set), one line per run. Needs matplotlib (``pip install "moekit[plot]"``)."""

from __future__ import annotations

from pathlib import Path

COLORS = {"none": "tab:gray", "aux": "tab:blue", "bias": "tab:orange"}
LABELS = {"none": "no balancing", "aux": "aux loss", "bias": "bias update"}


def plot_curves(doc: dict, path: Path) -> Path | None:
    """Draw ``doc`` (``curves_document``) into ``path``; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = doc["runs"]
    with_drops = doc["settings"]["capacity_factor"] is not None
    panels = [("loss", "next-byte loss (nats)"), ("imbalance", "max / mean expert load")]
    if with_drops:
        panels.append(("dropped", "dropped assignments (fraction)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8))
    for ax, (key, label) in zip(axes, panels):
        for method, curve in runs.items():
            ax.plot(range(1, len(curve[key]) + 1), curve[key], label=LABELS.get(method, method),
                    color=COLORS.get(method), linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="black", linewidth=0.6, linestyle=":")
    axes[0].legend()
    s = doc["settings"]
    fig.suptitle(f"moekit train: byte LM on the Python stdlib, {s['num_layers']} MoE layers, E={s['num_experts']}, "
                 f"k={s['top_k']}, d={s['d_model']}"
                 + (f", capacity factor {s['capacity_factor']}" if with_drops else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

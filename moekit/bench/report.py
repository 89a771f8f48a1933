"""The results of a bench run: the JSON document, a PNG of time/floor vs M per shape, a compact table."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table


def results_path(out_dir: Path, doc: dict) -> Path:
    """``<out_dir>/<device>-<date>.json`` (device with spaces as ``_``)."""
    return Path(out_dir) / f"{doc['device'].replace(' ', '_')}-{doc['date']}.json"


def write_json(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def plot(doc: dict, path: Path) -> Path | None:
    """time / floor vs M (log-log), one panel per shape, one line per backend. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    shapes = list(dict.fromkeys(c["shape"] for c in doc["cells"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        cells = [c for c in doc["cells"] if c["shape"] == shape]
        for backend in dict.fromkeys(c["backend"] for c in cells):
            pts = sorted((c["M"], c["us"] / c["floor_us"]) for c in cells if c["backend"] == backend)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1 / 0.9, color="gray", ls="--", lw=0.8, label="90% of floor")
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="time / floor", title=shape)
        ax.legend(fontsize=8)
    c = doc["ceilings"]
    fig.suptitle(f"{doc['device']}  copy {c['copy_TBps']:.2f} TB/s, matmul {c['mm_TFLOPs']:.0f} TFLOP/s ({c['mm_dtype']})"
                 f"  commit {doc['commit'][:12]}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(doc: dict) -> Table:
    t = Table(title=f"moekit bench: {doc['device']} ({doc['dtype']})", show_lines=False)
    for col in ("shape", "M", "backend", "µs", "floor", "%floor", "%copy", "TFLOP/s", "%mm", "touched"):
        t.add_column(col, justify="left" if col in ("shape", "backend") else "right")
    for c in doc["cells"]:
        t.add_row(c["shape"], str(c["M"]), c["backend"], f"{c['us']:.1f}", f"{c['floor_us']:.1f}",
                  f"{c['pct_floor']:.0f}", f"{c['pct_copy_bw']:.0f}", f"{c['tflops']:.3g}", f"{c['pct_mm']:.0f}",
                  f"{c['experts_touched']:.0f}")
    return t


def print_report(doc: dict, console: Console | None = None) -> None:
    console = console or Console(width=120)
    console.print(table(doc))
    c = doc["ceilings"]
    console.print(f"ceilings: copy {c['copy_TBps']:.2f} TB/s, matmul {c['mm_TFLOPs']:.1f} TFLOP/s ({c['mm_dtype']})")
    speedup = doc["summary"].get("geomean_speedup_triton_vs_grouped_mm")
    if speedup:
        console.print(f"triton vs grouped_mm, geometric mean speed-up: {speedup:.2f}x")

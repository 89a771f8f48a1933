"""The results of a bench run: the JSON document, a PNG of time/floor vs M per shape, a compact table."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moekit.bench.predict import draw_predictions, is_quantized, prediction_note


def free_results_path(out_dir: Path, stem: str, also: tuple[str, ...] = ()) -> Path:
    """``<out_dir>/<stem>.json``, or ``<stem>-2.json``, ``-3`` ... when that name (or its twin with a suffix in
    ``also``, e.g. the plot's ``.png``) is taken: a run never overwrites an earlier result."""
    path, n = Path(out_dir) / f"{stem}.json", 1
    while path.exists() or any(path.with_suffix(suffix).exists() for suffix in also):
        n += 1
        path = Path(out_dir) / f"{stem}-{n}.json"
    return path


def results_path(out_dir: Path, doc: dict) -> Path:
    """``<out_dir>/<device>-<date>.json`` (device with spaces as ``_``), or ``-2``, ``-3`` ... when the
    JSON, its PNG or a killed run's partial JSON is taken."""
    return free_results_path(out_dir, f"{doc['device'].replace(' ', '_')}-{doc['date']}",
                             also=(".png", PARTIAL_SUFFIX))


PARTIAL_SUFFIX = ".partial.json"  # beside a run's results path while it runs: the cells timed so far


def write_partial(doc: dict, path: Path) -> Path:
    """Write the document of a run still going (``doc["partial"]``: the cells timed so far) beside the results
    ``path`` as ``<stem>.partial.json``, replacing the last one atomically: a run killed by a time limit, the
    machine or the user keeps what it measured (``moekit bench --targets`` reads it). Returns its path."""
    partial = path.with_suffix(PARTIAL_SUFFIX)
    partial.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial.with_name(partial.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, partial)
    return partial


def write_json(doc: dict, path: Path) -> Path:
    """Write ``doc`` to ``path``; refuses (``FileExistsError``) to replace an existing file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "x") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    return path


def _si(value: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_flops(flops_per_s: float) -> str:
    """A rate with its SI prefix, 3 significant digits: ``755 TFLOP/s`` on an H200, ``48.2 GFLOP/s`` on a CPU."""
    return _si(flops_per_s, "FLOP/s")


def format_bandwidth(bytes_per_s: float) -> str:
    """A bandwidth with its SI prefix, 3 significant digits: ``4.15 TB/s``, ``9.87 GB/s``."""
    return _si(bytes_per_s, "B/s")


def ceilings_line(doc: dict) -> str:
    c = doc["ceilings"]
    fp8 = f", fp8 matmul {format_flops(c['fp8_mm_TFLOPs'] * 1e12)}" if c.get("fp8_mm_TFLOPs") else ""
    return (f"copy {format_bandwidth(c['copy_TBps'] * 1e12)}, matmul {format_flops(c['mm_TFLOPs'] * 1e12)} "
            f"({c['mm_dtype']}){fp8}")


def plot_title(doc: dict) -> str:
    return f"{doc['device']}  {ceilings_line(doc)}  commit {doc['commit'][:12]}"


def _title_and_notes(fig, doc: dict) -> None:
    """The title (wrapped to the figure's width), and the footnotes in a strip added below the panels."""
    width_in, height_in = fig.get_size_inches()
    fig.suptitle(textwrap.fill(plot_title(doc), int(width_in * 11)), fontsize=10)  # ~11 chars/inch at 10 pt
    text = "\n".join(textwrap.fill(n, int(width_in * 17)) for n in footnotes(doc))  # ~17 chars/inch at 7 pt
    strip_in = 0.12 * (text.count("\n") + 1) + 0.1 if text else 0.0
    fig.set_size_inches(width_in, height_in + strip_in)
    fig.tight_layout(rect=(0, strip_in / (height_in + strip_in), 1, 1))
    if text:
        fig.text(0.01, 0.01, text, fontsize=7, va="bottom")


LINE_STYLES = ("-", "--", ":", "-.")


def figure(doc: dict):
    """The results figure: time / floor vs M (log-log), one panel per shape, one line per backend and
    weight dtype; with quantized cells, a second row of µs vs M where each quantized dtype's measured
    points stand beside the byte model's predicted floor (``predict.draw_predictions``). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(c["shape"] for c in doc["cells"]))
    quantized = any(is_quantized(doc, c) for c in doc["cells"])
    rows = 2 if quantized else 1
    fig, axes = plt.subplots(rows, len(shapes), figsize=(5 * len(shapes), 4 * rows), squeeze=False)
    dtypes = list(dict.fromkeys(c.get("dtype", doc["dtype"]) for c in doc["cells"]))
    colors = {d: f"C{i}" for i, d in enumerate(dtypes)}
    styles: dict[str, str] = {}  # backend -> line style
    for col, shape in enumerate(shapes):
        ax = axes[0][col]
        cells = [c for c in doc["cells"] if c["shape"] == shape]
        for backend, dtype in dict.fromkeys((c["backend"], c.get("dtype", doc["dtype"])) for c in cells):
            pts = sorted((c["M"], c["us"] / c["floor_us"]) for c in cells
                         if c["backend"] == backend and c.get("dtype", doc["dtype"]) == dtype)
            # quantized runs: a colour per dtype (as in the second row), a line style per backend
            style = dict(color=colors[dtype],
                         ls=styles.setdefault(backend, LINE_STYLES[len(styles) % 4])) if quantized else {}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{backend} {dtype}" if quantized
                    else backend, **style)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1 / 0.9, color="gray", ls="--", lw=0.8, label="90% of floor")
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="time / floor", title=shape)
        ax.legend(fontsize=8)
        if quantized:
            draw_predictions(axes[1][col], doc, shape, colors, legend=col == 0)
    _title_and_notes(fig, doc)
    return fig


def plot(doc: dict, path: Path) -> Path | None:
    """``figure(doc)`` written to ``path``. None without matplotlib."""
    try:
        import matplotlib  # noqa: F401  (figure() picks the Agg backend before pyplot loads)
    except ImportError:
        return None
    fig = figure(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


ABOVE_FLOOR_CPU = (
    "%floor above 100 (time / floor below 1): the cell ran faster than the floor, i.e. the ceilings measured "
    "at the start of the run are lower than what this kernel achieves. On the CPU two things do that: the copy "
    "probe streams 2 x 128 MiB through DRAM, while a scaled-down cell's touched weights (a few MB) can stay in "
    "the caches; and the probes share the cores with whatever else runs, so a busy moment during the probes "
    "lowers the ceilings for every cell. Read such cells as 'at the ceiling'."
)
ABOVE_FLOOR_GPU = (
    "%floor above 100 (time / floor below 1): the cell ran faster than the floor, i.e. the measured ceilings "
    "are lower than what this kernel achieves: the copy probe moves read + write traffic, and a kernel that "
    "mostly reads streams a few % faster than a copy. Read such cells as 'at the ceiling'."
)
NOISY_CPU = (
    " On the CPU, torch's {threads} intra-op threads wait on each other when other processes hold the cores "
    "(measured at load 11 on 2 cores: cells up to 17x slower than with one thread); OMP_NUM_THREADS=1 trades "
    "speed for steadier numbers."
)


def footnotes(doc: dict) -> list[str]:
    """What the table and the plot need explained: cells above 100% of the floor, noisy cells."""
    notes = []
    if any(c["pct_floor"] > 100 for c in doc["cells"]):
        notes.append(ABOVE_FLOOR_CPU if doc["device"] == "cpu" else ABOVE_FLOOR_GPU)
    noisy = sum(c.get("noisy", False) for c in doc["cells"])
    if noisy:
        threads = doc.get("cpu_threads", 1)
        notes.append(f"{noisy} cell(s) marked noisy: their timed passes spread (interquartile range) more than "
                     f"{doc['noisy_spread_pct']:.0f}% of the median; the machine was busy, run again to confirm."
                     + (NOISY_CPU.format(threads=threads) if doc["device"] == "cpu" and threads > 1 else ""))
    if any("(sibling)" in (c.get("config") or "") for c in doc["cells"]):
        notes.append(SIBLING_NOTE)
    failed = doc.get("failed_cells") or []  # older files have none
    if failed:
        listed = ", ".join(f"{f['shape']} M={f['M']} {f['backend']} {f['dtype']}" for f in failed)
        notes.append(f"{len(failed)} cell(s) FAILED and are not in the table: {listed} ({failed[0]['reason']}; "
                     f"failed_cells in the JSON). The device has too little memory for them beside the weights "
                     f"this run holds (every --dtype of a shape at once): run them alone (--shapes / --batches / "
                     f"--dtype).")
    return notes + _quant_notes(doc)


SIBLING_NOTE = (
    "config \"<device> (sibling)\": this device has no tuned file of its own for the cell's shape, so its launch "
    "configs are those tuned on that device of the same compute capability (moekit.experts.configs.tuned_files); "
    "MOEKIT_SIBLING_CONFIGS=0 gives the heuristic instead, moekit tune the device's own file."
)


QUANT_BACKENDS = {
    "triton": "moekit's fused kernels (fp8_block: activations quantized in the path; weight-only: dequantized "
              "in registers)",
    "grouped_mm": "grouped_mm's quantized path (on the CPU without autograd each touched expert dequantized, or "
                  "run by torch's weight-only kernel: moekit.experts.cpu_quant; elsewhere every expert dequantized "
                  "on every call: correct, not fast)",
    "reference": "the reference (the exact definition, a per-expert loop)",
}


def _quant_notes(doc: dict) -> list[str]:
    """Which path the quantized cells ran, and that no peer is beside them; the fp8 rate the fp8 cells
    could not be held to; what the plot's dashed curves are."""
    quant = [c for c in doc["cells"] if is_quantized(doc, c)]
    if not quant:
        return []
    ran = "; ".join(QUANT_BACKENDS.get(b, b) for b in dict.fromkeys(c["backend"] for c in quant))
    notes = [f"Quantized cells ({', '.join(dict.fromkeys(c['dtype'] for c in quant))}) ran {ran}. No peer in "
             f"this bench takes quantized weights, so each is compared with moekit's own unquantized cell "
             f"({doc['dtype']}, same backend): xbf16 = its time over that cell's."]
    fp8_cells = any(c["dtype"] == "fp8_block" for c in quant)
    if fp8_cells and not doc["ceilings"].get("fp8_mm_TFLOPs"):
        notes.append(f"No fp8 matmul rate ({doc['ceilings'].get('fp8_mm_error')}): the fp8_block cells' floors "
                     f"and %mm use the dense {doc['ceilings']['mm_dtype']} rate (mm_dtype in the JSON).")
    predicted = prediction_note(doc)
    return notes + ([predicted] if predicted else [])


def format_us(us: float) -> str:
    """A time in µs with 3-4 significant digits, in ms or s past a millisecond (keeps the table narrow)."""
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.1f} µs" if us >= 10 else f"{us:.2f} µs"


def table(doc: dict) -> Table:
    t = Table(title=f"moekit bench: {doc['device']} ({doc['dtype']})", box=None, padding=(0, 1), pad_edge=False,
              caption="time: median of repeated passes (CUDA graph on the GPU up to M=1024); ±%: their spread "
                      "(interquartile range); eager: back-to-back eager calls, one sync; host: the issue time "
                      "of those calls (on the CPU both equal time); xbf16: a quantized cell's time over the "
                      "unquantized cell's; achieved TFLOP/s: in the JSON")
    columns = ("shape", "M", "backend", "dtype", "time", "±%", "eager", "host", "floor", "%floor", "xbf16", "%copy",
               "%mm", "touched")
    sourced = any(c.get("config") for c in doc["cells"])  # older files and CPU-only runs without triton lack it
    for col in columns + (("config",) if sourced else ()):
        t.add_column(col, justify="left" if col in ("shape", "backend", "dtype", "config") else "right", no_wrap=True)
    for c in doc["cells"]:
        spread = "-" if "spread_pct" not in c else f"{c['spread_pct']:.0f}" + (" noisy" if c["noisy"] else "")
        eager, host = (format_us(c[k]) if k in c else "-" for k in ("eager_us", "host_us"))  # older files lack them
        vs_bf16 = f"{c['vs_bf16']:.2f}" if c.get("vs_bf16") is not None else "-"
        t.add_row(c["shape"], str(c["M"]), c["backend"], c.get("dtype", doc["dtype"]), format_us(c["us"]), spread,
                  eager, host, format_us(c["floor_us"]), f"{c['pct_floor']:.0f}", vs_bf16,
                  f"{c['pct_copy_bw']:.0f}", f"{c['pct_mm']:.0f}", f"{c['experts_touched']:.0f}",
                  *((c.get("config") or "-",) if sourced else ()))
    return t


def report_width(doc: dict, least: int = 120) -> int:
    """Columns the table needs unwrapped (quantized runs add the dtype and xbf16 columns), at least ``least``."""
    return max(least, Console(width=1000).measure(table(doc)).maximum)


def print_report(doc: dict, console: Console | None = None) -> None:
    console = console or Console(width=report_width(doc))
    console.print(table(doc))
    for note in footnotes(doc):
        console.print(note)
    console.print(f"ceilings: {ceilings_line(doc)}")
    speedup = doc["summary"].get("geomean_speedup_triton_vs_grouped_mm")
    if speedup:
        console.print(f"triton vs grouped_mm, geometric mean speed-up: {speedup:.2f}x")
    for dtype, ratio in doc["summary"].get("geomean_time_vs_bf16", {}).items():
        if ratio:
            console.print(f"{dtype}: geometric mean time over the unquantized cells' {ratio:.2f}x")

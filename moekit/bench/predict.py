"""The byte model's prediction beside the measured quantized cells: what ``moekit analyze --dtype fp8``
says a cell's floor is, drawn next to what the bench measured.

The prediction is ``moekit.analysis.roofline.batch_cost`` for the cell's shape (E, N, K, k) in the
dtype's analysis format (``fp8_block`` -> ``fp8``, ...) on a GPU spec built from the run's own
ceilings (copy bandwidth; the fp8 or dense matmul rate): the same numbers ``moekit analyze --dtype fp8
--bandwidth <copy TB/s> --tflops <fp8 TFLOP/s>`` gives. It counts expected touched experts under
uniform routing and weights only (no activations, scales as the format counts them), so the gap
between the curve and the measured floor is the model's simplification, and the gap to the points is
the kernel's.
"""

from __future__ import annotations

import numpy as np

from moekit.analysis.formats import WeightFormat, get_format
from moekit.analysis.gpus import GpuSpec
from moekit.analysis.roofline import batch_cost
from moekit.config import MoEConfig

GRID_POINTS = 40  # log-spaced batches per predicted curve


def run_gpu(ceilings: dict) -> GpuSpec:
    """A GpuSpec of the run's measured ceilings: copy bandwidth, the dense rate (under ``bf16``, the
    weight-only formats' compute dtype; float32 on a CPU run) and the fp8 rate when measured."""
    rates = {"bf16": ceilings["mm_TFLOPs"]}
    if ceilings.get("fp8_mm_TFLOPs"):
        rates["fp8"] = ceilings["fp8_mm_TFLOPs"]
    return GpuSpec("this run's ceilings", ceilings["copy_TBps"], 0.0, rates,
                   "moekit bench: copy bandwidth and matmul rates measured in the run")


def format_of(dtype: str) -> WeightFormat | None:
    """The analysis format of a quantized bench dtype (``fp8_block`` -> ``fp8``); None for a dtype the
    byte model has no format for."""
    try:
        return get_format(dtype)
    except KeyError:
        return None


def predicted_floor_us(shape: dict, fmt: WeightFormat, ceilings: dict, batches) -> np.ndarray | None:
    """The byte model's floor in µs at each of ``batches`` for ``shape`` (a results file's shape entry:
    num_experts, n, k, top_k); None when the run has no rate for the format's compute dtype."""
    gpu = run_gpu(ceilings)
    if fmt.compute_dtype not in gpu.dense_tflops:
        return None
    cfg = MoEConfig(hidden_size=shape["k"], moe_intermediate_size=shape["n"], num_experts=shape["num_experts"],
                    top_k=shape["top_k"])
    return np.array([batch_cost(cfg, int(b), fmt, gpu).time_floor_s * 1e6 for b in batches])


def is_quantized(doc: dict, cell: dict) -> bool:
    """A quantized cell: its weights' dtype is not the run's activation dtype (files before --dtype: none)."""
    return cell.get("dtype", doc.get("dtype")) != doc.get("dtype")


def prediction_note(doc: dict) -> str | None:
    """The footnote that says what the byte model predicts for the quantized cells (the plot's dashed curves; worded
    so that it holds for a run without the PNG too), with the ``moekit analyze`` flags that give the same numbers;
    None when the run has no quantized cells."""
    fmts = {f.name: f for c in doc["cells"] if is_quantized(doc, c) and (f := format_of(c["dtype"]))}
    if not fmts:
        return None
    c = doc["ceilings"]
    rates = run_gpu(c).dense_tflops
    flags = "; ".join(f"--dtype {n} --bandwidth {c['copy_TBps']:.4g} --tflops {rates[f.compute_dtype]:.4g}"
                      for n, f in fmts.items() if f.compute_dtype in rates)
    return ("The byte model's predicted floor (the PNG's dashed curves; moekit analyze with the shape's "
            f"--experts/--top-k/--hidden/--moe-intermediate and {flags}): expected experts touched under uniform "
            "routing, weights only, bytes per weight as the format counts them; the table's floor counts the "
            "touched experts' exact packed bytes, scales and x/out.")


def draw_predictions(ax, doc: dict, shape_name: str, colors: dict[str, str], legend: bool = True) -> None:
    """Measured µs of the quantized cells of one shape (markers), the unquantized cells of the same
    backends (a line), and each quantized dtype's predicted floor (dashed, the dtype's colour).
    ``legend``: draw the legend (every shape's panel has the same entries: one legend is enough)."""
    cells = [c for c in doc["cells"] if c["shape"] == shape_name]
    quant = [c for c in cells if is_quantized(doc, c)]
    for backend in dict.fromkeys(c["backend"] for c in quant):  # the unquantized cells they are compared with
        base = sorted((c["M"], c["us"]) for c in cells if not is_quantized(doc, c) and c["backend"] == backend)
        if base:
            ax.plot(*zip(*base), marker="o", ls="-", color=colors.get(doc["dtype"], "gray"),
                    label=f"{backend} {doc['dtype']} (unquantized), measured")
    shape = next(s for s in doc["shapes"] if s["name"] == shape_name)
    top = max(c["M"] for c in cells)
    grid = np.unique(np.rint(np.geomspace(1, max(top, 2), GRID_POINTS)).astype(int))  # [G] batches, 1 .. top
    for dtype in dict.fromkeys(c["dtype"] for c in quant):
        pts = sorted((c["M"], c["us"]) for c in quant if c["dtype"] == dtype)
        ax.plot(*zip(*pts), marker="o", ls="none", color=colors[dtype], label=f"{dtype}, measured")
        fmt = format_of(dtype)
        floor = predicted_floor_us(shape, fmt, doc["ceilings"], grid) if fmt else None
        if floor is not None:
            ax.plot(grid, floor, ls="--", color=colors[dtype],
                    label=f"{dtype} predicted floor (analyze --dtype {fmt.name})")
    ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="µs per call", title=f"{shape_name}: quantized")
    if legend:
        ax.legend(fontsize=6)

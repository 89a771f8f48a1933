"""Bench JSONs read for ``moekit bench --targets``: checked to be ``moekit bench`` results (the kernel cells'
document of ``run._document``), their triton cells as ``TargetCell``s, each quantized cell beside the
unquantized cell of its own file (same shape, M, backend: the bench's ``vs_bf16``).

A file that is not such a result raises ``ValueError`` naming the file and what it lacks. Files written
before cells carried ``dtype`` / ``mm_dtype`` read as the bench's report reads them: the run's ``dtype``
and the ceilings' ``mm_dtype``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from moekit.bench.quant_cells import BASELINE
from moekit.bench.targets import JUDGED_BACKEND, TargetCell
from moekit.quant import SCHEMES

DOC_KEYS = ("device", "dtype", "ceilings", "cells")
CEILING_KEYS = ("copy_TBps", "mm_TFLOPs", "mm_dtype")
CELL_KEYS = ("shape", "M", "backend", "us", "pct_floor", "pct_mm")
NUMBERS = ("us", "pct_floor", "pct_mm")


@dataclass(frozen=True)
class BenchFile:
    """One bench JSON as --targets reads it."""

    path: str
    device: str  # torch.cuda.get_device_name, or "cpu"
    commit: str
    date: str
    versions: str  # "torch X, triton Y"
    ceilings: dict  # the run's measured ceilings (run._document's "ceilings")
    cells: list[TargetCell]  # its triton cells, in the file's order
    skipped: dict[str, int]  # other backends -> how many cells of theirs the file has (not judged)
    failed: list[str]  # the run's cells the device could not run ("shape M=.. backend dtype (reason)"; failed_cells)


def load_bench(path: str | Path) -> BenchFile:
    """``path`` read and checked; ``ValueError`` beginning with the path for anything but a bench result."""
    doc = _read(Path(path))
    raw = [_checked_cell(path, i, c) for i, c in enumerate(doc["cells"])]
    _refuse_repeats(path, raw, doc["dtype"])
    ours = [c for c in raw if c["backend"] == JUDGED_BACKEND]
    skipped: dict[str, int] = {}
    for c in raw:
        if c["backend"] != JUDGED_BACKEND:
            skipped[c["backend"]] = skipped.get(c["backend"], 0) + 1
    mm_dtype = doc["ceilings"]["mm_dtype"]
    base_us = {(c["shape"], c["M"]): c["us"] for c in ours if _dtype(c, doc["dtype"]) == BASELINE}
    cells = [_target_cell(str(path), c, _dtype(c, doc["dtype"]), mm_dtype, base_us) for c in ours]
    versions = f"torch {doc.get('torch', '?')}, triton {doc.get('triton') or '-'}"
    failed = [f"{f.get('shape')} M={f.get('M')} {f.get('backend')} {f.get('dtype')} ({f.get('reason')})"
              for f in doc.get("failed_cells") or [] if isinstance(f, dict)]  # files before session 43 have none
    return BenchFile(str(path), doc["device"], doc.get("commit", "unknown"), doc.get("date", "?"), versions,
                     doc["ceilings"], cells, skipped, failed)


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"{path}: cannot read it: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err}); give a moekit bench result") from None
    what = "moekit bench's kernel cells (bench --hf, --offload, --train and --cpu-experts results have none)"
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a moekit bench result: a JSON {type(doc).__name__}, expected an object of "
                         f"{what}")
    missing = [k for k in DOC_KEYS if k not in doc]
    if missing:
        raise ValueError(f"{path}: not a moekit bench result: no {', '.join(map(repr, missing))}; expected "
                         f"{what}")
    if not isinstance(doc["cells"], list) or not isinstance(doc["ceilings"], dict):
        raise ValueError(f"{path}: not a moekit bench result: 'cells' must be a list and 'ceilings' an object")
    missing = [k for k in CEILING_KEYS if k not in doc["ceilings"]]
    if missing:
        raise ValueError(f"{path}: not a moekit bench result: its 'ceilings' have no {', '.join(map(repr, missing))}")
    return doc


def _checked_cell(path, index: int, cell) -> dict:
    if not isinstance(cell, dict):
        raise ValueError(f"{path}: cell {index} is a {type(cell).__name__}, expected an object")
    missing = [k for k in CELL_KEYS if k not in cell]
    if missing:
        raise ValueError(f"{path}: cell {index} has no {', '.join(map(repr, missing))}: not a moekit bench cell")
    for key in NUMBERS + (("peer_us",) if cell.get("peer_us") is not None else ()):
        value = cell[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{path}: cell {index} ({cell['shape']} M={cell['M']}): {key} must be a finite "
                             f"number >= 0, got {value!r}")
    if cell["us"] <= 0 or (cell.get("peer_us") is not None and cell["peer_us"] <= 0):
        raise ValueError(f"{path}: cell {index} ({cell['shape']} M={cell['M']}): its times must be > 0 µs")
    return cell


def _dtype(cell: dict, run_dtype: str) -> str:
    """The cell's bench dtype: its scheme, or BASELINE for the run's unquantized cells."""
    dtype = cell.get("dtype", run_dtype)
    return dtype if dtype in SCHEMES else BASELINE


def _refuse_repeats(path, cells: list[dict], run_dtype: str) -> None:
    seen = set()
    for c in cells:
        key = (c["shape"], c["M"], c["backend"], _dtype(c, run_dtype))
        if key in seen:
            raise ValueError(f"{path}: two cells of {c['shape']} M={c['M']} {c['backend']} {key[3]}; "
                             "a bench result has one of each")
        seen.add(key)


def _target_cell(source: str, c: dict, dtype: str, mm_dtype: str, base_us: dict) -> TargetCell:
    return TargetCell(
        source=source, shape=c["shape"], M=int(c["M"]), dtype=dtype, us=float(c["us"]),
        pct_floor=float(c["pct_floor"]), pct_mm=float(c["pct_mm"]), mm_dtype=c.get("mm_dtype", mm_dtype),
        bf16_us=base_us.get((c["shape"], c["M"])) if dtype != BASELINE else None,
        peer_us=c.get("peer_us"), rel_err_vs_bf16=c.get("rel_err_vs_bf16"),
    )

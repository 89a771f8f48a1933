"""``moekit bench`` when a cell does not fit the device: out of memory is retried once after emptying the
allocator's cache, then recorded in ``failed_cells`` while the run goes on (an 80 GB H100 ran out at DeepSeek-V3
M = 16384 with every weight-only scheme held, session 43, and lost the whole run). Driven on the CPU with backends
that raise as a CUDA launch does."""

from __future__ import annotations

import pytest
import torch

from moekit.bench import sweep
from moekit.bench.cells import Shape
from moekit.bench.report import footnotes
from moekit.bench.run import run_bench
from moekit.experts import get_backend

TINY = Shape("tiny", num_experts=8, n=24, k=40, top_k=2)
OOM = "Triton Error [CUDA]: out of memory"


def _backends(monkeypatch, raises):
    """Backends that call the real ones unless ``raises(name, M, call_number)`` names an error to raise."""
    calls: dict[tuple[str, int], int] = {}

    def fake(name):
        real = get_backend(name)

        def run(x, *args, **kwargs):
            key = (name, x.shape[0])
            calls[key] = calls.get(key, 0) + 1
            error = raises(name, x.shape[0], calls[key])
            if error is not None:
                raise error
            return real(x, *args, **kwargs)
        return run

    monkeypatch.setattr(sweep, "get_backend", fake)
    return calls


def test_a_cell_out_of_memory_twice_is_recorded_and_the_run_goes_on(monkeypatch):
    _backends(monkeypatch, lambda name, m, n: RuntimeError(OOM) if (name, m) == ("reference", 5) else None)
    lines = []
    doc = run_bench(torch.device("cpu"), shapes=[TINY], batches=[1, 5], backends=["grouped_mm", "reference"],
                    on_progress=lambda p: lines.append(p), budget_s=0.01)
    assert {(c["M"], c["backend"]) for c in doc["cells"]} == {(1, "grouped_mm"), (1, "reference"), (5, "grouped_mm")}
    (failed,) = doc["failed_cells"]
    assert (failed["shape"], failed["M"], failed["backend"]) == ("tiny", 5, "reference")
    assert "out of device memory" in failed["reason"]
    assert any("tiny M=5 reference: FAILED" in p.message for p in lines)
    assert lines[-1].done == lines[-1].total == 4  # the failed cell counts as done
    (note,) = [n for n in footnotes(doc) if "FAILED" in n]
    assert "tiny M=5 reference" in note


def test_out_of_memory_once_is_retried_and_timed(monkeypatch):
    calls = _backends(monkeypatch, lambda name, m, n: torch.OutOfMemoryError("CUDA out of memory")
                      if (name, m, n) == ("grouped_mm", 1, 1) else None)
    doc = run_bench(torch.device("cpu"), shapes=[TINY], batches=[1], backends=["grouped_mm"], budget_s=0.01)
    (cell,) = doc["cells"]
    assert cell["backend"] == "grouped_mm" and cell["us"] > 0 and doc["failed_cells"] == []
    assert calls[("grouped_mm", 1)] > 2  # the failed call, then the retried cell's own calls


def test_other_errors_are_not_swallowed(monkeypatch):
    _backends(monkeypatch, lambda name, m, n: RuntimeError("an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_bench(torch.device("cpu"), shapes=[TINY], batches=[1], backends=["grouped_mm"], budget_s=0.01)

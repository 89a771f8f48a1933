"""The tables and the file name of a ``moekit bench --cpu-experts`` document (``moekit.bench.cpu_measure``);
they read every earlier result in ``benchmarks/results/*-cpu-experts-*.json`` too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moekit.bench.report import free_results_path


@dataclass(frozen=True)
class Headline:
    """One batch size in one line: moekit against transformers' fastest implementation."""

    tokens: int  # M
    moekit_ms: float | None  # None when the moekit row was not asked for
    best_hf: str | None  # the fastest transformers row ("hf_grouped_mm", ...), None when none ran
    best_hf_ms: float | None
    pct_of_dense: float | None  # moekit's rate as % of the dense fp32 ceiling of the same run

    @property
    def ratio(self) -> float | None:
        """transformers' best time / moekit's: > 1 when moekit is faster."""
        if self.moekit_ms is None or self.best_hf_ms is None:
            return None
        return self.best_hf_ms / self.moekit_ms


def headlines(doc: dict) -> list[Headline]:
    out = []
    for batch in doc["batches"]:
        rows = batch["rows"]
        hf = {name: r["us"] for name, r in rows.items() if name.startswith("hf_")}
        best = min(hf, key=hf.get) if hf else None
        moekit = rows.get("moekit")
        out.append(Headline(batch["M"], moekit["us"] / 1e3 if moekit else None, best,
                            hf[best] / 1e3 if best else None, moekit["pct_of_dense"] if moekit else None))
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def summary_lines(doc: dict) -> list[str]:
    """Per M: moekit ms, transformers' best (which) ms, best/moekit, moekit % of dense."""
    lines = [f"{'M':>5} {'moekit ms':>10} {'transformers best':>17} {'ms':>10} {'best/moekit':>11} "
             f"{'moekit % dense':>14}"]
    for h in headlines(doc):
        best = "-" if h.best_hf is None else h.best_hf.removeprefix("hf_")
        lines.append(f"{h.tokens:>5} {_num(h.moekit_ms, '10.2f')} {best:>17} {_num(h.best_hf_ms, '10.2f')} "
                     f"{_num(h.ratio, '10.2f')}x {_num(h.pct_of_dense, '14.0f')}")
    return lines


def row_lines(doc: dict) -> list[str]:
    """Every row of every batch: median ms, spread, GFLOP/s, % of dense, error vs transformers' eager."""
    lines = [f"{'M':>5} {'implementation':26} {'ms':>10} {'spread%':>8} {'GFLOP/s':>8} {'% dense':>8} {'err':>9}"]
    for batch in doc["batches"]:
        for name, r in batch["rows"].items():
            err = "-" if r["rel_err_vs_hf_eager"] is None else f"{r['rel_err_vs_hf_eager']:.1e}"
            lines.append(f"{batch['M']:>5} {name:26} {r['us'] / 1e3:10.2f} {r['spread_pct']:8.0f} {r['gflops']:8.1f} "
                         f"{r['pct_of_dense']:8.0f} {err:>9}")
    return lines


def report_lines(doc: dict) -> list[str]:
    """The header (CPU, threads, load), every row, then the summary per M."""
    shape = doc["shape"]
    head = [f"{doc['cpu']}  threads={doc['threads']}  E,N,K,k={shape['E']},{shape['N']},{shape['K']},{shape['k']}  "
            f"fp32  load avg before/after={doc['loadavg_before']}/{doc['loadavg_after']}  commit {doc['commit'][:12]}"]
    head += [f"note: {note}" for note in doc.get("notes", [])]
    return [*head, "", *row_lines(doc), "", *summary_lines(doc)]


def results_path(out_dir: Path, doc: dict) -> Path:
    """``<out_dir>/<cpu>-cpu-experts-<date>.json`` (spaces and slashes as ``_``), or ``-2``, ``-3`` ... when taken:
    a run never overwrites an earlier result."""
    return free_results_path(out_dir, f"{doc['cpu'].replace(' ', '_').replace('/', '_')}-cpu-experts-{doc['date']}")

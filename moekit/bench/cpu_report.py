"""The tables and the file name of a ``moekit bench --cpu-experts`` document (``moekit.bench.cpu_measure``);
they read every earlier result in ``benchmarks/results/*-cpu-experts-*.json`` too."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moekit.bench.report import PARTIAL_SUFFIX, free_results_path


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


def _err(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def row_lines(doc: dict) -> list[str]:
    """Every row of every batch: median ms, spread, GFLOP/s, % of dense, error vs transformers' eager, and
    (documents since session 30) error vs the reference backend on the quantized weights, weight MB read."""
    lines = [f"{'M':>5} {'implementation':26} {'ms':>10} {'spread%':>8} {'GFLOP/s':>8} {'% dense':>8} {'err':>9} "
             f"{'err ref':>9} {'weight MB':>10}"]
    for batch in doc["batches"]:
        for name, r in batch["rows"].items():
            mb = "-" if r.get("weight_bytes") is None else f"{r['weight_bytes'] / 1e6:.1f}"
            lines.append(f"{batch['M']:>5} {name:26} {r['us'] / 1e3:10.2f} {r['spread_pct']:8.0f} {r['gflops']:8.1f} "
                         f"{r['pct_of_dense']:8.0f} {_err(r['rel_err_vs_hf_eager']):>9} "
                         f"{_err(r.get('rel_err_vs_reference')):>9} {mb:>10}")
    return lines


def quant_summary_lines(doc: dict) -> list[str]:
    """Per scheme and M: moekit[s] ms (after), dequant_all[s] ms (before), the unquantized moekit ms, and the
    ratios after / unquantized and before / after."""
    schemes = doc.get("schemes") or []
    if not schemes:
        return []
    lines = [f"{'scheme':11} {'M':>5} {'before ms':>10} {'after ms':>10} {'unquant ms':>10} {'after/unq':>9} "
             f"{'before/after':>12}"]
    for scheme in schemes:
        for batch in doc["batches"]:
            rows = batch["rows"]
            after, before = rows[f"moekit[{scheme}]"]["us"] / 1e3, rows[f"dequant_all[{scheme}]"]["us"] / 1e3
            unq = rows["moekit"]["us"] / 1e3 if "moekit" in rows else None
            lines.append(f"{scheme:11} {batch['M']:>5} {before:10.2f} {after:10.2f} {_num(unq, '10.2f')} "
                         f"{_num(None if unq is None else after / unq, '9.2f')} {before / after:12.1f}")
    return lines


def report_lines(doc: dict) -> list[str]:
    """The header (CPU, threads, load), every row, then the summary per M."""
    shape = doc["shape"]
    head = [f"{doc['cpu']}  threads={doc['threads']}  E,N,K,k={shape['E']},{shape['N']},{shape['K']},{shape['k']}  "
            f"{doc['dtype']}  load avg before/after={doc['loadavg_before']}/{doc['loadavg_after']}  "
            f"commit {doc['commit'][:12]}"]
    head += [f"note: {note}" for note in doc.get("notes", [])]
    quant = quant_summary_lines(doc)
    return [*head, "", *row_lines(doc), "", *summary_lines(doc), *([""] + quant if quant else [])]


def results_path(out_dir: Path, doc: dict) -> Path:
    """``<out_dir>/<cpu>-cpu-experts-<date>.json`` (spaces and slashes as ``_``), or ``-2``, ``-3`` ... when taken:
    a run never overwrites an earlier result, nor a killed run's partial one."""
    return free_results_path(out_dir, f"{doc['cpu'].replace(' ', '_').replace('/', '_')}-cpu-experts-{doc['date']}",
                             also=(PARTIAL_SUFFIX,))

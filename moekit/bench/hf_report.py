"""The results of ``moekit bench --hf``: the JSON file (never overwriting one) and the table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from moekit.bench.report import free_results_path


def hf_results_path(out_dir: Path, doc: dict) -> Path:
    """``<out_dir>/<device>-hf-<date>.json`` (``-hf-fp8-`` for an fp8 model), or ``...-<date>-2.json``, ``-3`` ...
    when that file exists."""
    quant = doc.get("model", {}).get("quant")
    kind = f"hf-{quant}" if quant else "hf"
    return free_results_path(out_dir, f"{doc['device'].replace(' ', '_')}-{kind}-{doc['date']}")


def _number(value: float | None, fmt: str, error: str | None) -> str:
    if value is not None:
        return format(value, fmt)
    if error is None:
        return "-"
    if error.startswith("NotOnCPU"):  # hf_quant.NOT_ON_CPU: not attempted, neither passed nor failed
        return "not on CPU"
    if error.startswith("NoReference"):  # hf_run.NO_REFERENCE: this row ran; eager, its reference, did not
        return "no reference"
    return "skipped" if error.startswith("Skipped") else "[red]error[/red]"


def hf_table(doc: dict) -> Table:
    model = doc["model"]
    experts = f", {model['quant']} experts" if model.get("quant") else ""
    t = Table(title=f"moekit bench --hf: {model['name']} ({model['widths']} widths, {doc['layers']} layers, "
                    f"{model['dtype']}{experts}) on {doc['device']}")
    for col in ("impl", "mode", "decode tok/s", "step tok/s", "prefill ms", "logits err vs eager",
                "logits err vs fp64"):
        t.add_column(col, justify="left" if col in ("impl", "mode") else "right")
    for r in doc["rows"]:
        errors = r["errors"]
        t.add_row(r["impl"], r["mode"], _number(r["decode_tok_s"], ".1f", errors.get("decode_tok_s")),
                  _number(r.get("step_tok_s"), ".1f", errors.get("decode_tok_s", errors.get("step_tok_s"))),
                  _number(r["prefill_ms"], ".1f", errors.get("prefill_ms")),
                  _number(r["logits_rel_err_vs_eager"], ".2e", errors.get("logits_rel_err_vs_eager")),
                  _number(r["logits_rel_err_vs_fp64"], ".2e", errors.get("logits_rel_err_vs_fp64")))
    return t


def print_hf_report(doc: dict, console: Console | None = None) -> None:
    console = console or Console(width=120)
    console.print(hf_table(doc))
    s = doc["settings"]
    console.print(f"decode: {s['decode_tokens']} new tokens after {s['prompt_len']}, batch 1 (step tok/s: less a "
                  f"1-token generate, per extra token); prefill "
                  f"{s['prefill_batch']} x {s['prefill_len']}; median of {s['repeats']}")
    if any(r["impl"] == "no_experts" for r in doc["rows"]):
        console.print("no_experts: the experts return zeros (the ceiling of any implementation; its errors mean "
                      "nothing)")
    for r in doc["rows"]:
        for text in dict.fromkeys(r["errors"].values()):  # one line per distinct error of a row
            console.print(f"  {r['impl']} ({r['mode']}): {text}", markup=False, highlight=False)

"""The results of ``moekit bench --hf``: the JSON file (never overwriting one) and the table."""

from __future__ import annotations

import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moekit.bench.hf_compile_counts import counts_line
from moekit.bench.hf_wo import memory_line
from moekit.bench.report import free_results_path


def hf_results_path(out_dir: Path, doc: dict) -> Path:
    """``<out_dir>/<device>-hf-<date>.json`` (``-hf-<quant>-`` with ``--hf-quant``: ``-hf-fp8-``, ``-hf-int4_w4a16-``
    ...; then each ``--hf-quant-options`` entry as ``-<name><value>``: ``-hf-int4_w4a16-group_size32-symmetrictrue-``),
    or ``...-<date>-2.json``, ``-3`` ... when that file exists."""
    quant = doc.get("model", {}).get("quant")
    options = doc.get("quant", {}).get("options", {})
    kind = "-".join(["hf", quant, *(_file_safe(f"{name}{_flag_value(v)}") for name, v in options.items())] if quant
                    else ["hf"])
    return free_results_path(out_dir, f"{doc['device'].replace(' ', '_')}-{kind}-{doc['date']}")


def _flag_value(value) -> str:
    """An option's value as ``--hf-quant-options`` spells it: ``true`` / ``false``, ``RxC`` for a block shape."""
    if isinstance(value, bool):
        return str(value).lower()
    return "x".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


def _file_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)


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
    model, quant = doc["model"], doc.get("quant")
    experts = f", {model['quant']} experts" if model.get("quant") else ""
    if quant is not None:  # weight-only: the float model, one row's blocks quantized
        options = ", ".join(f"{k}={v}" for k, v in quant.get("options", {}).items())
        experts = f"; {quant['impl']}: its blocks' experts {quant['scheme']}{f' ({options})' if options else ''}"
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
    for line in quant_lines(doc):
        console.print(line, markup=False, highlight=False)
    if lost := step_lost_in_noise(doc):
        console.print(f"step tok/s -: {', '.join(lost)}: the whole generate's median took no longer than a 1-token "
                      "one's, so the steps were lost in the timing noise; more --decode-tokens or --repeats",
                      markup=False, highlight=False)
    if counts := counts_line([r for r in doc["rows"] if r["mode"] == "compiled"]):
        console.print(counts, markup=False, highlight=False)
    if any(r["impl"] == "no_experts" for r in doc["rows"]):
        console.print("no_experts: the experts return zeros (the ceiling of any implementation; its errors mean "
                      "nothing)")
    for r in doc["rows"]:
        for text in dict.fromkeys(r["errors"].values()):  # one line per distinct error of a row
            console.print(f"  {r['impl']} ({r['mode']}): {text}", markup=False, highlight=False)


def step_lost_in_noise(doc: dict) -> list[str]:
    """The rows (``impl (mode)``) whose decode rate was measured but whose step rate is not (``Row.finish``: the
    whole generate no slower than a 1-token one) and not failed: a "-" the table would leave unexplained. Empty when
    a generate makes one token (no step to measure)."""
    if doc.get("settings", {}).get("decode_tokens", 2) < 2:
        return []
    return [f"{r['impl']} ({r['mode']})" for r in doc["rows"] if r.get("decode_tok_s") is not None
            and r.get("step_tok_s") is None and "step_tok_s" not in r["errors"] and "step_tok_s" in r]


def quant_lines(doc: dict) -> list[str]:
    """A weight-only run's summary: the quantization's own cost in float64, and per mode the quantized blocks'
    decode and prefill over the unquantized blocks' (``moekit_blocks``) and the ceiling's (``no_experts``)."""
    quant = doc.get("quant")
    if quant is None:
        return []
    cost = quant["fp64_logits_rel_err"]
    lines = [f"{quant['scheme']}: float64 prefill logits of the dequantized experts vs the float ones: "
             + (f"{cost:.2e}" if isinstance(cost, float) else str(cost))]
    by = {(r["impl"], r["mode"]): r for r in doc["rows"]}
    for mode in ("eager", "compiled"):
        row = by.get((quant["impl"], mode))
        if row is None:
            continue
        parts = [f"{metric} x{row[metric] / other[metric]:.3f} {base}"
                 for base in ("moekit_blocks", "no_experts") if (other := by.get((base, mode)))
                 for metric in ("decode_tok_s", "step_tok_s")
                 if row.get(metric) and other.get(metric)]
        if row.get("prefill_ms") and (blocks := by.get(("moekit_blocks", mode))) and blocks.get("prefill_ms"):
            parts.append(f"prefill_ms x{row['prefill_ms'] / blocks['prefill_ms']:.3f} moekit_blocks")
        lines.append(f"{quant['impl']} ({mode}): " + (", ".join(parts) or "no ratio (a row did not run)"))
    memory = memory_line(quant)
    return lines + [memory] * (memory is not None)

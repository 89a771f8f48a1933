"""``moekit bench --hf``'s two passes over the experts implementations: eager (``measure_eager``: prefill logits
against eager's and the float64 model's, a decode, then timed round-robin repeats) and compiled (``measure_compiled``:
transformers' static-cache compiled decode, its step logits against eager's decode; ``float64_decode_errors`` against
the float64 model's). In eager mode every implementation is warmed before any is timed; the compiled pass compiles
each on a fresh dynamo state, warms it, then times it (``hf_compile_counts``). A measurement that fails records
``"Type: first line"`` in the row's errors instead of a number."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.bench import hf_measure as hm
from moekit.bench.hf_compile_counts import dynamo_counts, fresh_dynamo, recompile_limit
from moekit.bench.hf_fp64 import Float64Model, Float64Prefill
from moekit.bench.hf_models import REFERENCE_IMPL, free_memory_bytes, gathered_weight_bytes, not_run, use_impl
from moekit.bench.hf_options import HFBenchOptions, Inputs
from moekit.bench.hf_rows import ERR_EAGER, ERR_FP64, NO_REFERENCE, Row
from moekit.bench.hf_wo import BLOCK_QUANTS, QUANT_BLOCKS_IMPL

def _prefill_fits(model, impl: str, batch: torch.Tensor, quant: str | None) -> None:
    """Raise ``Skipped`` where ``impl`` would gather more expert weights than half the free memory (fp8
    experts: every implementation reads them in place)."""
    need = 0 if quant == "fp8" else gathered_weight_bytes(impl, model.config, batch.numel(), model.dtype.itemsize)
    free = free_memory_bytes(batch.device)
    if need > free // 2:
        raise hm.Skipped(f"{impl} would gather {need / 2**30:.1f} GiB of expert weights "
                          f"for this batch ({free / 2**30:.1f} GiB free)")


def _prefill_all_logits(model, impl: str, batch: torch.Tensor, quant: str | None) -> torch.Tensor:
    _prefill_fits(model, impl, batch, quant)
    return hm.prefill(model, batch, all_logits=True).logits


def _compare(row: Row, metric: str, logits: torch.Tensor, ref: torch.Tensor | None, missing: str | None) -> None:
    """``row.<metric>`` = the relative error of ``logits`` against ``ref``; where there is no ``ref``,
    ``missing`` (why) goes to the row's errors."""
    if ref is None:
        row.errors[metric] = missing
    else:
        setattr(row, metric, hm.rel_err(logits, ref))


def _warm_eager(model, row: Row, inputs: Inputs, opts: HFBenchOptions, ref_logits, fp64: Float64Prefill):
    """One prefill with all logits (the error checks) and one decode: (logits or None, Decode or None)."""
    use_impl(model, row.impl, opts.quant, opts.quant_options)
    logits = row.attempt("prefill_ms", lambda: _prefill_all_logits(model, row.impl, inputs.batch, opts.quant))
    if logits is None:
        row.errors[ERR_EAGER] = row.errors[ERR_FP64] = row.errors["prefill_ms"]
    else:
        if row.impl == REFERENCE_IMPL:
            row.logits_rel_err_vs_eager = 0.0  # by definition
        else:
            _compare(row, ERR_EAGER, logits, ref_logits, NO_REFERENCE)
        _compare(row, ERR_FP64, logits, fp64.logits, fp64.error)
    keep = row.impl == REFERENCE_IMPL  # eager's step logits are the compiled rows' reference
    dec = row.attempt("decode_tok_s", lambda: hm.decode(model, inputs.prompt, opts.decode_tokens, keep_logits=keep))
    return logits, dec


@dataclass
class Float64Refs:
    weights: Float64Prefill  # the model's own weights in float64
    quantized: Float64Prefill | None = None  # QUANT_BLOCKS_IMPL's: its blocks' quantized experts, dequantized

    def of(self, impl: str) -> Float64Prefill:
        return self.quantized if impl == QUANT_BLOCKS_IMPL and self.quantized is not None else self.weights


@dataclass
class EagerRows:
    rows: list[Row]  # one per implementation, in ``impls`` order
    ref_decode: hm.Decode | None  # the reference's decode: its step logits are the compiled rows' reference


def measure_eager(model, impls, inputs: Inputs, opts: HFBenchOptions, log, fp64: Float64Refs) -> EagerRows:
    """Eager-mode rows, and the reference's decode; ``fp64`` holds the float64 prefill logits (or why not)."""
    rows = {impl: Row(impl, "eager") for impl in impls}
    ref_logits, ref_decode = None, None
    for impl in impls:  # the reference first (select_impls): warm all before timing any
        reason = not_run(model, impl, opts.quant, inputs.prompt.device, compiled=False)
        if reason is None:
            logits, dec = _warm_eager(model, rows[impl], inputs, opts, ref_logits, fp64.of(impl))
        else:
            _not_attempted(rows[impl], reason, "prefill_ms", ERR_FP64)
            logits, dec = None, None
        if impl == REFERENCE_IMPL:
            ref_logits, ref_decode = logits, dec
        log(f"eager    warm {impl}: " + _summary(rows[impl], dec))
    del ref_logits
    timed = [i for i in impls if not {"decode_tok_s", "prefill_ms"} <= rows[i].errors.keys()]  # a failed warm-up: none
    for rep in range(opts.repeats):
        for impl in timed:
            log(f"eager    repeat {rep + 1}/{opts.repeats} {impl}: "
                + timed_pass(model, rows[impl], inputs, opts, compiled=None))
    return EagerRows(rows=[rows[i] for i in impls], ref_decode=ref_decode)


@dataclass
class CompiledRows:
    rows: list[Row]  # one per implementation, in ``impls`` order
    decodes: dict[str, hm.Decode]  # impl -> its warm-up decode (tokens, step logits), where that ran


def measure_compiled(model, impls, inputs: Inputs, opts: HFBenchOptions, ref: hm.Decode | None, log) -> CompiledRows:
    """Compiled-decode rows: each implementation compiled on a fresh dynamo state (``hf_compile_counts``: a graph
    break of one would leave the next uncompiled in part), warmed, then timed, its compile counts recorded."""
    rows = {impl: Row(impl, "compiled") for impl in impls}
    decodes = {}
    config = hm.compile_config(inputs.prompt.device, opts.compile_backend)
    with recompile_limit():
        for impl in impls:
            row = rows[impl]
            reason = not_run(model, impl, opts.quant, inputs.prompt.device, compiled=True)
            if reason is not None:
                _not_attempted(row, reason)
                log(f"compiled warm {impl}: " + _summary(row, None))
                continue
            fresh_dynamo()
            before = dynamo_counts()
            dec = _warm_compiled(model, row, inputs, opts, config, ref)
            warm = dynamo_counts() - before
            row.compile_graphs, row.compile_graph_breaks = warm.graphs, warm.graph_breaks
            log(f"compiled warm {impl}: " + _summary(row, dec)
                + f", {warm.graphs} graphs, {warm.graph_breaks} graph breaks")
            if dec is None:  # a failed warm-up has nothing to time
                continue
            decodes[impl] = dec
            before = dynamo_counts()
            for rep in range(opts.repeats):
                log(f"compiled repeat {rep + 1}/{opts.repeats} {impl}: "
                    + timed_pass(model, row, inputs, opts, compiled=config))
            row.recompiles = (dynamo_counts() - before).frames
    fresh_dynamo()
    return CompiledRows(rows=[rows[i] for i in impls], decodes=decodes)


def _warm_compiled(model, row: Row, inputs: Inputs, opts: HFBenchOptions, config, ref: hm.Decode | None):
    """One compiled decode of ``row``'s implementation (compiles it) and its error against ``ref``: the Decode
    or None."""
    use_impl(model, row.impl, opts.quant, opts.quant_options)
    dec = row.attempt("decode_tok_s", lambda: hm.decode(model, inputs.prompt, opts.decode_tokens,
                                                       compiled=config, keep_logits=True))
    if dec is None:
        row.errors[ERR_EAGER] = row.errors["decode_tok_s"]
    elif ref is None:
        row.errors[ERR_EAGER] = NO_REFERENCE
    else:
        row.logits_rel_err_vs_eager = hm.decode_rel_err(dec, ref)
    return dec


def float64_decode_errors(model, compiled: CompiledRows, prompt: torch.Tensor, quant: str | None = None) -> None:
    """Each compiled row's ``logits_rel_err_vs_fp64``: its warm-up decode's step logits against the float64
    model's logits for the very inputs each step saw (teacher-forced on the row's own tokens, so every step
    counts, not only those before the tokens diverge from another run's); a weight-only ``quant``'s
    ``QUANT_BLOCKS_IMPL`` row against the float64 model of its dequantized experts (one float64 model at a time).
    Failures go to the row's errors."""
    blocks_quant = quant if quant in BLOCK_QUANTS else None
    quantized = [r for r in compiled.rows if blocks_quant and r.impl == QUANT_BLOCKS_IMPL]
    for rows, weights in (([r for r in compiled.rows if r not in quantized], None), (quantized, blocks_quant)):
        if rows:
            _decode_errors(model, rows, compiled.decodes, prompt, weights)


def _decode_errors(model, rows: list[Row], decodes: dict, prompt: torch.Tensor, blocks_quant: str | None) -> None:
    try:
        fp64 = Float64Model(model, blocks_quant=blocks_quant)
    except Exception as err:  # noqa: BLE001  (no float64 on this device, or no room: recorded per row)
        for row in rows:
            row.errors[ERR_FP64] = hm.error_text(err)
        return
    for row in rows:
        _step_logits_error(fp64, row, decodes.get(row.impl), prompt)
    del fp64
    if prompt.device.type == "cuda":
        torch.cuda.empty_cache()


def _step_logits_error(fp64: Float64Model, row: Row, dec: hm.Decode | None, prompt: torch.Tensor) -> None:
    if dec is None:
        row.errors[ERR_FP64] = row.errors["decode_tok_s"]
        return
    ref = row.attempt(ERR_FP64, lambda: fp64.step_logits(prompt, dec.tokens))
    if ref is not None:
        row.logits_rel_err_vs_fp64 = hm.rel_err(dec.logits, ref)


def _not_attempted(row: Row, reason: str, *metrics: str) -> None:
    """``reason`` recorded for ``row``'s decode, its error against eager and ``metrics``: nothing of it runs."""
    for metric in ("decode_tok_s", ERR_EAGER, *metrics):
        row.errors[metric] = reason


def timed_pass(model, row: Row, inputs: Inputs, opts: HFBenchOptions, compiled) -> str:
    """One timed decode (and, in eager mode, prefill) of ``row``'s implementation; a line for the log."""
    use_impl(model, row.impl, opts.quant, opts.quant_options)
    done = []
    if "decode_tok_s" not in row.errors:
        dec = row.attempt("decode_tok_s",
                          lambda: hm.decode(model, inputs.prompt, opts.decode_tokens, compiled=compiled))
        if dec is not None:
            row.record("decode", dec.seconds)
            done.append(f"decode {opts.decode_tokens / dec.seconds:.1f} tok/s")
            if "step_tok_s" not in row.errors:  # its own metric: a failure here leaves decode_tok_s as measured
                one = row.attempt("step_tok_s", lambda: hm.decode(model, inputs.prompt, 1, compiled=compiled))
                if one is not None:
                    row.record("decode1", one.seconds)
    if compiled is None and "prefill_ms" not in row.errors:
        seconds = row.attempt("prefill_ms", lambda: hm.prefill(model, inputs.batch).seconds)
        if seconds is not None:
            row.record("prefill", seconds)
            done.append(f"prefill {1e3 * seconds:.1f} ms")
    return ", ".join(done) or "nothing to time (failed or skipped in the warm-up)"


def _summary(row: Row, dec: hm.Decode | None) -> str:
    parts = [f"generate {dec.seconds:.2f} s" if dec is not None else None,
             f"err {row.logits_rel_err_vs_eager:.2e}" if row.logits_rel_err_vs_eager is not None else None,
             f"vs fp64 {row.logits_rel_err_vs_fp64:.2e}" if row.logits_rel_err_vs_fp64 is not None else None]
    parts += [f"{k}: {v}" for k, v in row.errors.items() if k not in (ERR_EAGER, ERR_FP64)]
    return ", ".join(p for p in parts if p) or "ok"


def fp64_text(row: Row) -> str:
    value = row.logits_rel_err_vs_fp64
    return f"{value:.2e}" if value is not None else row.errors.get(ERR_FP64, "-")

"""``moekit bench --hf``: a transformers MoE model end to end, once per experts implementation.

For each implementation: decode tok/s of a greedy ``generate`` (batch 1, a fixed random prompt), the
prefill time of a B x L batch, and the relative error of the prefill logits against ``eager`` and against
the same model run once in float64 (``hf_fp64``). Then, unless told not to, transformers' compiled decode
(static cache + ``torch.compile`` through generate's ``CompileConfig``) with the error of its step logits
against eager's decode and against the float64 model's logits for the same steps. In eager mode every
implementation is warmed before any is timed and the timed repeats go round-robin over the implementations; the
compiled decode compiles each on a fresh dynamo state, warms it and times its repeats, noting how it compiled
(``hf_compile_counts``). Each number is the median. A measurement that fails records ``"Type: first line"``
instead of a number.
With ``quant="fp8"`` the experts are transformers' fine-grained fp8 ones and the implementations theirs
(``hf_quant``); with a weight-only ``quant`` the model stays float and ``moekit_blocks_quant`` runs its blocks
quantized by moekit, with a float64 reference of its own (``hf_wo``).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from moekit.bench import hf_measure as hm
from moekit.bench.hf_compile_counts import dynamo_counts, fresh_dynamo, recompile_limit
from moekit.bench.hf_fp64 import Float64Model, Float64Prefill, float64_prefill
from moekit.bench.hf_models import (
    MODELS, REFERENCE_IMPL, build_model, free_memory_bytes, gathered_weight_bytes, hf_config, not_run, select_impls,
    text_config, use_impl,
)
from moekit.bench.hf_quant import FP8_METHOD, FP8_TINY, quantize_experts_fp8
from moekit.bench.hf_rows import ERR_EAGER, ERR_FP64, NO_REFERENCE, Row
from moekit.bench.hf_wo import QUANT_BLOCKS_IMPL, BLOCK_QUANTS, freed_memory, wo_method
from moekit.bench.run import commit_id, device_name

@dataclass(frozen=True)
class HFBenchOptions:
    model: str  # a key of hf_models.MODELS
    layers: int  # decoder layers
    decode_tokens: int  # new tokens per generate call
    prompt_len: int  # the decode prompt's tokens (batch 1)
    prefill_batch: int  # B sequences ...
    prefill_len: int  # ... of L tokens in the prefill batch
    repeats: int  # timed passes (round-robin in eager mode); numbers are medians over them
    compile: bool  # also measure transformers' compiled decode
    compile_backend: str = "inductor"  # "eager" traces without code generation (the CPU tests)
    impls: tuple[str, ...] | None = None  # None: every registered one; eager always runs in eager mode
    tiny: bool = False  # tiny widths instead of the published ones
    dtype: str | None = None  # the model's dtype, one of HF_DTYPES; None: bfloat16 on CUDA, float32 on the CPU
    # None: float experts; "fp8": transformers' fine-grained fp8 experts (hf_quant); one of hf_wo.BLOCK_QUANTS: the
    # float model, and its blocks swapped to moekit's layer and quantized with it (the QUANT_BLOCKS_IMPL row)
    quant: str | None = None
    # a BLOCK_QUANTS scheme's quantizer options (--hf-quant-options) as use_moekit_blocks keeps them: sorted pairs
    quant_options: tuple[tuple[str, object], ...] = ()


HF_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(opts: HFBenchOptions, device: torch.device) -> torch.dtype:
    """The dtype the model is built in (``opts.dtype``, or the device's default); ValueError naming ``hf-dtype``."""
    if opts.dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if opts.dtype not in HF_DTYPES:
        raise ValueError(f"hf-dtype must be one of {HF_DTYPES}, got {opts.dtype!r}")
    return getattr(torch, opts.dtype)


def default_options(model: str, device: torch.device, tiny: bool = False, **overrides) -> HFBenchOptions:
    """The GPU run (bf16, real widths), a CPU run of a minute or two (one layer, short sequences, no
    compilation: transformers compiles generate only on accelerators), or the tiny CI run."""
    if tiny:
        base = HFBenchOptions(model, 2, 4, 8, 2, 16, 3, compile=True, compile_backend="eager", tiny=True)
    elif device.type == "cuda":
        base = HFBenchOptions(model, MODELS[model].default_layers, 64, 16, 4, 1024, 3, compile=True)
    else:
        base = HFBenchOptions(model, 1, 8, 8, 1, 64, 3, compile=False)
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class Inputs:
    prompt: torch.Tensor  # [1, P] random ids: the decode prompt
    batch: torch.Tensor  # [B, L] random ids: the prefill batch


def make_inputs(vocab_size: int, opts: HFBenchOptions, device: torch.device, seed: int = 1) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (1, opts.prompt_len), generator=g)
    batch = torch.randint(0, vocab_size, (opts.prefill_batch, opts.prefill_len), generator=g)
    return Inputs(prompt.to(device), batch.to(device))


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
                + _timed_pass(model, rows[impl], inputs, opts, compiled=None))
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
                    + _timed_pass(model, row, inputs, opts, compiled=config))
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


def _timed_pass(model, row: Row, inputs: Inputs, opts: HFBenchOptions, compiled) -> str:
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


def _fp64_text(row: Row) -> str:
    value = row.logits_rel_err_vs_fp64
    return f"{value:.2e}" if value is not None else row.errors.get(ERR_FP64, "-")


def run_hf_bench(device: torch.device, opts: HFBenchOptions, log: Callable[[str], None] = lambda msg: None) -> dict:
    """Build the model, measure every implementation, return the results document."""
    impls = select_impls(list(opts.impls) if opts.impls else None, opts.quant, device)
    dtype = model_dtype(opts, device)
    config = hf_config(opts.model, opts.layers, opts.tiny)
    if opts.quant == "fp8" and opts.tiny:
        config.update(FP8_TINY[opts.model])
    log(f"building {opts.model} ({'tiny' if opts.tiny else 'real'} widths, {opts.layers} layers, "
        f"{str(dtype).removeprefix('torch.')}{f', {opts.quant} experts' if opts.quant else ''}) on {device}; "
        f"implementations: {', '.join(impls)}")
    model = build_model(config, dtype, device)
    if opts.quant == "fp8":
        quantize_experts_fp8(model)
    inputs = make_inputs(text_config(config).vocab_size, opts, device)
    fp64, quant_cost = _float64_prefills(model, inputs.batch, opts, log)
    eager = measure_eager(model, impls, inputs, opts, log, fp64)
    del fp64
    rows = eager.rows
    if opts.compile:  # the reference runs compiled too only when asked for (compiling its loop is slow)
        asked = [i for i in impls if opts.impls is None or i in opts.impls or i == QUANT_BLOCKS_IMPL]
        compiled = measure_compiled(model, asked, inputs, opts, eager.ref_decode, log)
        float64_decode_errors(model, compiled, inputs.prompt, opts.quant)
        log("float64 decode steps: " + ", ".join(f"{r.impl} {_fp64_text(r)}" for r in compiled.rows))
        rows += compiled.rows
    memory = freed_memory(model, opts.quant, opts.quant_options, log) if opts.quant in BLOCK_QUANTS else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return _document(device, opts, config, dtype, [r.finish(opts.decode_tokens) for r in rows], quant_cost, memory)


def _float64_prefills(model, batch: torch.Tensor, opts: HFBenchOptions, log) -> tuple[Float64Refs, float | str | None]:
    """The float64 prefill logits of the model's weights and, for a weight-only ``opts.quant``, of its blocks'
    quantized experts dequantized (those blocks made here, with ``opts.quant_options``); and the latter's relative
    error against the former (the quantization's own cost; its failure as text; None: no weight-only run)."""
    quant = opts.quant
    fp64 = Float64Refs(float64_prefill(model, batch))
    log(f"float64 prefill (eager experts{', streamed' if fp64.weights.streamed else ''}): "
        f"{fp64.weights.error or 'done'}")
    if quant not in BLOCK_QUANTS:
        return fp64, None
    use_impl(model, QUANT_BLOCKS_IMPL, quant, opts.quant_options)  # quantized now: the float64 model reads them
    fp64.quantized = float64_prefill(model, batch, blocks_quant=quant)
    log(f"float64 prefill ({quant} experts dequantized): {fp64.quantized.error or 'done'}")
    missing = fp64.weights.error or fp64.quantized.error
    return fp64, missing or hm.rel_err(fp64.quantized.logits, fp64.weights.logits)


def _document(device, opts: HFBenchOptions, config, dtype, rows: list[dict], quant_cost=None, memory=None) -> dict:
    spec = MODELS[opts.model]
    return {
        "device": device_name(device),
        "date": datetime.date.today().isoformat(), "commit": commit_id(),
        "versions": _versions(),
        "model": {"name": opts.model, "preset": spec.preset, "widths": "tiny" if opts.tiny else "real",
                  "vocab_size": text_config(config).vocab_size, "dtype": str(dtype).removeprefix("torch."),
                  "quant": opts.quant, "config": config.to_diff_dict()},
        # a weight-only run: the scheme, its row, the float64 model of its dequantized experts against the float
        # one's prefill logits (a float, or why not), and the model's bytes with its float experts freed (hf_wo.
        # freed_memory: a dict, or why not)
        **({"quant": {"scheme": opts.quant, "options": dict(opts.quant_options), "impl": QUANT_BLOCKS_IMPL,
                      "fp64_logits_rel_err": quant_cost, "memory": memory}}
           if opts.quant in BLOCK_QUANTS else {}),
        "layers": opts.layers,
        "settings": asdict(opts),
        "method": (
            "random weights and ids; decode: greedy generate, batch 1, decode_tokens new tokens after a "
            "prompt_len prompt (decode_tok_s: tok/s over the whole call; step_tok_s: the same call less a 1-token "
            "generate, per extra token: prefill and per-call setup excluded); prefill: one forward of prefill_batch x "
            "prefill_len "
            "ids, no cache, last logits only; error vs eager: relative L2 of the prefill logits (eager mode) or "
            "of the decode steps' logits while the tokens agree (compiled) against the eager implementation in "
            "eager mode; error vs fp64: the same logits (every decode step: teacher-forced on the row's own "
            "tokens) against the same weights run in float64 with the eager experts (a chunk of experts at a time "
            "where the whole float64 copy does not fit: hf_fp64_stream; float32 only where the "
            "modeling code casts on purpose: RMSNorm statistics, router softmax, rotary cos/sin); compiled: "
            "generate(cache_implementation='static', compile_config=CompileConfig(backend)), each implementation "
            "compiled on a fresh dynamo state (torch._dynamo.reset), warmed, then its repeats, with dynamo's graphs "
            "and graph breaks in the warm-up and frames recompiled after it; eager mode: all implementations warmed "
            "first, repeats round-robin; medians"
            + (FP8_METHOD if opts.quant == "fp8" else wo_method(opts.quant, opts.quant_options) if opts.quant else "")
        ),
        "rows": rows,
    }


def _versions() -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version}

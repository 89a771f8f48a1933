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

The settings are ``hf_options``' and the two passes ``hf_passes``'; this module builds the model and the document.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict
from typing import Callable

import torch

from moekit.bench import hf_measure as hm
from moekit.bench.hf_fp64 import float64_prefill
from moekit.bench.hf_models import MODELS, build_model, hf_config, select_impls, text_config, use_impl
from moekit.bench.hf_options import HF_DTYPES, HFBenchOptions, Inputs, default_options, make_inputs, model_dtype
from moekit.bench.hf_passes import (CompiledRows, EagerRows, Float64Refs, float64_decode_errors, fp64_text,
                                    measure_compiled, measure_eager)
from moekit.bench.hf_quant import FP8_METHOD, FP8_TINY, quantize_experts_fp8
from moekit.bench.hf_rows import Row
from moekit.bench.hf_wo import BLOCK_QUANTS, QUANT_BLOCKS_IMPL, freed_memory, wo_method
from moekit.bench.run import commit_id, device_name

# the names callers import from here (cli._bench_hf, the tests), defined in hf_options and hf_passes
__all__ = ["HF_DTYPES", "CompiledRows", "EagerRows", "HFBenchOptions", "Inputs", "Row", "default_options",
           "float64_decode_errors", "make_inputs", "measure_compiled", "measure_eager", "model_dtype", "run_hf_bench"]


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
        log("float64 decode steps: " + ", ".join(f"{r.impl} {fp64_text(r)}" for r in compiled.rows))
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

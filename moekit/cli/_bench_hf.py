"""``moekit bench --hf``: the options and the run (the library is ``moekit.bench.hf_run``)."""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transformers end to end (--hf)")
    g.add_argument("--hf", action="store_true",
                   help="time whole transformers MoE models (random weights, no hub) per experts implementation")
    g.add_argument("--hf-model", default="all",
                   help="qwen3, mixtral, gpt-oss-20b, deepseek-v3, deepseek-v4, step-3.7 (comma-separated) or all: "
                   "those the installed transformers has (default: all); deepseek-v4 runs eager rows only "
                   "(transformers compiles no DeepSeek-V4 decode)")
    g.add_argument("--hf-impls", default=None,
                   help="comma-separated experts implementations (default: every registered one, off CUDA but "
                   "transformers' CUDA-only deepgemm and sonicmoe; eager, the reference, always runs in eager mode, "
                   "and compiled too where named); no_experts adds the ceiling: experts that return zeros, i.e. the "
                   "best decode any implementation could reach in that model; moekit_blocks runs each MoE block as "
                   "moekit's whole layer (moekit.hf.use_moekit_blocks: its router too)")
    g.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default on GPU: 8 qwen3, 2 mixtral, 4 gpt-oss-20b, 2 deepseek-v3, "
                        "2 deepseek-v4, 4 step-3.7; 1 CPU; 2 --tiny)")
    g.add_argument("--decode-tokens", type=int, default=None,
                   help="new tokens per generate (default 64 GPU, 8 CPU, 4 --tiny)")
    g.add_argument("--prompt-len", type=int, default=None,
                   help="decode prompt tokens (default 16 GPU, 8 CPU, 8 --tiny)")
    g.add_argument("--prefill-batch", type=int, default=None,
                   help="prefill sequences (default 4 GPU, 1 CPU, 2 --tiny)")
    g.add_argument("--prefill-len", type=int, default=None,
                   help="prefill tokens per sequence (default 1024 GPU, 64 CPU, 16 --tiny)")
    g.add_argument("--repeats", type=int, default=None,
                   help="timed round-robin repeats; medians (default 3; 7 with --cpu-experts)")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time transformers' compiled decode (default: on for CUDA and with --tiny, off on CPU)")
    g.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; with --tiny, eager: trace, no code generation)")
    g.add_argument("--hf-dtype", default=None,
                   help="the model's dtype: float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--hf-quant", default=None,
                   help="fp8: the experts quantized with transformers' fine-grained fp8 (FineGrainedFP8Config: e4m3, "
                   "128x128 block scales); implementations are then those of its FP8Experts (qwen3, mixtral, "
                   "deepseek-v3). "
                   "int8_w8a16, int4_w4a16, mxfp4 or fp8_block: the model stays in --hf-dtype and the row "
                   "moekit_blocks_quant runs it with every MoE block swapped to moekit's layer and its experts "
                   "quantized by moekit (fp8_block: the fp8 recipe for every model, gpt-oss-20b too) "
                   "(use_moekit_blocks(model, quant=...)); --hf-impls defaults to moekit_blocks,no_experts beside it "
                   "(every model). Default: off, the experts in --hf-dtype")
    g.add_argument("--hf-quant-options", default=None, metavar="NAME=VALUE,...",
                   help="the quantizer options of --hf-quant's scheme (moekit's quantizer: int4_w4a16 group_size=32|64|"
                   "128 and symmetric=true|false, fp8_block block_shape=RxC such as 64x128; int8_w8a16 and mxfp4 take "
                   "none), as use_moekit_blocks(quant_options=...) takes them; recorded in the JSON (options under "
                   "quant). Default: the scheme's defaults (int4 group_size=128, asymmetric; fp8_block 128x128)")
    g.add_argument("--tiny", action="store_true",
                   help="tiny widths, with --hf or --offload (a smoke run; the tests use it)")


def run(args: argparse.Namespace) -> int:
    # Random weights, random ids: nothing needs the hub, and a hub-kernel implementation (deepgemm, sonicmoe)
    # should fail and be recorded, not download. Set before transformers is imported.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from rich.console import Console

    from moekit.bench.hf_models import available_models, missing_family, model_names, select_impls
    from moekit.bench.hf_quant import check_quant, quant_models
    from moekit.bench.hf_report import hf_results_path, print_hf_report
    from moekit.bench.hf_run import default_options, run_hf_bench
    from moekit.bench.hf_wo import BLOCK_QUANTS
    from moekit.bench.report import write_json
    from moekit.cli._args import UsageError
    from moekit.cli._quant_options import parse_quant_options

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    models = quant_models(args.hf_quant, available_models()) if args.hf_model == "all" else args.hf_model.split(",")
    impls = tuple(args.hf_impls.split(",")) if args.hf_impls else None
    try:
        if set(models) - set(model_names()):
            raise ValueError(f"hf-model must be one of {model_names()} or all, got {args.hf_model!r}")
        for name in models:
            if missing_family(name):
                raise ValueError(missing_family(name))
            check_quant(args.hf_quant, name)
        select_impls(list(impls) if impls else None, args.hf_quant)
        quant_options = parse_quant_options(args.hf_quant_options, args.hf_quant, BLOCK_QUANTS)
        options = [_options(args, name, device, impls, default_options, quant_options) for name in models]
    except ValueError as err:
        raise UsageError(f"--{err}") from None
    console = Console(width=120)
    start = time.perf_counter()

    def log(message: str) -> None:
        console.print(f"[{time.perf_counter() - start:6.1f} s] {message}", markup=False, highlight=False)

    written = []  # a results file per model, as each finishes
    for opts in options:
        try:
            doc = run_hf_bench(device, opts, log)
        except KeyboardInterrupt:  # said before the CLI's "interrupted": which models are kept, which is not
            kept = f"the models finished before it are in {', '.join(map(str, written))}" if written else (
                "nothing written")
            print(f"moekit bench --hf: {opts.model} was interrupted, its rows not kept (a results file per model, "
                  f"written as each finishes); {kept}", file=sys.stderr)
            raise
        written.append(write_json(doc, hf_results_path(args.out, doc)))
        print_hf_report(doc, console)
        console.print(f"wrote {written[-1]}")
    return 0


def _options(args, name, device, impls, default_options, quant_options):
    from moekit.bench.hf_run import model_dtype

    opts = default_options(name, device, args.tiny, layers=args.layers, decode_tokens=args.decode_tokens,
                           prompt_len=args.prompt_len, prefill_batch=args.prefill_batch,
                           prefill_len=args.prefill_len, repeats=args.repeats, compile=args.compile,
                           compile_backend=args.compile_backend, impls=impls, dtype=args.hf_dtype,
                           quant=args.hf_quant, quant_options=quant_options or None)
    model_dtype(opts, device)  # a bad --hf-dtype fails here, before any model is built
    _check_compile_backend(args.compile_backend)
    for flag in ("layers", "decode_tokens", "prompt_len", "prefill_batch", "prefill_len", "repeats"):
        if getattr(opts, flag) < 1:
            raise ValueError(f"{flag.replace('_', '-')} must be >= 1, got {getattr(opts, flag)}")
    return opts


def _check_compile_backend(name: str | None) -> None:
    """A ``--compile-backend`` torch.compile does not know fails here, before any model is built: later it
    would only fill every compiled row with the same error."""
    import torch._dynamo

    if name is not None and name not in torch._dynamo.list_backends(exclude_tags=()):
        common = sorted({*torch._dynamo.list_backends(), "eager", "aot_eager"})
        raise ValueError(f"compile-backend must be a torch.compile backend (such as {common}), got {name!r}")

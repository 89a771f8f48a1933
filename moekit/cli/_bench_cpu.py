"""``moekit bench --cpu-experts``: the options and the run (the library is ``moekit.bench.cpu_measure``,
the tables ``moekit.bench.cpu_report``)."""

from __future__ import annotations

import argparse
import sys

from moekit.cli._args import UsageError, positive_int

ACT_DTYPES = ("float32", "bfloat16")
UNQUANTIZED = "bfloat16"  # ``moekit bench --dtype``'s name for the unquantized cells: here the rows that always run


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CPU experts (--cpu-experts)")
    g.add_argument("--cpu-experts", action="store_true",
                   help="time moekit's CPU experts path (backend auto) and its variants against transformers' "
                   "grouped_mm, batched_mm and eager experts, fp32, rounds interleaved, beside the dense matmul rate "
                   "of the same run; --backends picks rows (moekit, onednn_packed, ..., hf_eager); --dtype int8_w8a16, "
                   "int4_w4a16, mxfp4 add quantized rows (moekit[s], the pre-session-30 dequant_all[s], each kernel); "
                   "M = 1,8,64,512 unless --batches; --repeats rounds (default 7); JSON <cpu>-cpu-experts-<date>.json "
                   "under --out")
    g.add_argument("--shape", default=None,
                   help="with --cpu-experts: the expert shape E,N,K,k (default: Qwen3-30B-A3B, 128,768,2048,8)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="with --cpu-experts: torch threads (default: torch's, i.e. OMP_NUM_THREADS or the cores)")
    g.add_argument("--act-dtype", choices=ACT_DTYPES, default=None,
                   help="with --cpu-experts: x's dtype, and the unquantized weights' (default float32)")


def run(args: argparse.Namespace) -> int:
    """Check the options, measure with progress lines on stderr, print the tables, write the JSON."""
    if args.device is not None and args.device.split(":")[0] != "cpu":
        raise UsageError(f"--device: --cpu-experts runs on the CPU, got {args.device!r}")
    if args.shapes:
        raise UsageError("--shapes names presets of the kernel cells; --cpu-experts takes --shape E,N,K,k")
    if args.repeats is not None and args.repeats < 1:
        raise UsageError(f"--repeats must be >= 1, got {args.repeats}")
    import torch

    from moekit.bench import cpu_measure as cm
    from moekit.bench.cpu_report import report_lines, results_path
    from moekit.cli._kept import KeptRun

    try:
        shape = cm.ExpertsShape.parse(args.shape) if args.shape else cm.QWEN3_30B_A3B
    except ValueError as err:
        raise UsageError(f"--{err}") from None
    rows = set(args.backends or cm.ROWS)
    if rows - set(cm.ROWS):
        raise UsageError(f"--backends: unknown with --cpu-experts: {sorted(rows - set(cm.ROWS))}; rows: "
                         f"{', '.join(cm.ROWS)}")
    schemes = [d for d in (args.dtype or []) if d != UNQUANTIZED]
    unknown = sorted(set(schemes) - set(cm.cpu_quant_rows.WEIGHT_ONLY_SCHEMES))
    if unknown:
        raise UsageError(f"--dtype: no CPU experts loop for {unknown}; with --cpu-experts: {UNQUANTIZED} (the "
                         f"unquantized rows, always run), {', '.join(cm.cpu_quant_rows.WEIGHT_ONLY_SCHEMES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = args.batches or list(cm.DEFAULT_BATCHES)
    repeats = args.repeats or cm.DEFAULT_REPEATS

    def log(message: str) -> None:
        print(f"bench --cpu-experts {message}", file=sys.stderr, flush=True)

    log(f"E,N,K,k={shape.experts},{shape.intermediate},{shape.hidden},{shape.top_k} M={batches} "
        f"threads={torch.get_num_threads()} repeats={repeats} "
        f"transformers={cm.transformers_version() or 'not installed'}")
    if cm.transformers_version() is None:
        log(f"note: {cm.NO_TRANSFORMERS}")
    kept = KeptRun("moekit bench --cpu-experts", "the batches measured", lambda doc: results_path(args.out, doc))
    with kept.interruptible():
        doc = cm.measure_cpu_experts(shape, batches, repeats, rows, log, schemes=schemes,
                                     dtype=getattr(torch, args.act_dtype or "float32"), on_batch=kept.keep)
    path = kept.finish(doc)
    print("\n".join(report_lines(doc)))
    print(f"wrote {path}")
    return 0

"""``moekit bench --offload``: the options and the run (the library is ``moekit.bench.offload_measure``)."""

from __future__ import annotations

import argparse
import datetime
from dataclasses import asdict

from moekit.cli._args import ListOption, UsageError, fraction_arg, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("host-resident experts (--offload)")
    g.add_argument("--offload", action="store_true",
                   help="decode through offloaded DeepSeek-V3-width layers (E=256, N=2048, K=7168, top-8) whose "
                   "experts exceed the GPU budget; measures the host link and the CPU expert rate first (on the CPU "
                   "or with --tiny: E=16, K=64, N=32, top-2, a smoke run)")
    g.add_argument("--offload-layers", type=positive_int, default=2, help="MoE layers sharing the cache (default 2)")
    g.add_argument("--cache-fractions", action=ListOption, item=fraction_arg, default=[0.25, 0.5, 0.75],
                   help="GPU cache sizes as fractions of all routed experts, space- or comma-separated (default "
                   "0.25,0.5,0.75)")
    g.add_argument("--offload-steps", type=positive_int, default=3,
                   help="timed decode steps per configuration (default 3)")
    g.add_argument("--offload-places", action=ListOption, item=_place, default=["gpu", "cpu", "auto"],
                   help="where misses run (compute_misses_on): gpu, cpu, auto (default: all three)")
    g.add_argument("--offload-streams", action=ListOption, item=_stream, default=["uniform", "skewed"],
                   help="simulated routing streams: uniform, skewed (default: both)")
    g.add_argument("--offload-online-cpu-rate", action="store_true",
                   help='"auto" layers price CPU experts by an online estimate of the CPU rate '
                   '(moekit.offload.CpuRate)')
    g.add_argument("--offload-dtype", default="float", metavar="DTYPE",
                   help="the experts' format: float (bf16 on CUDA, float32 on the CPU) or a moekit.quant scheme "
                   "(fp8_block, int8_w8a16, int4_w4a16, mxfp4), kept packed on the host, in the cache and over the "
                   "link (default float)")


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from moekit.bench.offload_measure import measure_offload
    from moekit.bench.offload_report import HEADER, format_row
    from moekit.bench.report import PARTIAL_SUFFIX, free_results_path
    from moekit.bench.run import commit_id, device_name
    from moekit.cli._kept import KeptRun

    from moekit.quant import SCHEMES

    if args.offload_dtype != "float" and args.offload_dtype not in SCHEMES:
        raise UsageError(f"--offload-dtype must be float or one of {', '.join(SCHEMES)}, got {args.offload_dtype!r}")
    scheme = None if args.offload_dtype == "float" else args.offload_dtype
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda is not available on this machine; use --device cpu")
    shape = {} if device.type == "cuda" and not args.tiny else {"experts": 16, "hidden": 64, "inter": 32, "top_k": 2}
    console = Console(width=140)
    if shape:  # said first: the table's "gpu" rows are then host copies of toy experts, nothing like the real ones
        where = "the cache in host memory, no GPU" if device.type == "cpu" else "on the GPU"
        console.print(f"{'--tiny' if args.tiny else 'on the CPU'}: tiny layers (E={shape['experts']}, "
                      f"K={shape['hidden']}, N={shape['inter']}, top-{shape['top_k']}), {where}: a smoke run of "
                      "the offload code, not a measure of offloading", markup=False, highlight=False)
    console.print(HEADER, markup=False, highlight=False)
    head = {"device": device_name(device), "date": datetime.date.today().isoformat(), "commit": commit_id()}
    stem = f"{head['device'].replace(' ', '_')}-offload{'' if scheme is None else '-' + scheme}-{head['date']}"
    kept = KeptRun("moekit bench --offload", "the rows measured",
                   lambda doc: free_results_path(args.out, stem, also=(PARTIAL_SUFFIX,)))
    rows = []  # [OffloadRow] so far: kept on disk after each (a GPU run takes minutes)

    def on_row(row) -> None:
        console.print(format_row(row), markup=False, highlight=False)
        rows.append(row)
        kept.keep({**head, "offload_dtype": args.offload_dtype, "rows": [asdict(r) for r in rows]})

    with kept.interruptible():
        doc = measure_offload(device, layers=args.offload_layers, batches=tuple(args.batches or (1, 8, 32)),
                              fractions=tuple(args.cache_fractions), steps=args.offload_steps, scheme=scheme,
                              places=tuple(args.offload_places), streams=tuple(args.offload_streams),
                              online_cpu_rate=args.offload_online_cpu_rate, on_progress=on_row, **shape)
    doc = {**head, **doc}
    _print_results(console, doc, kept.finish(doc))
    return 0


def _print_results(console, doc: dict, path) -> None:
    """The table by cell and mode, the summary, the floor's terms and the measured costs; the results file."""
    from moekit.bench.offload_report import compact_table

    console.print("stream cache policy prefetch M | per mode: step ms, x floor, hit/sim hit | auto / better pure mode",
                  markup=False, highlight=False)
    for line in compact_table(doc["rows"]) + doc["summary"]:
        console.print(line, markup=False, highlight=False)
    console.print("floor's fixed per-layer ms (all-hit steps) / least per forward with a fetch (one forced in each "
                  "layer): "
                  + ", ".join(f"{k} {v:.3f}/{doc['fetch_layer_ms'][k]:.3f}" for k, v in doc["fixed_ms"].items()),
                  markup=False, highlight=False)
    console.print(f"{doc['dtype']} experts, {doc['expert_bytes'] / 2**20:.1f} MiB each; link {doc['link_GBps']:.1f} "
                  f"GB/s, GPU read {doc['gpu_read_GBps']:.0f} GB/s, CPU {doc['cpu_expert_us']:.0f} µs/expert + "
                  f"{doc['cpu_token_us']:.0f} µs/token + {doc['cpu_step_us']:.0f} µs/forward at {doc['cpu_threads']} "
                  f"threads ({doc['cpu_gemm']}), margin {doc['cpu_margin']:.2f}; setup "
                  f"{sum(doc['setup_s'].values()):.0f} s, table {doc['table_s']:.0f} s; wrote {path}")
    rows = doc.get("cpu_rows_us") or {}
    if rows:  # what the floor and auto price a CPU expert by (the line above: its ends' linear fit)
        console.print("CPU µs per expert by its rows: " + ", ".join(f"{r}: {us:.0f}" for r, us in rows.items())
                      + f"; + {doc['cpu_step_us']:.0f} µs per forward with CPU misses", markup=False, highlight=False)


def _place(text: str) -> str:
    if text not in ("gpu", "cpu", "auto"):
        raise argparse.ArgumentTypeError(f"expected gpu, cpu or auto, got {text!r}")
    return text


def _stream(text: str) -> str:
    if text not in ("uniform", "skewed"):
        raise argparse.ArgumentTypeError(f"expected uniform or skewed, got {text!r}")
    return text

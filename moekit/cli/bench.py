"""``moekit bench``: the experts backends side by side against the device's measured ceilings;
``moekit bench --hf``: whole transformers MoE models per experts implementation (``_bench_hf``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli import _bench_hf


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="time the experts backends against the measured copy bandwidth and matmul rate",
        description="Measure the device's copy bandwidth and dense matmul rate, then time every backend over "
        "the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B expert shapes (scaled down on the CPU); write JSON + PNG.",
    )
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--shapes", default=None, help="comma-separated presets (default: all three)")
    p.add_argument("--batches", type=_ints, default=None, help="comma-separated M values")
    p.add_argument("--backends", default=None, help="comma-separated backends (default: all available)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="directory for <device>-<date>.json/.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    _bench_hf.add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.hf:
        return _bench_hf.run(args)
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moekit.bench.cells import CPU_SCALE, Shape
    from moekit.bench.report import plot, print_report, results_path, write_json
    from moekit.bench.run import check_args, run_bench

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = None
    if args.shapes:
        scale = 1 if device.type == "cuda" else CPU_SCALE
        try:
            shapes = [Shape.from_preset(name, scale) for name in args.shapes.split(",")]
        except ValueError as err:
            raise SystemExit(f"bench: --shapes: {err}") from None
    backends = args.backends.split(",") if args.backends else None
    try:
        check_args(backends, args.batches)
    except ValueError as err:
        raise SystemExit(f"bench: {err}") from None
    console = Console(width=120)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        doc = run_bench(device, shapes, args.batches, backends, progress)
    path = write_json(doc, results_path(args.out, doc))
    print_report(doc, console)
    console.print(f"wrote {path}")
    if not args.no_plot:
        png = plot(doc, path.with_suffix(".png"))
        if png:
            console.print(f"wrote {png}")
    return 0

"""``moekit bench``: the experts backends side by side against the device's measured ceilings."""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli._args import ListOption, UsageError, device_arg, output_dir, positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="time the experts backends against the measured copy bandwidth and matmul rate",
        description="Measure the device's copy bandwidth and dense matmul rate, then time every backend over "
        "the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B expert shapes (scaled down on the CPU); write JSON + PNG.",
    )
    p.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--shapes", action=ListOption, default=None, help="presets, space- or comma-separated (default: all three)")
    p.add_argument("--batches", action=ListOption, item=positive_int, default=None, help="M values, space- or comma-separated")
    p.add_argument("--backends", action=ListOption, default=None, help="backends, space- or comma-separated (default: all available)")
    p.add_argument("--out", type=output_dir, default=Path("benchmarks/results"), help="directory for <device>-<date>.json/.png")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
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
            shapes = [Shape.from_preset(name, scale) for name in args.shapes]
        except ValueError as err:
            raise UsageError(f"--shapes: {err}") from None
    backends = args.backends
    try:
        check_args(backends, args.batches)
    except ValueError as err:
        raise UsageError(str(err)) from None
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

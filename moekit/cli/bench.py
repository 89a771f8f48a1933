"""``moekit bench``: the experts backends side by side against the device's measured ceilings;
``moekit bench --hf``: whole transformers MoE models per experts implementation (``_bench_hf``);
``moekit bench --offload``: decode with host-resident experts behind a GPU cache (``_bench_offload``);
``moekit bench --train``: forward + backward of the experts path against transformers' (``_bench_train``);
``moekit bench --cpu-experts``: the CPU experts path against transformers' and the dense rate (``_bench_cpu``);
``moekit bench --targets FILE ...``: issues #15 / #16 / #19's targets judged on bench JSONs (``_bench_targets``)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from moekit.bench.cells import CPU_BATCHES, GPU_BATCHES
from moekit.cli import COMMANDS, _bench_cpu, _bench_hf, _bench_offload, _bench_targets, _bench_train
from moekit.cli._args import (ListOption, UsageError, device_arg, made_output_dir, missing_extra, output_dir,
                              positive_float, positive_int)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help=COMMANDS["bench"],
        description="Measure the device's copy bandwidth and dense matmul rate, then time every backend over "
        "the Qwen3-30B-A3B, DeepSeek-V3 and Mixtral-8x7B expert shapes (scaled down on the CPU); write JSON + PNG.",
    )
    p.add_argument("--device", type=device_arg, default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--shapes", action=ListOption, default=None,
                   help="presets, space- or comma-separated (default: all three)")
    p.add_argument("--batches", action=ListOption, item=positive_int, default=None,
                   help="M values, space- or comma-separated (default: "
                   f"{','.join(map(str, GPU_BATCHES))} on the GPU, {','.join(map(str, CPU_BATCHES))} on the CPU)")
    p.add_argument("--backends", action=ListOption, default=None,
                   help="backends, space- or comma-separated (default: all available)")
    p.add_argument("--dtype", action=ListOption, default=None,
                   help="expert weight dtypes, space- or comma-separated: bfloat16 (unquantized; float32 on the CPU), "
                   "fp8_block, int8_w8a16, int4_w4a16, mxfp4 (default: bfloat16). Quantized cells run moekit's "
                   "quantized path (triton on the GPU) on weights quantized once per shape, beside the unquantized "
                   "cells, which always run with them")
    p.add_argument("--budget-s", type=positive_float, default=None,
                   help="seconds of timed passes per cell (default 0.3; at least 5 passes whatever the budget)")
    p.add_argument("--out", type=output_dir, default=Path("benchmarks/results"),
                   help="directory for <device>-<date>.json/.png (default: benchmarks/results under the current "
                   "directory; --hf, --offload, --train and --cpu-experts write there too); "
                   "an existing result is never overwritten: the run takes <device>-<date>-2, -3, ...")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    _bench_hf.add_arguments(p)
    _bench_offload.add_arguments(p)
    _bench_train.add_arguments(p)
    _bench_cpu.add_arguments(p)
    _bench_targets.add_arguments(p)
    p.set_defaults(func=_run)
    _DEFAULTS.update(vars(p.parse_args([])))  # every option's default: modes check what was given against them


# Each mode's own flags (dests) and the modes that read them: given to a run of none of those modes, a flag was
# dropped in silence (bench --train --tiny ran the full widths), so it is refused, naming where it applies.
_MODE_FLAGS = {
    ("hf",): ("hf_model", "hf_impls", "layers", "decode_tokens", "prompt_len", "prefill_batch", "prefill_len",
              "compile", "compile_backend", "hf_dtype", "hf_quant", "hf_quant_options"),
    ("hf", "cpu_experts"): ("repeats",),
    ("hf", "offload"): ("tiny",),
    ("offload",): ("offload_layers", "cache_fractions", "offload_steps", "offload_places", "offload_streams",
                   "offload_online_cpu_rate", "offload_dtype"),
}
_DEFAULTS: dict = {}  # dest -> the parser's default for every option, read when the parser is built
# The kernel cells' flags each other mode reads (--dtype / --budget-s: _run's own check); the rest it dropped in
# silence (bench --hf --batches 8 ran its own sizes).
_CELL_FLAGS = ("shapes", "batches", "backends", "no_plot")
_MODE_READS = {"hf": (), "offload": ("batches",), "train": ("shapes", "batches", "backends"),
               "cpu_experts": ("batches", "backends")}


def _check_mode_flags(args: argparse.Namespace) -> None:
    for modes, dests in _MODE_FLAGS.items():
        given = [dest for dest in dests if getattr(args, dest) != _DEFAULTS[dest]]
        if given and not any(getattr(args, mode) for mode in modes):
            where = " or ".join(f"--{mode.replace('_', '-')}" for mode in modes)
            flag = "--compile / --no-compile" if given[0] == "compile" else f"--{given[0].replace('_', '-')}"
            raise UsageError(f"{flag} applies to {where}, which this run is not")


def _run(args: argparse.Namespace) -> int:
    if args.targets is not None:
        return _bench_targets.run(args, _DEFAULTS)
    _check_mode_flags(args)
    modes = [f"--{m.replace('_', '-')}" for m in ("hf", "offload", "train", "cpu_experts") if getattr(args, m)]
    if modes and (args.budget_s or (args.dtype and modes != ["--cpu-experts"])):
        raise UsageError(f"--dtype and --budget-s apply to the kernel cells (--dtype also to --cpu-experts), "
                         f"not to {modes[0]}")
    for mode in modes:
        unread = [f for f in _CELL_FLAGS if getattr(args, f) and f not in _MODE_READS[mode[2:].replace("-", "_")]]
        unread = [f for f in unread if mode != "--cpu-experts" or f != "shapes"]  # its own line: use --shape
        if unread:
            takers = ["the kernel cells"] + [f"--{m.replace('_', '-')}" for m, r in _MODE_READS.items()
                                             if unread[0] in r]
            raise UsageError(f"--{unread[0].replace('_', '-')} applies to {', '.join(takers)}, not to {mode}")
    if not args.cpu_experts and (args.shape or args.threads or args.act_dtype):
        flag = "shape" if args.shape else "threads" if args.threads else "act-dtype"
        raise UsageError(f"--{flag} applies to --cpu-experts (the kernel cells take --shapes)")
    with made_output_dir(args.out):  # before any measurement: every mode writes its JSON there
        return _run_mode(args, modes)


def _run_mode(args: argparse.Namespace, modes: list[str]) -> int:
    """The run of the mode the flags name (``modes``: those given), each writing its JSON under ``args.out``."""
    if args.cpu_experts:
        if len(modes) > 1:
            raise UsageError(f"{modes[0]} and --cpu-experts are separate runs; give one")
        return _bench_cpu.run(args)
    if args.hf:
        return _bench_hf.run(args)
    if args.offload:
        return _bench_offload.run(args)
    if args.train:
        try:
            device = _device(args.device)
        except ValueError as err:
            raise UsageError(f"--{err}") from None
        return _bench_train.run(args, device)
    return _run_kernel_cells(args)


def _run_kernel_cells(args: argparse.Namespace) -> int:
    """The default mode: the experts backends' cells against the device's ceilings; the JSON (the cells so far kept
    in ``<results>.partial.json`` while it runs), the table, the PNG."""
    from rich.console import Console

    from moekit.bench.report import plot, print_report, report_width, results_path
    from moekit.bench.run import BUDGET_S, check_args, run_bench
    from moekit.cli._kept import KeptRun

    budget_s = args.budget_s or BUDGET_S
    try:
        device = _device(args.device)
        shapes = _shapes(args.shapes, device)
        backends = args.backends or None
        check_args(backends, args.batches, device, args.dtype, budget_s)
    except ValueError as err:
        raise UsageError(f"--{err}") from None  # each message begins with the argument's name
    kept = KeptRun("moekit bench", "the cells timed", lambda doc: results_path(args.out, doc))
    with kept.interruptible(), _progress() as on_progress:  # run_bench marks each partial document "partial"
        doc = run_bench(device, shapes, args.batches, backends, on_progress, args.dtype, budget_s, kept.keep)
    path = kept.finish(doc)
    console = Console(width=report_width(doc))
    print_report(doc, console)
    suffixed = not path.stem.endswith(doc["date"])
    console.print(f"wrote {path}" + (" (an earlier result of the day exists; results are never overwritten, "
                                     "each run takes the next free -N suffix)" if suffixed else ""))
    if not args.no_plot:
        png = plot(doc, path.with_suffix(".png"))
        console.print(f"wrote {png}" if png else f"no plot: {missing_extra('plot', 'matplotlib')}", markup=False)
    return 0


def _device(name: str | None):
    """``--device``, or cuda when available; ``ValueError`` for a device this machine lacks."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] not in ("cuda", "cpu"):
        raise ValueError(f"device: must be cuda or cpu, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device: cuda is not available on this machine; use --device cpu")
    return torch.device(name)


def _shapes(names: list[str] | None, device) -> list | None:
    """The presets named by ``--shapes``, scaled down on the CPU; ``ValueError`` names the flag."""
    from moekit.bench.cells import CPU_SCALE, Shape

    if not names:
        return None
    try:
        return [Shape.from_preset(name, 1 if device.type == "cuda" else CPU_SCALE) for name in names]
    except ValueError as err:
        raise ValueError(f"shapes: {err}") from None


@contextlib.contextmanager
def _progress():
    """A callback for ``run_bench``: one line per cell on stderr, under a progress bar on a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, width=120, highlight=False)
    columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("bench", total=None)

        def on_progress(p) -> None:
            bar.update(task, completed=p.done, total=p.total)
            console.print(f"[{p.done}/{p.total}] {p.message}", markup=False, soft_wrap=True)  # one line each

        yield on_progress

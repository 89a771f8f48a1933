"""``moekit tune``: tune the Triton experts kernels for a shape and weight format on this GPU; the file it
writes (in the user config directory, searched before the packaged configs) is picked up with no code
change. A tuned entry adds or replaces its own M and nothing else: the file's other M stay as they were, and the
lookups overlay a user file's M over the packaged file's. ``--install FILE ...`` merges tuned files into the packaged
configs (``moekit/experts/configs/``) the same way, for committing: tune on the GPU machine with ``--out DIR``, fetch
DIR, install from it. Both say where a tuned entry replaces one with
switches (the fp8 files' "weight_tma", "pair_dot", ...) that it leaves off or sets otherwise (the fp8 search times them
too, today's entry among its candidates; the other formats' the tiles alone)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moekit.cli import COMMANDS
from moekit.cli._args import ListOption, UsageError, output_dir, positive_float, positive_int
from moekit.quant import SCHEMES

# the weight-only register decode's own tunes (``bench.tuning_quant.WO_TUNE_NAMES``; the plain scheme names
# tune the whole-tile decode)
REGISTER_DECODE_TUNES = ("int4_w4a16_register", "mxfp4_register")
DTYPES = ("bfloat16", "float16", "float32", *SCHEMES, *REGISTER_DECODE_TUNES)


def register(subparsers) -> None:
    p = subparsers.add_parser("tune", help=COMMANDS["tune"],
                              description="Sweep launch configs of the Triton experts path of a weight format "
                              "per batch size M, resumably, and write a config file that lookups pick up.")
    p.add_argument("--preset", action=ListOption, item=str, default=None,
                   help="model presets, space- or comma-separated (repeatable), e.g. qwen3-30b-a3b")
    p.add_argument("--shape", default=None, help="explicit E,N,K,top_k instead of a preset, e.g. 64,1408,2048,6")
    p.add_argument("--batches", action=ListOption, item=positive_int, default=None,
                   help="M values, space- or comma-separated (default: 1..16384)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                   help="weights: a float dtype, or a quantization scheme (weights quantized, bf16 activations) "
                   "(default: bfloat16)")
    p.add_argument("--out", type=output_dir, default=None,
                   help="directory to write to (default: $MOEKIT_CONFIG_DIR, else $XDG_CONFIG_HOME/moekit/configs, "
                   "i.e. ~/.config/moekit/configs: lookups search it before the packaged configs)")
    p.add_argument("--budget-s", type=positive_float, default=None,
                   help="stop starting new M after this many seconds per shape (default: no limit)")
    p.add_argument("--install", action=ListOption, item=_tuned_file, default=None, metavar="FILE",
                   help="instead of tuning: merge these tuned files (written by moekit tune --out) into the "
                   "packaged configs, moekit/experts/configs/, per M (the packaged file's other M stay)")
    p.add_argument("--show", action="store_true",
                   help="instead of tuning: say, per M, whose tuned file the lookups of this shape and --dtype take "
                   "on this device (its own, a sibling device's such as 'NVIDIA_H200 (sibling)', or the heuristic); "
                   "without a CUDA GPU: that none applies, and the CPU path a call runs")
    p.set_defaults(func=_run)


def _tuned_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    return path


def _run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moekit.bench.cells import Shape
    from moekit.bench.tuning import TUNE_BATCHES, scheme_for, tune

    if args.install:
        return _install(args)
    try:
        shapes = [Shape.from_preset(p) for p in (args.preset or [])]
    except ValueError as err:
        raise UsageError(f"--preset: {err}") from None
    if args.shape:
        shapes.append(_explicit_shape(args.shape))
    if not shapes:
        raise UsageError("give --preset NAME or --shape E,N,K,top_k")
    if args.show:
        return _show(args, shapes)
    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU (the Triton kernels are tuned where they run); none is visible")
    scheme = scheme_for(args.dtype)
    for shape in shapes:  # before any shape's weights are made
        try:
            scheme.check_shape(shape, torch.device("cuda"))
        except (ValueError, TypeError) as err:
            raise UsageError(f"--dtype {args.dtype} cannot take {shape.name} (E={shape.num_experts}, N={shape.n}, "
                             f"K={shape.k}): {err}") from None
    console = Console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for shape in shapes:
            path = tune(shape, args.batches or TUNE_BATCHES, args.dtype, out_dir=args.out,
                        budget_s=args.budget_s, progress=progress, note=console.print)
            console.print(f"wrote {path}")
    return 0


def _install(args: argparse.Namespace) -> int:
    """``--install FILE ...``: the finished files merged into the packaged configs per M, all checked before any
    is written, each saying which M it added and replaced; a partial run's progress file is skipped, saying so (its
    finished M are in the file beside it)."""
    from moekit.bench.tuning import check_tuned_file, install

    if args.preset or args.shape or args.batches or args.out or args.budget_s:
        raise UsageError("--install copies files tuned before; give it alone, without --preset, --shape, "
                         "--batches, --out or --budget-s")
    finished = []
    for path in args.install:
        if path.name.endswith(".partial.json"):
            print(f"skipped {path}: the progress of an unfinished run (its finished M are in the file beside it)")
            continue
        try:
            check_tuned_file(path)
        except ValueError as err:
            raise UsageError(f"--install: {err}") from None
        finished.append(path)
    for path in finished:  # every file checked before any is written
        try:
            print(f"installed {install(path, note=print)}")
        except ValueError as err:  # the packaged file of that name is of another shape (edited by hand)
            raise UsageError(f"--install: {err}") from None
    return 0


def _show(args: argparse.Namespace, shapes: list) -> int:
    """``--show``: per shape, the M of ``--batches`` (default the tuner's) grouped by the file their lookups take on
    this device (the first GPU; the CPU without one), ``configs.served_by``."""
    import torch

    from moekit.bench.tuning import TUNE_BATCHES, scheme_for
    from moekit.experts.configs import device_key, served_by

    if args.out or args.budget_s:
        raise UsageError("--show only reads the config files; give it without --out or --budget-s")
    if not torch.cuda.is_available():
        return _show_cpu(args, shapes)
    scheme, device = scheme_for(args.dtype), device_key(torch.device("cuda"))
    for shape in shapes:
        name_of = lambda dev: scheme.file_name(shape.num_experts, shape.n, shape.k, dev)  # noqa: E731
        by_source: dict[str, list[int]] = {}
        for m in sorted(args.batches or TUNE_BATCHES):
            by_source.setdefault(served_by(m, name_of, device), []).append(m)
        served = "; ".join(f"M={','.join(map(str, ms))}: {source}" for source, ms in by_source.items())
        print(f"{shape.name} {scheme.name} on {device}: {served}")
    return 0


def _show_cpu(args: argparse.Namespace, shapes: list) -> int:
    """``--show`` without a CUDA GPU: the tuned files configure the Triton kernels, which run on CUDA only, so no M
    of a CPU call takes one (nor the heuristic: that is the Triton kernels' too); say which path a call runs here."""
    from moekit.bench.tuning import scheme_for
    from moekit.experts import resolve_backend

    backend = resolve_backend("auto", "cpu")
    quantized = args.dtype not in ("bfloat16", "float16", "float32")
    path = "the CPU quantized experts (moekit.experts.cpu_quant)" if quantized else "the CPU experts path"
    for shape in shapes:
        print(f"{shape.name} {scheme_for(args.dtype).name} on cpu: no tuned config applies: the tuned files (and the "
              f"heuristic) configure the Triton kernels, which run on a CUDA GPU (none visible); backend='auto' runs "
              f"{backend} here, {path}, which has no launch configs to tune (`moekit bench --cpu-experts` times it)")
    return 0


def _explicit_shape(text: str):
    """``--shape E,N,K,top_k`` as a bench ``Shape``; exits naming the flag when it is not four positive
    integers with top_k <= E."""
    from moekit.bench.cells import Shape
    from moekit.bench.cpu_measure import ExpertsShape

    try:
        s = ExpertsShape.parse(text)
    except ValueError:
        raise UsageError(f"--shape must be four positive integers E,N,K,top_k with top_k <= E, got {text!r}") from None
    return Shape(f"E{s.experts}_N{s.intermediate}_K{s.hidden}_k{s.top_k}", s.experts, s.intermediate, s.hidden,
                 s.top_k)

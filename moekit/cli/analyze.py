"""``moekit analyze``: what one MoE layer and one decode step cost on a GPU, and why.

    moekit analyze --preset deepseek-v3 --gpu h100 --dtype fp8
    moekit analyze --config config.json --gpu mi300x --dtype bf16 --json
    moekit analyze --experts 64 --top-k 6 --hidden 2048 --moe-intermediate 1408 --layers 26 --plot out.png
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import numpy as np

from moekit.analysis.billed import BilledLayer
from moekit.analysis.bills import param_bill
from moekit.analysis.formats import FORMATS, SCHEME_ALIASES, get_format
from moekit.analysis.gpus import get_gpu, gpu_names
from moekit.analysis.memory import DEFAULT_RESERVE_GIB, DEFAULT_UTILIZATION
from moekit.analysis.report import DEFAULT_BATCHES, analyze, report_to_json
from moekit.analysis.roofline import MAX_BATCH
from moekit.analysis.touch import inclusion_from_counts
from moekit.cli import COMMANDS
from moekit.cli._analyze_offload import add_arguments as add_offload_arguments
from moekit.cli._analyze_offload import check_offload_flags, offload_rows, offload_table, offload_to_json
from moekit.cli._args import ListOption, UsageError, plot_path, save_figure, working
from moekit.cli._model_source import add_source_arguments, layer_config, preset_source, read_config_json
from moekit.config import MoEConfig


def register(subparsers) -> None:
    p = subparsers.add_parser("analyze", help=COMMANDS["analyze"],
                              description=__doc__.replace("``", ""),  # the docstring's markup, not the terminal's
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("model (one of)")
    add_source_arguments(src)
    src.add_argument("--experts", type=int, help="E, routed experts (with --top-k --hidden --moe-intermediate)")
    src.add_argument("--top-k", type=int, help="k, experts per token")
    src.add_argument("--hidden", type=int, help="d, hidden size")
    src.add_argument("--moe-intermediate", type=int, help="d_ff of one expert")
    src.add_argument("--layers", type=int, help="MoE layers in the model (default: the config's, else 1)")
    routing = p.add_argument_group("routing (default: uniform, independent tokens)")
    routing.add_argument("--expert-load", metavar="COUNTS_JSON",
                         help="a JSON list of per-expert token counts (e.g. EPLB's load): model that skew instead")
    hw = p.add_argument_group("hardware and format")
    hw.add_argument("--gpu", default="h100", help=f"one of {gpu_names()} (default h100)")
    hw.add_argument("--dtype", type=_dtype, metavar="{" + ",".join(sorted(FORMATS)) + "}",
                    help=f"weight format (default: a --config file's quantization_config, else {DEFAULT_DTYPE}); "
                    "moekit bench's scheme names are aliases: "
                    + ", ".join(f"{s} = {n}" for s, n in sorted(SCHEME_ALIASES.items())))
    hw.add_argument("--bandwidth", type=float, metavar="TB_S", help="override the GPU's memory bandwidth")
    hw.add_argument("--tflops", type=float, help="override the GPU's dense TFLOP/s in the format's compute dtype")
    hw.add_argument("--memory-gib", type=float, help="override the GPU's capacity")
    hw.add_argument("--gpus", type=int, default=1, help="GPUs the weights are split over, for the fit (default 1)")
    hw.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION,
                    help=f"memory fraction an engine uses (default {DEFAULT_UTILIZATION:g}, vLLM's "
                    "gpu_memory_utilization)")
    hw.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                    help=f"per-GPU reserve for activations, graphs, non-torch memory (GiB; default "
                    f"{DEFAULT_RESERVE_GIB:g})")
    out = p.add_argument_group("output")
    out.add_argument("--batches", action=ListOption, item=_batch, default=list(DEFAULT_BATCHES),
                     help=f"batch sizes to sweep, space- or comma-separated, each in [1, {MAX_BATCH}] (default "
                     f"{','.join(map(str, DEFAULT_BATCHES))})")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--plot", metavar="OUT_PNG", type=plot_path, help="write the curves to this image")
    out.add_argument("--measure", action="store_true",
                     help="run the MoE layer on the present device over the sweep and compare")
    add_offload_arguments(p)
    p.set_defaults(func=run)


def _batch(text: str) -> int:
    """A --batches value: an integer in [1, 2^53] (the model's cost does not grow with it)."""
    try:
        batch = int(text)
    except ValueError:
        batch = 0
    if not 1 <= batch <= MAX_BATCH:
        raise argparse.ArgumentTypeError(f"each batch must be an integer in [1, 2^53 = {MAX_BATCH}], got {text!r}")
    return batch


DEFAULT_DTYPE = "fp8"
# a config.json's quantization_config -> the format its experts are stored in (gptq / awq: by their bits)
QUANT_METHODS = {"fp8": "fp8", "mxfp4": "mxfp4", ("gptq", 4): "int4", ("awq", 4): "int4", ("gptq", 8): "int8"}


def _file_dtype(hf: dict | None, path: str | None) -> str:
    """--dtype's default: the format a config.json's quantization_config stores the weights in (gpt-oss: mxfp4), said
    on stderr, else ``DEFAULT_DTYPE``."""
    quant = (hf or {}).get("quantization_config") if path else None
    if not isinstance(quant, dict):
        return DEFAULT_DTYPE
    method = quant.get("quant_method")
    name = QUANT_METHODS.get(method) or QUANT_METHODS.get((method, quant.get("bits")))
    said = f"config.json at {path}: its quantization_config (quant_method {method!r})"
    if name is None:
        print(f"note: {said} is no format the byte model bills: --dtype {DEFAULT_DTYPE}, the default", file=sys.stderr)
        return DEFAULT_DTYPE
    print(f"note: {said}: --dtype {name} (give --dtype to bill another format)", file=sys.stderr)
    return name


def _dtype(text: str) -> str:
    """A --dtype value: a format name, or a scheme name standing for one (``fp8_block`` -> ``fp8``)."""
    try:
        return get_format(text).name
    except KeyError as err:
        raise argparse.ArgumentTypeError(err.args[0]) from None


def _model(args) -> tuple[MoEConfig, dict | None, str, BilledLayer | None]:
    """The layer config, the whole-model config dict when known, a display name, and a config.json's billed layer."""
    shape_flags = (args.experts, args.top_k, args.hidden, args.moe_intermediate)
    chosen = sum(x is not None for x in (args.preset, args.config)) + any(f is not None for f in shape_flags)
    if chosen != 1:
        raise UsageError("give exactly one of --preset, --config, or --experts/--top-k/--hidden/--moe-intermediate")
    if args.preset:
        source = preset_source(args.preset)
        return source.layer, source.hf, source.name, None
    if args.config:
        hf = read_config_json(args.config)
        billed = _config_of(hf, args.config, args.layers)
        return billed.config, _bills_config(hf, args.config), args.config, billed
    if any(f is None for f in shape_flags):
        raise UsageError("--experts, --top-k, --hidden and --moe-intermediate go together")
    try:
        cfg = MoEConfig(hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                        num_experts=args.experts, top_k=args.top_k, num_moe_layers=args.layers)
    except ValueError as err:
        raise UsageError(f"--experts/--top-k/--hidden/--moe-intermediate: {err}") from err
    return cfg, None, "custom", None


def _config_of(hf: dict, path: str, layers: int | None) -> BilledLayer:
    """The layer a config.json describes; ``--layers`` stands in for a missing ``num_hidden_layers``."""
    billed = layer_config(hf, path)
    if billed.config.num_moe_layers is None and layers is None:
        raise UsageError(f"config.json at {path} has no 'num_hidden_layers': give --layers N, the model's MoE layers")
    return billed


def _bills_config(hf: dict, path: str) -> dict | None:
    """``hf`` when it has every field the whole-model bills read; else None, with a note on stderr."""
    try:
        param_bill(hf)
    except KeyError as err:
        print(f"note: config.json at {path} has no {err.args[0]!r}: no parameter or memory bills", file=sys.stderr)
        return None
    return hf


def _check_numbers(args) -> None:
    """Exit naming the flag when a number is out of its range (they would otherwise give negative times or
    a traceback from deep inside the byte model)."""
    positive = {"--bandwidth": args.bandwidth, "--tflops": args.tflops, "--memory-gib": args.memory_gib,
                "--layers": args.layers}
    for flag, value in positive.items():
        if value is not None and not 0 < value < float("inf"):
            raise UsageError(f"{flag} must be positive and finite, got {value}")
    if args.gpus < 1:
        raise UsageError(f"--gpus must be >= 1, got {args.gpus}")
    if not 0.0 < args.utilization <= 1.0:
        raise UsageError(f"--utilization must be in (0, 1], got {args.utilization}")
    if not args.reserve_gib >= 0:
        raise UsageError(f"--reserve-gib must be >= 0, got {args.reserve_gib}")


def run(args) -> int:
    _check_numbers(args)
    check_offload_flags(args)
    cfg, hf, name, billed = _model(args)
    if billed is not None and billed.refused is not None and (args.measure or args.offload):
        flag = "--measure times" if args.measure else "--offload predicts"
        raise UsageError(f"{flag} moekit's own layer, which cannot serve {name} ({billed.model_type}): "
                         f"{billed.refused}")
    if args.layers is not None:
        cfg = cfg.replace(num_moe_layers=args.layers)
    fmt = get_format(args.dtype or _file_dtype(hf, args.config))
    tflops = {fmt.compute_dtype: args.tflops} if args.tflops is not None else None
    try:
        gpu = get_gpu(args.gpu).with_overrides(args.bandwidth, args.memory_gib, tflops)
    except KeyError as err:
        raise UsageError(f"--{err.args[0]}") from None  # "gpu must be one of [...]": name the flag
    if fmt.compute_dtype not in gpu.dense_tflops:
        raise UsageError(f"{gpu.name} has no {fmt.compute_dtype} tensor throughput for {fmt.name} weights; "
                         f"choose another --dtype or supply --tflops")
    inclusion, routing = _inclusion(args.expert_load, cfg)
    report = analyze(cfg, gpu, fmt, tuple(args.batches), hf, name, args.gpus, args.utilization, args.reserve_gib,
                     inclusion, routing, *((billed.expert_matrices, billed.note) if billed else ()))
    offload = offload_rows(args, cfg, fmt, gpu) if args.offload else None
    measurement = None
    if args.measure:
        from moekit.bench.layer_measure import measure

        with working("analyze --measure") as status:
            measurement = measure(cfg, tuple(args.batches),
                                  on_step=lambda step: status.update(f"analyze --measure: {step} ..."))
    if args.json:
        _print_json(report, measurement, offload)
    else:
        _print_tables(report, measurement, offload)
    if args.plot:
        save_figure(functools.partial(_plot, report, measurement=measurement), args.plot, to_stderr=args.json)
    return 0


def _print_json(report, measurement, offload) -> None:
    data = report_to_json(report)
    data["offload"] = None if offload is None else offload_to_json(offload)
    data["measured"] = None
    if measurement:
        from moekit.bench.layer_measure import measurement_to_json

        data["measured"] = measurement_to_json(measurement)
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _print_tables(report, measurement, offload) -> None:
    from rich.console import Console

    from moekit.cli._analyze_tables import print_measurement, print_report

    console = Console()
    if not console.is_terminal:  # piped or logged: rich would fall back to 80 columns and cut cells
        console = Console(width=120)
    if report.note:
        console.print(f"note: {report.note}", markup=False, highlight=False)
    print_report(report, console)
    if offload:
        console.print(offload_table(offload))
    if measurement:
        print_measurement(measurement, console)


def _plot(report, path: str, measurement=None) -> None:
    """The figure, with the measured points drawn on it when there are any."""
    from moekit.analysis.plots import plot_report

    overlay = None
    if measurement:
        from moekit.bench.layer_measure import overlay_measurement

        overlay = functools.partial(overlay_measurement, measurement)
    plot_report(report, path, overlay)


def _inclusion(path: str | None, cfg: MoEConfig) -> tuple[np.ndarray | None, str]:
    """Per-expert inclusion probabilities from a counts file (dropless: tokens = sum / k, k·E/(E+Z) with identity
    experts), and a label. With identity experts the file may hold E + Z counts (``MoEStats.choice_counts``): the
    byte model keeps k·E/(E+Z) experts a token (its touch and intensity model), so the E routed ones are read and
    the measured identity share is named beside the modelled one."""
    if path is None:
        return None, "uniform"
    counts = _read_counts(path, cfg.num_experts, cfg.choice_width)  # [E] or [E + Z]
    note = ""
    if counts.size != cfg.num_experts:
        measured, modelled = counts[cfg.num_experts:].sum() / counts.sum(), 1 - cfg.routed_slots_per_token / cfg.top_k
        note = f"; identity slots {100 * measured:.1f}% measured, {100 * modelled:.1f}% modelled"
        counts = counts[:cfg.num_experts]  # [E]
    num_tokens = counts.sum() / cfg.routed_slots_per_token
    if counts.max() > num_tokens:
        raise UsageError(f"--expert-load has an expert with more than sum/k = {num_tokens:g} tokens; "
                         f"a token routes to an expert at most once")
    imbalance = counts.max() / counts.mean()
    return inclusion_from_counts(counts, num_tokens), f"measured load from {path} (max/mean {imbalance:.2f}{note})"


def _read_counts(path: str, num_experts: int, choice_width: int) -> np.ndarray:
    """The ``--expert-load`` file: E (or E + Z, identity experts last) finite, non-negative token counts, the
    routed ones not all zero."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise UsageError(f"--expert-load: cannot read {path}: {err.strerror}") from err
    except ValueError as err:
        raise UsageError(f"--expert-load: {path} is not JSON: {err}") from err
    widths = f"{num_experts}" if choice_width == num_experts else f"{num_experts} (or {choice_width}: + identity)"
    expected = f"--expert-load: {path} must hold a JSON list of {widths} token counts, one per expert"
    try:
        counts = np.asarray(data, dtype=np.float64)  # [E] or [E + Z]
    except (TypeError, ValueError):
        raise UsageError(f"{expected}; got {type(data).__name__} {json.dumps(data)[:60]}") from None
    if counts.shape not in ((num_experts,), (choice_width,)):
        raise UsageError(f"{expected}; got shape {list(counts.shape)}")
    bad = np.flatnonzero(~np.isfinite(counts) | (counts < 0))
    if bad.size:
        raise UsageError(f"{expected}, each finite and >= 0; expert {bad[0]} has {data[bad[0]]}")
    if counts[:num_experts].sum() == 0:
        raise UsageError(f"{expected}; every count is zero")
    return counts

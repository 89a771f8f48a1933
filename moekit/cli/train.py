"""``moekit train``: a small MoE byte-level language model on the Python standard library, three runs
side by side (no balancing, aux loss, bias update); prints loss and load imbalance, writes the curves
as JSON and a PNG. The library is ``moekit.train``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from moekit.cli import COMMANDS
from moekit.cli._args import (DefaultsHelpFormatter, device_arg, made_output_dir, missing_extra, output_dir,
                              positive_float, positive_int, seed_arg)


def register(subparsers) -> None:
    from moekit.train.loop import TrainSettings

    d = TrainSettings()
    p = subparsers.add_parser(
        "train", help=COMMANDS["train"],
        formatter_class=DefaultsHelpFormatter,
        description="Train a byte-level MoE language model on the Python standard library's source three times "
        "side by side, from the same weights on the same batches: without load balancing, with the auxiliary "
        "load-balancing loss, and with DeepSeek's bias update. Prints loss and max/mean expert load per step; "
        "writes train-curves.json and train-curves.png under --out (replacing earlier ones).",
    )
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimizer steps per run")
    import torch

    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else d.device,
                   help="cuda (the Triton experts path) when a GPU is present, else cpu; as demo and bench")
    p.add_argument("--out", type=output_dir, default=Path("moekit-train"), help="directory for the JSON and PNG")
    p.add_argument("--seed", type=seed_arg, default=d.seed, help="weights and batches")
    p.add_argument("--capacity-factor", type=positive_float, default=None,
                   help="drop over capacity (default: dropless)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="sequences per step")
    p.add_argument("--seq-len", type=positive_int, default=d.seq_len, help="bytes per sequence")
    p.add_argument("--layers", type=positive_int, default=d.num_layers, help="MoE layers")
    p.add_argument("--d-model", type=positive_int, default=d.d_model, help="model width")
    p.add_argument("--experts", type=positive_int, default=d.num_experts, help="routed experts per layer")
    p.add_argument("--top-k", type=positive_int, default=d.top_k, help="experts per token")
    p.add_argument("--expert-size", type=positive_int, default=d.expert_size, help="each expert's intermediate width")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="AdamW learning rate")
    p.add_argument("--aux-coef", type=positive_float, default=d.aux_loss_coef, help="the aux run's loss coefficient")
    p.add_argument("--bias-rate", type=positive_float, default=d.bias_rate, help="the bias run's update speed")
    p.add_argument("--ep", type=positive_int, default=d.ep, metavar="N",
                   help="spread every MoE layer's experts over N processes (expert parallelism: gloo on the CPU, NCCL "
                   "with one GPU each), each taking batch-size / N sequences; the curves are the whole batch's")
    p.add_argument("--spare-slots", type=int, default=d.spare_slots, metavar="S",
                   help="with --ep N: S redundant expert slots per MoE layer that EPLB fills with replicas of hot "
                   "experts (at most experts x (N - 1); a rank holds (experts + S) / N slots, rounded down or up; "
                   "needs --rebalance-every)")
    p.add_argument("--rebalance-every", type=int, default=d.rebalance_every, metavar="K",
                   help="with --ep: rebalance every MoE layer's experts with EPLB every K steps (the optimizer's state "
                   "moves with them); 0: the placement stays")
    p.add_argument("--log-every", type=positive_int, default=10, help="print a line every N steps")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from moekit.cli._args import UsageError
    from moekit.train.loop import TrainSettings

    try:
        settings = TrainSettings(
            steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, d_model=args.d_model,
            num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, expert_size=args.expert_size,
            lr=args.lr, aux_loss_coef=args.aux_coef, bias_rate=args.bias_rate, capacity_factor=args.capacity_factor,
            seed=args.seed, device=args.device, ep=args.ep, spare_slots=args.spare_slots,
            rebalance_every=args.rebalance_every,
        )
        settings.moe_config("none")  # top_k <= experts, ...: the config's own checks, before any work
    except ValueError as err:
        raise UsageError(f"{_flags_of(str(err))}: {err}") from None
    if settings.ep > 1:
        from moekit.train.ep import check_ranks

        try:
            check_ranks(settings)
        except ValueError as err:
            raise UsageError(f"--ep: {err}") from None
    with made_output_dir(args.out):  # before the runs: a directory that cannot be written would lose them at the end
        return _train(args, settings)


def _flags_of(message: str) -> str:
    """The flags a ``TrainSettings`` / ``MoEConfig`` refusal is about (their words, top_k, num_experts, are the flags'
    --top-k, --experts)."""
    if message.startswith("ep="):
        return "--ep/--batch-size" if "batch_size" in message else "--ep/--experts"
    if message.startswith(("spare_slots", "rebalance_every")):
        return "--spare-slots/--rebalance-every"
    return "--experts/--top-k/--d-model/--expert-size"


def _train(args: argparse.Namespace, settings) -> int:
    """The three runs side by side, their summary, the JSON and the PNG under ``args.out``."""
    from rich.console import Console

    from moekit.train.curves import curves_document, summary, write_curves
    from moekit.train.data import load_stdlib_bytes
    from moekit.train.loop import train_side_by_side
    from moekit.train.plot import plot_curves

    console = Console(highlight=False)
    spread = "" if settings.ep == 1 else (f", experts over {settings.ep} processes "
                                          f"({'NCCL' if settings.device.startswith('cuda') else 'gloo'})"
                                          + (f", EPLB every {settings.rebalance_every} steps with "
                                             f"{settings.spare_slots} spare slots" if settings.rebalance_every else ""))
    console.print(f"moekit train on {settings.device}: {settings.steps} steps x 3 runs{spread}")
    corpus = load_stdlib_bytes()
    console.print(f"data: {corpus.files} files, {corpus.data.numel() / 2**20:.1f} MiB from {corpus.root}")
    try:
        with _progress(console, args.log_every, settings.capacity_factor is not None) as on_step:
            if settings.ep == 1:
                result = train_side_by_side(settings, corpus, on_step)
            else:
                from moekit.train.ep import train_expert_parallel

                result = train_expert_parallel(settings, corpus, on_step)
    except KeyboardInterrupt:  # said before the CLI's "interrupted": the curves come whole or not at all
        print(f"moekit train: nothing written (train-curves.json and its plot are written after the three runs' "
              f"{settings.steps} steps; --steps for a shorter run)", file=sys.stderr)
        raise
    doc = curves_document(result, corpus)
    for method, s in summary(result).items():
        drops = f", dropped {100 * s['dropped']:.1f}%" if settings.capacity_factor is not None else ""
        console.print(f"{method:>5}: loss {s['loss']:.3f}, max/mean load {s['imbalance']:.2f}{drops} (mean of the last "
                      f"20% of steps)")
    console.print(f"wrote {write_curves(doc, args.out / 'train-curves.json')}", markup=False)
    if not args.no_plot:
        png = plot_curves(doc, args.out / "train-curves.png")
        console.print(f"wrote {png}" if png else f"no plot: {missing_extra('plot', 'matplotlib')}", markup=False)
    return 0


@contextlib.contextmanager
def _progress(console, log_every: int, with_drops: bool):
    """A callback for ``train_side_by_side``: a progress bar on a terminal, a line every ``log_every`` steps."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    start = time.perf_counter()
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("train", total=None)

        def on_step(report) -> None:
            bar.update(task, completed=report.step, total=report.steps)
            if report.step % log_every and report.step != report.steps:
                return
            parts = []
            for method, (loss, imbalance, dropped) in report.latest.items():
                parts.append(f"{method} loss {loss:.3f} load {imbalance:.2f}"
                             + (f" drop {100 * dropped:.1f}%" if with_drops else ""))
            console.print(f"step {report.step:>4}/{report.steps} [{time.perf_counter() - start:6.1f} s]  "
                          + " | ".join(parts),
                          soft_wrap=True)  # one line per report, also when piped

        yield on_step

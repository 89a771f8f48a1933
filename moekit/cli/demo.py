"""``moekit demo``: the main job (see moekit.demo)."""

from __future__ import annotations

import json

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from moekit.cli import COMMANDS
from moekit.cli._args import device_arg, seed_arg
from moekit.demo import DEMO_CONFIG, DemoReport, run_demo, total_steps


def register(subparsers) -> None:
    c = DEMO_CONFIG
    p = subparsers.add_parser(
        "demo", help=COMMANDS["demo"],
        description=f"Build a small MoE layer (E={c.num_experts} experts, top-{c.top_k}, hidden {c.hidden_size}, "
        f"expert width {c.moe_intermediate_size}), check that grouped dispatch equals a naive per-token loop, then "
        "measure load imbalance, dropped assignments and effective sparsity across batch sizes and capacity factors, "
        "and the experts a batch touches against the uniform-routing prediction E*(1-(1-k/E)^B).")
    p.add_argument("--device", type=device_arg, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when present)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the weights and tokens (default: 0)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of tables")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.json:
        print(json.dumps(run_demo(args.seed, args.device).to_dict(), indent=2))
        return 0
    console = Console()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("running the demo MoE", total=total_steps())
        report = run_demo(args.seed, args.device, advance=lambda: progress.advance(task))
    print_report(report, console)
    return 0


def print_report(report: DemoReport, console: Console) -> None:
    cfg, ex = DEMO_CONFIG, report.exactness
    console.print(
        f"[bold]moekit demo[/bold] on {report.device}: E={cfg.num_experts} experts, top-{cfg.top_k}, "
        f"hidden {cfg.hidden_size}, expert width {cfg.moe_intermediate_size}"
    )
    console.print(
        f"grouped dispatch == naive per-token loop on {ex.tokens} tokens: {ex.naive_matmuls} per-token matmuls "
        f"became {ex.grouped_matmuls} grouped ones; max |diff| = {ex.max_abs_diff:.1e} (float64) [green]OK[/green]"
    )
    sweep = Table(
        title="load imbalance, drops and effective sparsity",
        caption="imbalance = max/mean expert load before drops; sparsity = E / experts touched; mean of 16 batches",
    )
    for col in ("batch", "capacity", "imbalance", "dropped", "sparsity"):
        sweep.add_column(col, justify="right")
    for row in report.sweep:
        cf = "dropless" if row.capacity_factor is None else f"{row.capacity_factor:g}"
        sweep.add_row(str(row.batch), cf, f"{row.imbalance:.2f}x", f"{row.drop_rate:.1%}",
                      f"{row.effective_sparsity:.2f}x")
    console.print(sweep)
    touch = Table(title="experts touched", caption="predicted: uniform routing, E*(1-(1-k/E)^B)")
    for col in ("batch", "measured", "predicted", "ratio"):
        touch.add_column(col, justify="right")
    for row in report.touch:
        touch.add_row(str(row.batch), f"{row.measured:.2f}", f"{row.predicted:.2f}",
                      f"{row.measured / row.predicted:.2f}")
    console.print(touch)
    console.print(f"done in {report.seconds:.1f} s")

"""``moekit bench --targets FILE ...``: issues #15 / #16 / #19's target tables from bench JSONs, as Markdown on
stdout (the library is ``moekit.bench.targets``, ``targets_load``, ``targets_judge``, ``targets_report``).

A mode of ``bench`` rather than a subcommand of its own: it reads what ``moekit bench`` wrote, and its
documentation, its files and its users are the bench's. It measures nothing, so every other bench option is
refused beside it (a ``--device`` or ``--dtype`` given there would be dropped in silence).
"""

from __future__ import annotations

import argparse
import sys

from moekit.cli._args import ListOption, UsageError

IGNORED = ("targets", "func", "command")  # dests that are not options of a measuring run


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("issue targets (--targets)")
    g.add_argument("--targets", action=ListOption, default=None, metavar="JSON",
                   help="measure nothing: read moekit bench results, space- or comma-separated (the kernel cells' "
                   "JSON; a bf16 + fp8_block run and a weight-only run may be separate files, each quantized cell "
                   "compared with the bf16 cell of its own file) and print issues #15, #16 and #19's targets as "
                   "Markdown tables: per cell ✓ / ✗ for each target that applies, per target the cells met and missed")


def run(args: argparse.Namespace, defaults: dict) -> int:
    """Refuse the measuring options, read and judge the files, print the Markdown."""
    given = [dest for dest, value in vars(args).items() if dest not in IGNORED and value != defaults.get(dest)]
    if given:
        raise UsageError(f"--targets reads results and measures nothing; --{given[0].replace('_', '-')} applies to a "
                         "measuring run")
    from moekit.bench.targets_judge import judge
    from moekit.bench.targets_load import load_bench
    from moekit.bench.targets_report import markdown

    try:
        files = [load_bench(path) for path in args.targets]
    except ValueError as err:
        raise UsageError(f"--targets: {err}") from None
    sys.stdout.write(markdown(judge(files)))
    return 0

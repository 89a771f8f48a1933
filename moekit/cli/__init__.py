"""The ``moekit`` command. Each subcommand is a module in this package with
``register(subparsers)``, which adds its parser and sets ``func`` (args -> exit code), and a line in ``COMMANDS``.
A run imports the module of the one command it names and no other (``moekit --help`` none of them): a command's
module imports what its command needs (analyze the byte model, demo rich, simulate the simulator), which
``moekit analyze --help`` should not wait for.

Errors: a mistake in the command line or a file it names is a ``UsageError`` (``_args.py``), reported
here as one line, ``moekit <subcommand>: error: <message>``, exit code 2 (argparse's own errors look
and exit the same). Anything else is a bug and keeps its traceback. ``MOEKIT_DEBUG=1`` shows the
traceback of a usage error too.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Iterable

from moekit.cli._args import UsageError


def _version() -> str:
    try:
        return importlib.metadata.version("moekit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


# COMMAND -> its line in ``moekit --help`` (the commands' modules pass it as their parser's help), in that order
COMMANDS = {
    "analyze": "the byte model: experts touched, intensity, step-time floors, bills",
    "bench": "time the experts backends against the measured copy bandwidth and matmul rate",
    "demo": "grouped dispatch == naive loop, then imbalance, drops and sparsity",
    "serve": "serve the routing / load-balancing simulator page locally",
    "simulate": "routing / load-balancing simulator and the lesson's exercises",
    "train": "train a small MoE LM three ways: no balancing, aux loss, bias update",
    "tune": "tune the Triton experts kernels for a shape on this GPU",
}


def build_parser(built: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The ``moekit`` parser, the commands in ``built`` with their own parsers (their modules imported), every
    other command a bare entry that lists it in ``moekit --help`` (it parses nothing: ``main`` builds the one its
    argv names)."""
    parser = argparse.ArgumentParser(prog="moekit", description="Mixture-of-Experts layers, exact and explained.")
    parser.add_argument("--version", action="version", version=f"moekit {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    with_parsers = set(built)
    for name, summary in COMMANDS.items():
        if name in with_parsers:
            importlib.import_module(f"{__name__}.{name}").register(subparsers)
        else:
            subparsers.add_parser(name, help=summary)
    return parser


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the deepest subcommand ``args`` chose (``simulate cache``: the cache parser, whose usage and
    name, ``moekit simulate cache``, an unknown flag after it is reported under)."""
    for action in parser._actions:  # argparse keeps its subparsers there: no public accessor
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _innermost(action.choices[getattr(args, action.dest)], args)
    return parser


def _named_command(argv: list[str]) -> list[str]:
    """``[COMMAND]`` when ``argv`` runs one, else ``[]`` (``--help``, ``--version``, a misspelt command, nothing):
    the top-level options take no value, so the command is argv's first word that is not an option."""
    first = next((word for word in argv if not word.startswith("-")), None)
    return [first] if first in COMMANDS else []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_named_command(argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # parse_args would report them as the top-level parser's: "moekit: error", its usage line
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        if os.environ.get("MOEKIT_DEBUG", "") not in ("", "0"):
            raise
        print(f"moekit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moekit {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout's reader closed it (moekit demo --json | head): stop quietly, as Python's docs do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would raise it again
        return 1


"""The ``moekit`` command. Each subcommand is a module in this package with
``register(subparsers)``, which adds its parser and sets ``func`` (args -> exit code).

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
import pkgutil
import sys

from moekit.cli._args import UsageError


def _version() -> str:
    try:
        return importlib.metadata.version("moekit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``moekit`` parser and each subcommand's, by name."""
    parser = argparse.ArgumentParser(prog="moekit", description="Mixture-of-Experts layers, exact and explained.")
    parser.add_argument("--version", action="version", version=f"moekit {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser, subparsers.choices


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the deepest subcommand ``args`` chose (``simulate cache``: the cache parser, whose usage and
    name, ``moekit simulate cache``, an unknown flag after it is reported under)."""
    for action in parser._actions:  # argparse keeps its subparsers there: no public accessor
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return _innermost(action.choices[getattr(args, action.dest)], args)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser, commands = _parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # parse_args would report them as the top-level parser's: "moekit: error", its usage line
        _innermost(commands[args.command], args).error(f"unrecognized arguments: {' '.join(unknown)}")
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


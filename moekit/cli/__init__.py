"""The ``moekit`` command. Each subcommand is a module in this package with
``register(subparsers)``, which adds its parser and sets ``func`` (args -> exit code)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekit", description="Mixture-of-Experts layers, exact and explained.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


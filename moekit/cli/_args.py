"""What every subcommand shares: the user-error exception ``main`` reports in one line, the list option,
and argument types that check a value where it is parsed (so a bad one fails before any work, with
argparse's ``moekit <subcommand>: error: argument --flag: ...`` and exit code 2).

    p.add_argument("--batches", action=ListOption, item=positive_int)   # --batches 1 8 64, or 1,8,64
    p.add_argument("--device", type=device_arg)                         # cpu, cuda, cuda:N; present
    p.add_argument("--plot", type=plot_path)                            # matplotlib there, path writable
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable


class UsageError(Exception):
    """A mistake in the command line or in a file it names. ``moekit.cli.main`` prints the message as
    one line, ``moekit <subcommand>: error: <message>``, and exits 2; the message names the flag.
    Anything else raised is a bug and keeps its traceback."""


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except the empty ones (None, False): ``(default: None)``
    after ``--plot`` says nothing a reader can use."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def missing_extra(extra: str, package: str) -> str:
    """The one-line advice for an optional package that is not installed."""
    return f"needs {package}, which is not installed: pip install \"moekit[{extra}]\""


class ListOption(argparse.Action):
    """A list option that takes its values space- or comma-separated, or both: ``--batches 1 8 64``,
    ``--batches 1,8,64``. ``item`` converts one value (raising ``ValueError`` or
    ``argparse.ArgumentTypeError``); a repeated flag adds to the list."""

    def __init__(self, option_strings, dest, item: Callable[[str], Any] = str, **kwargs):
        kwargs.setdefault("metavar", dest.upper())
        super().__init__(option_strings, dest, nargs="+", **kwargs)
        self.item = item

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = []
        for text in (part.strip() for value in values for part in value.split(",")):
            if not text:
                continue
            try:
                items.append(self.item(text))
            except (ValueError, argparse.ArgumentTypeError) as err:
                detail = str(err) if isinstance(err, argparse.ArgumentTypeError) else f"invalid value {text!r}"
                raise argparse.ArgumentError(self, detail) from None
        if not items:
            raise argparse.ArgumentError(self, "expected at least one value")
        current = getattr(namespace, self.dest, None)
        given_before = current is not None and current is not self.default
        setattr(namespace, self.dest, [*current, *items] if given_before else items)


def _int_in(text: str, low: int, high: int, expected: str) -> int:
    """``text`` as an integer in [low, high], or an ``ArgumentTypeError`` saying what was ``expected``."""
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _int_in(text, 1, sys.maxsize, "a positive integer")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fraction_arg(text: str) -> float:
    """A fraction in (0, 1] (a cache size as a share of all experts)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a cache fraction in (0, 1], got {text!r}")
    return value


def seed_arg(text: str) -> int:
    """A seed torch accepts: an integer in [0, 2^63)."""
    return _int_in(text, 0, 2**63 - 1, "an integer in [0, 2^63)")


def device_arg(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, and present in this process: a CPU build of torch or a machine
    with no GPU is told so here rather than by a CUDA traceback halfway through a run."""
    import torch

    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return text
    if kind != "cuda" or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is a CPU build" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        raise argparse.ArgumentTypeError(f"{text} is not available: {why}; use --device cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def port_arg(text: str) -> int:
    return _int_in(text, 0, 65535, "a port number in [0, 65535] (0 picks a free one)")


def writable_file(path: Path) -> None:
    """Raise ``ArgumentTypeError`` unless ``path`` can be created or replaced as a file."""
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {path}: permission denied")


def output_dir(text: str) -> Path:
    """A directory that exists and is writable, or can be made inside the nearest one that does."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write under {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write under {path}: permission denied on {existing}")
    return path


@contextlib.contextmanager
def made_output_dir(path: Path):
    """``--out``'s directory (given, or the default, which ``output_dir`` never sees), made before a run's work: one
    that cannot be made or written (a read-only or special file system: root passes ``output_dir``'s access check
    on /proc, where mkdir fails) stops the run at its start in one line, not at its end with a traceback and the
    results lost. A usage error the run finds inside the block removes the directories this made, while empty."""
    made = [p for p in (path, *path.parents) if not p.exists()]  # what mkdir makes, deepest first
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out: cannot write under {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--out: cannot write under {path}: permission denied")
    try:
        yield path
    except UsageError:
        for p in made:
            if not p.is_dir() or any(p.iterdir()):
                break
            p.rmdir()
        raise


def plot_path(text: str) -> str:
    """An image file name for ``--plot``: matplotlib is installed, the suffix is a format it writes,
    and the file can be written."""
    try:
        import matplotlib  # the package first: when blocked, a cached submodule would still import

        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError(missing_extra("plot", "matplotlib")) from None
    path = Path(text)
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        got = f"suffix .{suffix}" if suffix else "no suffix"
        raise argparse.ArgumentTypeError(f"{text}: {got}; give an image name ending in one of "
                                         f"{', '.join('.' + f for f in sorted(formats))}")
    writable_file(path)
    return text


def save_figure(draw: Callable[[str], None], path: str, *, to_stderr: bool = False) -> None:
    """Call ``draw(path)`` and say ``wrote PATH`` (on stderr when stdout carries JSON); an ``OSError``
    while writing (disk full, permissions changed since parsing) is the user's, not a bug."""
    try:
        draw(path)
    except OSError as err:
        raise UsageError(f"--plot: cannot write {path}: {err.strerror or err}") from err
    print(f"wrote {path}", file=sys.stderr if to_stderr else sys.stdout)


def working(what: str):
    """A spinner on stderr while a run works (``moekit simulate``'s exercises 10-25 s on a 2-core CPU, ``analyze
    --measure`` 17 s: silent before); ``.update(text)`` changes what it says. rich draws it on a terminal only, so
    pipes and ``--json`` output stay clean."""
    from rich.console import Console

    return Console(stderr=True).status(f"{what} ...")

"""Progress of the walks over a model's MoE blocks that take minutes on a large model (``use_moekit_blocks`` with
``quant=``, ``offload_experts``: DeepSeek-V3's 58 blocks, each quantized or copied to host memory).

Both take ``progress``: None (the default) writes a line on stderr when stderr is a terminal and nothing otherwise
(a pipe, a log, a notebook's captured stream stay clean); True writes it wherever stderr goes; False nothing; a
callable is called as ``progress(done, total)`` after each block (1..total), and nothing is written. The line is
plain text, rewritten in place on a terminal (``\\r``) and one line a block elsewhere; the CLI's rich displays draw
on a terminal only and leave nothing behind, which ``True`` into a log would lose.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Iterator, Sequence, TypeVar, Union

Progress = Union[bool, None, Callable[[int, int], None]]  # the ``progress`` argument's type
T = TypeVar("T")


def block_progress(progress: Progress, what: str) -> Callable[[int, int], None] | None:
    """The ``(done, total)`` callback ``progress`` asks for (None: nothing to report), checked before any block
    changes; ``what`` names the walk on the line (``use_moekit_blocks``)."""
    if progress is None:
        isatty = getattr(sys.stderr, "isatty", None)
        return StderrLine(what) if isatty is not None and isatty() else None
    if progress is True:
        return StderrLine(what)
    if progress is False:
        return None
    if callable(progress):
        return progress
    raise TypeError(f"progress must be None (a line on a terminal), True, False or a callable(done, total), got "
                    f"{type(progress).__name__}")


def reported(blocks: Sequence[T], report: Callable[[int, int], None] | None) -> Iterator[T]:
    """``blocks`` one by one, calling ``report(i, len(blocks))`` once the loop has finished the i-th (1-based): when
    it asks for the next one, so a ``continue`` counts too."""
    for i, block in enumerate(blocks, 1):
        yield block
        if report is not None:
            report(i, len(blocks))


class StderrLine:
    """``<what>: block <done>/<total> (<s> s)`` on stderr: rewritten in place on a terminal, a line each elsewhere."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        stream = sys.stderr  # read at each call: a caller (or a test) may have replaced it
        isatty = getattr(stream, "isatty", None)
        terminal = isatty is not None and isatty()
        text = f"{self.what}: block {done}/{total} ({time.perf_counter() - self.start:.0f} s)"
        stream.write(("\r" + text + ("\n" if done == total else "")) if terminal else text + "\n")
        stream.flush()

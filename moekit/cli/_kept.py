"""A long command's results kept on disk while it runs, and said where on a Ctrl-C.

``moekit bench`` (the kernel cells) kept ``<results>.partial.json`` since session 44; session 53 found
``bench --offload`` and ``bench --cpu-experts`` (minutes each) losing every row to a Ctrl-C, saying only
"interrupted". ``KeptRun`` is the one way each of them keeps the document so far and names it.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moekit.bench.report import write_json, write_partial


@dataclass
class KeptRun:
    """One run's results file and the partial document beside it while it runs."""

    command: str  # the line's prefix: "moekit bench --offload"
    what: str  # what a partial holds, in words: "the rows measured"
    path_of: Callable[[dict], Path]  # the results path of a document: chosen once, at the first keep (or the end)
    path: Path | None = None
    partial: Path | None = None  # <path stem>.partial.json, once a step was kept; removed by finish

    def keep(self, doc: dict) -> None:
        """After each step: ``doc`` (the run so far) replaces the partial file, marked ``"partial": True``."""
        if self.path is None:
            self.path = self.path_of(doc)
        self.partial = write_partial({**doc, "partial": True}, self.path)

    @contextlib.contextmanager
    def interruptible(self):
        """Around the run: a Ctrl-C (``KeyboardInterrupt``, which the CLI turns into exit status 130) first says
        where the steps done are, or that none was."""
        try:
            yield
        except KeyboardInterrupt:
            said = (f"{self.what} before the interruption are in {self.partial}" if self.partial is not None else
                    "nothing written (interrupted before its first result)")
            print(f"{self.command}: {said}", file=sys.stderr)
            raise

    def finish(self, doc: dict) -> Path:
        """The run's document written to its results path (never over another file); the partial file removed."""
        path = write_json(doc, self.path or self.path_of(doc))
        if self.partial is not None:
            self.partial.unlink(missing_ok=True)
        return path

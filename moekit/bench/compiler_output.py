"""Compiler output kept out of the console while ``moekit tune`` searches configs.

Triton's MLIR passes print a kernel that fails to compile (its whole IR and a reproducer, hundreds of lines) from C++
straight to file descriptor 2, past Python's ``sys.stderr``. The tuner times such a config as failed and goes on, so
that output is not an error of the run: ``stderr_to`` sends file descriptor 2 to a log file while a batch size is
tuned, and the tuner says how many configs failed and where their output is.

    with stderr_to(path): ...  # fd 2 (C, C++ and Python writes alike) appended to path, restored after
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path


@contextlib.contextmanager
def stderr_to(path: Path):
    """Inside, whatever is written to file descriptor 2 is appended to ``path`` (created with its directory); fd 2
    is restored on the way out, also on an exception."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)

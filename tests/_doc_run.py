"""Run one docs section's Python examples and its check (``test_docs.py``), in this process or, for a section
marked ``<!-- test: ranks N -->``, on N gloo ranks spawned on loopback (``_parallel_harness``), each rank
running the section's blocks as a ``torchrun`` process runs the reader's script."""

from __future__ import annotations

import contextlib
import io
import os

from moekit.experts.cpu_phased import one_thread

import _doc_checks
from _doc_setups import SETUPS
from _doc_text import Block, blocks


def section_blocks(doc: str, section: str) -> list[Block]:
    return [b for b in blocks(doc) if b.lang == "python" and b.section == section]


def ranks_of(doc: str, section: str) -> int:
    """The rank count a section asks for (1 when it asks for none)."""
    asked = [int(d.value) for b in section_blocks(doc, section) for d in b.directives if d.kind == "ranks"]
    return max(asked, default=1)


def run_section(doc: str, section: str) -> str:
    """Run the section's blocks in order in one namespace, after their setups and with their substitutions
    (``no-run`` blocks only compile), then its check; returns what the blocks printed."""
    namespace, printed = {"__name__": "__doc_example__"}, io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(one_thread())  # small ops: on a loaded 2-core host 2 threads took 2-7x the CPU
        for block in section_blocks(doc, section):
            for directive in block.directives:
                if directive.kind == "setup":
                    assert directive.value in SETUPS, f"{doc}:{block.line}: no setup {directive.value!r}"
                    namespace.update(stack.enter_context(SETUPS[directive.value]()))
            code = compile(block.source(), f"{doc}:{block.line}", "exec")
            if "no-run" not in block.tags:
                with contextlib.redirect_stdout(printed):
                    exec(code, namespace)  # noqa: S102 - the docs' own examples
        assert section in _doc_checks.CHECKS, f"{doc}: section {section!r} has examples but no check in _doc_checks"
        _doc_checks.CHECKS[section](namespace, printed.getvalue())
    return printed.getvalue()


def run_section_on_rank(rank: int, world_size: int, doc: str, section: str) -> str:
    """``run_section`` on one rank of a gloo group the harness made (what torchrun's environment gives a script)."""
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    return run_section(doc, section)

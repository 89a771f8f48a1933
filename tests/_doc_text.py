"""The user-facing docs (README.md, benchmarks/README.md, docs/*.md) read as data for ``test_docs.py`` and
``test_docs_names.py``: fenced blocks with their section and test directives, inline code spans, and the
commands of the shell blocks.

A directive is an HTML comment (invisible when rendered) on the lines right before a fence:

    <!-- test: setup NAME -->          run _doc_setups.SETUPS[NAME] first: the names the prose says the reader has
    <!-- test: substitute OLD => NEW --> replace the text OLD by NEW before running (real sizes or a GPU -> tiny, CPU)
    <!-- test: ranks N -->             run the section on N gloo ranks (CPU processes), as torchrun would

and a fence tagged ```python no-run is only compiled (it needs what a test cannot have: several GPUs).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "benchmarks/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
BENCHMARK_TABLE = "benchmarks/README.md"  # one row per script of benchmarks/

FENCE = re.compile(r"^```(.*)$")
DIRECTIVE = re.compile(r"^<!-- test: (setup|substitute|ranks) (.+?) -->$")
HEADING = re.compile(r"^## (.+)$")


@dataclass(frozen=True)
class Directive:
    kind: str  # "setup", "substitute" or "ranks"
    value: str  # the setup's name, "OLD => NEW", or the rank count


@dataclass(frozen=True)
class Block:
    """One fenced block."""

    doc: str  # the file, relative to the repository: "README.md", "docs/parallel.md"
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word ("python", "bash"; "" for a plain block)
    tags: tuple[str, ...]  # the info string's other words ("no-run",)
    section: str  # the enclosing level-2 heading: its blocks share one namespace when run
    text: str
    directives: tuple[Directive, ...]  # the test directives on the lines right before the fence

    def source(self) -> str:
        """The text with this block's substitutions made; each OLD must occur (a stale one fails)."""
        text = self.text
        for d in self.directives:
            if d.kind == "substitute":
                old, new = d.value.split(" => ")
                if old not in text:
                    raise AssertionError(f"{self.doc}:{self.line}: substitute {old!r} does not occur in the block")
                text = text.replace(old, new)
        return text


@dataclass(frozen=True)
class Span:
    """One inline code span outside fenced blocks (it may run over a line break)."""

    doc: str
    line: int  # where it starts
    text: str  # whitespace runs (line breaks too) collapsed to one space


@dataclass(frozen=True)
class Command:
    """One command of a shell block or an inline span: its words, as the shell splits them."""

    doc: str
    line: int
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {' '.join(self.words)}"


@cache
def blocks(doc: str) -> tuple[Block, ...]:
    found, section, pending, opened = [], "", [], None
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if opened is not None:  # inside a block: collect until the closing fence
            if fence:
                start, lang, tags, directives, body = opened
                found.append(Block(doc, start, lang, tags, section, "".join(f"{b}\n" for b in body), directives))
                opened = None
            else:
                opened[4].append(line)
        elif fence:
            words = fence.group(1).split() or [""]
            opened = (number, words[0], tuple(words[1:]), tuple(pending), [])
        elif heading := HEADING.match(line):
            section = heading.group(1)
        if directive := DIRECTIVE.match(line):
            pending.append(Directive(*directive.groups()))
        elif not fence or opened is None:
            pending = []
    return tuple(found)


@cache
def spans(doc: str) -> tuple[Span, ...]:
    """Inline code spans, fenced blocks blanked out first (line numbers kept)."""
    lines = (ROOT / doc).read_text().splitlines()
    for block in blocks(doc):
        for i in range(block.line - 1, block.line + block.text.count("\n") + 1):
            lines[i] = ""
    text = "\n".join(lines)
    return tuple(Span(doc, text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
                 for m in re.finditer(r"`([^`]+)`", text))


def shell_commands(block: Block) -> list[Command]:
    """The commands of a shell block: continued lines joined, comments dropped, ``a && b`` split."""
    commands, pending, start = [], "", 0
    for number, line in enumerate(block.text.splitlines(), block.line + 1):
        start = start or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending = ""
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            commands.append(Command(block.doc, start, tuple(words[:cut])))
            words = words[cut + 1:]
        start = 0
    return commands


def all_commands() -> list[Command]:
    """Every command of every shell block, and every inline span that is a whole ``moekit <subcommand>``
    line (optional parts ``[--flag value]`` taken as given)."""
    found = [c for doc in DOCS for b in blocks(doc) if b.lang in ("bash", "sh", "shell") for c in shell_commands(b)]
    for doc in DOCS:
        for span in spans(doc):
            if re.match(r"moekit [a-z]", span.text):
                found.append(Command(doc, span.line, tuple(shlex.split(span.text.replace("[", "").replace("]", "")))))
    return found

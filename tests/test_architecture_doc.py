"""docs/architecture.md's module map holds to the tree: every ``.py`` file under ``moekit/`` has one row, every
row's stages are the page's own stage table's (and each of those is used), every ``moekit/`` path the page names
exists, and a file a row names on its own (``route.py``, ``_kernels/gate_kernel.py``) is in the row's package or
one above it. The checks read the page as text and report every offender at once; the names of the code the page
mentions are ``test_docs_names.py``'s, its links and flags ``test_docs.py``'s."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

import pytest

from _doc_text import ROOT

PAGE = "docs/architecture.md"
ROW = re.compile(r"^\| `(moekit/[^`]+)` \| ([^|]+) \| (.+) \|$")  # | `moekit/x/y.py` | stage, stage | owns |
PATH = re.compile(r"(?<![\w./-])moekit/[\w./-]*")  # a repository path: moekit/routing/, moekit/layer.py
FILE_NAME = re.compile(r"`((?!moekit/)(?:\w+/)?\w+\.py)`")  # a row's mention of a file: `_kernels/gemm.py`


@dataclass(frozen=True)
class MapRow:
    """One row of the map: a module, the stages it serves, what it owns."""

    line: int  # 1-based line of the page
    path: str  # relative to the repository: "moekit/routing/route.py"
    stages: tuple[str, ...]  # ("group", "combine")
    owns: str  # the third cell, as written


def map_rows(text: str) -> list[MapRow]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if match := ROW.match(line):
            stages = tuple(s.strip() for s in match.group(2).split(","))
            rows.append(MapRow(number, match.group(1), stages, match.group(3)))
    return rows


def stage_names(text: str) -> set[str]:
    """The first column of the table under the page's "## Stages" heading (its header row aside)."""
    section = re.search(r"^## Stages[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    body = section.group(1).split("| --- |", 1)[-1] if section else ""
    return set(re.findall(r"^\| ([a-z]+) \|", body, re.M))


def module_files(root) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / "moekit").rglob("*.py")}


def problems(text: str, root) -> list[str]:
    """Everything wrong with the page ``text`` against the tree at ``root``, one line each."""
    rows, stages, files = map_rows(text), stage_names(text), module_files(root)
    found = [f"{PAGE}: no stage table under '## Stages'"] if not stages else []
    mapped = [row.path for row in rows]
    found += [f"{PAGE}: moekit module with no row in the map: {path}" for path in sorted(files - set(mapped))]
    found += [f"{PAGE}:{row.line}: the map names {row.path} twice" for row in rows if mapped.count(row.path) > 1
              and mapped.index(row.path) != rows.index(row)]
    found += [f"{PAGE}:{row.line}: {row.path}: stage {stage!r} is not in the stage table {sorted(stages)}"
              for row in rows for stage in row.stages if stages and stage not in stages]
    used = {stage for row in rows for stage in row.stages}
    found += [f"{PAGE}: stage {stage!r} of the stage table has no row" for stage in sorted(stages - used)]
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"{PAGE}:{number}: {path} does not exist" for path in PATH.findall(line)
                  if not (root / path.rstrip(".")).exists()]
    for row in rows:
        packages = PurePosixPath(row.path).parents
        found += [f"{PAGE}:{row.line}: {row.path} names {name}, which is not in its package or one above it"
                  for name in FILE_NAME.findall(row.owns)
                  if not any((root / package / name).is_file() for package in packages if str(package) != ".")]
    return found


def test_the_module_map_is_the_tree():
    text = (ROOT / PAGE).read_text()
    assert len(map_rows(text)) == len(module_files(ROOT)) > 200  # the map is read at all (a changed row format)
    found = problems(text, ROOT)
    assert not found, "docs/architecture.md against the tree:\n" + "\n".join(found)


STAGES = "## Stages\n\n| stage | what |\n| --- | --- |\n| route | r |\n| group | g |\n\n## The map\n\n"
A, C = "| `moekit/a.py` | route | x |\n", "| `moekit/b/c.py` | group | x |\n"  # the two modules' right rows


@pytest.mark.parametrize("rows, wanted", [
    (A + C, []),
    (A, ["no row in the map: moekit/b/c.py", "stage 'group' of the stage table has no row"]),
    (A + C.replace("group", "group, experts"), ["stage 'experts' is not in"]),
    (A + C + A, ["names moekit/a.py twice"]),
    (A + C + "| `moekit/b/gone.py` | group | x |\n", ["moekit/b/gone.py does not exist"]),
    (A + C.replace("| x |", "| twin `a.py`, `d.py` |") + "see `moekit/b/`, moekit/e/",
     ["names d.py, which is not", "moekit/e/ does not exist"]),
])
def test_the_map_check_finds_what_is_wrong(rows, wanted, tmp_path):
    """On a tree of two modules (moekit/a.py, moekit/b/c.py): a complete page passes, and each kind of fault is
    reported, all of them in one go."""
    (tmp_path / "moekit" / "b").mkdir(parents=True)
    (tmp_path / "moekit" / "a.py").write_text("")
    (tmp_path / "moekit" / "b" / "c.py").write_text("")
    found = problems(STAGES + rows, tmp_path)
    assert len(found) == len(wanted) and all(any(w in f for f in found) for w in wanted), found

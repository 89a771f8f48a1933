"""Every name of the code the docs (``_doc_text.DOCS``) mention in backticks is there: ``moekit.x.y`` imports and
resolves, ``module.name`` (a moekit module's basename, ``triton_lean.BATCHED``) and ``Class.name``
(``LaunchOptions.align_fold_max``, a class defined in moekit) resolve too, a call's keywords are parameters of
what it calls, ALL_CAPS names are words of the source, and the README's code layout and import direction are
the tree's. The docs' variables that share a module's name (``ep.rebalance``, ``report.left``) and file names
(``cost.py``) are not names of the code."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from pathlib import Path

import pytest

from _doc_text import DOCS, ROOT, blocks, spans

DOC_VARIABLES = frozenset({"ep", "stats", "report", "model", "config", "ceilings", "layer", "cache", "moe"})
FILE_SUFFIXES = frozenset({"py", "json", "md", "log", "png", "html", "csv"})


MISSING = object()


def lookup(name: str):
    """What ``name`` imports as: a module, or a module followed by a chain of attributes; MISSING if nothing."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, MISSING)
            if obj is MISSING:
                break
        return obj
    return MISSING


def resolves(name: str) -> bool:
    return lookup(name) is not MISSING


@cache
def modules_by_basename() -> dict[str, tuple[str, ...]]:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "moekit").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts[-1] != "__main__":
            found.setdefault(parts[-1], []).append(".".join(parts))
    return {name: tuple(modules) for name, modules in found.items()}


@cache
def classes_by_name() -> dict[str, tuple[str, ...]]:
    """Each class defined at the top of a moekit module: the modules that define one of that name."""
    found: dict[str, list[str]] = {}
    for modules in modules_by_basename().values():
        for module in modules:
            path = ROOT.joinpath(*module.split("."))
            path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(module)
    return {name: tuple(modules) for name, modules in found.items()}


def class_has(module: str, name: str, attr: str) -> bool:
    """A class attribute, or an instance attribute its source assigns or annotates (``self.last_cpu = ...``)."""
    cls = getattr(importlib.import_module(module), name)
    if hasattr(cls, attr):
        return True
    source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("moekit"))
    return re.search(rf"(self\.{attr}\s*(:[^=\n]+)?=|^\s+{attr}\s*:)", source, re.M) is not None


def qualified_name_ok(head: str, attr: str) -> bool | None:
    """None when ``head.attr`` is not a name of the code (a variable, a file), else whether it resolves."""
    if head in DOC_VARIABLES or attr in FILE_SUFFIXES:
        return None
    if head in modules_by_basename():
        return any(resolves(f"{module}.{attr}") for module in modules_by_basename()[head]) or resolves(f"{head}.{attr}")
    if head in classes_by_name():
        return any(class_has(module, head, attr) for module in classes_by_name()[head])
    return None


def names(pattern: str) -> list[tuple[str, int, tuple[str, ...]]]:
    return [(s.doc, s.line, m) for doc in DOCS for s in spans(doc) for m in re.findall(pattern, s.text)]


def test_every_moekit_name_resolves():
    found = names(r"(?<![\w.])(moekit(?:\.\w+)+)")
    assert len(found) > 50
    bad = sorted({f"{doc}:{line}: {name}" for doc, line, name in found if not resolves(name)})
    assert not bad, "names that do not import or resolve:\n" + "\n".join(bad)


def test_every_module_or_class_qualified_name_resolves():
    found = names(r"(?<![\w.])([A-Za-z_]\w*)\.([A-Za-z_]\w*)")
    checked = [(doc, line, pair) for doc, line, pair in found if pair[0] != "moekit"]
    verdicts = [(doc, line, pair, qualified_name_ok(*pair)) for doc, line, pair in checked]
    assert sum(v is not None for *_, v in verdicts) > 50
    bad = sorted({f"{doc}:{line}: {'.'.join(pair)}" for doc, line, pair, ok in verdicts if ok is False})
    assert not bad, "names of moekit modules or classes that do not resolve:\n" + "\n".join(bad)


@pytest.mark.parametrize("head, attr, ok", [
    ("triton_lean", "BATCHED", True), ("triton_lean", "NO_SUCH", False), ("LaunchOptions", "align_fold_max", True),
    ("OffloadedMoE", "last_cpu", True), ("OffloadedMoE", "no_such", False), ("ep", "rebalance", None),
    ("cost", "py", None), ("moekit", "hf", True),
])
def test_qualified_names_are_judged(head, attr, ok):
    assert (resolves(f"{head}.{attr}") if head == "moekit" else qualified_name_ok(head, attr)) is ok


OTHER_TOOLS_ENV = ("NCCL_", "GLOO_", "OMP_", "TORCH_", "CUDA_", "PYTHON")  # what torch, NCCL, OpenMP, Python read


def test_every_constant_and_environment_variable_is_in_the_code():
    """A bare ALL_CAPS span (``REUSE_MAX_BYTES``, ``AHEAD``, ``$MOEKIT_CONFIG_DIR``, ``MOEKIT_DEBUG=1``) is a word of
    moekit's or the benchmarks' source: a constant, a kernel parameter or an environment variable they read."""
    source = "\n".join(p.read_text() for d in ("moekit", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    found = names(r"^\$?([A-Z][A-Z0-9]*_?[A-Z0-9_]*)(?:=\S*)?$")
    assert len(found) >= 5
    bad = sorted({f"{doc}:{line}: {name}" for doc, line, name in found
                  if len(name) > 1 and not name.startswith(OTHER_TOOLS_ENV) and not re.search(rf"\b{name}\b", source)})
    assert not bad, "constants or environment variables moekit does not have:\n" + "\n".join(bad)


def test_the_import_direction_is_test_structure_s():
    """The README's "Imports point down only": its chain, level by level, analysis's imports and the sideways
    edges are the ones tests/test_structure.py holds the code to (private modules and the entry point aside)."""
    from test_structure import ANALYSIS_MAY_IMPORT, LEVELS, SIDEWAYS_ALLOWED

    readme = " ".join((ROOT / "README.md").read_text().split())
    chain = re.search(r"Imports point down only: `([^`]+)`", readme).group(1)
    levels: dict[int, set[str]] = {}
    for name, level in LEVELS.items():
        if not name.startswith(("_", "<")) and name != "analysis":
            levels.setdefault(level, set()).add(name)
    assert [set(level.split(", ")) for level in chain.split(" → ")] == [levels[n] for n in sorted(levels)[::-1]]
    analysis = re.search(r"`analysis → ([^`]+)`", readme).group(1)
    assert set(analysis.split(", ")) == ANALYSIS_MAY_IMPORT - {"analysis"}
    sideways = re.search(r"sideways edges: ([^)]+)\)", readme).group(1)
    assert set(re.findall(r"(\w+) → (\w+)", sideways)) == SIDEWAYS_ALLOWED


def test_the_code_layout_names_every_top_level_module():
    """The README's "Layout of the code" map: each entry's paths exist, and every module and package at the top
    of moekit/ has an entry (a new one goes on the map)."""
    layout = next(b for b in blocks("README.md") if b.section == "Layout of the code").text
    entries = [line for line in layout.splitlines() if line.startswith(("moekit/", "benchmarks/"))]
    heads = [re.split(r"\s{2,}", line)[0] for line in entries]
    named = set()
    for head in heads:
        first, *rest = head.split(", ")
        base = ROOT / first if first.endswith("/") else (ROOT / first).parent
        assert (ROOT / first).exists() and all((base / r).exists() for r in rest), head
        named |= {Path(p).stem for p in (first, *rest)} | {Path(first).name}
    top = {p.stem for p in (ROOT / "moekit").iterdir()
           if (p.suffix == ".py" or p.is_dir()) and not p.name.startswith("__")}
    assert not top - named, f"top-level moekit modules the layout does not name: {sorted(top - named)}"


def callee(func: ast.expr):
    """The moekit object a call in the docs names: ``moekit.x.f``, a class defined in moekit or its method,
    ``module.f`` of a moekit module's basename, or a name ``moekit`` exports; MISSING for anything else."""
    rest = []
    while isinstance(func, ast.Attribute):
        rest.insert(0, func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id in DOC_VARIABLES:
        return MISSING
    head = func.id
    if head == "moekit":
        names = [".".join([head, *rest])]
    elif head in classes_by_name():
        names = [".".join([module, head, *rest]) for module in classes_by_name()[head]]
    elif head in modules_by_basename() and rest:
        names = [".".join([module, *rest]) for module in modules_by_basename()[head]]
    else:
        names = [".".join(["moekit", head, *rest])]
    return next((obj for obj in map(lookup, names) if obj is not MISSING), MISSING)


def keyword_parameters(obj) -> set[str] | None:
    """The keywords ``obj`` accepts; None when it is not a callable with a signature or takes ``**kwargs``."""
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return None
    return None if any(p.kind is p.VAR_KEYWORD for p in params.values()) else set(params)


def test_every_keyword_the_docs_pass_is_a_parameter():
    """A call in a span (``MoE(cfg, eager_graph_rows=64)``, ``moekit.balance.update_correction_bias_(moe, counts,
    rate=1e-3)``) to a moekit callable passes only keywords its signature has."""
    checked, bad = 0, []
    for doc in DOCS:
        for span in spans(doc):
            try:
                tree = ast.parse(span.text, mode="eval")
            except SyntaxError:
                continue
            for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
                obj = callee(call.func)
                params = keyword_parameters(obj) if obj is not MISSING else None
                checked += params is not None
                bad += [f"{doc}:{span.line}: {kw.arg}= in `{span.text}`" for kw in call.keywords
                        if params is not None and kw.arg and kw.arg not in params]
    assert checked >= 25
    assert not bad, "keywords the called function does not take:\n" + "\n".join(bad)

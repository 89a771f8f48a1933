"""The shape of the code, read with ``ast`` (nothing is imported): the import direction of design.md,
private modules kept to their package, and the size limits of style.md ("functions that fit on a
screen", "one concern per file").

design.md's picture, top to bottom (arrows point down only):

    cli ──▶ bench, sim, demo, train ──▶ offload, parallel, hf ──▶ layer ──▶ experts, quant, layouts, routing,
    losses, balance ──▶ config, presets, activations;   analysis ──▶ config, presets
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moekit"

# Level of each top-level module or package of moekit: an import may stay in its own package or go to
# a strictly lower level, never up, and sideways only where SAME_LEVEL_ALLOWED says: the stages of
# level 1 use each other's public modules (design.md: "one public grouping module that every stage
# uses"; their internals are the private-module rule's), and config.py reads presets.py.
LEVELS = {
    "__main__": 6,  # ``python -m moekit``: the entry point, the one module above the cli
    "cli": 5,
    "bench": 4, "sim": 4, "demo": 4, "train": 4,
    "offload": 3, "parallel": 3, "hf": 3,
    "<root>": 2, "layer": 2,  # ``import moekit`` runs moekit/__init__.py, which imports the layer
    "layer_fast": 2,  # the layer's decode fast path: reads the layer's state, imported by it only
    "layer_hash": 2,  # HashMoE, the layer routed by a token-id table: a subclass of the layer's MoE
    "layer_hash_fast": 2,  # HashMoE's decode fast path: imported by layer_hash only, built on layer_fast's parts
    "experts": 1, "quant": 1, "layouts": 1, "routing": 1, "losses": 1, "balance": 1,
    "layer_repr": 1,  # the line print(moe) shows, from the config alone: imported by the layer, imports config only
    "config": 0, "presets": 0, "activations": 0, "_checks": 0, "_bounded": 0, "triton_bind": 0,
    "eager_graphs": 0, "batch_launch": 0, "func_ops": 0,
    "config_hf": 0,  # from_hf_config's readers (design.md's config.py row), imported by config only
    "config_hf_clamps": 0,  # a layer's per-layer SwiGLU clamps, imported by config and moekit.hf
    "config_hf_v4": 0,  # DeepSeek-V4's reader, split from config_hf (its size limit); imported by config_hf and hf
    "config_hf_fields": 0,  # the readers' config dict and its missing-field error, split from config_hf (size limit)
    "config_hf_refused": 0,  # the families from_hf_config refuses and why, split from config_hf (its size limit)
    "analysis": 3,  # imported by bench and sim; itself imports only ANALYSIS_MAY_IMPORT
}
SAME_LEVEL_ALLOWED = {0, 1}
# Single sideways edges at other levels, one direction only: the benchmarks replay the simulator's
# routing streams (``bench.offload_measure``), and transformers interop wraps a model's blocks into
# offloaded layers (``hf.offload``), and the layer keeps its decode fast path in a module of its own
# (``layer_fast``), and ``HashMoE`` subclasses it (``layer_hash``) and keeps its own fast path beside it
# (``layer_hash_fast``, on ``layer_fast``'s checks and experts step); no target imports its source back.
SIDEWAYS_ALLOWED = {("bench", "sim"), ("hf", "offload"), ("layer", "layer_fast"), ("layer_hash", "layer"),
                    ("layer_hash", "layer_hash_fast"), ("layer_hash_fast", "layer_fast")}
ANALYSIS_MAY_IMPORT = {"analysis", "config", "presets"}
ABOVE_THE_LIBRARY = {"bench", "cli", "sim", "demo", "train"}
CLI_ENTRY_POINTS = {"moekit.__main__"}  # the one module outside cli that runs it

MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_LINE_CHARS = 120  # style.md's columns, counted in characters (a "µ" is one), not bytes
SIZED_DIRS = ("moekit", "tests", "benchmarks")
SIZED_SUFFIXES = (".py", ".js", ".html", ".css")  # source; JSON configs and results are data


@dataclass(frozen=True)
class Import:
    """One ``import`` or ``from ... import`` edge from a moekit module to a moekit module."""

    source: str  # the importing module, e.g. "moekit.bench.run"
    target: str  # the imported module, or a private name in it ("moekit.experts.triton._launch")
    line: int  # where in the source file

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


@cache
def imports() -> tuple[Import, ...]:
    """Every moekit -> moekit import under moekit/, function-level (lazy) imports included."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = module_name(path)
        package = source if is_package(path) else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against the importing package
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            else:
                continue
            edges += [Import(source, _resolve(t), node.lineno) for t in targets if t.split(".")[0] == "moekit"]
    return tuple(dict.fromkeys(edges))  # ``from m import a, b`` names m once


def _resolve(target: str) -> str:
    """The module a dotted target names (``moekit.experts.get_backend`` -> ``moekit.experts``), or the
    target itself when it is a private name inside a module (the private-module rule reads it)."""
    module = target
    while module not in real_modules() and "." in module:
        module = module.rpartition(".")[0]
    name = target[len(module) + 1:].split(".")[0]
    return target if name.startswith("_") else module


@cache
def real_modules() -> frozenset[str]:
    return frozenset(module_name(p) for p in PACKAGE.rglob("*.py"))


def top(module: str) -> str:
    """The top-level module or package of moekit a dotted name lives in ("<root>" for moekit itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def test_every_package_has_a_level():
    tops = {top(module_name(p)) for p in PACKAGE.rglob("*.py")}
    missing = sorted(tops - LEVELS.keys())
    assert not missing, f"moekit modules with no place in design.md's picture (add them to LEVELS): {missing}"


def test_imports_point_down():
    bad = []
    for edge in imports():
        src, dst = top(edge.source), top(edge.target)
        if src == dst or src not in LEVELS or dst not in LEVELS or edge.source == "moekit":
            continue  # within a package; unknown names fail the test above; the root re-exports the API
        if src == "analysis" and dst not in ANALYSIS_MAY_IMPORT:
            bad.append(f"{edge} (analysis imports only {sorted(ANALYSIS_MAY_IMPORT)})")
        elif LEVELS[dst] > LEVELS[src] or (LEVELS[dst] == LEVELS[src] and LEVELS[src] not in SAME_LEVEL_ALLOWED
                                           and (src, dst) not in SIDEWAYS_ALLOWED):
            bad.append(f"{edge} ({src} is level {LEVELS[src]}, {dst} level {LEVELS[dst]})")
    assert not bad, "imports against design.md's direction:\n" + "\n".join(bad)


def test_library_never_imports_the_tools_above_it():
    bad = [str(e) for e in imports()
           if top(e.source) not in ABOVE_THE_LIBRARY | {"__main__"} and top(e.target) in ABOVE_THE_LIBRARY]
    assert not bad, "library modules importing bench/cli/sim/demo/train:\n" + "\n".join(bad)


def test_nothing_imports_the_cli():
    bad = [str(e) for e in imports()
           if top(e.target) == "cli" and top(e.source) != "cli" and e.source not in CLI_ENTRY_POINTS]
    assert not bad, "modules importing moekit.cli (only the entry point may):\n" + "\n".join(bad)


def private_owner(module: str) -> str | None:
    """The package that owns the first private part of ``module`` (``moekit.layouts._grouping`` ->
    ``moekit.layouts``), or None when no part is private. A private name inside a plain module
    (``moekit.experts.triton._launch``) belongs to that module's package."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            owner = ".".join(parts[:i])
            return owner if owner in _packages() else owner.rpartition(".")[0]
    return None


@cache
def _packages() -> frozenset[str]:
    return frozenset(module_name(p) for p in PACKAGE.rglob("__init__.py"))


def test_private_modules_stay_in_their_package():
    bad = []
    for edge in imports():
        owner = private_owner(edge.target)
        if owner is not None and edge.source != owner and not edge.source.startswith(owner + "."):
            bad.append(f"{edge} (private to {owner})")
    assert not bad, "private modules or names imported from outside their package:\n" + "\n".join(bad)


def sized_files() -> list[Path]:
    return sorted(p for d in SIZED_DIRS for p in (ROOT / d).rglob("*")
                  if p.suffix in SIZED_SUFFIXES and "__pycache__" not in p.parts)


def test_files_fit():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sized_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long)


def test_functions_fit_on_a_screen():
    long = []
    for path in sized_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # from ``def`` to the last line; decorators not counted
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_lines_fit():
    long = [f"{p.relative_to(ROOT)}:{i}: {len(line)} characters" for p in sized_files() if p.suffix == ".py"
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > MAX_LINE_CHARS]
    assert not long, f"lines over {MAX_LINE_CHARS} characters:\n" + "\n".join(long)


@pytest.mark.parametrize("module, owner", [
    ("moekit.layouts._grouping", "moekit.layouts"),
    ("moekit.experts._kernels.gemm", "moekit.experts"),
    ("moekit.experts.triton._launch", "moekit.experts"),
    ("moekit.experts.triton", None),
    ("moekit.__main__", None),
])
def test_private_owner(module, owner):
    assert private_owner(module) == owner

"""The docs (README.md, benchmarks/README.md, docs/*.md) hold to the code: every Python example runs and what it
computes or prints is checked; every ``moekit``/``torchrun``/``python -m moekit`` command line parses with the
real parser; every ``--flag`` the prose names exists; every repository path and relative link is there; the
quick start's test command is CI's and its demo output the demo's; the lists the README spells out (extras,
presets, GPUs, benchmark scripts) are the code's. How the docs mark what a CPU test cannot run:
``_doc_text.py``. Names of the code: ``test_docs_names.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re

import pytest
import torch
import torch.distributed.run as torchrun
from rich.console import Console

from moekit import preset_names
from moekit.analysis.gpus import gpu_names
from moekit.bench.ep import build_parser as ep_parser
from moekit.cli import build_parser
from moekit.cli.demo import print_report
from moekit.config_hf import HF_READERS
from moekit.demo import run_demo
from moekit.experts.cpu_phased import one_thread

from _doc_run import ranks_of, run_section, run_section_on_rank
from _doc_text import BENCHMARK_TABLE, DOCS, ROOT, all_commands, blocks, spans
from _parallel_harness import run_ranks

SECTIONS = sorted({(b.doc, b.section) for doc in DOCS for b in blocks(doc) if b.lang == "python"})

# Words of the docs' commands that stand for the reader's own values (prose like "--link-gbps B").
PLACEHOLDERS = {"$NODE_RANK": "0", "B": "25", "C": "64", "G": "20", "S": "300"}
# Files a command's parser requires to exist (``moekit tune --install FILE``): made empty in the test's cwd.
FILES_READ = ("E256_N2048_K7168_fp8_block_NVIDIA_H200.json",)


@pytest.mark.parametrize("doc, section", SECTIONS, ids=[f"{d}:{s[:40]}" for d, s in SECTIONS])
def test_python_examples_run_and_compute_what_they_say(doc, section, monkeypatch, tmp_path):
    """A section's blocks run in order in one namespace, in this process or on the ranks it asks for, and
    its check (``_doc_checks``) holds the results against a reference."""
    monkeypatch.chdir(tmp_path)
    ranks = ranks_of(doc, section)
    printed = run_ranks(run_section_on_rank, ranks, doc, section) if ranks > 1 else [run_section(doc, section)]
    assert len(printed) == ranks


def _words(words: tuple[str, ...]) -> list[str]:
    for word in words:
        assert not re.search(r"<[^>]*>", word) or word in PLACEHOLDERS, f"placeholder {word!r} not in PLACEHOLDERS"
    return [PLACEHOLDERS.get(w, w) for w in words]


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _parses(parser: argparse.ArgumentParser, argv: list[str]) -> str:
    """'' when ``argv`` parses, else argparse's message. Flags are taken whole: a doc's ``--hf-impl`` is not
    argparse's abbreviation of ``--hf-impls``, it is a flag that does not exist."""
    for each in _parsers(parser):
        each.allow_abbrev = False
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return ""


def _module_parser(module: str) -> argparse.ArgumentParser | None:
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    if module == "moekit" or module.startswith("moekit.cli"):
        return build_parser()
    return getattr(importlib.import_module(module), "build_parser", lambda: None)()


def _problem(words: list[str]) -> str:
    """What is wrong with one command line, '' if nothing: moekit's, torchrun's or a module's parser."""
    if words[0] == "moekit":
        return _parses(build_parser(), words[1:])
    if words[0] == "torchrun":
        if problem := _parses(torchrun.get_args_parser(), words[1:]):
            return problem
        args = torchrun.get_args_parser().parse_args(words[1:])
        parser = _module_parser(args.training_script) if args.module else None
        return _parses(parser, args.training_script_args) if parser else ""
    if words[0].startswith("python") and words[1] == "-m" and words[2].startswith("moekit"):
        parser = _module_parser(words[2])
        return _parses(parser, words[3:]) if parser else ""
    return ""  # pip, pytest, the reader's own script


COMMANDS = [c for c in all_commands() if c.words[0] in ("moekit", "torchrun") or "moekit" in " ".join(c.words[:3])]


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.doc}:{c.line}" for c in COMMANDS])
def test_command_lines_parse(command, monkeypatch, tmp_path):
    """Parsed, never run; as on a GPU machine (``--device cuda``), in a directory holding the files they read."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in FILES_READ:
        (tmp_path / name).write_text("{}")
    problem = _problem(_words(command.words))
    assert not problem, f"{command}\n  {problem}"


def test_the_docs_have_commands_and_examples():
    """The collection above is not empty by accident (a changed fence or heading format)."""
    assert len(COMMANDS) >= 40 and len(SECTIONS) >= 5
    assert any(c.words[:2] == ("torchrun", "--standalone") and "moekit.bench.ep" in c.words for c in COMMANDS)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for each in _parsers(parser) for action in each._actions for flag in action.option_strings}


def known_flags() -> set[str]:
    """Every option of moekit's command, the EP benchmark, torchrun and the benchmark scripts."""
    scripts = "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    return (_option_strings(build_parser()) | _option_strings(ep_parser())
            | _option_strings(torchrun.get_args_parser()) | set(re.findall(r"[\"'](--[a-z0-9][\w-]*)[\"']", scripts)))


def test_every_flag_the_prose_names_exists():
    known = known_flags()
    unknown = [f"{s.doc}:{s.line}: {flag} in `{s.text}`" for doc in DOCS for s in spans(doc)
               for flag in re.findall(r"(?<![\w-])(--[a-z0-9][\w-]*)", s.text) if flag not in known]
    assert not unknown, "flags no parser has:\n" + "\n".join(unknown)


def test_a_subcommand_s_flags_in_the_prose_are_its_own():
    """A span that starts with a subcommand (``moekit bench --targets``, or ``bench --hf`` after a ``moekit`` named
    before it) names only that subcommand's flags (its nested ones too): docs/hf.md said ``bench --config``, a flag
    only ``analyze`` and ``simulate`` take, which the check over all parsers above let through."""
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    own = {name: _option_strings(sub) for name, sub in action.choices.items()}
    wrong = []
    for doc in DOCS:
        for s in spans(doc):
            words = s.text.split()
            words = words[1:] if words[:1] == ["moekit"] else words
            if words and words[0] in own:
                wrong += [f"{s.doc}:{s.line}: {flag} in `{s.text}`" for flag in
                          re.findall(r"(?<![\w-])(--[a-z0-9][\w-]*)", s.text) if flag not in own[words[0]]]
    assert not wrong, "flags the subcommand does not take:\n" + "\n".join(wrong)


PATH = re.compile(r"(?:moekit|benchmarks|docs|tests)/[\w./*<>-]+")


def test_every_repository_path_the_docs_name_exists():
    """A path with ``<placeholders>`` or ``*`` must match at least one file."""
    missing = []
    for doc in DOCS:
        for span in spans(doc):
            if PATH.fullmatch(span.text):
                pattern = re.sub(r"<[^>]*>", "*", span.text)
                if not (any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()):
                    missing.append(f"{span.doc}:{span.line}: {span.text}")
    assert not missing, "paths that are not in the repository:\n" + "\n".join(missing)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, what is not a word character, a hyphen or a
    space dropped, spaces as hyphens, a repeated one suffixed -1, -2, ... (headings inside fenced blocks are not)."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if heading := (None if fenced else re.match(r"#{1,6} (.+)$", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_relative_link_resolves():
    """A relative link names a file that exists and, with a ``#fragment`` into a Markdown file (or the doc itself),
    a heading of that file."""
    bad = []
    for doc in DOCS:
        for target, fragment in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", (ROOT / doc).read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path = (ROOT / doc).parent.joinpath(target) if target else ROOT / doc
            if not path.exists():
                bad.append(f"{doc}: {target}")
            elif fragment and path.suffix == ".md" and fragment not in heading_anchors(path.read_text()):
                bad.append(f"{doc}: {target}#{fragment} (no such heading)")
    assert not bad, "links to files or headings that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("heading, anchor", [
    ("## Speed today", "speed-today"), ("## Today's standing", "todays-standing"),
    ("## Quantized experts: `moekit.quant`", "quantized-experts-moekitquant"),
    ("## Session 38 (lead): the H200 tables of main d949508 (bf16, fp8_block, int8 / int4 / mxfp4)",
     "session-38-lead-the-h200-tables-of-main-d949508-bf16-fp8_block-int8--int4--mxfp4"),
])
def test_heading_anchors_are_github_s(heading, anchor):
    assert anchor in heading_anchors(heading) and anchor + "x" not in heading_anchors(heading)
    assert heading_anchors(f"{heading}\n{heading}\n") == {anchor, anchor + "-1"}


def test_quick_start_is_what_ci_runs():
    """The README's two quick-start commands: the first installs and runs the demo, the second is the
    test command ``.ci/run`` runs, word for word."""
    quick = next(b for b in blocks("README.md") if b.section == "Quick start" and b.lang == "bash")
    install, tests = quick.text.splitlines()
    assert install.endswith("&& moekit demo") and "pip install" in install
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_a_command_with_a_wrong_flag_fails():
    """The parse check can fail: an unknown flag and a bad value are caught, named."""
    assert "unrecognized arguments: --no-such-flag" in _problem(["moekit", "bench", "--no-such-flag"])
    assert "unrecognized arguments: --hf-impl" in _problem(["moekit", "bench", "--hf", "--hf-impl", "moekit"])
    assert "--batches" in _problem(["moekit", "bench", "--batches", "x"])
    assert "invalid choice" in _problem(["torchrun", "--standalone", "-m", "moekit.bench.ep", "--dispatch", "x"])


def test_the_demo_output_shown_is_what_moekit_demo_prints():
    """The quick start's "Real output (CPU)": the same header and table rows (``done in`` and the wrapping of the
    long line depend on the machine and the terminal)."""
    shown = next(b for b in blocks("README.md") if b.section == "Quick start" and b.lang == "").text
    printed = io.StringIO()
    with one_thread():  # the demo's small ops: 1.3 s of CPU on one thread, 8.8 s on two of a loaded machine
        print_report(run_demo(0, "cpu"), Console(file=printed, width=100))
    rows = [line for line in printed.getvalue().splitlines() if "│" in line or line.startswith("moekit demo")]
    assert rows == [line for line in shown.splitlines() if "│" in line or line.startswith("moekit demo")]


def _pyproject_list(key: str) -> list[str]:
    """The package names of one list of pyproject.toml (``dependencies``, or an extra's), versions dropped."""
    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^{re.escape(key)} = \[(.*?)\]", text, re.M | re.S).group(1)
    return [re.match(r"[\w-]+", item).group(0) for item in re.findall(r'"([^"]+)"', body)]


def test_the_extras_table_is_pyproject():
    """"Optional extras": the base install's packages, and per extra a row naming every package it installs."""
    readme = (ROOT / "README.md").read_text()
    base = re.search(r"`pip install -e \.` needs only ([\w ,]+)\.", readme).group(1)
    assert sorted(re.split(r", | and ", base)) == sorted(_pyproject_list("dependencies"))
    optional = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = re.findall(r"^(\w+) = \[", optional, re.M)
    section = readme.split("## Optional extras")[1].split("\n## ")[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M))
    assert sorted(rows) == sorted(extras)
    for extra in extras:
        assert all(package in rows[extra] for package in _pyproject_list(extra)), (extra, rows[extra])


def test_the_lists_the_readme_spells_out_are_the_code_s():
    """The presets the API table lists are ``moekit.preset_names()``; the GPUs ``moekit analyze`` names are
    its spec table's; the model types it says ``from_hf_config`` reads are ``HF_READERS``'s count."""
    readme = (ROOT / "README.md").read_text()
    presets = re.search(r"^\| `moekit\.preset_names\(\)`[^|]*\| ([^|]+) \|", readme, re.M).group(1)
    assert sorted(presets.strip().split(", ")) == sorted(preset_names())
    gpus = re.search(r"on a GPU from the spec table \(([^)]+)\)", readme).group(1)
    assert sorted(re.findall(r"`(\w+)`", gpus)) == sorted(gpu_names())
    types = re.search(r"`\.from_hf_config\(cfg\)` \((\d+) model types", readme).group(1)
    assert int(types) == len(HF_READERS)


def test_every_benchmark_script_has_a_row_and_every_row_a_script():
    """benchmarks/README.md's tables: a row's first cell names its scripts; each is a file of benchmarks/, and
    each script there has a row (a helper a row names in its ``(+ ...)`` too)."""
    table = (ROOT / BENCHMARK_TABLE).read_text()
    named = {name for cell in re.findall(r"^\| (.+?) \|", table, re.M) for name in re.findall(r"`([\w-]+\.py)`", cell)}
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")}
    assert not named - scripts, f"rows naming scripts benchmarks/ does not have: {sorted(named - scripts)}"
    assert not scripts - named, f"scripts without a row in {BENCHMARK_TABLE}: {sorted(scripts - named)}"


def _script_source(name: str, seen: set[str]) -> str:
    """A benchmark script's source with that of the benchmark modules it imports and the scripts it runs
    (``runpy`` / ``subprocess`` name them as ``NAME.py``): where its flags may be defined."""
    path = ROOT / "benchmarks" / name
    if name in seen or not path.is_file():
        return ""
    seen.add(name)
    text = path.read_text()
    used = set(re.findall(r"^\s*(?:from|import) (\w+)", text, re.M)) | set(re.findall(r"\b(\w+)\.py\b", text))
    return text + "".join(_script_source(f"{module}.py", seen) for module in sorted(used))


def test_every_benchmark_command_s_flags_are_its_script_s():
    """A span that runs a script of benchmarks/ (``python benchmarks/X.py --out ... [--smoke]``, ``X.py --cells
    close``) passes only flags that script (or what it imports or runs) defines."""
    checked, bad = 0, []
    for doc in DOCS:
        for span in spans(doc):
            run = re.search(r"(?:^|benchmarks/)(\w+\.py) ([^|]*)", span.text)
            flags = re.findall(r"(?<![\w-])(--[a-z0-9][\w-]*)", run.group(2)) if run else []
            if not flags or not (ROOT / "benchmarks" / run.group(1)).is_file():
                continue
            checked += 1
            source = _script_source(run.group(1), set())
            bad += [f"{doc}:{span.line}: {run.group(1)} {flag}" for flag in flags
                    if not re.search(rf"[\"']{re.escape(flag)}[\"']", source)]
    assert checked >= 40  # 42 commands at session 43 (39 finished scripts removed): not empty by accident
    assert not bad, "flags the script does not define:\n" + "\n".join(bad)

"""The speed tables of README.md ("Speed today") and docs/speed.md are the bench results they cite: every row's
µs, % of the floor and time over bf16 is the cell of ``SOURCES`` as ``row_text`` rounds it, and the docs name
those files; the README's sentence on a whole transformers model is ``HF_SOURCE``'s rows. A figure copied by hand
from another run, or left behind when the files change, fails here."""

from __future__ import annotations

import json
import re
from functools import cache

import pytest

from _doc_text import ROOT

SOURCES = tuple(f"benchmarks/results/NVIDIA_H200-2026-12-06-{name}.json"
                for name in ("qwen3-dsv3", "mixtral", "wo-qwen3", "wo-dsv3-mixtral"))
SHAPES = {"qwen3-30b-a3b": "Qwen3-30B-A3B", "deepseek-v3": "DeepSeek-V3", "mixtral-8x7b": "Mixtral-8x7B"}
SCHEMES = ("fp8_block", "int8_w8a16", "int4_w4a16", "mxfp4")
HEADER = "| shape | M | bf16 µs | % of floor | " + " | ".join(f"{s} x bf16" for s in SCHEMES) + " |"
HF_SOURCE = "benchmarks/results/NVIDIA_H200-hf-2026-12-04.json"  # moekit bench --hf, Qwen3-30B-A3B widths
TABLES = {"README.md": (1, 64, 1024, 16384), "docs/speed.md": None}  # the M each table shows (None: every M)


@cache
def cells() -> dict[tuple[str, int, str], dict]:
    """(shape, M, dtype) -> the triton cell of the cited files. Each quantized cell's ``vs_bf16`` is against the
    bf16 cell of its own file, as ``moekit bench --targets`` judges it."""
    found = {}
    for source in SOURCES:
        for cell in json.loads((ROOT / source).read_text())["cells"]:
            if cell["backend"] == "triton":  # a bf16 cell in two files: the first's (its own run)
                found.setdefault((cell["shape"], cell["M"], cell["dtype"]), cell)
    return found


def row_text(shape: str, m: int) -> str:
    """One table row as the docs write it, from the cells."""
    bf16 = cells()[(shape, m, "bfloat16")]
    ratios = [f"{cells()[(shape, m, scheme)]['vs_bf16']:.2f}" for scheme in SCHEMES]
    return f"| {SHAPES[shape]} | {m} | {bf16['us']:.1f} | {bf16['pct_floor']:.0f} | " + " | ".join(ratios) + " |"


def table_rows(doc: str) -> list[str]:
    """The rows under the docs' speed-table header (its separator row aside)."""
    lines = (ROOT / doc).read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


@pytest.mark.parametrize("doc", sorted(TABLES))
def test_the_speed_table_is_the_cited_results(doc):
    text = (ROOT / doc).read_text()
    assert all(source.split("/")[-1] in text for source in SOURCES), f"{doc} does not name every file of {SOURCES}"
    ms = TABLES[doc] or sorted({m for _, m, _ in cells()})
    want = [row_text(shape, m) for shape in SHAPES for m in ms]
    assert table_rows(doc) == want


def test_a_changed_figure_is_caught():
    """The comparison reads figures, not just the layout: one digit off is a different row."""
    row = row_text("qwen3-30b-a3b", 1)
    changed = re.sub(r"\| (\d+\.\d) \|", lambda m: f"| {float(m.group(1)) + 0.1:.1f} |", row, count=1)
    assert changed != row and changed not in [row_text(s, m) for s in SHAPES for m in (1, 64, 1024, 16384)]


def hf_sentence() -> str:
    """The README's sentence on the transformers model, from ``HF_SOURCE``'s eager and compiled rows."""
    run = json.loads((ROOT / HF_SOURCE).read_text())
    rows = {(row["impl"], row["mode"]): row for row in run["rows"]}
    assert (run["settings"]["prefill_batch"], run["settings"]["prefill_len"], run["layers"]) == (4, 1024, 8)
    moekit, peer = rows[("moekit", "eager")], rows[("grouped_mm", "eager")]
    moekit_c, peer_c = rows[("moekit", "compiled")], rows[("grouped_mm", "compiled")]
    return (f"moekit's experts decoded {moekit['decode_tok_s']:.1f} tok/s eagerly against "
            f"{peer['decode_tok_s']:.1f} for transformers' `grouped_mm` and {moekit_c['step_tok_s']:.1f} against "
            f"{peer_c['step_tok_s']:.1f} per compiled step, and prefilled 4 × 1024 tokens in "
            f"{moekit['prefill_ms']:.1f} ms against {peer['prefill_ms']:.1f}.")


def test_the_transformers_figures_are_the_cited_run():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert HF_SOURCE.split("/")[-1] in readme and hf_sentence() in readme


def _speed_today() -> str:
    text = (ROOT / "README.md").read_text()
    return " ".join(text[text.index("## Speed today"):text.index("## Quantized experts")].split())


def _version(text: str) -> str:
    return ".".join(text.split("+")[0].split(".")[:2])  # "2.11.0+cu130" -> "2.11"


def test_speed_today_names_the_run_of_every_cited_file():
    """The paragraph says which run: each cited file's device, short commit, date, torch and Triton (and the
    transformers run's), as the files record them; and its remark on the weight-only files' own bf16 cells (the
    denominators of their ratios) is what those cells are."""
    para = _speed_today()
    assert "on one NVIDIA H200" in para and "on an H200" in para
    for source in SOURCES + (HF_SOURCE,):
        run = json.loads((ROOT / source).read_text())
        versions = run.get("versions") or run  # the --hf file keeps them apart
        assert run["device"] == "NVIDIA H200" and f"main `{run['commit'][:7]}`, {run['date']}" in para, source
        for name, spelled in (("torch", "torch"), ("triton", "Triton"), ("transformers", "transformers")):
            if versions.get(name):
                assert f"{spelled} {_version(versions[name])}" in para, (source, name)
    own = {}
    for source in SOURCES[2:]:  # the weight-only files' bf16 cells
        for cell in json.loads((ROOT / source).read_text())["cells"]:
            if cell["backend"] == "triton" and cell["dtype"] == "bfloat16":
                own[(cell["shape"], cell["M"])] = cell["us"]
    gaps = {key: abs(us / cells()[(*key, "bfloat16")]["us"] - 1)
            for key, us in own.items() if key[1] in TABLES["README.md"]}
    outlier = ("mixtral-8x7b", 1024)
    assert max(g for key, g in gaps.items() if key != outlier) <= 0.021 < gaps[outlier]
    assert "within 2.1% of the table's, but for Mixtral M = 1024: " f"{own[outlier]:.1f} µs" in para

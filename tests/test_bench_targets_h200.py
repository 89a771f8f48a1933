"""``moekit bench --targets`` on session 38's real H200 run (main d949508): the committed JSONs against the bench's
own logs of that run, and the verdicts against the closing note's hand-made "Against the targets"
(benchmarks/triton-notes.md, "Session 38 (lead): the H200 tables of main d949508")."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moekit.cli import main

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
RUN = "NVIDIA_H200-2026-12-06"
PARTS = ("qwen3-dsv3", "mixtral", "wo-qwen3", "wo-dsv3-mixtral")  # the run's calls, bf16 + fp8 first
# a row of the bench's table: shape M backend dtype time ±% eager host floor %floor xbf16 %copy %mm touched
LOG_ROW = re.compile(r"^(?P<shape>[a-z0-9-]+)\s+(?P<M>\d+)\s+triton\s+(?P<dtype>\S+)\s+"
                     r"(?P<time>[\d.]+) (?P<unit>µs|ms)\s+\d+\s+\S+ \S+\s+\S+ \S+\s+\S+ \S+\s+"
                     r"(?P<floor>\d+)\s+(?P<xbf16>[\d.]+|-)\s+\d+\s+(?P<mm>\d+)\s")


def json_file(part: str) -> str:
    return str(RESULTS / f"{RUN}-{part}.json")


def log_rows(part: str) -> dict[tuple, dict]:
    text = (RESULTS / "raw" / f"{RUN}-d949508-bench-{part}.log").read_text()
    rows = {}
    for line in text.splitlines():
        m = LOG_ROW.match(line)
        if m:
            rows[(m["shape"], int(m["M"]), m["dtype"])] = m.groupdict()
    return rows


def targets(capsys, *parts: str) -> str:
    assert main(["bench", "--targets", *map(json_file, parts)]) == 0
    return capsys.readouterr().out


def tool_rows(markdown: str) -> dict[tuple, dict]:
    """Every issue table's rows, by (shape, M, dtype)."""
    rows = {}
    for section in markdown.split("\n## #")[1:]:
        issue = int(section.split(":")[0])
        lines = [ln for ln in section.splitlines() if ln.startswith("|")]  # none: no cell of the issue
        head = [h.strip() for h in lines[0].strip("|").split("|")] if lines else []
        for ln in lines[2:]:
            row = dict(zip(head, (v.strip() for v in ln.strip("|").split("|"))))
            dtype = row.get("dtype", {15: "fp8_block", 19: "bfloat16"}.get(issue))
            rows[(row["shape"], int(row["M"]), dtype)] = row
    return rows


@pytest.mark.parametrize("part", PARTS)
def test_the_tables_read_what_the_bench_printed(part, capsys):
    """Each JSON through --targets alone: every triton row of the bench's log of that call is in the tables with
    the same time, % floor, % mm (at M >= 4096) and x bf16."""
    logged, ours = log_rows(part), tool_rows(targets(capsys, part))
    assert len(logged) in (20, 40, 80) and set(ours) == set(logged)
    for key, log in logged.items():
        row = ours[key]
        us = float(row["µs"])
        shown = float(log["time"]) * (1000 if log["unit"] == "ms" else 1)
        assert us == pytest.approx(shown, rel=0.005, abs=0.051), key  # the log: 3-4 digits
        pct = row.get("% floor (% mm)", row.get("% floor")).split(" (")  # #16 reads no % mm
        assert f"{float(pct[0]):.0f}" == log["floor"], key
        assert len(pct) == 2 or key[1] < 4096 or key[2] not in ("bfloat16", "fp8_block"), key
        if len(pct) == 2:
            assert f"{float(pct[1].rstrip(')')):.0f}" == log["mm"], key
        if log["xbf16"] != "-":
            assert row["x bf16"][:4] == log["xbf16"], key


def misses(markdown: str, issue: int, label: str) -> set[str]:
    """The cells a target's summary line lists as missed, as "shape [dtype] M=m"."""
    section = markdown.split(f"\n## #{issue}:")[1].split("\n## ")[0]
    (line,) = [ln for ln in section.splitlines() if ln.startswith("- ") and f"**{label}**" in ln]
    listed = line.split("missed: ")[1].split("; ")[0].split(". (")[0] if "missed: " in line else ""
    return {name.rsplit(" ", 1)[0] for name in listed.split(", ") if name}


def test_the_verdicts_of_the_session_38_note(capsys):
    """The note's "Against the targets", cell by cell, but for three cells the note rounded to the bound and
    counted as met: fp8 DeepSeek-V3 M = 512 and Mixtral M = 64 at 89.8% of the floor, DeepSeek-V3 M = 16384 at
    59.8% of the fp8 matmul rate."""
    out = targets(capsys, *PARTS)
    qwen3_mid = {f"qwen3-30b-a3b M={m}" for m in (8, 32, 64, 128, 256, 512, 1024)}
    mixtral_mid = {f"mixtral-8x7b M={m}" for m in (32, 128, 256, 512, 1024)}
    rounded_by_the_note = {"deepseek-v3 M=512", "mixtral-8x7b M=64"}
    assert misses(out, 15, "M = 1") == {"qwen3-30b-a3b M=1"}
    assert misses(out, 15, "8-1024") == qwen3_mid | mixtral_mid | {"deepseek-v3 M=1024"} | rounded_by_the_note
    assert misses(out, 15, "≥ 4096") == {"qwen3-30b-a3b M=4096", "qwen3-30b-a3b M=16384", "deepseek-v3 M=4096",
                                         "deepseek-v3 M=16384"}  # the last the note's "60 ✓": 59.8
    assert misses(out, 15, "≤ bf16") == set() and "met in 30 of 30 cells" in out
    assert misses(out, 19, "M = 1") == {"qwen3-30b-a3b M=1"}
    assert misses(out, 19, "8-1024") == {"mixtral-8x7b M=256", "mixtral-8x7b M=512", "mixtral-8x7b M=1024",
                                         "qwen3-30b-a3b M=512", "qwen3-30b-a3b M=1024"}
    assert misses(out, 19, "≥ 4096") == {"deepseek-v3 M=4096", "deepseek-v3 M=16384", "qwen3-30b-a3b M=4096",
                                         "qwen3-30b-a3b M=16384"}
    # #16 target 1: met only by int8 DeepSeek-V3 8-64 and int8 Mixtral 1-32, of the 24 cells
    met_t1 = {f"deepseek-v3 int8_w8a16 M={m}" for m in (8, 32, 64)} | {f"mixtral-8x7b int8_w8a16 M={m}"
                                                                       for m in (1, 8, 32)}
    every_t1 = {f"{s} {d} M={m}" for s in ("deepseek-v3", "mixtral-8x7b")
                for d in ("int8_w8a16", "int4_w4a16", "mxfp4") for m in (1, 8, 32, 64)}
    assert misses(out, 16, "≤ 64") == every_t1 - met_t1
    assert misses(out, 16, "int4 M = 1") == {"qwen3-30b-a3b int4_w4a16 M=1"}
    met_t3 = {"qwen3-30b-a3b int8_w8a16 M=1024", "deepseek-v3 int8_w8a16 M=1024", "deepseek-v3 int8_w8a16 M=4096",
              "mixtral-8x7b mxfp4 M=16384"}
    every_t3 = {f"{s} {d} M={m}" for s in ("qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b")
                for d in ("int8_w8a16", "int4_w4a16", "mxfp4") for m in (1024, 4096, 16384)}
    assert misses(out, 16, "≥ 1024") == every_t3 - met_t3
    # the note's layer errors: fp8 6.2-6.4%, int8 1.4-1.6%, int4 17.3-18.0%, mxfp4 19.1-19.9%
    for dtype, span in (("fp8_block", "6.2-6.4%"), ("int8_w8a16", "1.4-1.6%"), ("int4_w4a16", "17.3-18.0%"),
                        ("mxfp4", "19.1-19.9%")):
        assert f"accuracy, {dtype}: the layer's relative L2 error against the unquantized layer {span}" in out


def test_the_weight_only_run_keeps_its_own_bf16(capsys):
    """Given after the bf16 + fp8 run, the weight-only files' bf16 cells are not judged again (#19 reads the
    first), yet each weight-only cell's x bf16 is against its own run's bf16 (Qwen3 int4 M = 1: 18.1 over
    24.4 µs, where the first run's bf16 cell took 24.5)."""
    out = targets(capsys, *PARTS)
    rows = tool_rows(out)
    int4 = rows[("qwen3-30b-a3b", 1, "int4_w4a16")]
    assert (int4["bf16 µs"], int4["x bf16"]) == ("24.4", "0.74")
    assert rows[("qwen3-30b-a3b", 1, "bfloat16")]["µs"] == "24.5"
    assert out.count("cells of `") == 3 and "are also in" in out

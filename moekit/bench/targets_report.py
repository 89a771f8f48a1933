"""``moekit bench --targets``' Markdown: per issue a table of its cells (shape, M, µs, % floor or % mm, x bf16
or x peer, ✓ / ✗ per target that applies) and a line per target (met in n of m cells, the misses), to paste
into a closing note."""

from __future__ import annotations

from moekit.bench.report import ceilings_line
from moekit.bench.targets import ISSUE_TITLES, PCT_FLOOR, PCT_FP8_MM, PCT_MM, X_BF16, X_PEER, Rule, TargetCell
from moekit.bench.targets_judge import IssueResult, RuleResult, TargetsResult, Verdict

MARKS = {True: "✓", False: "**✗**", None: "?"}  # a cell: met, missed, could not be judged
TARGET_MARKS = {True: "✓", False: "✗", None: "?"}  # a target: met, missed, no cell judged


def markdown(result: TargetsResult) -> str:
    lines = ["# The issues' targets from `moekit bench`", ""]
    lines += [f"- `{f.path}`: {f.device}, {f.date}, commit {f.commit[:12]}, {f.versions}; "
              f"{ceilings_line({'ceilings': f.ceilings})}; {len(f.cells)} triton cells" for f in result.files]
    not_h200 = sorted({f.device for f in result.files if "H200" not in f.device})
    if not_h200:
        lines += ["", f"> The issues' targets are H200 figures; these cells ran on {', '.join(not_h200)}: the "
                      "verdicts compare that device with the H200's targets."]
    lines += _left_out(result)
    for issue in result.issues:
        lines += ["", *_issue_section(issue, result.peer_source)]
    return "\n".join(lines) + "\n"


def _left_out(result: TargetsResult) -> list[str]:
    """What the tables do not judge, said once: cells the run could not time, other backends' cells, cells
    repeated in a later file."""
    lines = []
    for f in result.files:
        if f.failed:
            lines.append(f"- **failed in the run, so in no table**: `{f.path}`'s {'; '.join(f.failed)}")
        if f.skipped:
            counts = ", ".join(f"{n} {b}" for b, n in f.skipped.items())
            lines.append(f"- not judged: `{f.path}`'s cells of other backends ({counts}); the issues' targets "
                         "are the triton backend's")
    by_file: dict[tuple[str, str], int] = {}
    for r in result.repeats:
        key = (r.cell.source, r.judged_from)
        by_file[key] = by_file.get(key, 0) + 1
    for (source, first), n in by_file.items():
        lines.append(f"- {n} cells of `{source}` are also in `{first}` (same shape, M, dtype): judged from "
                     f"`{first}`, given first; in `{source}` they are only its quantized cells' x bf16 base")
    return [""] + lines if lines else []


def _issue_section(issue: IssueResult, peer_source: str) -> list[str]:
    dtypes = list(dict.fromkeys(c.dtype for c in issue.cells))
    lines = [f"## #{issue.issue}: {ISSUE_TITLES[issue.issue]}", ""]
    if not issue.cells:
        return lines + ["No triton cell of this issue's dtypes in these files."]
    lines += _table(issue, show_dtype=len(dtypes) > 1)
    lines += ["", "Against the targets:"]
    lines += [_summary(r, show_dtype=len(dtypes) > 1) for r in issue.results]
    if any(r.rule.metric is X_PEER for r in issue.results):
        lines.append(f"- peer times: {peer_source}")
    lines += _accuracy(issue.cells)
    return lines


def _columns(results: list[RuleResult]) -> list[str]:
    metrics = {r.rule.metric.name for r in results}
    columns = ["µs"]
    if PCT_MM.name in metrics:
        columns.append("% floor (% mm)")
    elif PCT_FLOOR.name in metrics:
        columns.append("% floor")
    if X_BF16.name in metrics:
        columns += ["bf16 µs", "x bf16"]
    if X_PEER.name in metrics:
        columns += ["peer µs", "x peer"]
    return columns


def _table(issue: IssueResult, show_dtype: bool) -> list[str]:
    per_cell = [r for r in issue.results if not r.rule.geomean]
    head = ["shape", "M", *(["dtype"] if show_dtype else []), *_columns(issue.results),
            *(r.rule.label for r in per_cell)]
    verdicts = [{id(v.cell): v for v in r.verdicts} for r in per_cell]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in issue.cells:
        figures = _figures(c, issue.results)
        row = [c.shape, str(c.M), *([c.dtype] if show_dtype else [])]
        row += [figures[col] for col in _columns(issue.results)]
        row += [_mark(v.get(id(c))) for v in verdicts]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _mark(verdict: Verdict | None) -> str:
    return "" if verdict is None else MARKS[verdict.met]


def _figures(c: TargetCell, results: list[RuleResult]) -> dict[str, str]:
    """A cell's figures as the table shows them, each with the digits that keep it on its side of the bounds
    of the rules that read it."""
    def bounds(*metrics) -> list[float]:
        return [r.rule.bound for r in results
                if r.rule.metric in metrics and not r.rule.geomean and r.rule.cells.holds(c)]

    pct = _number(c.pct_floor, 0, bounds(PCT_FLOOR))
    if bounds(PCT_MM, PCT_FP8_MM):
        pct += f" ({_number(c.pct_mm, 0, bounds(PCT_MM, PCT_FP8_MM))})"
    x_bf16, x_peer = X_BF16.read(c), X_PEER.read(c)
    return {"µs": f"{c.us:.1f}", "% floor": pct, "% floor (% mm)": pct,
            "bf16 µs": "-" if c.bf16_us is None else f"{c.bf16_us:.1f}",
            "x bf16": "-" if x_bf16 is None else _number(x_bf16, 2, bounds(X_BF16)),
            "peer µs": "-" if c.peer_us is None else f"{c.peer_us:.1f}",
            "x peer": "-" if x_peer is None else _number(x_peer, 2, bounds(X_PEER))}


def _number(value: float, digits: int, bounds: list[float]) -> str:
    """``value`` to ``digits`` decimals, more where rounding would carry it across one of ``bounds`` (89.6
    shows as 89.6, not 90, beside a ≥ 90 target it misses)."""
    text = f"{value:.{digits}f}"
    while digits < 4 and any((float(text) >= b) != (value >= b) or (float(text) <= b) != (value <= b)
                             for b in bounds):
        digits += 1
        text = f"{value:.{digits}f}"
    return text


def _summary(result: RuleResult, show_dtype: bool) -> str:
    rule = result.rule
    head = f"- {TARGET_MARKS[result.met]} **{rule.label}** ({rule.bound_text}): \"{rule.text}\""
    if not result.verdicts:
        return head + ": no cell of these files"
    if rule.geomean:
        text = (f"{result.geomean:.2f}x over {len(result.judged)} cells" if result.judged else "no cell judged")
    else:
        text = f"met in {len(result.judged) - len(result.misses)} of {len(result.judged)} cells"
        if result.misses:
            text += "; missed: " + ", ".join(_cell_name(v, rule, show_dtype) for v in result.misses)
    unjudged = len(result.verdicts) - len(result.judged)
    if unjudged:
        text += f"; {unjudged} cells not judged ({rule.metric.missing})"
    return head + " — " + text + (f". ({rule.note})" if rule.note else "")


def _cell_name(v: Verdict, rule: Rule, show_dtype: bool) -> str:
    digits = 0 if rule.metric.unit == "%" else 2
    dtype = f" {v.cell.dtype}" if show_dtype else ""
    return f"{v.cell.shape}{dtype} M={v.cell.M} {_number(v.value, digits, [rule.bound])}{rule.metric.unit}"


def _accuracy(cells: list[TargetCell]) -> list[str]:
    """Per quantized dtype, the layer's error against the unquantized layer (the issues ask it reported)."""
    lines = []
    for dtype in dict.fromkeys(c.dtype for c in cells):
        errs = [c.rel_err_vs_bf16 for c in cells if c.dtype == dtype and c.rel_err_vs_bf16 is not None]
        if errs:
            lines.append(f"- accuracy, {dtype}: the layer's relative L2 error against the unquantized layer "
                         f"{100 * min(errs):.1f}-{100 * max(errs):.1f}% over {len(errs)} cells (rel_err_vs_bf16)")
    return lines

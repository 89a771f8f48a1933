"""The issues' targets judged on the cells of one or more bench JSONs (``targets.RULES``).

Cells are gathered over the files in the order given; a (shape, M, dtype) cell in several files (the bf16
cells of a bf16 + fp8 run and of a weight-only run) is judged from the first file that has it, and each
quantized cell keeps the x bf16 of its own file. #19's peer time is the cells' ``peer_us`` where the
JSON has any, else issue #19's own table (``targets_peers``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from moekit.bench.targets import RULES, X_PEER, Rule, TargetCell, issue_dtypes, issue_rules, issues
from moekit.bench.targets_load import BenchFile
from moekit.bench.targets_peers import ISSUE_19_PEER_US, ISSUE_19_SOURCE

JSON_PEERS = "the cells' own peer_us (in the JSON)"
NO_PEERS = "none: no cell has a peer_us, and issue #19's table holds an H200's µs while no file here is an H200's"


@dataclass(frozen=True)
class Verdict:
    """One rule on one cell."""

    cell: TargetCell
    value: float | None  # the rule's figure for the cell; None: the cell cannot say it (rule.metric.missing)
    met: bool | None  # per-cell rules: value within the bound; None where value is; geomean rules: None


@dataclass(frozen=True)
class RuleResult:
    rule: Rule
    verdicts: list[Verdict]  # every cell the rule speaks of, in the table's order

    @property
    def judged(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.value is not None]

    @property
    def misses(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.met is False]

    @property
    def geomean(self) -> float | None:
        """Geomean rules: the geometric mean of the figure over the cells that have it."""
        values = [v.value for v in self.judged]
        return math.exp(sum(map(math.log, values)) / len(values)) if values else None

    @property
    def met(self) -> bool | None:
        """The target as a whole: every judged cell within the bound (the geomean, for a geomean rule);
        None when no cell could be judged."""
        if self.rule.geomean:
            return None if self.geomean is None else self.rule.meets(self.geomean)
        return None if not self.judged else not self.misses


@dataclass(frozen=True)
class Repeat:
    """A (shape, M, dtype) cell found again in a later file: judged from the first."""

    cell: TargetCell  # the later file's cell, not judged
    judged_from: str  # the file whose cell the tables read


@dataclass(frozen=True)
class IssueResult:
    issue: int
    cells: list[TargetCell]  # the issue's table: its dtypes' cells, files in the order given
    results: list[RuleResult]  # in the order of targets.RULES


@dataclass(frozen=True)
class TargetsResult:
    files: list[BenchFile]
    issues: list[IssueResult]
    peer_source: str  # JSON_PEERS, targets_peers.ISSUE_19_SOURCE or NO_PEERS
    repeats: list[Repeat]


def judge(files: list[BenchFile]) -> TargetsResult:
    cells, repeats = _first_of_each(files)
    cells, peer_source = _with_peers(cells, {f.path for f in files if "H200" in f.device})
    results = []
    for issue in issues():
        dtypes = issue_dtypes(issue)
        table = [c for c in cells if c.dtype in dtypes]
        results.append(IssueResult(issue, table, [_judge_rule(r, table) for r in issue_rules(issue)]))
    return TargetsResult(files, results, peer_source, repeats)


def _first_of_each(files: list[BenchFile]) -> tuple[list[TargetCell], list[Repeat]]:
    first: dict[tuple, TargetCell] = {}
    repeats = []
    for f in files:
        for c in f.cells:
            key = (c.shape, c.M, c.dtype)
            if key in first:
                repeats.append(Repeat(c, first[key].source))
            else:
                first[key] = c
    return list(first.values()), repeats


def _with_peers(cells: list[TargetCell], h200_sources: set[str]) -> tuple[list[TargetCell], str]:
    """The cells with #19's peer time: their own ``peer_us`` when any cell #19 reads has one, else the issue's
    table for the real presets, for cells of an H200 file only (the table's µs are an H200's: another device's
    cells get no peer, so their peer targets read "?")."""
    peer_rules = [r for r in RULES if r.metric is X_PEER]
    if any(c.peer_us is not None for c in cells if any(r.cells.holds(c) for r in peer_rules)):
        return cells, JSON_PEERS
    with_table = [dataclasses.replace(c, peer_us=ISSUE_19_PEER_US.get((c.shape, c.M)))
                  if c.source in h200_sources and any(r.cells.holds(c) for r in peer_rules) else c for c in cells]
    return with_table, ISSUE_19_SOURCE if h200_sources else NO_PEERS


def _judge_rule(rule: Rule, table: list[TargetCell]) -> RuleResult:
    verdicts = []
    for c in table:
        if not rule.cells.holds(c):
            continue
        value = rule.metric.read(c)
        met = None if value is None or rule.geomean else rule.meets(value)
        verdicts.append(Verdict(c, value, met))
    return RuleResult(rule, verdicts)

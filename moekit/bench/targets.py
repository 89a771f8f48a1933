"""The targets of issues #15 (fp8_block), #16 (weight-only) and #19 (bf16 kernels, round two) as one table
of rules, read by ``moekit bench --targets`` (``targets_judge`` judges a bench JSON's cells by them,
``targets_report`` prints the tables).

A rule is data: the issue, its target as the issue words it, the cells it speaks of (weight dtypes, an M
range, shapes), the figure it reads off each cell and the bound that figure must meet, per cell or, for
#19's peer speed-up, once on the geometric mean over the cells. The figures are the bench's own:
``pct_floor`` and ``pct_mm`` as the JSON has them, x bf16 = the cell's µs over the unquantized cell of its
own run (same shape, M, backend: the bench's ``vs_bf16``), x peer = the best peer's µs over the cell's.
The targets are the issues' H200 figures.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

from moekit.bench.quant_cells import BASELINE, FP8

WEIGHT_ONLY = ("int8_w8a16", "int4_w4a16", "mxfp4")
JUDGED_BACKEND = "triton"  # the issues set targets for moekit's triton backend; other backends' cells are skipped


@dataclass(frozen=True)
class TargetCell:
    """One triton cell of a bench JSON, with what the rules read."""

    source: str  # the JSON it came from
    shape: str  # as the bench names it: a preset, or "<preset>/16" scaled down on the CPU
    M: int
    dtype: str  # BASELINE for the run's unquantized cells (bf16; float32 on the CPU), else the moekit.quant scheme
    us: float  # the bench's median µs per call
    pct_floor: float  # floor_us / us * 100
    pct_mm: float  # achieved FLOP/s over the measured matmul rate of mm_dtype * 100
    mm_dtype: str  # the rate pct_mm reads: float8_e4m3fn for fp8_block cells of a run that measured it
    bf16_us: float | None = None  # the unquantized cell of the same file, shape, M, backend; None: none there
    peer_us: float | None = None  # the best peer's µs at this shape and M (#19); None: no peer known
    rel_err_vs_bf16: float | None = None  # quantized cells: the layer's relative L2 against the unquantized one

    @property
    def preset(self) -> str:
        return self.shape.split("/")[0]


@dataclass(frozen=True)
class Metric:
    """A figure of a cell that a rule bounds; ``read`` gives None where the cell cannot say it."""

    name: str  # the column it shows in
    unit: str  # "%" or "x"
    read: Callable[[TargetCell], float | None]
    missing: str  # why ``read`` gave None


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


PCT_FLOOR = Metric("% floor", "%", lambda c: c.pct_floor, "")
PCT_MM = Metric("% mm", "%", lambda c: c.pct_mm, "")
PCT_FP8_MM = Metric("% mm", "%", lambda c: c.pct_mm if c.mm_dtype.startswith("float8") else None,
                    "the run measured no fp8 matmul rate (its % mm is of the dense rate)")
X_BF16 = Metric("x bf16", "x", lambda c: _ratio(c.us, c.bf16_us), "no unquantized cell of this shape and M in its file")
X_PEER = Metric("x peer", "x", lambda c: _ratio(c.peer_us, c.us), "no peer time for this shape and M")


@dataclass(frozen=True)
class CellSet:
    """The cells a rule speaks of."""

    dtypes: tuple[str, ...]  # bench dtypes; BASELINE stands for the run's unquantized cells
    m_min: int = 1
    m_max: int = sys.maxsize
    presets: tuple[str, ...] = ()  # preset names the rule names; () = every shape

    def holds(self, cell: TargetCell) -> bool:
        return (cell.dtype in self.dtypes and self.m_min <= cell.M <= self.m_max
                and (not self.presets or cell.preset in self.presets))


@dataclass(frozen=True)
class Rule:
    issue: int
    label: str  # the table's column header
    text: str  # the target, as the issue words it
    cells: CellSet
    metric: Metric
    bound: float
    at_most: bool = False  # the figure must be <= bound (else >= bound)
    geomean: bool = False  # judged once, on the geometric mean of the figure over the cells that have it
    note: str = field(default="", compare=False)  # how the rule reads the issue, where its words leave a choice

    def meets(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound

    @property
    def bound_text(self) -> str:
        return f"{'≤' if self.at_most else '≥'} {self.bound:.3g}{self.metric.unit}"


ISSUE_TITLES = {
    15: "fp8 experts (fp8_block): DeepSeek-V3's block-quantized recipe",
    16: "weight-only quantized experts (int8_w8a16, int4_w4a16, mxfp4)",
    19: "kernels, round two (bf16)",
}
DECODE, MID, PREFILL = dict(m_max=1), dict(m_min=8, m_max=1024), dict(m_min=4096)
DSV3_MIXTRAL, QWEN3 = ("deepseek-v3", "mixtral-8x7b"), ("qwen3-30b-a3b",)

RULES = (
    Rule(15, "M = 1", "M = 1: ≥ 80% of the fp8 floor on DeepSeek-V3 and Qwen3 (Mixtral too)",
         CellSet((FP8,), **DECODE), PCT_FLOOR, 80),
    Rule(15, "8-1024", "8 ≤ M ≤ 1024: ≥ 90% of the floor, activation quantization and alignment included",
         CellSet((FP8,), **MID), PCT_FLOOR, 90),
    Rule(15, "≥ 4096", "M ≥ 4096: ≥ 60% of the measured fp8 matmul rate",
         CellSet((FP8,), **PREFILL), PCT_FP8_MM, 60),
    Rule(15, "≤ bf16", "Every fp8 cell at least as fast as moekit's own bf16 cell at the same shape and M",
         CellSet((FP8,)), X_BF16, 1.0, at_most=True),
    Rule(16, "≤ 64", "DeepSeek-V3 and Mixtral shapes: ≥ 80% of the packed-byte floor for every scheme at M ≤ 64",
         CellSet(WEIGHT_ONLY, m_max=64, presets=DSV3_MIXTRAL), PCT_FLOOR, 80),
    Rule(16, "int4 M = 1", "Qwen3-30B-A3B int4 at M = 1: ≤ 0.45 × moekit's bf16 time",
         CellSet(("int4_w4a16",), presets=QWEN3, **DECODE), X_BF16, 0.45, at_most=True),
    Rule(16, "≥ 1024",
         "M ≥ 1024: no weight-only cell slower than 0.9 × moekit's bf16 cell at the same shape and M",
         CellSet(WEIGHT_ONLY, m_min=1024), X_BF16, 1 / 0.9, at_most=True,
         note="read as the closing notes read it since session 38: at least 0.9 x bf16's speed, "
              "so time ≤ 1/0.9 = 1.11 x bf16's"),
    Rule(19, "8-1024", "8 ≤ M ≤ 1024: ≥ 90% of the floor on every shape",
         CellSet((BASELINE,), **MID), PCT_FLOOR, 90),
    Rule(19, "≥ 4096", "M ≥ 4096: ≥ 70% of the measured matmul rate on every shape",
         CellSet((BASELINE,), **PREFILL), PCT_MM, 70),
    Rule(19, "M = 1", "M = 1: ≥ 80% of the floor on every shape",
         CellSet((BASELINE,), **DECODE), PCT_FLOOR, 80),
    Rule(19, "geomean", "Geometric mean ≥ 1.25× the best peer per cell over the 30 cells above",
         CellSet((BASELINE,)), X_PEER, 1.25, geomean=True,
         note="over the cells that have a peer time; the issue's own table lists 21 of the 30 (M = 1, 8, 64, "
              "512, 1024, 4096, 16384): its 1.11x is over all 30, the 21 listed give 1.14x"),
    Rule(19, "≥ peer", "no cell slower than its best peer", CellSet((BASELINE,)), X_PEER, 1.0),
)


def issues() -> list[int]:
    """The issues the rules come from, in the rules' order."""
    return list(dict.fromkeys(r.issue for r in RULES))


def issue_rules(issue: int) -> list[Rule]:
    return [r for r in RULES if r.issue == issue]


def issue_dtypes(issue: int) -> list[str]:
    """The bench dtypes an issue's rules speak of: its table's cells."""
    return list(dict.fromkeys(d for r in issue_rules(issue) for d in r.cells.dtypes))

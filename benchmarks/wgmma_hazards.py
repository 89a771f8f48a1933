"""The wgmma pipeline of an sm_90 kernel read from its SASS (``nvdisasm -c``): the waits' depths, and any instruction
in an MMA loop that writes a register an HGMMA still in flight reads (its A fragment or its accumulator).

PTX forbids writing a wgmma's A registers before the ``wgmma.wait_group`` that retires it. A loop that issues one
register-A ``warpgroup_mma`` a step and keeps a step in flight (``wait(1)``) breaks that: Triton's lowering copies A
into fresh registers at each issue (``mov.b32``), the same PTX registers every iteration, so the next step's copy
overwrites the ones the previous step's wgmmas still read (session 30, ``gluon_gemm_wo_swap``'s INFLIGHT 2 before its
2-step unroll: 16 such writes a loop). ptxas neither reports nor serializes this; this reader finds it.

    WARPGROUP.DEPBAR.LE gsb0, N     wait until at most N groups are in flight
    HGMMA.64xNx16... Racc, RA, gdesc[..], Racc[, gsb0]     RA..RA+3: A; gsb0 closes a group (its commit)
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_INSTR = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA `\((\.L_x_\d+)\)")


@dataclass(frozen=True)
class PipelineReport:
    """What ``pipeline_report`` reads from one kernel's SASS."""

    waits: dict  # N (as "0x1") -> how many ``WARPGROUP.DEPBAR.LE gsb0, N`` the kernel has
    loops: int  # innermost loops that issue HGMMAs
    writes: list  # instructions (text) of those loops that write a register an in-flight HGMMA reads

    def line(self) -> str:
        depths = " ".join(f"{n}:{c}" for n, c in sorted(self.waits.items())) or "none"
        return f"waits {depths}, in-flight writes {len(self.writes)} in {self.loops} MMA loops"


def mma_loops(lines: list[str]) -> list[list[str]]:
    """The innermost loops (label .. the backward branch to it) whose body issues an HGMMA: their SASS lines."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    spans = []
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i and any("HGMMA" in b for b in lines[labels[m.group(1)]:i]):
            spans.append((labels[m.group(1)], i))
    inner = [s for s in spans if not any(s[0] <= o[0] and o[1] <= s[1] and o != s for o in spans)]
    return [lines[a:b + 1] for a, b in inner]


def _registers(operand: str, width: int) -> set:
    m = re.match(r"R(\d+)$", operand)
    return set(range(int(m.group(1)), int(m.group(1)) + width)) if m else set()


def _width(op: str) -> int:
    """Registers a destination spans (LDS.64 / IMAD.WIDE: 2, .128: 4)."""
    return 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op else 1


def inflight_writes(body: list[str]) -> list[str]:
    """The loop body's instructions (run three times around, the first pass only filling the pipeline) that write an
    A or accumulator register of an HGMMA whose group no wait has retired yet; HGMMAs chaining on their accumulator
    are the pipeline itself, not writes."""
    instructions = [m.group(1) for line in body if (m := _INSTR.match(line))]
    pending, group, found = [], set(), []
    for n, text in enumerate(instructions * 3):
        bare = re.sub(r"^@!?U?P[T\d]+\s+", "", text)
        op, _, rest = bare.partition(" ")
        operands = [o.strip() for o in rest.split(",")]
        if op.startswith("HGMMA"):
            accumulator = int(operands[0][1:])
            group |= _registers(operands[1], 4) | set(range(accumulator, accumulator + int(op.split("x")[1]) // 2))
            if "gsb0" in operands:
                pending, group = pending + [group], set()
        elif op.startswith("WARPGROUP.DEPBAR"):
            keep = int(operands[-1], 16)
            pending = pending[len(pending) - keep:] if keep else []
        elif n >= len(instructions) and operands and _registers(operands[0], _width(op)) & set().union(*pending):
            found.append(text)
    return sorted(set(found))


def pipeline_report(sass: str) -> PipelineReport:
    """The waits' depths over the whole kernel and the in-flight writes of its innermost MMA loops."""
    lines = sass.splitlines()
    loops = mma_loops(lines)
    waits = Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass))
    return PipelineReport(dict(waits), len(loops), [w for body in loops for w in inflight_writes(body)])

"""Where a kernel's local-memory spills sit in its SASS: inside the innermost loops that hold its tensor-core MMAs
(a cost every K-step) or around them (once a tile). Reads ``nvdisasm -c`` text (the disassembler Triton bundles):
a loop is a backward branch ``BRA `(.L_x_N)`` to a label above it; an MMA loop the smallest loop around a
``HGMMA`` / ``QGMMA`` instruction; a spill an ``STL`` / ``LDL``.

    nvdisasm -c kernel.cubin | python benchmarks/sass_loops.py      # "mma loops 2, spills 58, in mma loops 0"
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")
_MMA = re.compile(r"\b[HQ]GMMA\.")
_SPILL = re.compile(r"\b(STL|LDL)\b")


@dataclass(frozen=True)
class SpillPlaces:
    mma_loops: int  # innermost loops holding an MMA
    spills: int  # STL / LDL instructions in the kernel
    in_mma_loops: int  # of them, inside an MMA loop (paid every K-step)

    def __str__(self) -> str:
        return f"mma loops {self.mma_loops}, spills {self.spills}, in mma loops {self.in_mma_loops}"


def spill_places(sass: str) -> SpillPlaces:
    """Count ``sass``'s spills inside and outside its MMA loops."""
    code: list[tuple[int, str]] = []  # (address, instruction)
    labels: dict[str, int] = {}
    pending: list[str] = []  # labels waiting for the next instruction's address
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _INSTRUCTION.match(line):
            address = int(m.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            code.append((address, m.group(2)))
    loops = [(labels[m.group(1)], address) for address, text in code
             if (m := _BRANCH.search(text)) and labels.get(m.group(1), address + 1) <= address]
    mma_loops = set()
    for address, text in code:
        if _MMA.search(text):
            around = [loop for loop in loops if loop[0] <= address <= loop[1]]
            if around:
                mma_loops.add(min(around, key=lambda loop: loop[1] - loop[0]))
    spills = [address for address, text in code if _SPILL.search(text)]
    inside = sum(1 for a in spills if any(start <= a <= end for start, end in mma_loops))
    return SpillPlaces(len(mma_loops), len(spills), inside)


if __name__ == "__main__":
    print(spill_places(sys.stdin.read()))

"""Tile candidates for the fused backward's shape classes that ``triton_backward_launch.TUNED`` leaves to its
heuristic or where the Triton step lost to ``grouped_mm`` on the H100 (session 49's ``auto49`` cells), kept
apart from ``TUNED`` until a device check measures them: no default takes one. Select one by passing it to
``experts_backward(tiles=candidate.tiles)``; ``benchmarks/trn50_device_check.py`` also times each through the
training step by giving ``TUNED`` its entry for the run.

Why these classes (``shape_class``: width narrow N <= 1024 / mid <= 4096 / wide; rows per expert few <= 256 /
some <= 1024 / many):
- "wide/few" (Mixtral-8x7B at M = 1024: 256 rows per expert; Mixtral's shape at E 32, M = 4096): no entry, so the
  heuristic's gathering weight grads (pointer loads by sorted id; the contiguous TMA kernel beat them 17-85% to
  17-36% of the bf16 mm on the H200) and a 64-wide grad tile; the step was 0.55 / 0.48 of grouped_mm's.
- "wide/some" (Mixtral at M = 4096): tuned on the H200; 0.88 of grouped_mm's step on the H100.
- "mid/many" (DeepSeek-V3's shape at E 16 / M = 4096, E 64 / M = 16384; DeepSeek-V2-Lite at M = 16384): no entry;
  0.95 of grouped_mm's at E 16, M = 4096.
Every candidate's GEMM tiles are ones ``TUNED`` already runs on sm_90 in another class (the same constexprs, so
the same compiled kernels, shared memory and spills); only their combination and the class are new.

Shapes: N expert intermediate (w2's last dim).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moekit.experts.triton_backward_launch import TUNED, BackwardTiles


@dataclass(frozen=True)
class TileCandidate:
    """Tiles to try for one ``shape_class`` in place of what ``backward_tiles`` gives it now."""

    shape_class: str  # a ``shape_class`` key
    name: str  # unique within its class
    tiles: BackwardTiles


# The backward's own tiles of "wide/many" (Mixtral at M = 16384): its forward tiles dropped, as the ``MoE`` path's
# forward is the inference one whatever the class.
_WIDE_MANY = replace(TUNED["wide/many"], fwd13=None, fwd2=None)
# "wide/some"'s split grad tile (dY @ W2 its own GEMM, 256 wide) and dX tile, with both weight grads persistent (one
# program per SM walking the 128 x 256 tiles in one flat loop: "mid/some"'s dW13 tile; "wide/many" nests the loops).
_WIDE_PERSISTENT = BackwardTiles(128, TUNED["wide/some"].grad, TUNED["wide/some"].dx, TUNED["mid/some"].dw13,
                                 TUNED["mid/some"].dw13)

# "wide/some" with "mid/few"'s split grad tile, 64 columns wide instead of 128. Compiled offline for sm_90 (Triton 3.6,
# ``benchmarks/trn50_compile_cpu.py``): the 128-wide tile (in "mid/some" and "wide/some") has 605 spill instructions
# (1288 B of spill stores) in its epilogue (two 128 x 128 fp32 accumulators and the dg tile read there, 8 warps), none
# in its K loop; the 64-wide one 10 (20 B), and 131 KB of shared memory against 197 KB.
_WIDE_GRAD64 = replace(TUNED["wide/some"], grad=TUNED["mid/few"].grad)

CANDIDATES: tuple[TileCandidate, ...] = (
    TileCandidate("wide/few", "as-wide/some", TUNED["wide/some"]),
    TileCandidate("wide/few", "persistent", _WIDE_PERSISTENT),
    TileCandidate("wide/few", "grad64", _WIDE_GRAD64),
    TileCandidate("wide/some", "as-wide/many", _WIDE_MANY),
    TileCandidate("wide/some", "persistent", _WIDE_PERSISTENT),
    TileCandidate("wide/some", "grad64", _WIDE_GRAD64),
    TileCandidate("mid/many", "as-mid/some", TUNED["mid/some"]),
)


def candidates_for(shape_class: str) -> dict[str, BackwardTiles]:
    """The candidates of ``shape_class`` by name ({} for a class without any)."""
    return {c.name: c.tiles for c in CANDIDATES if c.shape_class == shape_class}

"""Tile candidates for the fused backward at Mixtral's width that a device check measured and no default takes, kept
selectable with their figures: ``experts_backward(tiles=candidate.tiles)``; ``benchmarks/trn50_device_check.py``
also times each through the training step by giving ``TUNED`` its entry for the run, against the tiles taken now.

Session 50 (``trn50_device_check.py`` on an H100, trn50-ck1 at a7e00a0e; triton-notes "Training, session 50") tried
these and two more for the classes where the Triton step lost to grouped_mm on the H100 (``shape_class``: width
narrow N <= 1024 / mid <= 4096 / wide; rows per expert few <= 256 / some <= 1024 / many). Two were taken into
``TUNED``: "wide/few" (Mixtral-8x7B at M = 1024; before: the heuristic's pointer-load tiles and gathering weight
grads) takes "wide/some"'s grad and dX tiles with both weight grads persistent (step 11.6 -> 7.0 ms; backward 10.1 ->
5.4), "mid/many" (DeepSeek-V2-Lite at M = 16384) "mid/some"'s tiles (step 19.8 -> 13.1 ms). What is left here lost
to or tied with the tiles taken, by step wall ms (medians of 5 interleaved rounds):
- "wide/few" (Mixtral M = 1024; taken 7.01): "as-wide/some" 7.30 (its weight grads not persistent: dW13 1.31 ms
  against 1.20), "grad64" 7.07 (the 64-wide split grad tile: 2.11 ms against 2.21, the weight grads as "as-wide/some").
- "wide/some" (Mixtral M = 4096; taken, ``TUNED``'s H200 tiles, 19.19): "as-wide/many" 19.09, "persistent" 19.53,
  "grad64" 19.84: none outside the rounds' spread, so the H200's tiles stay. The grad GEMM is 6.3 of the backward's
  14.8 ms whatever its tile, 64 or 128 wide (the 128-wide one spills 605 instructions in its epilogue on sm_90, none in
  its K loop: ``benchmarks/trn50_compile_cpu.py``).
Every candidate's GEMM tiles are ones ``TUNED`` already runs on sm_90 in another class (the same constexprs, so the
same compiled kernels, shared memory and spills); only their combination and the class are new.

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


# "wide/some"'s split grad tile (dY @ W2 its own GEMM, 256 wide) and dX tile, with both weight grads persistent (one
# program per SM walking the 128 x 256 tiles in one flat loop): what "wide/few" takes.
_WIDE_PERSISTENT = TUNED["wide/few"]
# "wide/some" with "mid/few"'s split grad tile, 64 columns wide instead of 128 (Triton 3.6: 10 spill instructions
# against 605, 131 KB of shared memory against 197 KB).
_WIDE_GRAD64 = replace(TUNED["wide/some"], grad=TUNED["mid/few"].grad)

CANDIDATES: tuple[TileCandidate, ...] = (
    TileCandidate("wide/few", "as-wide/some", TUNED["wide/some"]),
    TileCandidate("wide/few", "grad64", _WIDE_GRAD64),
    TileCandidate("wide/some", "as-wide/many", replace(TUNED["wide/many"], fwd13=None, fwd2=None)),
    TileCandidate("wide/some", "persistent", _WIDE_PERSISTENT),
    TileCandidate("wide/some", "grad64", _WIDE_GRAD64),
)


def candidates_for(shape_class: str) -> dict[str, BackwardTiles]:
    """The candidates of ``shape_class`` by name ({} for a class without any)."""
    return {c.name: c.tiles for c in CANDIDATES if c.shape_class == shape_class}

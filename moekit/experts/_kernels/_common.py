"""Helpers shared by the kernels."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Programmatic dependent launch (Hopper and later; the host sets ``launch_pdl``). A kernel launched
    so may start while the kernel before it in the stream is still running, which hides its launch and
    ramp behind that kernel's tail. Every kernel of the path calls this before its first read of another
    kernel's output and before its first write: it returns once the previous kernel has finished and
    its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def let_next_kernel_launch(PDL: tl.constexpr):
    """Let the next kernel in the stream launch once every program of this one has called this (or
    exited). Each kernel calls it only after ``wait_for_previous_kernel``, so the order is transitive:
    when a kernel's wait returns, every earlier kernel in the stream has finished."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP: tl.constexpr):
    """Global expert ids (int64 vector) -> local ids, ``num_experts`` meaning "not routed here".

    Same rule as ``moekit.layouts.grouping.to_local_ids``: an id < 0, an id >= the map's length, and
    a map entry of -1 are all "not here"; nothing is ever wrapped onto a valid expert.
    """
    if HAS_MAP:
        in_map = (ids >= 0) & (ids < num_global)
        ids = tl.load(map_ptr + tl.where(in_map, ids, 0), mask=in_map, other=-1).to(tl.int64)
    routed = (ids >= 0) & (ids < num_experts)
    return tl.where(routed, ids, num_experts)


@triton.jit
def grouped_tile(tile, num_m, num_n, GROUP: tl.constexpr):
    """(m, n) of tile number ``tile`` in the grouped order: GROUP consecutive m blocks (usually one expert's rows, or
    one expert's row tiles of its weight grad) sweep the n tiles together, so a tile of the operand they share is read
    from HBM once and from L2 by the others (``gemm._grid_position``'s order, for a tile number not the program's)."""
    per_group = GROUP * num_n
    first = (tile // per_group) * GROUP
    group = tl.minimum(num_m - first, GROUP)
    return first + (tile % per_group) % group, (tile % per_group) // group

"""Helpers shared by the kernels."""

import triton
import triton.language as tl


@triton.jit
def local_expert_ids(ids, map_ptr, num_experts, num_global, HAS_MAP: tl.constexpr):
    """Global expert ids (int64 vector) -> local ids, ``num_experts`` meaning "not routed here".

    Same rule as ``moekit.layouts._grouping.to_local_ids``: an id < 0, an id >= the map's length, and
    a map entry of -1 are all "not here"; nothing is ever wrapped onto a valid expert.
    """
    if HAS_MAP:
        in_map = (ids >= 0) & (ids < num_global)
        ids = tl.load(map_ptr + tl.where(in_map, ids, 0), mask=in_map, other=-1).to(tl.int64)
    routed = (ids >= 0) & (ids < num_experts)
    return tl.where(routed, ids, num_experts)

"""Expert parallelism over ``torch.distributed``: placement, EPLB, and the all-to-all ``EPMoE`` layer.

    [Gate+Route, local tokens] -> [Dispatch: all_to_all_single] -> [Local experts] -> [Combine: all_to_all_single]

``moekit.parallel.placement`` has no ``torch.distributed`` dependency (the simulator imports it);
``EPMoE`` is imported on first use.
"""

from moekit.parallel.placement import (
    Placement,
    balancedness,
    contiguous_placement,
    eplb_placement,
    load_lower_bound,
    rank_loads,
    round_robin_placement,
)

__all__ = [
    "Placement",
    "contiguous_placement",
    "round_robin_placement",
    "eplb_placement",
    "rank_loads",
    "balancedness",
    "load_lower_bound",
]


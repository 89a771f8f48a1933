"""Routing: everything that turns router logits, or a ``Routing``, into a ``Routing``.

    [Route -> Capacity (opt-in) -> Shared slots] -> Group -> Experts -> Combine

``route`` scores, selects and weights the k routed experts (``route.py``); ``apply_capacity`` drops
what exceeds each expert's capacity and counts it (``capacity.py``); ``append_shared_slots`` adds a
fused shared expert's S slots (``shared.py``). ``MoE.route_tokens`` composes the three in this order.
"""

from moekit.routing.capacity import CapacityResult, DropPolicy, apply_capacity, expert_capacity
from moekit.routing.route import Routing, route
from moekit.routing.shared import append_shared_slots

__all__ = [
    "Routing", "route",
    "CapacityResult", "DropPolicy", "apply_capacity", "expert_capacity",
    "append_shared_slots",
]

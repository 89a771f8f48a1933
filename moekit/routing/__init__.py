"""Routing: everything that turns router logits, or a ``Routing``, into a ``Routing``.

    [Route -> Capacity (opt-in) -> Shared slots] -> Group -> Experts -> Combine

``route`` scores, selects and weights the k routed experts (``route.py``); ``apply_capacity`` drops
what exceeds each expert's capacity and counts it (``capacity.py``); ``append_shared_slots`` adds a
fused shared expert's S slots (``shared.py``). ``MoE.route_tokens`` composes the three in this order.
``weighting.py`` holds the slot weights that do more than scale an expert's output (LongCat-Flash's identity
experts, Llama-4's input-weighted experts). ``route_fused`` / ``FusedRouter`` (``fused.py``) compute ``route`` (and
the shared slots) in one Triton kernel, the router options of ``router_math.py`` too (``fused.computes``, where "auto"
takes it on CUDA); ``route`` stays the torch twin the kernel is tested against. For up to 256
tokens ``gate_route.py`` runs the gate GEMM (``gate.py``; tensor cores above 8, ``gate_mma.py``) and that kernel
in one launch. ``hash_route`` (``hash_route.py``) routes by a token-id table instead (DeepSeek-V4's hash layers,
``moekit.HashMoE``), in torch on every device.
"""

from moekit.routing.capacity import CapacityResult, DropPolicy, apply_capacity, expert_capacity
from moekit.routing.fused import FusedRouter, fused_router, route_fused
from moekit.routing.route import Routing, route
from moekit.routing.shared import append_shared_slots

__all__ = [
    "Routing", "route",
    "CapacityResult", "DropPolicy", "apply_capacity", "expert_capacity",
    "append_shared_slots",
    "FusedRouter", "fused_router", "route_fused",
]

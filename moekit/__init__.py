"""moekit: Mixture-of-Experts layers for PyTorch.

    x -> gate -> route -> group -> experts (w13, act-and-mul, w2, routed weight) -> combine (+ shared)
"""

from moekit.config import MoEConfig
from moekit.layer import MoE, MoEOutput, MoEStats, RoutedTokens
from moekit.layer_hash import HashMoE
from moekit.presets import hf_config_of_preset, preset_names
from moekit.routing import Routing, append_shared_slots, route

__all__ = [
    "MoE", "HashMoE", "MoEOutput", "MoEStats", "RoutedTokens", "MoEConfig", "Routing", "route", "append_shared_slots",
    "preset_names", "hf_config_of_preset",
]

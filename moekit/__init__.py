"""moekit: Mixture-of-Experts layers for PyTorch.

    x -> gate -> route -> group -> experts (w13, act-and-mul, w2, routed weight) -> combine (+ shared)

The names below are imported on first use (PEP 562), so that what needs no layer starts without torch: the
``moekit`` command's ``--help``, ``--version`` and usage errors (1.5 s of ``import torch`` on a CPU machine, for a
line of text). ``import moekit; moekit.MoE`` and ``from moekit import MoE`` work as before, and so does a
submodule read as an attribute (``moekit.routing``), as it did when this file imported them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and readers see: the names __getattr__ gives
    from moekit.config import MoEConfig
    from moekit.layer import MoE, MoEOutput, MoEStats, RoutedTokens
    from moekit.layer_hash import HashMoE
    from moekit.presets import hf_config_of_preset, preset_names
    from moekit.routing import Routing, append_shared_slots, route

# public name -> the module that defines it
_HOMES = {
    "MoE": "moekit.layer", "MoEOutput": "moekit.layer", "MoEStats": "moekit.layer", "RoutedTokens": "moekit.layer",
    "HashMoE": "moekit.layer_hash", "MoEConfig": "moekit.config", "Routing": "moekit.routing",
    "route": "moekit.routing", "append_shared_slots": "moekit.routing", "preset_names": "moekit.presets",
    "hf_config_of_preset": "moekit.presets",
}
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value  # looked up once
        return value
    # a submodule read as an attribute (moekit.routing, moekit.hf): imported, as when this file imported the layer
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'moekit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""Seeded random streams: one simulation seed fans out into independent, named generators.

Each purpose (router weight, evaluation batch, training batches, ...) gets its own generator so that
changing how many batches one stage draws never shifts what another stage sees.
"""

from __future__ import annotations

import torch

ROUTER, EVAL, AUX_TRAIN, BIAS_BATCHES, TOUCH, CACHE = range(6)


def generator(seed: int, stream: int) -> torch.Generator:
    """The generator of ``stream`` (< 256) for ``seed``; distinct (seed, stream) pairs never share a state."""
    if not 0 <= stream < 256:
        raise ValueError(f"stream must be in [0, 256), got {stream}")
    return torch.Generator().manual_seed((seed << 8) | stream)

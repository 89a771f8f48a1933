"""``stats_on_host``'s read under dynamo: the layer's stats behind ``torch.compiler.disable``. A module of its own
because the decorator imports torch._dynamo (1.3 s on the development machine): ``routed.stats_on_host`` imports
this module only where dynamo is already loaded, so ``import moekit`` and eager forwards never pay it."""

from __future__ import annotations

import torch


@torch.compiler.disable(reason="MoE(x, return_stats=True) reads its MoEStats on the host (counts, drops: a sync), "
                        "outside the graph; under fullgraph=True pass return_aux_loss=True instead (no host read)")
def stats_untraced(layer, routed):
    """``layer._stats(routed)`` (a ``MoEStats``), run outside any graph."""
    return layer._stats(routed)

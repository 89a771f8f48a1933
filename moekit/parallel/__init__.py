"""Expert parallelism over ``torch.distributed``: placement, EPLB, and the all-to-all ``EPMoE`` layer.

    [Gate+Route, local tokens] -> [Dispatch: all_to_all_single] -> [Local experts] -> [Combine: all_to_all_single]

``moekit.parallel.placement`` and ``moekit.parallel.eplb`` have no ``torch.distributed`` dependency (the
simulator imports them); ``EPMoE`` and ``sync_grads`` (training: every gradient averaged over the ranks after
backward) are imported on first use.
"""

from moekit.parallel.eplb import eplb_placement, load_lower_bound
from moekit.parallel.placement import (
    Placement,
    balancedness,
    contiguous_placement,
    rank_loads,
    round_robin_placement,
)

from moekit.parallel import eplb as _eplb
from moekit.parallel import placement as _placement

__all__ = [*_placement.__all__, *_eplb.__all__, "EPMoE", "EPHashMoE", "RebalanceReport", "PeerRankError",
           "sync_grads"]


def __getattr__(name: str):
    if name in ("EPMoE", "RebalanceReport"):  # imported on first use: it needs torch.distributed
        from moekit.parallel import layer

        return getattr(layer, name)
    if name == "EPHashMoE":  # a HashMoE's expert-parallel layer (EPMoE.from_moe(hash_moe) builds it)
        from moekit.parallel import layer_hash

        return layer_hash.EPHashMoE
    if name == "sync_grads":  # a model's gradients after backward: needs torch.distributed
        from moekit.parallel import grad_sync

        return grad_sync.sync_grads
    if name == "PeerRankError":
        from moekit.parallel import errors

        return errors.PeerRankError
    raise AttributeError(f"module 'moekit.parallel' has no attribute {name!r}")

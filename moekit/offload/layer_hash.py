"""``OffloadedHashMoE``: an offloaded ``HashMoE`` (DeepSeek-V4's hash layers); ``OffloadedMoE.from_moe`` of a
``HashMoE`` builds it.

    [Gate (device) + Route: tid2eid[token_ids] (device table)] -> [OffloadedMoE's experts: cache hits, misses fetched
    or on the CPU] (+ shared) -> [Prefetch the next layer's experts]

The routing is ``HashMoE``'s (the [V, k] table stays on the device with the gate: it is the routing, not an
expert; the router asked for is the ``HashMoE``'s: on CUDA by default the gate kernel and the one-launch hash
router, since session 49), the experts are ``OffloadedMoE``'s. ``moe(x, token_ids=ids)`` as a ``HashMoE``; a call
without ids, or with an id outside the table, is its error naming ``token_ids``. The next layer's prediction: a hash
layer after a hash layer is told exactly, ``tid2eid[token_ids]`` of these ids (``predicted_ids``); a top-k layer by
its router on this input, as between top-k layers; a hash layer after a top-k layer is not predicted (that layer has
no ids).

Shapes: M tokens, K hidden, k = top_k, V table rows.
"""

from __future__ import annotations

import torch

from moekit.layer_hash import HashMoE
from moekit.offload.layer import OffloadedMoE
from moekit.routing.routed import RoutedTokens


class OffloadedHashMoE(OffloadedMoE, HashMoE):
    """``OffloadedMoE`` routed as ``HashMoE`` (the module doc); build it with ``OffloadedMoE.from_moe(hash_moe, ...)``
    (the options are ``OffloadedMoE.from_moe``'s)."""

    def route_tokens(self, x2d: torch.Tensor, workspace=None, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        """``HashMoE.route_tokens`` (checks ``token_ids`` [M] first), the ids kept for the next layer's prediction."""
        routed = HashMoE.route_tokens(self, x2d, workspace, token_ids)
        self._token_ids = token_ids  # [M]; read by this forward's run_routed (_touched)
        return routed

    def predicted_ids(self, x2d: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor | None:
        """This layer's experts [M*k] for the previous layer's ``token_ids`` [M] (the model's ids, the same at every
        layer): its table's rows, exact; None when the previous layer had none (a top-k layer)."""
        return None if token_ids is None else self.tid2eid[token_ids].reshape(-1)

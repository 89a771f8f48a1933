"""``EPHashMoE``: an expert-parallel ``HashMoE`` (DeepSeek-V4's hash layers); ``EPMoE.from_moe`` of a ``HashMoE``
builds it.

    [Gate + Route on each rank: tid2eid[token_ids] (the table replicated), weighted by the scores; the HashMoE's
      router choice, on CUDA by default the gate kernel and the one-launch hash router] -> [EPMoE's
      dispatch to the experts' owner ranks, local experts, combine] (+ shared)

The table is small ([V, k] int64: 6 MiB at V4's vocabulary of 129280 x k = 6) and every rank holds it whole
(``verify_replicated`` checks it equal over the group), so the routing is local and the table's choices leave each
rank as top-k assignments do. What trains: the gate (it weighs the table's experts: sqrt(softplus) scores), the
experts and the shared expert; the table is a buffer, fixed. ``sync_grads`` averages them as ``EPMoE``'s.
``ep(x, token_ids=ids)`` with this rank's tokens and their ids; a call without ids, or an id outside the table, is
``HashMoE``'s error naming ``token_ids`` on that rank and ``PeerRankError`` on the others (agreed before the dispatch).

Shapes: M local tokens, K hidden, k = top_k, V table rows.
"""

from __future__ import annotations

import torch

from moekit.layer_hash import HashMoE
from moekit.parallel.layer import EPMoE
from moekit.routing.routed import MoEOutput, RoutedTokens


class EPHashMoE(EPMoE, HashMoE):
    """``EPMoE`` routed as ``HashMoE`` (the module doc): ``EPHashMoE(config, placement, group, ...)`` for a config with
    ``hash_table_size`` (then ``load_table_`` the model's table on every rank), or ``EPMoE.from_moe(hash_moe)``."""

    def route_tokens(self, x2d: torch.Tensor, workspace=None, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        """``HashMoE.route_tokens`` on this rank's tokens x2d [M, K] and ids [M], counting the routed load for EPLB."""
        routed = HashMoE.route_tokens(self, x2d, workspace, token_ids)
        if self.track_load:
            self._accumulate_load(routed.routing.topk_ids)  # shared slots (ids >= E) are not counted
        return routed

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None, return_stats: bool = False,
                return_aux_loss: bool = False) -> torch.Tensor | MoEOutput:
        """x [..., K] (this rank's tokens), token_ids [...] (their ids) -> [..., K]; collective as ``EPMoE.forward``."""
        return self._collective(x, return_stats or return_aux_loss,
                                lambda: HashMoE.forward(self, x, token_ids, return_stats, return_aux_loss))

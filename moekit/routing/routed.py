"""What ``MoE.route_tokens`` hands the rest of the layer: the routing of a batch, what capacity dropped,
and what the losses read. A routing result, so it lives with the routing stage; ``moekit.layer`` (and
``moekit``) re-export it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.routing.route import Routing


@dataclass
class RoutedTokens:
    """What ``MoE.route_tokens`` decided for a batch of M tokens."""

    routing: Routing  # [M, k(+S)]; capacity drops are id -1 / weight 0; fused shared slots (ids E..E+S-1) last
    dropped_count: torch.Tensor | None = None  # [] int64; assignments the capacity factor dropped; None when dropless
    router_logits: torch.Tensor | None = None  # [M, E] the gate's output (router dtype), what the losses read
    # [M, k(+S)] int32; the router's output before capacity drops: its first top_k columns are the routed choice
    router_ids: torch.Tensor | None = None
    top_k: int = 0  # routed slots of router_ids

    @property
    def selected_ids(self) -> torch.Tensor | None:
        """[M, k] int32: the router's choice before capacity drops and shared slots. Sliced here, on access (the
        losses read it), not by every forward (a slice is an op of a few µs of host time)."""
        ids = self.router_ids
        return ids if ids is None or ids.shape[1] == self.top_k else ids[:, : self.top_k]

    @property
    def dropped(self) -> torch.Tensor:
        """[] int64: assignments the capacity factor dropped, 0 when dropless. The dropless zero is made
        here, on access (a fresh tensor each time, never shared), not by every forward."""
        if self.dropped_count is None:
            return torch.zeros((), dtype=torch.int64, device=self.routing.topk_ids.device)
        return self.dropped_count

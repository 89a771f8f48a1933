"""What ``MoE.route_tokens`` hands the rest of the layer: the routing of a batch, what capacity dropped,
and what the losses read; ``MoEStats``, what a forward did, read from it; ``MoEOutput``, a forward's output with
them. Routing results, so they live with the routing stage; ``moekit.layer`` (and ``moekit``) re-export them."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from moekit.routing.route import Routing


@dataclass
class RoutedTokens:
    """What ``MoE.route_tokens`` decided for a batch of M tokens."""

    routing: Routing  # [M, k(+S)]; capacity drops are id -1 / weight 0; fused shared slots (ids E..E+S-1) last
    dropped_count: torch.Tensor | None = None  # [] int64; assignments the capacity factor dropped; None when dropless
    router_logits: torch.Tensor | None = None  # [M, E(+Z|S)] the gate's output (router dtype); losses read [M, E(+Z)]
    # [M, k(+S)] int32; the router's output before capacity drops: its first top_k columns are the routed choice
    router_ids: torch.Tensor | None = None
    top_k: int = 0  # routed slots of router_ids
    # [M, 1] the routing's dtype; each token's summed identity-expert weight (LongCat-Flash: out += it x token), the
    # identity slots then skipped in ``routing`` (id -1); None without identity experts
    identity_weights: torch.Tensor | None = None

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


@dataclass
class MoEStats:
    """What one forward did, per routed expert (shared slots excluded)."""

    counts: torch.Tensor  # [E] int64; assignments each routed expert processed (after drops); sums to M*k - dropped
    experts_touched: int  # experts with counts > 0
    padded_rows: int  # rows of the block-aligned layout (block_size) the GEMMs would run, padding included
    dropped: int  # assignments dropped by the capacity factor (0 when dropless)
    num_tokens: int  # M
    masked_tokens: int  # tokens with no finite router logit (nonfinite="mask"): all their weights 0, output 0
    layout: str = ""  # the grouping the experts backend used: grouped_mm's plan ("contiguous", ...), else its fixed one
    # [Z] int64; slots the router gave identity expert E + j (LongCat-Flash's zero-computation experts: no expert runs,
    # no capacity drops them); None without identity experts. counts + identity_counts sum to M*k - dropped
    identity_counts: torch.Tensor | None = None

    @property
    def choice_counts(self) -> torch.Tensor:
        """[E + Z] int64: ``counts`` then ``identity_counts``, over the experts the router chooses from (the
        correction bias's width, what ``moekit.balance.update_correction_bias_`` reads); ``counts`` without
        identity experts."""
        return self.counts if self.identity_counts is None else torch.cat([self.counts, self.identity_counts])

    @property
    def zero_compute_share(self) -> float:
        """The fraction of the M*k routed slots that went to identity experts (LongCat-Flash's zero-computation
        share: k·(1 - share) experts run a token on average); 0.0 without identity experts or tokens."""
        if self.identity_counts is None:
            return 0.0
        hits = int(self.identity_counts.sum())
        slots = hits + int(self.counts.sum()) + self.dropped  # M*k
        return hits / slots if slots else 0.0


@dataclass
class MoEOutput:
    """What ``MoE.forward(x, return_stats=True)`` or ``(x, return_aux_loss=True)`` returns."""

    out: torch.Tensor  # [..., K]
    stats: MoEStats | None  # None from forward(x, return_aux_loss=True): the stats are host reads, that path has none
    router_logits: torch.Tensor | None = None  # [M, E(+Z|S)] the gate's logits, router dtype (differentiable)
    # [] float32: config.aux_loss_coef * load_balancing_loss + seq_aux_loss_coef * sequence_balance_loss +
    # z_loss_coef * z_loss over this forward's M tokens (add it to the task loss); None when all three
    # coefficients are 0. The balance losses count the router's choice before capacity drops.
    aux_loss: torch.Tensor | None = None


def stats_on_host(layer, routed: RoutedTokens) -> MoEStats:
    """``layer._stats(routed)`` (``MoE.forward(return_stats=True)``), never traced: a compiled layer breaks its graph
    here once, cleanly (its int fields are host reads), instead of at each read inside, and ``fullgraph=True``
    refuses it with ``_stats_untraced``'s reason rather than dynamo's word on whatever it met first.

    ``torch.compiler.disable`` imports torch._dynamo (1.3 s of ``import moekit`` when it decorated this function at
    import), so the disabled function is taken only where dynamo is loaded: always while it traces (its
    ``IMPORT_NAME`` runs the import below in Python, the decorator with it, before it meets the call), and in any
    process that loaded it, as before. A process that never imported dynamo has nothing that could trace this call.
    ``is_compiling()`` goes first so that dynamo, tracing, never reads ``sys.modules``."""
    if torch.compiler.is_compiling() or "torch._dynamo" in sys.modules:
        from moekit.routing._stats_untraced import stats_untraced

        return stats_untraced(layer, routed)
    return layer._stats(routed)


def stats_of(routed: RoutedTokens, num_experts: int, block: int, layout: str,
             num_identity_experts: int = 0) -> MoEStats:
    """The stats of a forward's routing: counts over the E routed experts (ids -1, shared slots E.. and the
    identity slots taken out before the experts are not counted), padded to ``block`` rows an expert; with
    ``num_identity_experts`` Z > 0, the router's identity slots counted apart (``identity_counts``)."""
    ids = routed.routing.topk_ids.reshape(-1).long()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    counts = torch.bincount(ids, minlength=num_experts)  # [E]
    identity = None
    if num_identity_experts:
        chosen = routed.selected_ids.reshape(-1).long()  # [M*k]; ids E..E+Z-1 are identity slots
        identity = torch.bincount(chosen[chosen >= num_experts] - num_experts, minlength=num_identity_experts)  # [Z]
    masked = routed.routing.masked_tokens
    return MoEStats(
        counts=counts,
        experts_touched=int((counts > 0).sum()),
        padded_rows=int(((counts + block - 1) // block * block).sum()),
        dropped=0 if routed.dropped_count is None else int(routed.dropped_count),
        num_tokens=routed.routing.num_tokens,
        masked_tokens=int(masked if masked is not None else 0),
        layout=layout,
        identity_counts=identity,
    )

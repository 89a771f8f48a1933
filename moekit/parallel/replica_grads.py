"""An expert's replicas train as one expert: their ``w13`` / ``w2`` gradients summed, the sum in every replica.

    [backward: each slot's gradient covers the tokens it served] -> [partial: this rank's slots of e, summed]
      -> [all_to_all_single: partials between the ranks holding e] -> [sum in ascending rank order, into every slot]

EPLB (``EPMoE.rebalance(num_redundant=R)``) puts a hot expert in several slots, on several ranks or twice on one, and
the dispatch splits its tokens over them, so each slot's gradient covers only its share; a single copy of the expert
would get their sum. ``EPMoE.sync_grads`` (after backward, before the optimizer step) writes that sum into
every slot, so an optimizer step keeps the replicas equal. Communication: only the partials of experts whose slots sit
on more than one rank, only between the ranks holding them (one row a shared expert a pair of ranks, both directions);
an expert doubled on one rank is summed locally; a placement where no expert spans two ranks makes no collective at all.
Every holder adds the same partials in the same (ascending rank) order, so the replicas' gradients are bit-identical.

Shapes: L slots on this rank (+ S fused shared slots, not replicas: every rank's own, left to data parallelism),
X replicated experts this rank holds, P = 2N*K + K*N one expert's two gradients flattened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.parallel.placement import Placement


@dataclass(frozen=True)
class ReplicaSums:
    """What one rank adds and exchanges for its replicated experts under one placement (host ints)."""

    experts: tuple[int, ...]  # the logical experts this rank holds in 2+ slots of the group, ascending
    slots: tuple[tuple[int, ...], ...]  # slots[i]: this rank's local slots of experts[i], ascending
    holders: tuple[tuple[int, ...], ...]  # holders[i]: the distinct ranks holding experts[i], ascending
    peers: tuple[tuple[int, ...], ...]  # peers[r]: indices into experts held by rank r too (none for r = this rank)
    exchanges: bool  # some expert of the placement has slots on two ranks: the group's collective runs

    @classmethod
    def build(cls, placement: Placement, rank: int) -> "ReplicaSums":
        mine = placement.slots[rank]
        ranks_of = [sorted(set(placement.replicas(e))) for e in range(placement.num_experts)]
        experts = sorted({e for e in mine if len(placement.replicas(e)) > 1})
        peers = tuple(tuple(i for i, e in enumerate(experts) if r != rank and r in ranks_of[e])
                      for r in range(placement.world_size))
        return cls(experts=tuple(experts),
                   slots=tuple(tuple(s for s, held in enumerate(mine) if held == e) for e in experts),
                   holders=tuple(tuple(ranks_of[e]) for e in experts), peers=peers,
                   exchanges=any(len(ranks) > 1 for ranks in ranks_of))


def check_grads(w13: torch.Tensor, w2: torch.Tensor, rank: int, what: str = "") -> None:
    """Raise a ValueError naming the weight when a training expert weight holds no gradient (before backward)."""
    missing = [name for name, w in (("w13", w13), ("w2", w2)) if w.requires_grad and w.grad is None]
    if missing:
        raise ValueError(f"sync_grads: {' and '.join(missing)}{what} hold no gradient on rank {rank}: call it after "
                         "backward")


def sum_replicas(w13: torch.Tensor, w2: torch.Tensor, plan: ReplicaSums, rank: int, group) -> int:
    """Every slot of a replicated expert gets the sum of its slots' gradients over the group (``w13.grad`` [L+S, 2N,
    K], ``w2.grad`` [L+S, K, N], in place); returns the experts summed on this rank. One ``all_to_all_single`` over
    the group when ``plan.exchanges`` (every rank calls it then, after the caller's error agreement), none otherwise;
    the gradients are there (``check_grads``)."""
    if not plan.experts and not plan.exchanges:
        return 0
    width = w13[0].numel() + w2[0].numel() if w13.shape[0] else 0  # P
    g13, g2 = w13.grad, w2.grad
    partial = torch.stack([torch.cat([g13[list(s)].sum(0).reshape(-1), g2[list(s)].sum(0).reshape(-1)])
                           for s in plan.slots]) if plan.experts else w13.new_empty((0, width))  # [X, P]
    received = _exchange(partial, plan, group) if plan.exchanges else {}
    acc = torch.promote_types(partial.dtype, torch.float32)  # bf16 gradients summed in float32, rounded once
    with torch.no_grad():
        for i, slots in enumerate(plan.slots):
            parts = [partial[i] if r == rank else received[(r, i)] for r in plan.holders[i]]
            total = parts[0].to(acc)
            for part in parts[1:]:
                total = total + part.to(acc)
            total = total.to(partial.dtype)
            for s in slots:
                g13[s].copy_(total[: g13[s].numel()].view_as(g13[s]))
                g2[s].copy_(total[g13[s].numel():].view_as(g2[s]))
    return len(plan.experts)


def _exchange(partial: torch.Tensor, plan: ReplicaSums, group) -> dict[tuple[int, int], torch.Tensor]:
    """partial [X, P] -> {(rank r, i): rank r's partial of experts[i]} for every peer r holding experts[i]: one
    ``all_to_all_single`` in which this rank sends each peer the rows they both hold (the same list both ways)."""
    sizes = [len(p) for p in plan.peers]
    send = partial[[i for p in plan.peers for i in p]]  # [sum(sizes), P]
    recv = partial.new_empty((sum(sizes), partial.shape[1]))
    dist.all_to_all_single(recv, send, sizes, sizes, group=group)
    rows, offset = {}, 0
    for r, indices in enumerate(plan.peers):
        for i in indices:
            rows[(r, i)] = recv[offset]
            offset += 1
    return rows

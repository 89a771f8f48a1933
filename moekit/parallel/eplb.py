"""EPLB: a placement of E + R physical expert slots on W ranks that balances the rank loads.

Names as in ``moekit.parallel.placement``: E = ``num_experts``, W = ``world_size``, R = ``num_redundant``,
P = E + R physical slots in all.

EPLB (``eplb_placement``), in three steps:

1. Replicate: each of the R redundant slots goes to the expert whose per-replica load
   ``load[e] / replicas[e]`` is the largest at that moment (ties: lower id), never more than W
   replicas of one expert. This greedy step minimises the largest per-replica load exactly.
2. Pack: every replica is an item of weight ``load[e] / replicas[e]``; items go heaviest first to the
   least-loaded rank that still has a free slot and does not hold that expert yet (LPT with a slot
   limit of ceil(P / W) per rank, like DeepSeek's balanced packing).
3. Refine: while swapping one item of the most-loaded rank with a lighter item of another rank lowers
   the larger of the two rank loads, do the best such swap (each swap strictly lowers the sum of
   squared rank loads, so this terminates; capped at 4·P swaps anyway).

The result is measured against ``load_lower_bound``: max(mean rank load, the largest per-replica load
after step 1). Every placement's maximum rank load is at least that bound, so ``max / bound`` says how
far greedy can be from optimal. ``eplb_placement(..., current=p)`` returns ``p`` unchanged unless the
new placement lowers the maximum rank load, so a rebalance never raises it.
"""

from __future__ import annotations

import heapq

from moekit.parallel.placement import Placement, _check_loads, rank_loads

__all__ = ["eplb_placement", "load_lower_bound"]


def _replicate(values: list[float], world_size: int, num_redundant: int) -> list[int]:
    """Step 1: replica count per expert, each extra replica to the largest per-replica load."""
    num_experts = len(values)
    if num_redundant < 0:
        raise ValueError(f"num_redundant must be >= 0, got {num_redundant}")
    if num_redundant > num_experts * (world_size - 1):
        raise ValueError(
            f"num_redundant={num_redundant} needs more than world_size={world_size} replicas of some expert "
            f"(at most {num_experts * (world_size - 1)} for num_experts={num_experts})"
        )
    counts = [1] * num_experts
    heap = [(-v, e) for e, v in enumerate(values)]  # (-per-replica load, expert): lower id wins ties
    heapq.heapify(heap)
    for _ in range(num_redundant):
        full = []
        while True:
            neg, e = heapq.heappop(heap)
            if counts[e] < world_size:
                break
            full.append((neg, e))  # already on every rank: set aside for this round
        counts[e] += 1
        heapq.heappush(heap, (-values[e] / counts[e], e))
        for item in full:
            heapq.heappush(heap, item)
    return counts


def load_lower_bound(loads, world_size: int, num_redundant: int = 0) -> float:
    """A bound no placement of E + ``num_redundant`` slots on ``world_size`` ranks can beat: the
    maximum rank load is at least the mean rank load, and at least the largest per-replica load
    after the best possible replication (a replica's whole share lands on one rank)."""
    values = _check_loads(loads)
    counts = _replicate(values, world_size, num_redundant)
    largest_share = max(v / c for v, c in zip(values, counts))
    return max(sum(values) / world_size, largest_share)


def eplb_placement(
    loads, world_size: int, num_redundant: int = 0, *, current: Placement | None = None
) -> Placement:
    """A placement of E + ``num_redundant`` physical slots that minimises the maximum rank load
    (greedy; see the module docstring). Deterministic: the same loads give the same placement.

    With ``current``, returns ``current`` itself unless the new placement has a strictly lower
    maximum rank load under ``loads``, so applying it never raises the maximum rank load.
    """
    values = _check_loads(loads)
    num_experts = len(values)
    if world_size < 1 or num_experts + num_redundant < world_size:
        raise ValueError(
            f"need num_experts + num_redundant >= world_size >= 1 (a slot on every rank), got "
            f"num_experts={num_experts}, num_redundant={num_redundant}, world_size={world_size}"
        )
    counts = _replicate(values, world_size, num_redundant)
    num_physical = num_experts + num_redundant
    slot_limit = -(-num_physical // world_size)  # ceil(P / W) slots per rank at most

    items = sorted(((values[e] / counts[e], e) for e in range(num_experts) for _ in range(counts[e])),
                   key=lambda item: (-item[0], item[1]))  # heaviest first, then lower id
    slots: list[list[int]] = [[] for _ in range(world_size)]
    loads_now = [0.0] * world_size
    for share, e in items:
        # The least-loaded rank with room that does not hold e yet; ties go to the lower rank.
        rank = min((r for r in range(world_size) if len(slots[r]) < slot_limit and e not in slots[r]),
                   key=lambda r: (loads_now[r], r))
        slots[rank].append(e)
        loads_now[rank] += share
    _refine_by_swaps(slots, loads_now, [values[e] / counts[e] for e in range(num_experts)])
    for rank_slots in slots:
        rank_slots.sort()
    placement = Placement(num_experts, world_size, slots)

    if current is not None:
        if current.num_experts != num_experts or current.world_size != world_size:
            raise ValueError(
                f"current must place num_experts={num_experts} over world_size={world_size}, got "
                f"{current.num_experts} over {current.world_size}"
            )
        if max(rank_loads(placement, values)) >= max(rank_loads(current, values)):
            return current
    return placement


def _refine_by_swaps(slots: list[list[int]], loads_now: list[float], share: list[float]) -> None:
    """Step 3: swap one item of the most-loaded rank with a lighter one elsewhere while that lowers
    the larger of the two rank loads; the best swap first. Edits ``slots`` and ``loads_now``."""
    world_size = len(slots)
    for _ in range(4 * sum(len(s) for s in slots)):
        top = max(range(world_size), key=lambda r: (loads_now[r], -r))
        best = None  # (new pair max, a index on top, other rank, b index)
        for i, a in enumerate(slots[top]):
            for other in range(world_size):
                if other == top:
                    continue
                for j, b in enumerate(slots[other]):
                    delta = share[a] - share[b]
                    if delta <= 0 or a in slots[other] or b in slots[top]:
                        continue
                    pair_max = max(loads_now[top] - delta, loads_now[other] + delta)
                    if pair_max < loads_now[top] - 1e-12 * max(1.0, loads_now[top]):
                        if best is None or pair_max < best[0]:
                            best = (pair_max, i, other, j)
        if best is None:
            return
        _, i, other, j = best
        a, b = slots[top][i], slots[other][j]
        slots[top][i], slots[other][j] = b, a
        loads_now[top] -= share[a] - share[b]
        loads_now[other] += share[a] - share[b]

"""EPLB: a placement of E + R physical expert slots on W ranks that balances the rank loads.

Names as in ``moekit.parallel.placement``: E = ``num_experts``, W = ``world_size``, R = ``num_redundant``,
P = E + R physical slots in all, S_r = the slots of rank r (P // W, or one more on P % W of the ranks).
Cost model: a replica serves an equal share ``load[e] / replicas[e]`` of its expert's load, and a
rank's load is the sum over its slots; the goal is the lowest maximum rank load.

Replica counts and placement are chosen together (``eplb_placement``), because counts fixed first
can rule the best placement out (Zipf-1.6 loads, E=256, W=8, R=8: greedy counts give at best 1.044 x
the mean, other counts 1.000):

1. Count vectors (replicas per expert, >= 1 each, P in all): the R-step greedy that gives every extra
   slot to the largest ``load[e] / replicas[e]`` (ties: lower id), capped at W replicas per expert
   and uncapped (DeepSeek's ``replicate_experts``); and, for targets T = bound·(1 + slack), the fewest
   replicas that keep every share <= T, the slots left over one each to the heaviest experts. When
   there are at most ``_EXHAUSTIVE`` count vectors in all, every one of them.
2. Pack each vector twice by LPT (replicas heaviest first to the least-loaded rank with a free slot,
   ties to the lower rank): once preferring ranks that do not hold that expert yet, once ignoring
   that (DeepSeek's balanced packing).
3. Local search on the ``_SEARCHED`` packings with the lowest maximum (on all of them when the counts
   were enumerated), from the most-loaded rank t, while some move leaves every rank it touches below
   t's load: the best swap of a slot of t with a lighter slot elsewhere (counts fixed), else the best
   replica transfer (one slot changes expert: one expert loses a replica, another gains one). Every
   accepted move lowers the rank-load vector sorted descending, so the search ends; it is capped at
   P moves anyway.
4. Keep the lowest maximum rank load; at equal load, the fewest slots that double an expert on its
   rank (ties: the earlier candidate).

A rank may hold two replicas of one expert: under the cost model that rank serves both shares, which
is sometimes the only way to the optimum (loads [16, 13, 3], W=2, R=1: 16/16 needs expert 0 twice on
one rank, as DeepSeek's packing does; with distinct experts per rank 17.5 is the best).

DeepSeek's algorithm is one of the packings; the search starts from the lowest packings and never
raises their maximum, so the result is never worse than DeepSeek's on the same loads (its ties broken
as above). On every case with E <= 4, W <= 3, R <= 3 tried against an exhaustive search it is
optimal; in general it is a heuristic. Deterministic: the same loads give the same placement.

``load_lower_bound``: max(mean rank load, the largest per-replica load of the W-capped greedy counts).
Every placement's maximum rank load is at least that bound, so ``max / bound`` says how far a
placement can be from optimal. ``eplb_placement(..., current=p)`` returns ``p`` unchanged unless the
new placement lowers the maximum rank load, so a rebalance never raises it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field

from moekit.parallel.placement import Placement, _check_loads, rank_loads

__all__ = ["eplb_placement", "load_lower_bound"]

_TARGET_SLACK = (0.0, 0.02, 0.05, 0.1, 0.2)  # count candidates for targets bound·(1 + slack)
_SEARCHED = 3  # packings, lowest LPT maximum first, that get the local search (1, 2, 3 on 35 Zipf and
# one-hot cases: mean max/bound 1.0189, 1.0178, 1.0158; time grows about linearly)
_EXHAUSTIVE = 64  # at most this many count vectors (E=4, R<=4; E=8, R<=1): pack and search them all


def _replicate(values: list[float], world_size: int, num_redundant: int, capped: bool = True) -> list[int]:
    """Replica count per expert: each extra replica to the largest per-replica load (ties: lower id),
    at most ``world_size`` replicas of one expert when ``capped``."""
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
            if not capped or counts[e] < world_size:
                break
            full.append((neg, e))  # already on every rank: set aside for this round
        counts[e] += 1
        heapq.heappush(heap, (-values[e] / counts[e], e))
        for item in full:
            heapq.heappush(heap, item)
    return counts


def load_lower_bound(loads, world_size: int, num_redundant: int = 0) -> float:
    """A bound no placement of E + ``num_redundant`` slots on ``world_size`` ranks can beat: the
    maximum rank load is at least the mean rank load, and at least ``load[e] / d[e]`` for every expert,
    d[e] <= W being the ranks that hold e (its whole load lands on them; two replicas on one rank
    only make that rank's share larger). The d with sum(d) <= E + R that minimises the largest
    ``load[e] / d[e]`` is the W-capped greedy replication."""
    values = _check_loads(loads)
    counts = _replicate(values, world_size, num_redundant)
    largest_share = max(v / c for v, c in zip(values, counts))
    return max(sum(values) / world_size, largest_share)


@dataclass
class RebalanceReport:
    """What one EPLB rebalance of an ``EPMoE`` saw and did (identical on every rank)."""

    loads: list[float]  # [E] routed assignments per logical expert, summed over ranks since the last rebalance
    balancedness_before: float  # mean / max rank load under the old placement
    balancedness_after: float  # the same under the placement now in use
    max_load_before: float
    max_load_after: float  # <= max_load_before: the old placement is kept unless the new one is better
    lower_bound: float  # no placement with this many redundant slots can have a lower max rank load
    slots_received: int  # expert slots whose weights this rank received over the network
    placement: Placement  # the placement now in use


@dataclass
class _Packing:
    """A placement under construction: the expert in every slot and what each rank carries."""

    values: list[float]  # [E] load of logical expert e
    counts: list[int]  # [E] slots holding e over all ranks (>= 1)
    slots: list[list[int]]  # [W][S_r] expert held by each slot of rank r
    loads: list[float] = field(init=False)  # [W] sum over rank r's slots of values[e] / counts[e]
    where: list[dict[int, int]] = field(init=False)  # [E] {rank: slots of e on that rank}

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Recompute loads and ``where`` from slots and counts (no drift from incremental updates)."""
        self.loads = [sum(self.values[e] / self.counts[e] for e in s) for s in self.slots]
        self.where = [{} for _ in self.values]
        for rank, rank_slots in enumerate(self.slots):
            for e in rank_slots:
                self.where[e][rank] = self.where[e].get(rank, 0) + 1

    @property
    def peak(self) -> float:
        return max(self.loads)

    @property
    def doubled(self) -> int:
        """Slots that hold an expert their rank already holds in another slot."""
        return sum(len(s) - len(set(s)) for s in self.slots)

    def rewrite(self, changes: list[tuple[int, int, int]]) -> None:
        """Apply (rank, slot index, new expert) changes; the counts follow."""
        for rank, index, expert in changes:
            self.counts[self.slots[rank][index]] -= 1
            self.counts[expert] += 1
            self.slots[rank][index] = expert
        self.refresh()


@dataclass
class _Move:
    score: float  # the largest new load among the ranks it touches
    changes: list[tuple[int, int, int]]  # (rank, slot index, new expert)


def _pack(values: list[float], counts: list[int], world_size: int, spread: bool) -> _Packing:
    """LPT: replicas heaviest first (ties: lower id), each to the least-loaded rank with a free slot
    (ties: lower rank); with ``spread``, a rank that does not hold that expert yet where one has room.
    Every rank ends with P // W or P // W + 1 slots."""
    base, extra = divmod(sum(counts), world_size)
    items = sorted(((values[e] / counts[e], e) for e in range(len(values)) for _ in range(counts[e])),
                   key=lambda item: (-item[0], item[1]))
    slots: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0.0] * world_size
    longer = 0  # ranks holding base + 1 slots; at most ``extra`` may
    for share, e in items:
        room = base + (longer < extra)
        rank = min((r for r in range(world_size) if len(slots[r]) < room),
                   key=lambda r: (spread and e in slots[r], loads[r], r))
        slots[rank].append(e)
        loads[rank] += share
        longer += len(slots[rank]) == base + 1
    return _Packing(values, list(counts), slots)


def _best_swap(p: _Packing, top: int, limit: float) -> _Move | None:
    """The swap of a slot of ``top`` with a lighter slot of another rank that leaves the larger of the
    two ranks lowest, if that is below ``limit``. Counts do not change. For a slot of share x on
    ``top`` and a rank ``gap`` lighter, the best partner slot has the share nearest x - gap / 2
    (bisection over that rank's sorted shares)."""
    share = [v / c for v, c in zip(p.values, p.counts)]
    by_rank = [sorted((share[e], j) for j, e in enumerate(s)) for s in p.slots]  # [W][S_r] (share, slot)
    best = None
    for i, a in enumerate(p.slots[top]):
        for other, ordered in enumerate(by_rank):
            gap = p.loads[top] - p.loads[other]
            if other == top or gap <= 0:
                continue
            k = bisect.bisect_left(ordered, (share[a] - gap / 2, -1))
            for b_share, j in ordered[max(k - 1, 0) : k + 1]:
                delta = share[a] - b_share
                new_max = p.loads[top] - delta if 2 * delta < gap else p.loads[other] + delta
                if 0 < delta and new_max < limit and (best is None or new_max < best.score):
                    best = _Move(new_max, [(top, i, p.slots[other][j]), (other, j, a)])
    return best


def _load_after(p: _Packing, r: int, rank: int, old: int, new: int) -> float:
    """Rank ``r``'s load once a slot of ``rank`` holds ``new`` instead of ``old``: ``old``'s remaining
    replicas each carry more, ``new``'s each carry less, and ``rank`` trades one for the other."""
    here = int(r == rank)
    load = p.loads[r]
    for expert, gained in ((old, -1), (new, 1)):
        held = p.where[expert].get(r, 0)
        value, count = p.values[expert], p.counts[expert]
        load += (held + gained * here) * value / (count + gained) - held * value / count
    return load


def _best_transfer(p: _Packing, top: int, limit: float) -> _Move | None:
    """The best replica transfer that lowers ``top``: a slot anywhere whose expert has >= 2 replicas
    becomes another replica of an expert on ``top`` (shrinking its shares there), or a slot of ``top``
    becomes any other expert. Every touched rank must end below ``limit``."""
    candidates = [(s, i, b) for b in sorted(set(p.slots[top])) for s, held in enumerate(p.slots)
                  for i, a in enumerate(held) if a != b and p.counts[a] > 1]
    candidates += [(top, i, b) for i, a in enumerate(p.slots[top]) if p.counts[a] > 1
                   for b in range(len(p.values)) if b != a]
    best = None
    for rank, index, new in candidates:
        old = p.slots[rank][index]
        cutoff = limit if best is None else best.score
        # Two touched ranks first (an untouched top keeps its load, so fails here): most candidates stop.
        if max(_load_after(p, top, rank, old, new), _load_after(p, rank, rank, old, new)) >= cutoff:
            continue
        new_max = 0.0
        for r in (*p.where[old], *p.where[new]):  # the ranks that hold ``old`` grow: they fail first
            new_max = max(new_max, _load_after(p, r, rank, old, new))
            if new_max >= cutoff:
                break
        else:
            best = _Move(new_max, [(rank, index, new)])
    return best


def _candidate_counts(values: list[float], world_size: int, num_redundant: int) -> list[list[int]]:
    """Replica-count vectors to pack (step 1 of the module docstring), without repeats."""
    out = [_replicate(values, world_size, num_redundant, capped) for capped in (True, False)]
    bound = load_lower_bound(values, world_size, num_redundant)
    for slack in _TARGET_SLACK:
        counts = _counts_for_target(values, len(values) + num_redundant, bound * (1 + slack))
        if counts is not None:
            out.append(counts)
    return [c for i, c in enumerate(out) if c not in out[:i]]


def _all_counts(num_experts: int, num_redundant: int):
    """Every replica-count vector: each expert >= 1 replica, R extra in all (stars and bars)."""
    for bars in itertools.combinations(range(num_redundant + num_experts - 1), num_experts - 1):
        edges = (-1, *bars, num_redundant + num_experts - 1)
        yield [edges[i + 1] - edges[i] for i in range(num_experts)]


def _counts_for_target(values: list[float], num_physical: int, target: float) -> list[int] | None:
    """The fewest replicas that keep every share <= ``target``, then the slots left over one each to
    the experts in decreasing load order (ties: lower id), cycling; None when they need > P slots."""
    counts = [max(1, math.ceil(v / target * (1 - 1e-12))) if target > 0 else 1 for v in values]
    left = num_physical - sum(counts)
    if left < 0:
        return None
    order = sorted(range(len(values)), key=lambda e: (-values[e], e))
    for i in range(left):
        counts[order[i % len(order)]] += 1
    return counts


def _improve(p: _Packing) -> None:
    """Local search (step 2 of the module docstring): swaps first, then replica transfers."""
    world_size = len(p.slots)
    for _ in range(sum(p.counts)):  # P moves: on 35 Zipf and one-hot cases a cap of 4·P found no better placement
        top = max(range(world_size), key=lambda r: (p.loads[r], -r))
        limit = p.loads[top] * (1 - 1e-12)
        move = _best_swap(p, top, limit) or _best_transfer(p, top, limit)
        if move is None:
            return
        p.rewrite(move.changes)


def eplb_placement(
    loads, world_size: int, num_redundant: int = 0, *, current: Placement | None = None
) -> Placement:
    """A placement of E + ``num_redundant`` physical slots (P // W or P // W + 1 per rank) that
    minimises the maximum rank load (a search, see the module docstring); never worse than
    DeepSeek's EPLB. Deterministic: the same loads give the same placement.

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
    count_vectors = _candidate_counts(values, world_size, num_redundant)
    exhaustive = math.comb(num_redundant + num_experts - 1, num_experts - 1) <= _EXHAUSTIVE
    if exhaustive:
        count_vectors += [c for c in _all_counts(num_experts, num_redundant) if c not in count_vectors]
    packings = [_pack(values, counts, world_size, spread) for counts in count_vectors for spread in (True, False)]
    if not exhaustive:  # sorted() is stable: ties keep the candidates' order
        packings = sorted(packings, key=lambda p: p.peak)[:_SEARCHED]
    best = None
    for packing in packings:
        _improve(packing)
        if best is None or _better(packing, best):
            best = packing
    placement = Placement(num_experts, world_size, [sorted(s) for s in best.slots])

    if current is not None:
        if current.num_experts != num_experts or current.world_size != world_size:
            raise ValueError(
                f"current must place num_experts={num_experts} over world_size={world_size}, got "
                f"{current.num_experts} over {current.world_size}"
            )
        if max(rank_loads(placement, values)) >= max(rank_loads(current, values)):
            return current
    return placement


def _better(a: _Packing, b: _Packing) -> bool:
    """``a`` has a lower maximum rank load than ``b`` (beyond rounding), or the same with fewer doubled slots."""
    tol = 1e-12 * max(a.peak, b.peak)
    return a.peak < b.peak - tol or (a.peak <= b.peak + tol and a.doubled < b.doubled)

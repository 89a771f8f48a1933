"""Expert placement: which rank holds which logical expert, and EPLB's rebalanced placements.

Pure Python (plus torch for ``expert_map_for``); no ``torch.distributed``, so the simulator's
expert-parallel what-if and the ``EPMoE`` layer share one implementation.

Names: E = ``num_experts`` (logical routed experts), W = ``world_size`` (ranks), R = ``num_redundant``
(extra physical slots that hold replicas of hot experts), P = E + R physical slots in all,
``num_local_experts(r)`` = the physical slots on rank r.

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
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = [
    "Placement",
    "contiguous_placement",
    "round_robin_placement",
    "eplb_placement",
    "rank_loads",
    "balancedness",
    "load_lower_bound",
]


@dataclass
class Placement:
    """A logical -> physical expert map over ``world_size`` ranks.

    Every logical expert is held by at least one rank (else its tokens would have nowhere to go) and
    by a rank at most once; an expert on several ranks has replicas, and the tokens routed to it are
    split evenly over them.
    """

    num_experts: int  # E: logical routed experts
    world_size: int  # W: ranks
    slots: list[list[int]]  # slots[r] = logical experts held by rank r, in local-index order
    _replicas: list[list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {self.num_experts!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if len(self.slots) != self.world_size:
            raise ValueError(f"slots must have one list per rank (world_size={self.world_size}), got {len(self.slots)}")
        self.slots = [[int(e) for e in rank_slots] for rank_slots in self.slots]
        replicas: list[list[int]] = [[] for _ in range(self.num_experts)]
        for rank, rank_slots in enumerate(self.slots):
            if len(set(rank_slots)) != len(rank_slots):
                raise ValueError(f"slots[{rank}] holds an expert twice: {rank_slots}")
            for e in rank_slots:
                if not 0 <= e < self.num_experts:
                    raise ValueError(f"slots[{rank}] has expert id {e}, expected 0 <= id < num_experts={self.num_experts}")
                replicas[e].append(rank)
        missing = [e for e, ranks in enumerate(replicas) if not ranks]
        if missing:
            raise ValueError(f"every expert must be held by some rank; experts {missing[:8]} are on none")
        self._replicas = replicas

    @property
    def num_physical_experts(self) -> int:
        """P: physical expert slots over all ranks (E plus the redundant replicas)."""
        return sum(len(s) for s in self.slots)

    @property
    def num_redundant(self) -> int:
        return self.num_physical_experts - self.num_experts

    def num_local_experts(self, rank: int) -> int:
        """Physical expert slots on ``rank`` (the first dim of its ``w13``/``w2``)."""
        return len(self.slots[rank])

    def replicas(self, expert: int) -> list[int]:
        """The ranks that hold logical ``expert``, ascending."""
        return list(self._replicas[expert])

    def replica_counts(self) -> list[int]:
        """replica_counts()[e] = number of ranks holding expert e (>= 1)."""
        return [len(r) for r in self._replicas]

    def expert_map_for(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[E] int32: the local index of each logical expert on ``rank``, or -1 where it holds none
        (vLLM's expert-map convention, accepted by ``moekit.experts.run_experts``)."""
        out = torch.full((self.num_experts,), -1, dtype=torch.int32)
        for local, e in enumerate(self.slots[rank]):
            out[e] = local
        return out.to(device) if device is not None else out

    @classmethod
    def from_expert_maps(cls, expert_maps) -> "Placement":
        """From per-rank expert maps (vLLM's form): ``expert_maps[r][e]`` is e's local index on rank r,
        or -1 where rank r does not hold e. Each rank's local indices must be 0..L-1."""
        rows = [list(map(int, m.tolist() if isinstance(m, torch.Tensor) else m)) for m in expert_maps]
        if not rows or len({len(r) for r in rows}) != 1:
            raise ValueError("expert_maps must be a non-empty [world_size, num_experts] table")
        slots = []
        for rank, row in enumerate(rows):
            held = sorted((local, e) for e, local in enumerate(row) if local != -1)
            if [local for local, _ in held] != list(range(len(held))):
                raise ValueError(f"expert_maps[{rank}] must use local indices 0..L-1 once each (or -1), got {row}")
            slots.append([e for _, e in held])
        return cls(num_experts=len(rows[0]), world_size=len(rows), slots=slots)

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "world_size": self.world_size, "slots": [list(s) for s in self.slots]}

    @classmethod
    def from_dict(cls, d: dict) -> "Placement":
        return cls(num_experts=int(d["num_experts"]), world_size=int(d["world_size"]), slots=d["slots"])


def contiguous_placement(num_experts: int, world_size: int) -> Placement:
    """Rank r holds a contiguous run of experts; the first E % W ranks hold one more
    (E=256, W=2: rank 0 holds 0..127, rank 1 holds 128..255). Needs E >= W."""
    _check_sizes(num_experts, world_size)
    base, extra = divmod(num_experts, world_size)
    slots, start = [], 0
    for rank in range(world_size):
        size = base + (rank < extra)
        slots.append(list(range(start, start + size)))
        start += size
    return Placement(num_experts, world_size, slots)


def round_robin_placement(num_experts: int, world_size: int) -> Placement:
    """Rank r holds experts r, r + W, r + 2W, ... (spreads neighbouring, often co-hot, experts)."""
    _check_sizes(num_experts, world_size)
    return Placement(num_experts, world_size, [list(range(r, num_experts, world_size)) for r in range(world_size)])


def _check_sizes(num_experts: int, world_size: int) -> None:
    if world_size < 1 or num_experts < world_size:
        raise ValueError(f"need num_experts >= world_size >= 1, got num_experts={num_experts}, world_size={world_size}")


def _check_loads(loads) -> list[float]:
    values = [float(v) for v in (loads.tolist() if isinstance(loads, torch.Tensor) else loads)]
    if not values:
        raise ValueError("loads must have one entry per logical expert, got none")
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"loads must be finite and >= 0; entries {bad[:8]} are not")
    return values


def rank_loads(placement: Placement, loads) -> list[float]:
    """Load per rank: each rank sums ``load[e] / replicas(e)`` over the experts it holds (the even
    split EPMoE's replica choice produces)."""
    values = _check_loads(loads)
    if len(values) != placement.num_experts:
        raise ValueError(f"loads must have num_experts={placement.num_experts} entries, got {len(values)}")
    counts = placement.replica_counts()
    return [sum(values[e] / counts[e] for e in rank_slots) for rank_slots in placement.slots]


def balancedness(rank_loads: Sequence[float]) -> float:
    """mean / max of the rank loads: 1.0 is perfectly balanced, 1/W is everything on one rank.
    An all-zero load counts as balanced (1.0)."""
    values = [float(v) for v in rank_loads]
    if not values:
        raise ValueError("rank_loads must not be empty")
    peak = max(values)
    return 1.0 if peak <= 0 else (sum(values) / len(values)) / peak


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

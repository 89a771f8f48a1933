"""Expert placement: which rank holds which logical expert, and the rank loads a placement gives.

Pure Python (plus torch for ``expert_map_for``); no ``torch.distributed``, so the simulator's
expert-parallel what-if and the ``EPMoE`` layer share one implementation. EPLB's rebalanced
placements live in ``moekit.parallel.eplb``.

Names: E = ``num_experts`` (logical routed experts), W = ``world_size`` (ranks), R = ``num_redundant``
(extra physical slots that hold replicas of hot experts), P = E + R physical slots in all,
``num_local_experts(r)`` = the physical slots on rank r.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from moekit._checks import check_int

__all__ = [
    "Placement",
    "contiguous_placement",
    "round_robin_placement",
    "rank_loads",
    "balancedness",
]


@dataclass
class Placement:
    """A logical -> physical expert map over ``world_size`` ranks.

    Every logical expert is held by at least one slot (else its tokens would have nowhere to go); an
    expert in several slots has replicas, and the tokens routed to it are split evenly over them. A
    rank may hold two replicas of one expert (EPLB does when that balances better): it then serves
    both shares, and dispatch sends that rank's share to one of the two slots.
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
            for e in rank_slots:
                if not 0 <= e < self.num_experts:
                    raise ValueError(f"slots[{rank}] has expert id {e}, expected 0 <= id < "
                                     f"num_experts={self.num_experts}")
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
        """The rank of each replica of logical ``expert``, ascending (a rank holding it twice appears twice)."""
        return list(self._replicas[expert])

    def replica_counts(self) -> list[int]:
        """replica_counts()[e] = number of slots holding expert e (>= 1)."""
        return [len(r) for r in self._replicas]

    def expert_map_for(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[E] int32: the local index of each logical expert on ``rank``, or -1 where it holds none
        (vLLM's expert-map convention, accepted by ``moekit.experts.run_experts``). An expert held twice
        on ``rank`` maps to the later of its two slots (a map has room for one)."""
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
    check_int("num_experts", num_experts)
    check_int("world_size", world_size)
    if world_size < 1 or num_experts < world_size:
        raise ValueError(f"need num_experts >= world_size >= 1, got num_experts={num_experts}, world_size={world_size}")


def _check_loads(loads) -> list[float]:
    flat = loads.tolist() if isinstance(loads, torch.Tensor) else list(loads)
    try:
        values = [float(v) for v in flat]
    except (TypeError, ValueError):  # a 2-D tensor's rows, a string: float()'s own error named no argument
        shape = f" of shape {tuple(loads.shape)}" if hasattr(loads, "shape") else ""
        raise TypeError(f"loads must be a 1-D sequence of numbers (one per logical expert), got "
                        f"{type(loads).__name__}{shape}") from None
    if not values:
        raise ValueError("loads must have one entry per logical expert, got none")
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"loads must be finite and >= 0; entries {bad[:8]} are not")
    return values


def rank_loads(placement: Placement, loads) -> list[float]:
    """Load per rank: each rank sums ``load[e] / replicas(e)`` over its slots (the even split EPMoE's
    replica choice produces; a rank holding e twice serves two shares)."""
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

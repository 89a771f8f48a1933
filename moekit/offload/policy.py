"""Which cached expert to evict: least recently used (``"lru"``) or least frequently used (``"lfu"``).

A policy only orders keys; the cache owns the slots. Keys are ``(layer, expert)`` pairs, so one policy
ranks the experts of every layer that shares a GPU budget. Time is a counter the cache advances once
per forward (``tick``), not wall time, so the order is deterministic.
"""

from __future__ import annotations

import heapq
from typing import Container, Hashable, Literal

PolicyName = Literal["lru", "lfu"]
POLICIES = ("lru", "lfu")


class EvictionPolicy:
    """Tracks uses of cached keys and names the victim among those not protected.

    ``lru``: the key used longest ago. ``lfu``: the key used fewest times since it was cached, ties
    broken by least recent use (so a one-off burst does not pin an expert forever when counts tie).
    Remaining ties go to the key cached first.

    The order is a lazy min-heap of (rank, insertion order, key) entries: a use pushes the key's new
    entry and leaves the old one stale (skipped when it surfaces), so a victim costs O(log n) plus the
    protected and stale entries it passes, not a scan of every cached key (at C = hundreds of slots the
    scan was ~0.1 ms of host time per eviction).
    """

    def __init__(self, name: PolicyName) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self._last_use: dict[Hashable, int] = {}  # key -> tick of its latest use
        self._uses: dict[Hashable, int] = {}  # key -> uses since it entered the cache
        self._order: dict[Hashable, int] = {}  # key -> insertion counter (the last tie-break)
        self._heap: list[tuple] = []  # (rank, order, key); an entry is live while its rank is the key's rank
        self._inserted = 0

    def _rank(self, key: Hashable) -> tuple[int, ...]:
        if self.name == "lru":
            return (self._last_use[key],)
        return (self._uses[key], self._last_use[key])

    def _push(self, key: Hashable) -> None:
        heapq.heappush(self._heap, (self._rank(key), self._order[key], key))
        if len(self._heap) > 4 * len(self._order) + 64:  # drop stale entries now and then
            self._heap = [(self._rank(k), o, k) for k, o in self._order.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Hashable, tick: int) -> None:
        self._last_use[key] = tick
        self._uses[key] = 0
        self._order[key] = self._inserted
        self._inserted += 1
        self._push(key)

    def touch(self, key: Hashable, tick: int) -> None:
        """``key`` was used by a forward at ``tick``."""
        self._last_use[key] = tick
        self._uses[key] += 1
        self._push(key)

    def requeue(self, keys: list[Hashable]) -> None:
        """Give cached ``keys`` fresh insertion orders in the order given (the last tie-break): a forward
        that fetched some of its misses early leaves the order one batch of them would have."""
        for key in keys:
            self._order[key] = self._inserted
            self._inserted += 1
            self._push(key)

    def last_use(self, key: Hashable) -> int:
        """The tick of ``key``'s latest use (or its insertion)."""
        return self._last_use[key]

    def remove(self, key: Hashable) -> None:
        del self._last_use[key], self._uses[key], self._order[key]

    def victim(self, protected: Container[Hashable] = ()) -> Hashable | None:
        """The key to evict, never one in ``protected``; None when every cached key is protected."""
        found = self.victims(1, protected)
        return found[0] if found else None

    def victims(self, count: int, protected: Container[Hashable] = ()) -> list[Hashable]:
        """The ``count`` keys to evict, first victim first, none in ``protected``: what ``count`` calls of
        ``victim`` would name with each victim removed in between (fewer when too few keys are free).
        One pass: the protected entries it passes are pushed back once, not once per victim."""
        passed, found, seen = [], [], set()
        while self._heap and len(found) < count:
            rank, order, key = heapq.heappop(self._heap)
            if key in seen or self._order.get(key) != order or self._rank(key) != rank:
                continue  # stale (the key was used again, or removed) or a duplicate (two uses in one tick)
            seen.add(key)
            (passed if key in protected else found).append((rank, order, key))
        for entry in passed + found:  # still cached until the caller removes them (then stale)
            heapq.heappush(self._heap, entry)
        return [key for _, _, key in found]

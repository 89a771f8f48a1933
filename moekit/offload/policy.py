"""Which cached expert to evict: least recently used (``"lru"``) or least frequently used (``"lfu"``).

A policy only orders keys; the cache owns the slots. Keys are ``(layer, expert)`` pairs, so one policy
ranks the experts of every layer that shares a GPU budget. Time is a counter the cache advances once
per forward (``tick``), not wall time, so the order is deterministic.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Literal

PolicyName = Literal["lru", "lfu"]
POLICIES = ("lru", "lfu")


class EvictionPolicy:
    """Tracks uses of cached keys and names the victim among those not protected.

    ``lru``: the key used longest ago. ``lfu``: the key used fewest times since it was cached, ties
    broken by least recent use (so a one-off burst does not pin an expert forever when counts tie).
    """

    def __init__(self, name: PolicyName) -> None:
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self._last_use: dict[Hashable, int] = {}  # key -> tick of its latest use
        self._uses: dict[Hashable, int] = {}  # key -> uses since it entered the cache

    def insert(self, key: Hashable, tick: int) -> None:
        self._last_use[key] = tick
        self._uses[key] = 0

    def touch(self, key: Hashable, tick: int) -> None:
        """``key`` was used by a forward at ``tick``."""
        self._last_use[key] = tick
        self._uses[key] += 1

    def remove(self, key: Hashable) -> None:
        del self._last_use[key], self._uses[key]

    def victim(self, protected: Iterable[Hashable] = ()) -> Hashable | None:
        """The key to evict, never one in ``protected``; None when every cached key is protected."""
        keep = set(protected)
        candidates = [key for key in self._last_use if key not in keep]
        if not candidates:
            return None
        if self.name == "lru":
            return min(candidates, key=lambda key: self._last_use[key])
        return min(candidates, key=lambda key: (self._uses[key], self._last_use[key]))

"""The one way moekit keeps a cache bounded: bound launches, plans, workspaces and memos are dicts keyed by the kind
of call, and an unending stream of new kinds (shapes, strides, pointers) must not grow them without end. When one is
full the entry inserted first goes (a dict keeps insertion order): FIFO, not LRU, so a hit costs one dict lookup and
nothing more."""

from __future__ import annotations

from typing import TypeVar

V = TypeVar("V")


def put_bounded(cache: dict, key, value: V, limit: int) -> V:
    """``cache[key] = value``, first dropping the entry inserted first when ``limit`` entries are kept and ``key`` is
    not one of them. Callers holding a lock may race a weakref callback that removes entries: if the oldest is gone
    by the time it is looked up, nothing more goes. Returns ``value``."""
    if key not in cache and len(cache) >= limit:
        cache.pop(next(iter(cache), None), None)
    cache[key] = value
    return value

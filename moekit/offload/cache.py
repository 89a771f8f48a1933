"""``ExpertCache``: C GPU slots for expert weights whose home is host memory, shared by a stack of layers.

    host (pinned) w13 [E, 2N, K], w2 [E, K, N] per layer ──copy stream──▶ slots w13 [C, 2N, K], w2 [C, K, N]

A layer registers its host weights and gets a layer id; ``(layer, expert)`` keys name cached experts,
so every layer of a model draws on one GPU budget (a model owns one cache, not one per layer). A
layer's forward asks ``ensure`` for the experts its batch touches (fetching misses into free or
evicted slots), computes with ``expert_map`` (global expert -> slot, -1 elsewhere), then ``release``s
them. ``prefetch`` fetches a later layer's predicted experts ahead of time.

Ordering on CUDA: copies run on a side stream. A copy into a slot waits for the event recorded after
the last compute that read the slot; the compute stream waits for the copies it needs. The experts a
forward is using are protected from eviction until ``release``. On the CPU (tests; both "devices"
the CPU) copies are plain and synchronous: the same bookkeeping runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from moekit.offload.policy import EvictionPolicy, PolicyName
from moekit.offload.stats import OffloadStats

Key = tuple[int, int]  # (layer id, expert id)


@dataclass
class _HostExperts:
    """One registered layer's home weights."""

    w13: torch.Tensor  # [E, 2N, K] on the CPU (pinned when CUDA is in use)
    w2: torch.Tensor  # [E, K, N] on the CPU

    @property
    def expert_bytes(self) -> int:
        return (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()


@dataclass
class _Slots:
    """The GPU side: slot tensors, who is in which slot, and when each slot was last read."""

    w13: torch.Tensor  # [C, 2N, K]
    w2: torch.Tensor  # [C, K, N]
    owner: list[Key | None]  # [C]; the expert held by each slot, None when free
    where: dict[Key, int] = field(default_factory=dict)  # key -> its slot; inverse of owner
    read_done: list[object | None] = field(default_factory=list)  # [C]; CUDA event after the last read, or None
    copy_done: list[object | None] = field(default_factory=list)  # [C]; CUDA event after the copy into it, or None


class ExpertCache:
    """C expert slots on ``device`` with an eviction ``policy`` ("lru" or "lfu"), shared by layers.

    ``stats`` accumulates over every forward of every layer (``OffloadStats``).
    """

    def __init__(self, cache_experts: int, *, device: torch.device | str, policy: PolicyName = "lfu") -> None:
        if not isinstance(cache_experts, int) or isinstance(cache_experts, bool) or cache_experts < 1:
            raise ValueError(f"cache_experts must be an int >= 1 (GPU expert slots), got {cache_experts!r}")
        self.cache_experts = cache_experts
        self.device = torch.device(device)
        self.policy = EvictionPolicy(policy)
        self.stats = OffloadStats()
        self._layers: list[_HostExperts] = []
        self._slots: _Slots | None = None
        self._protected: set[Key] = set()
        self._prefetched: set[Key] = set()  # fetched by a prediction, not yet used
        self._tick = 0
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None

    # -- registration --------------------------------------------------------------------------------

    def register(self, w13: torch.Tensor, w2: torch.Tensor) -> int:
        """Take a layer's host weights (w13 [E, 2N, K], w2 [E, K, N]); returns its layer id. Every layer
        of one cache has the same expert shape and dtype (the slots are one tensor)."""
        host = _HostExperts(w13=_to_host(w13, self.device), w2=_to_host(w2, self.device))
        if self._slots is None:
            c = self.cache_experts
            self._slots = _Slots(
                w13=torch.empty((c, *host.w13.shape[1:]), dtype=host.w13.dtype, device=self.device),
                w2=torch.empty((c, *host.w2.shape[1:]), dtype=host.w2.dtype, device=self.device),
                owner=[None] * c, read_done=[None] * c, copy_done=[None] * c,
            )
        elif host.w13.shape[1:] != self._slots.w13.shape[1:] or host.w13.dtype != self._slots.w13.dtype:
            raise ValueError(
                f"every layer of one ExpertCache needs experts of shape {tuple(self._slots.w13.shape[1:])} "
                f"{self._slots.w13.dtype}, got w13 {tuple(host.w13.shape[1:])} {host.w13.dtype}"
            )
        self._layers.append(host)
        return len(self._layers) - 1

    def host(self, layer: int) -> _HostExperts:
        return self._layers[layer]

    @property
    def slot_w13(self) -> torch.Tensor:
        """[C, 2N, K] the slot weights (index them through ``expert_map``)."""
        return self._slots.w13

    @property
    def slot_w2(self) -> torch.Tensor:
        """[C, K, N]"""
        return self._slots.w2

    def cached(self, layer: int) -> dict[int, int]:
        """expert -> slot for the layer's experts in the cache now."""
        return {e: s for (l, e), s in self._slots.where.items() if l == layer} if self._slots else {}

    # -- a forward's use -----------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Advance the policy's clock: uses within one forward share a tick."""
        self._tick += 1

    def lookup(self, layer: int, experts: list[int], stats: OffloadStats) -> tuple[list[int], list[int]]:
        """Split ``experts`` into (hits, misses); hits are touched in the policy and protected."""
        hits, misses = [], []
        for e in experts:
            key = (layer, e)
            if key in self._slots.where:
                hits.append(e)
                self.policy.touch(key, self._tick)
                self._protected.add(key)
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    stats.prefetch_used += 1
            else:
                misses.append(e)
        stats.hits += len(hits)
        return hits, misses

    def free_slots(self) -> int:
        """Slots a fetch can take now: free ones plus unprotected occupied ones."""
        return sum(1 for key in self._slots.owner if key is None or key not in self._protected)

    def ensure(self, layer: int, experts: list[int], stats: OffloadStats) -> None:
        """Fetch ``experts`` (misses of ``layer``) into slots, evicting unprotected ones; they stay
        protected until ``release``. Raises if more are asked than ``free_slots()``."""
        if len(experts) > self.free_slots():
            raise RuntimeError(f"{len(experts)} experts asked for but only {self.free_slots()} cache slots can be freed")
        for e in experts:
            self._fetch((layer, e), stats)
            self.policy.touch((layer, e), self._tick)
            self._protected.add((layer, e))
        stats.fetched += len(experts)

    def rounds(self, layer: int, hits: list[int], misses: list[int], stats: OffloadStats) -> Iterator[list[int]]:
        """Yield the experts of each compute round of a forward: the hits and as many fetched misses as
        the cache can hold, then the rest in rounds of at most C. Each round's experts are in slots
        when yielded and released when the consumer asks for the next round (or at the end)."""
        todo, running = list(misses), list(hits)
        while True:
            batch = todo[: self.free_slots()]
            if not batch and not running and todo:
                raise RuntimeError("the expert cache has no slot to fetch into")
            todo = todo[len(batch):]
            self.ensure(layer, batch, stats)
            running += batch
            self.wait_ready(layer, running)
            yield running
            self.release(layer, running)
            running = []
            if not todo:
                return

    def prefetch(self, layer: int, experts: list[int], stats: OffloadStats) -> None:
        """Fetch ``layer``'s predicted experts that are not cached, as far as unprotected slots allow
        (the forward in flight keeps its experts); the copies overlap the compute stream's work."""
        fetched = self._fetch_ahead(layer, experts, stats)
        self._prefetched.update(fetched)
        stats.prefetched += len(fetched)

    def admit(self, layer: int, experts: list[int], stats: OffloadStats) -> None:
        """Copy experts a forward computed elsewhere (the CPU) into the cache for later forwards."""
        stats.admitted += len(self._fetch_ahead(layer, experts, stats))

    def _fetch_ahead(self, layer: int, experts: list[int], stats: OffloadStats) -> list[Key]:
        fetched: list[Key] = []
        for e in experts:
            key = (layer, e)
            if key in self._slots.where:
                continue
            if self.free_slots() == 0:
                break
            self._fetch(key, stats)
            self._protected.add(key)  # until the loop ends: a later one must not evict it
            fetched.append(key)
        self._protected.difference_update(fetched)
        return fetched

    def release(self, layer: int, experts: list[int]) -> None:
        """The forward has enqueued every read of these experts' slots: unprotect them and record when
        the reads finish, so a later copy into those slots waits for them."""
        event = None
        if self._copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        for e in experts:
            key = (layer, e)
            self._protected.discard(key)
            if key in self._slots.where:
                self._slots.read_done[self._slots.where[key]] = event

    def slot_map(self, layer: int, experts: list[int], num_experts: int) -> torch.Tensor:
        """[E] int32 on the device: the slot of each of ``experts`` (cached), -1 for every other expert."""
        table = [-1] * num_experts
        for e in experts:
            table[e] = self._slots.where[(layer, e)]
        return torch.tensor(table, dtype=torch.int32).to(self.device, non_blocking=True)

    # -- slots ---------------------------------------------------------------------------------------

    def _take_slot(self) -> int:
        slots = self._slots
        for s, key in enumerate(slots.owner):
            if key is None:
                return s
        victim = self.policy.victim(self._protected)
        if victim is None:
            raise RuntimeError("every cache slot is in use by the forward in flight")
        s = slots.where.pop(victim)
        self.policy.remove(victim)
        self._prefetched.discard(victim)
        slots.owner[s] = None
        return s

    def _fetch(self, key: Key, stats: OffloadStats) -> None:
        s = self._take_slot()
        slots, host = self._slots, self._layers[key[0]]
        if self._copy_stream is None:
            slots.w13[s].copy_(host.w13[key[1]])
            slots.w2[s].copy_(host.w2[key[1]])
        else:
            with torch.cuda.stream(self._copy_stream):
                if slots.read_done[s] is not None:
                    self._copy_stream.wait_event(slots.read_done[s])
                slots.w13[s].copy_(host.w13[key[1]], non_blocking=True)
                slots.w2[s].copy_(host.w2[key[1]], non_blocking=True)
                slots.copy_done[s] = torch.cuda.Event()
                slots.copy_done[s].record(self._copy_stream)
        slots.owner[s], slots.where[key] = key, s
        self.policy.insert(key, self._tick)
        stats.bytes_transferred += host.expert_bytes

    def wait_ready(self, layer: int, experts: list[int]) -> None:
        """Make the compute stream wait for the copies into these experts' slots (fetched, prefetched or
        admitted), and for nothing else on the copy stream."""
        if self._copy_stream is None:
            return
        stream = torch.cuda.current_stream(self.device)
        for e in experts:
            event = self._slots.copy_done[self._slots.where[(layer, e)]]
            if event is not None:
                stream.wait_event(event)


def _to_host(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``w`` detached on the CPU, pinned when the cache's device is CUDA (so copies are async). A CPU
    tensor already in that form is used as it is (shared, not copied: a model's expert weights may be
    most of host memory)."""
    host = w.detach()
    if host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu").contiguous()
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host

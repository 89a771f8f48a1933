"""``ExpertCache``: C GPU slots for expert weights whose home is host memory, shared by a stack of layers.

    host (pinned) w13 [E, 2N, K], w2 [E, K, N] per layer ──copy stream──▶ slots w13 [C, 2N, K], w2 [C, K, N]

Quantized experts stay packed on both sides: each of their tensors (``moekit.quant``'s layouts: q,
scale, zero) is a part with E leading on the host and C leading in the slots (``parts.ExpertWeights``),
so a slot costs one expert's packed bytes and a fetch copies them; the slots read as a QuantizedWeight
of C experts (``slot_weights``). Expert biases (gpt-oss) are parts too. The parts live in byte blocks
(``blocks.BlockLayout``: w13 and w2 one block each, every small part together in a third), so a fetch
is one ``copy_`` per block, and consecutive experts fetched into consecutive slots share one copy.

A layer registers its host weights and gets a layer id; ``(layer, expert)`` keys name cached experts, so every layer of
a model draws on one GPU budget (a model owns one cache, not one per layer). A layer's forward asks ``ensure`` for the
experts its batch touches (fetching misses into free or evicted slots), computes with ``expert_map`` (global expert ->
slot, -1 elsewhere), then ``release``s them. ``prefetch`` fetches a later layer's predicted experts ahead of time.

Ordering on CUDA: copies run on a side stream. A copy into a slot waits for the event recorded after
the last compute that read the slot; the compute stream waits for the copies it needs. The experts a
forward is using are protected from eviction until ``release``. On the CPU (tests; both "devices"
the CPU) copies are plain and synchronous: the same bookkeeping runs.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from moekit.offload.blocks import BlockLayout, slots_device
from moekit.offload.cache_pickle import PicklableCache
from moekit.offload.cache_repr import ReadableCache
from moekit.offload.parts import ExpertWeights, Weight
from moekit.offload.policy import EvictionPolicy, PolicyName
from moekit.offload.stats import OffloadStats

Key = tuple[int, int]  # (layer id, expert id)
HORIZON_WEIGHT = 1 / 16  # the newest victim's share in the running mean of idle ticks at eviction (``reuse``)


@dataclass
class _Slots:
    """The GPU side: slot tensors, who is in which slot, and when each slot was last read."""

    blocks: list[torch.Tensor]  # [G] of [C, B_g] uint8: the layout's groups (``blocks.BlockLayout``)
    owner: list[Key | None]  # [C]; the expert held by each slot, None when free
    free: list[int]  # slots holding nothing, popped from the end (slot 0 first)
    where: dict[Key, int] = field(default_factory=dict)  # key -> its slot; inverse of owner
    read_done: list[object | None] = field(default_factory=list)  # [C]; CUDA event after the last read, or None
    copy_done: list[object | None] = field(default_factory=list)  # [C]; CUDA event after the copy into it, or None
    waited: list[int | None] = field(default_factory=list)  # [C]; the stream (handle) that waited for copy_done


class ExpertCache(PicklableCache, ReadableCache):
    """C expert slots on ``device`` with an eviction ``policy`` ("lru" or "lfu"), shared by layers. ``stats``
    accumulates over every forward of every layer (``OffloadStats``); pickle: ``cache_pickle``, repr: ``cache_repr``"""

    def __init__(self, cache_experts: int, *, device: torch.device | str, policy: PolicyName = "lfu") -> None:
        if not isinstance(cache_experts, int) or isinstance(cache_experts, bool) or cache_experts < 1:
            raise ValueError(f"cache_experts must be an int >= 1 (GPU expert slots), got {cache_experts!r}")
        self.cache_experts, self.device = cache_experts, slots_device(device)
        self.policy = EvictionPolicy(policy)
        self.stats = OffloadStats()
        self._layers: list[ExpertWeights] = []
        self._slots: _Slots | None = None
        self._layout: BlockLayout | None = None
        self._host_blocks: list[list[torch.Tensor]] = []  # per layer: its [E, B_g] host blocks
        self._slot_weights: tuple = ()
        self._expert_bytes = 0
        self._protected: set[Key] = set()
        self._prefetched: set[Key] = set()  # fetched by a prediction, not yet used
        self._tick = 0
        self._touches: dict[Key, int] = {}  # every lookup of a key since its layer's first, hit or miss
        self._first_tick: dict[int, int] = {}  # layer -> the tick of its first lookup
        self._horizon = math.inf  # ticks an unused expert stays cached: running mean of the victims' idle ticks
        self._dry = False  # within bookkeeping_only(): fetches copy no bytes
        self.trace = None  # a ``trace.StepTrace`` to record the step's marks in (``mark``), or None
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.lock = threading.RLock()  # held by each layer's forward (``OffloadedMoE.run_routed``): one at a time

    # -- registration --------------------------------------------------------------------------------

    def register(self, w13: Weight, w2: Weight, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> int:
        """Take a layer's host weights (w13 [E, 2N, K], w2 [E, K, N]: float tensors or ``moekit.quant``
        QuantizedWeights, kept packed; b13 [E, 2N] / b2 [E, K] when the experts have biases); returns its
        layer id. Every layer of one cache has the same expert parts (shapes, dtypes, scheme and options:
        the slots are one tensor per part)."""
        weights = ExpertWeights.of(w13, w2, b13, b2)
        pin = self.device.type == "cuda"
        parts = {k: _to_host(t, self.device) for k, t in weights.parts.items()}
        layout = BlockLayout.of(parts)
        blocks = layout.pack(parts, pin=pin)
        # rebuilt from the host blocks' views, so nothing keeps the caller's (device) tensors alive
        host = ExpertWeights.of(*weights.rebuild(layout.typed(blocks)))
        if self._slots is None:
            c = self.cache_experts
            slot_blocks = layout.allocate(c, self.device)
            self._slots = _Slots(blocks=slot_blocks, owner=[None] * c, free=list(range(c - 1, -1, -1)),
                                 read_done=[None] * c, copy_done=[None] * c, waited=[None] * c)
            self._slot_weights, self._expert_bytes = host.rebuild(layout.typed(slot_blocks)), host.expert_bytes
            self._layout = layout
        elif host.signature() != self._layers[0].signature():
            raise ValueError(f"every layer of one ExpertCache needs the same experts: the cache holds "
                             f"{self._layers[0].describe()}, this layer has {host.describe()}")
        self._layers.append(host)
        self._host_blocks.append(blocks)
        return len(self._layers) - 1

    def host(self, layer: int) -> ExpertWeights:
        """The layer's home weights (pinned host parts when the cache is on CUDA)."""
        return self._layers[layer]

    @property
    def expert_bytes(self) -> int:
        """Bytes of one cached expert (packed bytes for a quantized scheme): one slot, one fetch."""
        return self._expert_bytes

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds and one fetch copies: ``expert_bytes`` plus the alignment padding of the
        small parts' block (under 256 per small part; 0 for float experts without biases)."""
        return self._layout.padded_bytes if self._layout is not None else 0

    @property
    def slot_weights(self) -> tuple[Weight, Weight, torch.Tensor | None, torch.Tensor | None]:
        """(w13 [C, 2N, K], w2 [C, K, N], b13 [C, 2N] | None, b2 [C, K] | None) over the slots (index them
        through ``expert_map``); quantized weights when the layers' experts are quantized."""
        return self._slot_weights

    def cached(self, layer: int) -> dict[int, int]:
        """expert -> slot for the layer's experts in the cache now."""
        return {e: s for (l, e), s in self._slots.where.items() if l == layer} if self._slots else {}

    @contextlib.contextmanager
    def bookkeeping_only(self) -> Iterator[None]:
        """Within: fetches, prefetches and admissions update which expert is in which slot, the policy
        and the stats as usual, but copy no bytes; the slots keep stale contents. For bringing a cache
        to the state a stream's past leaves it in when nothing reads those slots' values (a benchmark's
        warm-up, timed afterwards for speed and hit rate only; the what-if's weightless replay)."""
        self._dry = True
        try:
            yield
        finally:
            self._dry = False

    def mark(self, name: str, layer: int, copy: bool = False) -> None:
        """A point of the step for ``trace`` (nothing when it is None), on the copy stream with ``copy``."""
        if self.trace is not None:
            self.trace.mark(name, layer, self._copy_stream if copy else None)

    # -- a forward's use -----------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Advance the policy's clock: uses within one forward share a tick."""
        self._tick += 1

    def lookup(self, layer: int, experts: list[int], stats: OffloadStats) -> tuple[list[int], list[int]]:
        """Split ``experts`` into (hits, misses); hits are touched in the policy and protected."""
        hits, misses = [], []
        self._first_tick.setdefault(layer, self._tick)
        for e in experts:
            key = (layer, e)
            self._touches[key] = self._touches.get(key, 0) + 1
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

    def reuse(self, layer: int, experts: list[int]) -> dict[int, float]:
        """expert -> the chance it is touched again before the policy would evict it, were it cached now:
        1 - exp(-H x rate), the rate being its lookups per tick since the layer's first (Poisson) and H
        the ticks an unused expert stays cached (the running mean of the victims' idle ticks at eviction,
        weight ``HORIZON_WEIGHT``). Infinite before the first eviction: H is unknown and a fetched expert
        stays cached through the fill, while one left out misses at every later touch (``split.split_misses``
        then fetches every miss). Call after ``lookup``, which counts this forward's touches."""
        if math.isinf(self._horizon):
            return dict.fromkeys(experts, math.inf)
        elapsed, neg, touches = self._tick - self._first_tick.get(layer, self._tick) + 1, -self._horizon, self._touches
        return {e: -math.expm1(neg * touches.get((layer, e), 0) / elapsed) for e in experts}

    def free_slots(self) -> int:
        """Slots a fetch can take now: free ones plus unprotected occupied ones (every protected key is
        cached: keys are protected when hit or fetched and released before they can be evicted)."""
        return len(self._slots.free) + len(self._slots.where) - len(self._protected)

    def ensure(self, layer: int, experts: list[int], stats: OffloadStats) -> None:
        """Fetch ``experts`` (misses of ``layer``) into slots, evicting unprotected ones; they stay
        protected until ``release``. Raises if more are asked than ``free_slots()``."""
        if len(experts) > self.free_slots():
            raise RuntimeError(f"{len(experts)} experts asked for, only {self.free_slots()} cache slots can be freed")
        keys = [(layer, e) for e in experts]
        self._fetch(keys, stats, "fetch")  # protects them
        for key in keys:
            self.policy.touch(key, self._tick)
        stats.fetched += len(experts)

    def ensure_early(self, layer: int, experts: list[int], stats: OffloadStats) -> list[int]:
        """``ensure`` as many of ``experts`` as slots can be freed now, in order: fetches issued before the rest
        are planned ("auto"'s, ``plan.plan_forward``'s ``issue``); returns them (``rounds``' ``issued``)."""
        early = experts[: self.free_slots()]
        self.ensure(layer, early, stats)
        return early

    def rounds(self, layer: int, hits: list[int], misses: list[int], stats: OffloadStats,
               split: bool = True, issued: list[int] = ()) -> Iterator[list[int]]:
        """Yield the experts of each compute group of a forward: the first round is the hits and as many
        fetched misses as the cache can hold, then the rest in rounds of at most C. With ``split``, a round
        that has both experts already cached and experts being fetched yields them as two groups, the
        cached ones first: their compute is queued while the copies travel (it waits only for copies into
        its own slots), and the fetched group waits for its copies; without, one group once they land.
        ``issued``: misses this forward already fetched (``ensure``: "auto"'s before its search), in the
        first round's fetched group ahead of ``misses``' first batch (the cache then as after one batch).
        Each group's experts are in slots when yielded; a round's experts are released when the consumer
        asks for the next round's first group (or at the end)."""
        todo, running, early = list(misses), list(hits), list(issued)
        while True:
            batch = todo[: self.free_slots()]
            if not batch and not running and not early and todo:
                raise RuntimeError("the expert cache has no slot to fetch into")
            todo = todo[len(batch):]
            self.ensure(layer, batch, stats)
            if early:  # the policy's tie-break order as one batch of them in expert order would leave it
                self.policy.requeue([(layer, e) for e in sorted(early + batch)])
            batch, early = early + batch, []
            for group in [running, batch] if split and running and batch else [running + batch]:
                self.wait_ready(layer, group)
                yield group
            self.release(layer, running + batch)
            running = []
            if not todo:
                return

    def prefetch(self, layer: int, experts: list[int], stats: OffloadStats) -> None:
        """Fetch ``layer``'s predicted experts that are not cached, as far as unprotected slots allow
        (the forward in flight keeps its experts); the copies overlap the compute stream's work."""
        fetched = self._fetch_ahead(layer, experts, stats, "prefetch")
        self._prefetched.update(fetched)
        stats.prefetched += len(fetched)

    def admit(self, layer: int, experts: list[int], stats: OffloadStats) -> None:
        """Copy experts a forward computed elsewhere (the CPU) into the cache for later forwards."""
        stats.admitted += len(self._fetch_ahead(layer, experts, stats, "admit"))

    def _fetch_ahead(self, layer: int, experts: list[int], stats: OffloadStats, kind: str) -> list[Key]:
        """Fetch the first of ``experts`` not cached, as many as slots can be freed; unprotected after."""
        where = self._slots.where
        keys = [(layer, e) for e in experts if (layer, e) not in where][: self.free_slots()]
        self._fetch(keys, stats, kind)
        self._protected.difference_update(keys)
        return keys

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

    def evict(self, layer: int, experts: list[int]) -> list[int]:
        """Drop ``layer``'s ``experts`` from the cache where cached and not in use by a forward (a later
        touch misses); returns those dropped. For controlled fetch counts (``offload_floor.measure_forced``)."""
        keys = [(layer, e) for e in experts if (layer, e) in self._slots.where and (layer, e) not in self._protected]
        for key in keys:
            self._drop(key)
        return [e for _, e in keys]

    def slot_map(self, layer: int, experts: list[int], num_experts: int) -> torch.Tensor:
        """[E] int32 on the device: the slot of each of ``experts`` (cached), -1 for every other expert."""
        table = [-1] * num_experts
        for e in experts:
            table[e] = self._slots.where[(layer, e)]
        # Pinned source: a pageable one makes the "non-blocking" copy wait for the compute stream to drain
        # (the host cannot queue the next layer ahead); pinned, torch's host allocator keeps the buffer
        # alive until the copy is done.
        pinned = self._copy_stream is not None
        return torch.tensor(table, dtype=torch.int32, pin_memory=pinned).to(self.device, non_blocking=True)

    # -- slots ---------------------------------------------------------------------------------------

    def _free_up(self, count: int) -> None:
        """Evict unprotected experts until ``count`` slots are free (the policy's victims, in one pass)."""
        slots = self._slots
        need = count - len(slots.free)
        if need <= 0:
            return
        victims = self.policy.victims(need, self._protected)
        if len(victims) < need:
            raise RuntimeError("every cache slot is in use by the forward in flight")
        for victim in victims:
            idle = self._tick - self.policy.last_use(victim)
            self._horizon = (idle if math.isinf(self._horizon)
                             else self._horizon + HORIZON_WEIGHT * (idle - self._horizon))
            self._drop(victim)

    def _drop(self, key: Key) -> None:
        """``key`` leaves the cache: its slot is free, the policy forgets it."""
        s = self._slots.where.pop(key)
        self.policy.remove(key)
        self._prefetched.discard(key)
        self._slots.owner[s] = None
        self._slots.free.append(s)

    def _fetch(self, keys: list[Key], stats: OffloadStats, kind: str) -> None:
        """Copy ``keys``' blocks into slots (free or evicted) and protect them. The batch's slots, in
        ascending order, take its keys in (layer, expert) order, so consecutive experts landing in
        consecutive slots form runs, each one ``copy_`` per block group. On CUDA on the copy stream,
        after the reads of each slot's previous expert, one event recorded after the batch. ``kind``
        ("fetch", "prefetch", "admit") names the batch's marks (``mark``)."""
        if not keys:
            return
        slots = self._slots
        self._free_up(len(keys))
        taken = sorted(slots.free.pop() for _ in keys)
        placed = list(zip(sorted(keys), taken))
        for key in keys:  # the policy sees the batch in the caller's order
            self.policy.insert(key, self._tick)
        for key, s in placed:
            slots.owner[s], slots.where[key] = key, s
            self._protected.add(key)  # a later key of the batch must not evict it
        stats.bytes_transferred += len(keys) * self._expert_bytes  # every layer's experts have the same parts
        if self._dry:
            return
        stream = contextlib.nullcontext() if self._copy_stream is None else torch.cuda.stream(self._copy_stream)
        with stream:
            if self._copy_stream is not None:
                for event in {id(slots.read_done[s]): slots.read_done[s] for s in taken}.values():
                    if event is not None:  # slots released together share one event
                        self._copy_stream.wait_event(event)
            self.mark(f"copy_start:{kind}", keys[0][0], copy=True)
            for layer, expert, slot, count in _runs(placed):
                host = self._host_blocks[layer]
                for g, block in enumerate(slots.blocks):
                    block[slot: slot + count].copy_(host[g][expert: expert + count],
                                                    non_blocking=self._copy_stream is not None)
            self.mark(f"copy_end:{kind}", keys[0][0], copy=True)
            if self._copy_stream is not None:
                done = torch.cuda.Event()
                done.record(self._copy_stream)
                for s in taken:
                    slots.copy_done[s], slots.waited[s] = done, None

    def wait_ready(self, layer: int, experts: list[int]) -> None:
        """Make the compute stream wait for the copies into these experts' slots (fetched, prefetched or
        admitted), and for nothing else on the copy stream. A copy this stream has waited for once is
        not waited for again (its later work is ordered after it): a cached expert's hits make no
        stream wait at all, where they made one per batch their experts came in (up to one per hit)."""
        if self._copy_stream is None:
            return
        slots, stream, waited = self._slots, torch.cuda.current_stream(self.device), set()
        handle = stream.cuda_stream
        for e in experts:
            s = slots.where[(layer, e)]
            event = slots.copy_done[s]
            if event is None or slots.waited[s] == handle:
                continue
            if id(event) not in waited:  # one event per fetched batch
                stream.wait_event(event)
                waited.add(id(event))
            slots.waited[s] = handle


def _runs(placed: list[tuple[Key, int]]) -> list[tuple[int, int, int, int]]:
    """(layer, first expert, first slot, count) of each maximal run of ``placed`` ((layer, expert), slot)
    pairs, sorted by key with ascending slots, whose experts and slots both go up by one."""
    runs: list[list[int]] = []
    for (layer, expert), slot in placed:
        last = runs[-1] if runs else None
        if last and last[0] == layer and last[1] + last[3] == expert and last[2] + last[3] == slot:
            last[3] += 1
        else:
            runs.append([layer, expert, slot, 1])
    return [tuple(r) for r in runs]


def _to_host(w: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``w`` detached on the CPU, pinned when the cache's device is CUDA (so copies are async). A CPU tensor already in
    that form is used as it is (shared, not copied: a model's expert weights may be most of host memory)."""
    host = w.detach()
    if host.device.type != "cpu" or not host.is_contiguous():
        host = host.to("cpu").contiguous()
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host

"""Dispatch and combine over ``torch.distributed.all_to_all_single``.

    Gate+Route -> [Plan -> Counts all-to-all -> Payload all-to-all] -> Local experts -> [Combine all-to-all -> Sum]

Shapes: M local tokens, k slots per token (routed, plus S fused shared slots), E logical experts,
W ranks, Rmax = most replicas of one expert, T = rows this rank sends (a token once per destination
rank), U = rows it receives, K hidden, B = bytes of one payload row.

A payload row is one token's hidden vector followed by its k local expert ids (int32, -1 where the
slot is served elsewhere) and k weights (float32, float64 for float64 routing; 0 there), packed as bytes so that one
collective carries all three. The receiving rank runs its local experts over the U rows; the combine sends the
U weighted partial sums back and the source rank adds them into its tokens.

Two dispatches:
- exact (``plan_sends`` -> ``pack_sends`` -> counts -> ``start_dispatch``): T rows, each token once per
  rank that serves one of its slots. Host synchronisation: exactly one per forward, the read of the
  counts after their all-to-all: ``all_to_all_single`` takes its split sizes as Python ints (NCCL posts
  one send and one receive per peer with host-side sizes). In ``EPMoE`` that all-to-all is also the
  error agreement (``CollectiveErrors.agree``), so the forward has one sync in all. Everything else
  is device work queued before the sync (replica choice, send order, the payload rows, about 20
  kernels: they run behind the previous work while the host waits) or after it (the payload and
  combine all-to-alls, the sum: no host read). The payload is built for R = M * min(W, k) rows, the
  most T can be, and only its first T rows are sent. Because of the sync this path is not CUDA-graph
  capturable.
- padded (``dispatch_padded``): C rows to every rank whatever the routing (C = the most tokens a rank
  may pass), so no counts and no host sync: W*C rows on the wire, CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moekit.layouts.grouping import rank_within_groups
from moekit.parallel.errors import SplitSizes, exchange_columns
from moekit.parallel.placement import Placement
from moekit.parallel.rows import as_bytes, attach_gradients, view_rows_as


@dataclass
class ReplicaTables:
    """Device tables that turn a logical expert into (rank, local index) of one of its replicas."""

    num_replicas: torch.Tensor  # [E] int64; ranks holding expert e (>= 1)
    rank_of: torch.Tensor  # [E, Rmax] int64; rank of replica i of e (ascending); padding repeats replica 0
    local_of: torch.Tensor  # [E, Rmax] int64; e's local index on rank_of[e, i]
    # [E + S + 1, 2] int64: (rank, local index) of replica 0 of each routed expert, then of each fused
    # shared slot (this rank, num_local_routed + s), then (-1, -1): where a skipped slot goes.
    lookup: torch.Tensor
    # physical routed experts on this rank; fused shared slot s is local index num_local_routed + s
    num_local_routed: int
    num_shared_slots: int  # S: fused shared slots, run on the token's own rank
    replicated: bool = True  # some expert has more than one replica (host flag: without, no replica choice runs)

    @classmethod
    def build(cls, placement: Placement, rank: int, num_shared_slots: int, device,
              width: int | None = None) -> "ReplicaTables":
        """``width``: Rmax, raised to the most replicas of one expert if smaller; a fixed width (W: the most a
        placement can have unless it doubles an expert on a rank, as EPLB may) keeps the tables' shapes when the
        placement changes."""
        num_experts = placement.num_experts
        replicas = [placement.replicas(e) for e in range(num_experts)]
        width = max(max(len(r) for r in replicas), width or 0)
        local_index = [{e: i for i, e in enumerate(s)} for s in placement.slots]
        rank_of = [[r[i % len(r)] for i in range(width)] for r in replicas]
        local_of = [[local_index[r][e] for r in row] for e, row in enumerate(rank_of)]
        num_local_routed = placement.num_local_experts(rank)
        lookup = ([[row[0], loc[0]] for row, loc in zip(rank_of, local_of)]
                  + [[rank, num_local_routed + s] for s in range(num_shared_slots)] + [[-1, -1]])
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            num_replicas=as_tensor([len(r) for r in replicas]),
            rank_of=as_tensor(rank_of),
            local_of=as_tensor(local_of),
            lookup=as_tensor(lookup),
            num_local_routed=num_local_routed,
            num_shared_slots=num_shared_slots,
            replicated=any(len(r) > 1 for r in replicas),
        )


@dataclass
class Destinations:
    """The rank and local expert serving each of this rank's token slots (device tensors, no host sync)."""

    dest: torch.Tensor  # [M, k] int64; rank serving each slot, -1 for a skipped slot
    local: torch.Tensor  # [M, k] int64; local expert index on that rank (-1 for a skipped slot)


def choose_replicas(topk_ids: torch.Tensor, tables: ReplicaTables, rank: int) -> Destinations:
    """Choose a replica for every slot: the rank that serves it and the expert's index there.

    Without replicas this is one table lookup (three kernels). With replicas the choice is
    deterministic and even: the j-th slot (in token order) on this rank that routes to expert e goes
    to replica ``(j + rank) % replicas(e)``, so each source splits e's traffic within one row of even,
    and the ``+ rank`` offset spreads the remainders over the replicas.
    """
    num_tokens, top_k = topk_ids.shape
    slots = tables.lookup.shape[0] - 1  # E + S; row E + S is the skip row
    index = topk_ids.clamp(-1, slots).remainder(slots + 1)  # [M, k]; -1 and ids >= E + S -> E + S
    pair = tables.lookup[index]  # [M, k, 2]
    if not tables.replicated:  # one replica each: no sort, no counting
        return Destinations(pair[..., 0], pair[..., 1])
    num_experts = tables.num_replicas.numel()
    routed = index < num_experts  # [M, k]
    key = torch.where(routed, index, num_experts).reshape(-1)  # [M*k]; E = not a routed slot
    # j: earlier slots here on the same expert
    position = rank_within_groups(key, num_experts).rank.view(num_tokens, top_k)
    safe = torch.where(routed, index, 0)  # [M, k]
    replica = (position + rank) % tables.num_replicas[safe]  # [M, k]
    dest = torch.where(routed, tables.rank_of[safe, replica], pair[..., 0])
    local = torch.where(routed, tables.local_of[safe, replica], pair[..., 1])
    return Destinations(dest, local)


@dataclass
class SendPlan:
    """Where this rank's token slots go, grouped by destination (device tensors; built with no host sync)."""

    chosen: Destinations  # the serving rank and local expert of each slot
    send_counts: torch.Tensor  # [W] int64; rows sent to each rank (a token once per rank it needs)
    # [R] int64, R = M * min(W, k) >= T: flat (rank * M + token) keys of the T rows to send, by rank then
    # token; entries T..R-1 are filler (never sent). Its length bounds T without a host sync.
    send_key: torch.Tensor


def plan_sends(topk_ids: torch.Tensor, tables: ReplicaTables, rank: int, world_size: int) -> SendPlan:
    """Choose the replicas (``choose_replicas``) and group the rows to send by destination rank."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    chosen = choose_replicas(topk_ids, tables, rank)
    # needs[w, t]: token t has a slot served by rank w. Row W collects skipped slots (dest -1).
    needs = torch.zeros(world_size + 1, num_tokens, dtype=torch.bool, device=device)
    needs.scatter_(0, chosen.dest.remainder(world_size + 1).t(), True)
    flat = needs[:world_size].reshape(-1)  # [W*M] (a view): the (rank, token) keys, rank-major
    send_counts = needs[:world_size].sum(1)  # [W]
    # Each needed key goes to 1 + its position among the needed ones (a prefix sum), the others to the
    # discarded entry 0: the host learns how many there are only from the counts exchange, so no
    # nonzero() sync here, and no sort.
    bound = num_tokens * min(world_size, top_k)
    target = torch.where(flat, torch.cumsum(flat, 0), 0)  # [W*M]
    order = torch.zeros(bound + 1, dtype=torch.int64, device=device)
    order.scatter_(0, target, torch.arange(flat.numel(), device=device))
    return SendPlan(chosen=chosen, send_counts=send_counts, send_key=order[1:])


@dataclass
class PackedSends:
    """A send plan's payload, built before the counts exchange so that its kernels queue behind the
    previous work while the host waits; after the exchange only the all-to-all is left to issue."""

    plan: SendPlan
    payload: torch.Tensor  # [R, B] uint8; row i carries send_key[i]'s token (rows T..R-1: filler)
    send_token: torch.Tensor  # [R] int64; local token of each row
    sent_x: torch.Tensor  # [R, K]; the rows' hidden vectors, in the autograd graph
    sent_weights: torch.Tensor  # [R, k]; the rows' weights (0 for slots served elsewhere), likewise
    num_tokens: int  # M


def pack_sends(x2d: torch.Tensor, topk_weights: torch.Tensor, plan: SendPlan) -> PackedSends:
    """One payload row per planned key: the token's hidden vector, its local ids on that rank (-1 where
    another rank serves the slot) and its weights (0 there)."""
    num_tokens = max(x2d.shape[0], 1)
    send_rank, send_token = plan.send_key // num_tokens, plan.send_key % num_tokens  # [R], [R]
    here = plan.chosen.dest[send_token] == send_rank[:, None]  # [R, k]
    ids = torch.where(here, plan.chosen.local[send_token], -1).to(torch.int32)  # [R, k]
    weights = torch.where(here, topk_weights[send_token].to(weights_dtype(topk_weights)), 0.0)  # [R, k]
    x_sent = x2d[send_token]  # [R, K]
    return PackedSends(plan, _pack(x_sent, ids, weights), send_token, x_sent, weights, x2d.shape[0])


@dataclass
class Dispatched:
    """What the dispatch delivered to this rank, and how to send the results back."""

    x: torch.Tensor  # [U, K]; received token rows, grouped by source rank
    local_ids: torch.Tensor  # [U, k] int32; local expert of each slot on this rank, -1 = not here
    weights: torch.Tensor  # [U, k] float32 (float64 for float64 weights); routing weight of each slot, 0 where not here
    send_token: torch.Tensor | None  # [T] int64; local token of each sent row (rank-major); None when padded
    send_splits: list[int]  # [W]; rows sent to each rank (host ints, from the one sync; C each when padded)
    recv_splits: list[int]  # [W]; rows received from each rank
    num_tokens: int  # M
    capacity: int | None = None  # C: rows per rank pair of the padded dispatch (row t = token t); None = exact
    send_key: torch.Tensor | None = None  # [T] int64; destination rank * M + send_token of each sent row (exact)


def exchange(send_counts: torch.Tensor, group, timeout: timedelta | None) -> SplitSizes:
    """The counts all-to-all, then a host sync: the split sizes as Python ints (``EPMoE``'s forward
    exchanges them inside its error agreement instead, ``CollectiveErrors.agree``)."""
    sent, received = exchange_columns(send_counts[:, None], group, timeout)  # [W][1] each
    return SplitSizes(send=[row[0] for row in sent], recv=[row[0] for row in received])


@dataclass
class PendingDispatch:
    """A payload all-to-all in flight; ``wait`` makes the current stream wait for it and unpacks."""

    work: object  # the collective's handle (``dist.Work``)
    group: object  # the process group (the backward's all-to-all runs on it)
    received: torch.Tensor  # [U, B] uint8, filled by the collective
    payload: torch.Tensor  # [T, B] uint8; kept alive until the collective has read it
    hidden: int
    top_k: int
    dtype: torch.dtype
    send_token: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    capacity: int | None
    sent_x: torch.Tensor  # [T, K]; the rows sent, in the autograd graph (their gradients come back in backward)
    sent_weights: torch.Tensor  # [T, k]; the weights sent, likewise
    send_key: torch.Tensor | None = None  # [T]; rank * M + token of each sent row (exact dispatch)

    def wait(self) -> Dispatched:
        self.work.wait()
        x_recv, ids_recv, weights_recv = _unpack(self.received, self.hidden, self.top_k, self.dtype,
                                                 self.sent_weights.dtype)
        x_recv, weights_recv = attach_gradients((self.sent_x, self.sent_weights), (x_recv, weights_recv),
                                                self.send_splits, self.recv_splits, self.group)
        return Dispatched(x_recv, ids_recv, weights_recv, self.send_token, self.send_splits, self.recv_splits,
                          self.num_tokens, self.capacity, self.send_key)


def dispatch(
    x2d: torch.Tensor, topk_weights: torch.Tensor, plan: SendPlan, group, timeout: timedelta | None = None
) -> Dispatched:
    """Send each token once to every rank that serves one of its slots, with that rank's local ids
    and weights. Collective: every rank of ``group`` must call it, also with M = 0."""
    packed = pack_sends(x2d, topk_weights, plan)
    return start_dispatch(packed, exchange(plan.send_counts, group, timeout), group).wait()


def start_dispatch(packed: PackedSends, splits: SplitSizes, group) -> PendingDispatch:
    """``dispatch``'s payload all-to-all with the split sizes already exchanged, issued asynchronously
    (no host sync): the collective runs while the caller queues other work."""
    rows = sum(splits.send)  # T
    payload = packed.payload[:rows]  # [T, B]
    received = payload.new_empty((sum(splits.recv), payload.shape[1]))  # [U, B]
    work = dist.all_to_all_single(received, payload, splits.recv, splits.send, group=group, async_op=True)
    hidden, top_k = packed.sent_x.shape[1], packed.sent_weights.shape[1]
    return PendingDispatch(work, group, received, payload, hidden, top_k, packed.sent_x.dtype,
                           packed.send_token[:rows], splits.send, splits.recv, packed.num_tokens, None,
                           packed.sent_x[:rows], packed.sent_weights[:rows], send_key=packed.plan.send_key[:rows])


def dispatch_padded(
    x2d: torch.Tensor, topk_weights: torch.Tensor, chosen: Destinations, capacity: int, group
) -> Dispatched:
    """The dispatch without the host sync: every rank sends exactly ``capacity`` (C) rows to every rank,
    row t carrying token t (ids -1 and weights 0 where that rank serves none of its slots; rows M..C-1
    are zero padding), so the split sizes are known without exchanging counts. Costs W*C rows on the
    wire whatever the routing; in exchange the forward never waits for the host and can be captured
    in a CUDA graph (DeepEP's low-latency mode makes the same trade). Collective, also with M = 0."""
    return start_dispatch_padded(x2d, topk_weights, chosen, capacity, group).wait()


def start_dispatch_padded(
    x2d: torch.Tensor, topk_weights: torch.Tensor, chosen: Destinations, capacity: int, group
) -> PendingDispatch:
    """``dispatch_padded``'s all-to-all issued asynchronously."""
    num_tokens, hidden = x2d.shape
    if num_tokens > capacity:
        raise ValueError(f"x must have at most max_tokens_per_rank={capacity} tokens on each rank, got {num_tokens}")
    top_k = chosen.dest.shape[1]
    world_size = dist.get_world_size(group)
    wdtype = weights_dtype(topk_weights)
    if (torch.is_grad_enabled() and (x2d.requires_grad or topk_weights.requires_grad)) or not _writable_views(
            hidden, top_k, x2d.dtype, wdtype):
        payload, sent_x, sent_weights = _pack_padded_copies(x2d, topk_weights.to(wdtype), chosen, capacity, world_size)
    else:  # written in place: one pass over the W*C rows instead of three (zero, copy, pack)
        payload, sent_x, sent_weights = _pack_padded_in_place(x2d, topk_weights.to(wdtype), chosen, capacity,
                                                              world_size)
    received = torch.empty_like(payload)  # [W*C, B]
    work = dist.all_to_all_single(received, payload, group=group, async_op=True)  # equal splits: C rows per rank pair
    splits = [capacity] * world_size
    return PendingDispatch(work, group, received, payload, hidden, top_k, x2d.dtype, None, splits, splits, num_tokens,
                           capacity, sent_x, sent_weights)


def _pack_padded_copies(x2d, topk_weights, chosen, capacity, world_size):
    """The padded payload [W*C, B] from [W, C, *] copies that autograd sees: (payload, rows [W*C, K],
    weights [W*C, k]), row t of each rank's block token t, rows M..C-1 zero with ids -1."""
    num_tokens, hidden = x2d.shape
    top_k = chosen.dest.shape[1]
    here = chosen.dest[None] == torch.arange(world_size, device=x2d.device)[:, None, None]  # [W, M, k]
    ids = torch.full((world_size, capacity, top_k), -1, dtype=torch.int32, device=x2d.device)  # [W, C, k]
    ids[:, :num_tokens] = torch.where(here, chosen.local[None], -1)
    weights = topk_weights.new_zeros(world_size, capacity, top_k)  # [W, C, k]
    weights[:, :num_tokens] = torch.where(here, topk_weights[None], 0.0)
    rows = x2d.new_zeros((world_size, capacity, hidden))  # [W, C, K]
    rows[:, :num_tokens] = x2d
    payload = _pack(rows.view(-1, hidden), ids.view(-1, top_k), weights.view(-1, top_k))  # [W*C, B]
    return payload, rows.view(-1, hidden), weights.view(-1, top_k)


def _pack_padded_in_place(x2d, topk_weights, chosen, capacity, world_size):
    """``_pack_padded_copies``' payload written through typed views of its bytes (no autograd): (payload,
    x2d, weights [W*C, k] view); the second and third only carry shapes and dtypes on from here."""
    num_tokens, hidden = x2d.shape
    top_k = chosen.dest.shape[1]
    row_bytes = hidden * x2d.dtype.itemsize + top_k * (4 + topk_weights.dtype.itemsize)
    payload = torch.empty(world_size * capacity, row_bytes, dtype=torch.uint8, device=x2d.device)  # [W*C, B]
    flat = _unpack(payload, hidden, top_k, x2d.dtype, topk_weights.dtype)  # [W*C, K], [W*C, k] x2: views of the bytes
    x_rows, ids, weights = (t.view(world_size, capacity, -1) for t in flat)  # [W, C, *]
    here = chosen.dest[None] == torch.arange(world_size, device=x2d.device)[:, None, None]  # [W, M, k]
    x_rows[:, :num_tokens] = x2d
    ids[:, :num_tokens] = torch.where(here, chosen.local[None], -1)  # [W, M, k] (small)
    weights[:, :num_tokens] = torch.where(here, topk_weights[None], 0.0)
    if num_tokens < capacity:  # padding rows: zeros, ids -1 (never read by an expert)
        payload.view(world_size, capacity, row_bytes)[:, num_tokens:] = 0
        ids[:, num_tokens:] = -1
    return payload, x2d, flat[2]


def _writable_views(hidden: int, top_k: int, dtype: torch.dtype, wdtype: torch.dtype) -> bool:
    """The payload's x, ids and weights columns can be viewed in their dtypes (aligned offsets and row size)."""
    x_bytes = hidden * dtype.itemsize
    row_bytes = x_bytes + top_k * (4 + wdtype.itemsize)
    return all(offset % size == 0 and row_bytes % size == 0
               for offset, size in ((0, dtype.itemsize), (x_bytes, 4), (x_bytes + 4 * top_k, wdtype.itemsize)))


def combine(y: torch.Tensor, sent: Dispatched, group) -> torch.Tensor:
    """y [U, K] (each row the weighted sum of this rank's slots for that token) -> out [M, K]:
    send the rows back to their source ranks and sum each token's partials in float32."""
    return start_combine(y, sent, group).wait()


@dataclass
class PendingCombine:
    """A combine all-to-all in flight; ``wait`` sums each token's partials into out [M, K]."""

    work: object  # the collective's handle (``dist.Work``)
    back: torch.Tensor  # [T, K]; filled by the collective (T = W*C when padded)
    y: torch.Tensor  # [U, K]; kept alive until the collective has read it (and its gradient's way back)
    sent: Dispatched
    group: object  # the process group (the backward's all-to-all runs on it)

    def wait(self) -> torch.Tensor:
        self.work.wait()
        sent, y = self.sent, self.y
        (back,) = attach_gradients((y,), (self.back,), sent.recv_splits, sent.send_splits, self.group)  # [T, K]
        # Sums over ranks accumulate in float32 (torch's reductions of half types do), rounded once.
        if sent.capacity is not None:  # row t of each rank's block is token t: a sum over the ranks
            partials = back.view(len(sent.send_splits), sent.capacity, y.shape[1])[:, : sent.num_tokens]  # [W, M, K]
            return partials.sum(0)
        num_tokens, world_size = sent.num_tokens, len(sent.send_splits)
        if sent.send_key is not None and 2 * back.shape[0] >= world_size * num_tokens:  # a dense [W, M, K] sum
            # Each token comes back at most once per rank: copy every row to its (rank, token) place and sum
            # over ranks, one pass over the rows (index_add_ would need a float32 copy of bf16 rows).
            # The places are the dispatch's own keys: no host-to-device copy (which would wait for the GPU).
            dense = back.new_zeros((world_size * num_tokens, y.shape[1]))  # [W*M, K]
            dense.index_copy_(0, sent.send_key, back)
            return dense.view(world_size, num_tokens, y.shape[1]).sum(0)
        acc = torch.promote_types(y.dtype, torch.float32)
        out = torch.zeros(num_tokens, y.shape[1], dtype=acc, device=y.device)  # [M, K]
        out.index_add_(0, sent.send_token, back.to(acc))
        return out.to(y.dtype)


def start_combine(y: torch.Tensor, sent: Dispatched, group) -> PendingCombine:
    """``combine``'s all-to-all issued asynchronously; the sum happens in ``wait``."""
    y = y.contiguous()
    back = y.new_empty((sum(sent.send_splits), y.shape[1]))  # [T, K] (T = W*C when padded)
    work = dist.all_to_all_single(back, y.detach(), sent.send_splits, sent.recv_splits, group=group, async_op=True)
    return PendingCombine(work, back, y, sent, group)


def _pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, K] x, [T, k] int32 ids, [T, k] float32 weights -> [T, B] uint8 rows, B = K*x.itemsize + 8k."""
    return torch.cat([as_bytes(t) for t in (x, ids, weights)], dim=1)  # bytes: no graph (rows.py); [T, B]


def _unpack(rows: torch.Tensor, hidden: int, top_k: int, dtype: torch.dtype, wdtype: torch.dtype):
    x_bytes = hidden * dtype.itemsize
    x = view_rows_as(rows[:, :x_bytes], dtype)  # [U, K], a strided view when the row size allows (no copy)
    ids = view_rows_as(rows[:, x_bytes : x_bytes + 4 * top_k], torch.int32)  # [U, k]
    weights = view_rows_as(rows[:, x_bytes + 4 * top_k :], wdtype)  # [U, k]
    return x, ids, weights


def weights_dtype(topk_weights: torch.Tensor) -> torch.dtype:
    """The routing weights' dtype on the wire: float32, or float64 when they are (a float64 layer)."""
    return torch.promote_types(topk_weights.dtype, torch.float32)

"""Micro-batch overlap for ``EPMoE``: chunk i's experts run while chunk i+1's dispatch and chunk i-1's
combine are on the wire.

    tokens -> C chunks (sizes differ by at most 1; a rank with fewer tokens than C sends empty ones)
    issue order:  D0  D1 | E0  C0  D2 | E1  C1  D3 | ...  (D dispatch, E experts, C combine)

Every collective is issued with ``async_op=True``; the experts of chunk i wait only for D_i. On one
process group the collectives run in issue order on the communication stream, so after E_i is queued
C_i (which needs E_i's rows) and D_{i+2} follow while E_{i+1} computes: about max(experts, all-to-alls)
per chunk instead of their sum, once the pipeline is full.

Exact dispatch: every chunk's payload is packed first, then the split sizes of all C chunks travel in
one counts all-to-all (the error agreement's) before any payload: one host sync per forward, as without
overlap; a per-chunk exchange would stall the host behind each combine. With C = 1 this is the plain
forward. Padded dispatch: each chunk sends ceil(max_tokens_per_rank / C) rows to every rank, with no
host sync, so the whole forward stays CUDA-graph capturable.

Every rank must use the same number of chunks (``EPMoE(overlap=C)`` checks it at construction).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from moekit.parallel.dispatch import (
    PendingDispatch,
    choose_replicas,
    pack_sends,
    plan_sends,
    start_combine,
    start_dispatch,
    start_dispatch_padded,
)
from moekit.parallel.errors import SplitSizes


def chunk_bounds(num_tokens: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``chunks`` consecutive chunks of ``num_tokens`` tokens; sizes differ by
    at most one, larger first, empty chunks last when there are fewer tokens than chunks."""
    base, extra = divmod(num_tokens, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def run_chunks(ep, starters: list[Callable[[], PendingDispatch]]) -> torch.Tensor:
    """Dispatch -> experts -> combine over the chunks whose dispatches ``starters`` issue: [M, K].

    With several chunks on CUDA (eager, no autograd) the bookkeeping of the communication runs on a
    side stream: chunk i+1's dispatch (the padded payload's packing, the collective) and every chunk's
    combine sum, so the compute stream runs only the experts and waits only for their rows."""
    side = _side_stream(ep.w13.device) if len(starters) > 1 else None
    if side is None:
        return _run_chunks_one_stream(ep, starters)
    compute = torch.cuda.current_stream()
    side.wait_stream(compute)  # the tokens and the routing are ready before the side stream reads them
    # Every buffer a collective reads or writes stays referenced here until both streams are ordered
    # after the last combine (which follows every collective of this forward on the group's stream).
    pending: list[PendingDispatch] = [starters[0]()]
    combines, outs = [], []
    for i in range(len(starters)):
        if i + 1 < len(starters):
            with torch.cuda.stream(side):
                pending.append(starters[i + 1]())  # packed and on the wire while chunk i computes
            pending[i + 1].received.record_stream(compute)  # allocated on the side stream, read here
        sent = pending[i].wait()  # the compute stream waits for this chunk's rows only
        combines.append(start_combine(ep.run_local_experts(sent), sent, ep.group))  # waits for the experts
        combines[-1].back.record_stream(side)
        with torch.cuda.stream(side):
            outs.append(combines[-1].wait())  # the side stream waits for the rows back and sums them
    compute.wait_stream(side)
    for out in outs:
        out.record_stream(compute)
    return torch.cat(outs)


def _run_chunks_one_stream(ep, starters) -> torch.Tensor:
    pending: list[PendingDispatch | None] = [starters[0]()] + [None] * (len(starters) - 1)
    combines = []
    for i in range(len(starters)):
        if i + 1 < len(starters):
            pending[i + 1] = starters[i + 1]()  # on the wire while chunk i computes
        sent = pending[i].wait()
        pending[i] = None
        combines.append(start_combine(ep.run_local_experts(sent), sent, ep.group))
    outs = [c.wait() for c in combines]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device):
    """The communication bookkeeping's stream on ``device`` (one per device, made once), or None where
    one stream is used: off CUDA, under CUDA-graph capture (the padded graph keeps one stream), and
    when autograd records the forward (its backward runs the chunks' collectives on one stream)."""
    if device.type != "cuda" or torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def dispatch_starters(ep, x2d, topk_ids, topk_weights, agree: Callable[..., list[SplitSizes] | None]):
    """One callable per chunk that issues its dispatch, after ``agree`` (the error agreement: exact, it
    carries the counts of every chunk, ``agree(counts [C, W])``; padded, ``agree()``)."""
    if ep.max_tokens_per_rank is not None:
        agree()
        return _padded_starters(ep, x2d, topk_ids, topk_weights)
    return _exact_starters(ep, x2d, topk_ids, topk_weights, agree)


def _exact_starters(ep, x2d, topk_ids, topk_weights, agree):
    """Every chunk's payload is packed first (queued behind the previous work while the host waits),
    then ``agree`` exchanges the counts of all chunks (the forward's one host sync)."""
    bounds = chunk_bounds(x2d.shape[0], ep.overlap)
    packs = [pack_sends(x2d[a:b], topk_weights[a:b],
                        plan_sends(topk_ids[a:b], ep.replica_tables, ep.rank, ep.world_size))
             for a, b in bounds]
    counts = packs[0].plan.send_counts[None] if len(packs) == 1 else torch.stack([p.plan.send_counts for p in packs])
    splits = agree(counts)
    return [(lambda p=p, s=s: start_dispatch(p, s, ep.group)) for p, s in zip(packs, splits)]


def _padded_starters(ep, x2d, topk_ids, topk_weights):
    """Each chunk sends ceil(max_tokens_per_rank / C) rows to every rank: no host sync."""
    bounds = chunk_bounds(x2d.shape[0], ep.overlap)
    capacity = math.ceil(ep.max_tokens_per_rank / len(bounds))
    return [
        (lambda x=x2d[a:b], w=topk_weights[a:b], c=choose_replicas(topk_ids[a:b], ep.replica_tables, ep.rank):
         start_dispatch_padded(x, w, c, capacity, ep.group))
        for a, b in bounds
    ]

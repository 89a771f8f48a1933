"""Micro-batch overlap for ``EPMoE``: chunk i's experts run while chunk i+1's dispatch and chunk i-1's
combine are on the wire.

    tokens -> C chunks (sizes differ by at most 1; a rank with fewer tokens than C sends empty ones)
    issue order:  D0  D1 | E0  C0  D2 | E1  C1  D3 | ...  (D dispatch, E experts, C combine)

Every collective is issued with ``async_op=True``; the experts of chunk i wait only for D_i. On one
process group the collectives run in issue order on the communication stream, so after E_i is queued
C_i (which needs E_i's rows) and D_{i+2} follow while E_{i+1} computes: about max(experts, all-to-alls)
per chunk instead of their sum, once the pipeline is full.

Exact dispatch: the split sizes of all C chunks travel in one counts all-to-all before any payload (one
host sync per forward, as without overlap); a per-chunk exchange would stall the host behind each
combine. Padded dispatch: each chunk sends ceil(max_tokens_per_rank / C) rows to every rank, with no
host sync, so the whole forward stays CUDA-graph capturable.

Every rank must use the same number of chunks (``EPMoE(overlap=C)`` checks it at construction).
"""

from __future__ import annotations

import math

import torch

from moekit.parallel.dispatch import (
    PendingDispatch,
    choose_replicas,
    exchange_chunks,
    plan_sends,
    start_combine,
    start_dispatch,
    start_dispatch_padded,
)


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


def overlapped_experts(ep, x2d: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``EPMoE.forward_routed``'s dispatch -> experts -> combine over ``ep.overlap`` chunks: [M, K]."""
    bounds = chunk_bounds(x2d.shape[0], ep.overlap)
    starts = _dispatch_starters(ep, x2d, topk_ids, topk_weights, bounds)
    pending: list[PendingDispatch | None] = [starts[0]()] + [None] * (len(bounds) - 1)
    combines = []
    for i in range(len(bounds)):
        if i + 1 < len(bounds):
            pending[i + 1] = starts[i + 1]()  # on the wire while chunk i computes
        sent = pending[i].wait()
        pending[i] = None
        combines.append(start_combine(ep.run_local_experts(sent), sent, ep.group))
    return torch.cat([c.wait() for c in combines])


def _dispatch_starters(ep, x2d, topk_ids, topk_weights, bounds):
    """One callable per chunk that issues its dispatch; for the exact dispatch the split sizes of every
    chunk are exchanged first, in one collective."""
    chunks = [(x2d[a:b], topk_ids[a:b], topk_weights[a:b]) for a, b in bounds]
    if ep.max_tokens_per_rank is not None:
        capacity = math.ceil(ep.max_tokens_per_rank / len(bounds))
        return [
            (lambda x=x, w=w, c=choose_replicas(i, ep.replica_tables, ep.rank): start_dispatch_padded(x, w, c, capacity, ep.group))
            for x, i, w in chunks
        ]
    plans = [plan_sends(i, ep.replica_tables, ep.rank, ep.world_size) for _, i, _ in chunks]
    splits = exchange_chunks(torch.stack([p.send_counts for p in plans]), ep.group, ep.timeout)
    return [
        (lambda x=x, w=w, p=p, s=s: start_dispatch(x, w, p, s, ep.group))
        for (x, _, w), p, s in zip(chunks, plans, splits)
    ]

"""Collective errors: one rank's failure becomes an error on every rank, before the next collective.

    [local checks and work, may raise] -> [agree: all_to_all of int64 [W, 2 + C]] -> [the payload collectives]

A collective call (``EPMoE.forward``, ``rebalance``) first does everything that can fail on one rank
alone (argument checks, routing, the exact dispatch's send plan), then every rank agrees: one
``all_to_all_single`` in which every rank sends every rank ``[a, -a]``, a = its signature (or FAILED,
above any signature, when it failed): the largest first column is the largest signature, minus the
largest second column the smallest. The same collective carries the exact dispatch's row counts (C
more columns: the rows this rank sends that rank in each of C chunks), so the dispatch's one host sync
is also the agreement's: one tiny collective and one read on the host per forward, the whole cost of
the common path. When nobody failed and all signatures are equal, the call goes on. Otherwise the ranks exchange their
messages (``all_gather_object``, only then) and every rank raises before any payload collective, so
the group stays in step and the next call works:

- a rank that failed raises its own error, unchanged;
- every other rank raises ``PeerRankError`` naming the failing ranks and quoting their messages;
- ranks that all succeeded but disagree on the signature (what the next collective needs to be equal,
  e.g. the payload row's dtype) raise the same ``ValueError`` listing every rank's signature.

The signature travels as a CRC-32 of its text: two different texts collide with probability 2^-32.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_MAX_MESSAGE = 500  # characters of a rank's message quoted to the others
_FAILED = 1 << 31  # a failed rank's entry: above every signature (CRC-32 masked to 31 bits)


@dataclass
class SplitSizes:
    """Rows this rank exchanges with every rank, as host ints (what ``all_to_all_single`` takes)."""

    send: list[int]  # [W]; rows this rank sends to each rank
    recv: list[int]  # [W]; rows this rank receives from each rank


def exchange_columns(send: torch.Tensor, group, timeout: timedelta | None) -> tuple[list, list]:
    """``send`` [W, X] int64 (row w goes to rank w) -> (send, received) as host lists [W][X]: one
    ``all_to_all_single`` and one host sync (the read of both; it waits for the work queued before)."""
    recv = torch.empty_like(send)  # [W, X]: row w is what rank w sent here
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    # A peer that never arrives raises here after the timeout (gloo: the process group's timeout;
    # NCCL: ``timeout`` if given, else the watchdog aborts after the process group's timeout).
    work.wait() if timeout is None else work.wait(timeout)
    with torch.profiler.record_function("moekit::host_sync"):  # counted by the EP benchmark's --profile
        both = torch.stack([send, recv]).tolist()  # [2, W, X]; host sync
    return both[0], both[1]


class PeerRankError(RuntimeError):
    """Raised on a rank that did nothing wrong when another rank of the group failed in the same
    collective call. ``failed_ranks``: the failing ranks (group ranks), ascending."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


class CollectiveErrors:
    """The error agreement of a layer's collective calls, as a re-entrant context manager.

    ``with errors.on(device):`` opens one call (a call nested in another, like ``forward`` ->
    ``forward_routed``, joins the outer one's agreement). Every rank that gets through its local work
    calls ``agree(signature)``; an ``Exception`` raised inside the call before that point takes this
    rank into the same agreement as a failure (sending zero counts when the call carries counts: its
    ``counts_chunks``, the same on every rank), then propagates. After ``agree`` the context does
    nothing more (an error in the collectives themselves is the same on every rank, or a peer is gone
    and the timeout applies). While the current CUDA stream is being captured into a graph
    (``capturing``) both are no-ops and errors stay local: a capture may not sync with the host.
    """

    def __init__(self, group, *, timeout: timedelta | None = None) -> None:
        self.group, self.timeout = group, timeout
        self.device, self.depth, self.agreed, self.capturing = None, 0, False, False
        self.counts_chunks = 0

    def on(self, device, counts_chunks: int = 0) -> "CollectiveErrors":
        """Self, ready to enter for one call whose flag lives on ``device`` (the weights' device) and
        whose agreement carries ``counts_chunks`` chunks of row counts (0: none)."""
        if self.depth == 0:
            self.device, self.agreed, self.counts_chunks = device, False, counts_chunks
            self.capturing = _stream_capturing()
        return self

    def agree(self, signature: str = "", what: str = "", counts: torch.Tensor | None = None) -> list[SplitSizes] | None:
        """Collective: return when every rank succeeded with the same ``signature``; raise otherwise.
        ``what`` names the signature in the disagreement error. ``counts`` [C, W] int64 (C =
        ``counts_chunks``): rows this rank sends each rank per chunk, exchanged in the same collective
        (also under capture, where it fails as any host sync does); returns each chunk's split sizes
        (None without counts, and for a second ``agree`` in the same call, which does nothing)."""
        if self.agreed or (counts is None and self.capturing):
            self.agreed = True
            return None
        self.agreed = True
        if counts is not None and tuple(counts.shape) != (self.counts_chunks, dist.get_world_size(self.group)):
            raise ValueError(f"counts must have shape [counts_chunks={self.counts_chunks}, W], got "
                             f"{tuple(counts.shape)}")
        return _agree(self, None, signature, what, counts)

    def __enter__(self) -> "CollectiveErrors":
        self.depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.depth -= 1
        if self.depth == 0 and isinstance(exc, Exception) and not self.agreed:
            self.agreed = True
            if not self.capturing:
                _agree(self, exc, "", "", None)
        return False  # this rank's own error propagates unchanged


def _stream_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _agree(ctx: CollectiveErrors, error: Exception | None, signature: str, what: str,
           counts: torch.Tensor | None) -> list[SplitSizes] | None:
    """The agreement's collective (every rank sends [a, -a, its counts for that rank]) and its checks."""
    world_size, chunks = dist.get_world_size(ctx.group), ctx.counts_chunks
    mark = _FAILED if error is not None else zlib.crc32(signature.encode()) & 0x7FFFFFFF
    # Filled on the device: torch.tensor([...], device=cuda) would copy from pageable host memory,
    # which waits for the work queued on the stream (measured: 4 host syncs per EP forward, not 2).
    send = torch.full((world_size, 2 + chunks), mark, dtype=torch.int64, device=ctx.device)  # [W, 2 + C]
    send[:, 1] = -mark
    if chunks:  # a failed rank sends no rows
        send[:, 2:] = 0 if counts is None else counts.t()
    sent, received = exchange_columns(send, ctx.group, ctx.timeout)  # [W][2 + C] each
    top, bottom = max(r[0] for r in received), -max(r[1] for r in received)
    if top != _FAILED and top == bottom:
        if counts is None:
            return None
        return [SplitSizes(send=[row[2 + c] for row in sent], recv=[row[2 + c] for row in received])
                for c in range(chunks)]
    mine = None if error is None else f"{type(error).__name__}: {str(error)[:_MAX_MESSAGE]}"
    gathered: list = [None] * dist.get_world_size(ctx.group)
    dist.all_gather_object(gathered, (mine, signature), group=ctx.group)
    if error is not None:
        return  # the caller re-raises its own error
    failed = {rank: message for rank, (message, _) in enumerate(gathered) if message is not None}
    if failed:
        ranks = sorted(failed)
        if len(ranks) == 1:
            text = f"rank {ranks[0]} failed: {failed[ranks[0]]}"
        else:
            text = f"ranks {ranks} failed: " + "; ".join(f"rank {r}: {failed[r]}" for r in ranks)
        raise PeerRankError(text, ranks)
    listing = "; ".join(f"rank {rank}: {sig[:_MAX_MESSAGE]}" for rank, (_, sig) in enumerate(gathered))
    raise ValueError(f"the ranks disagree on {what or 'the call'}: {listing}")


def check_same_on_all_ranks(fingerprint: dict, group, what: str = "settings") -> None:
    """Raise the same clear ValueError on every rank when the ranks' values differ (one all_gather)."""
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fingerprint, group=group)
    reference = gathered[0]
    problems = []
    for rank, other in enumerate(gathered[1:], start=1):
        for key in reference:
            if other.get(key) != reference[key]:
                if key == "config":
                    fields = [f for f in reference[key] if reference[key][f] != other[key].get(f)]
                    detail = ", ".join(f"{f}: {reference[key][f]!r} vs {other[key].get(f)!r}" for f in fields)
                else:
                    detail = f"{reference[key]!r} vs {other.get(key)!r}"
                detail = detail if len(detail) <= 200 else detail[:200] + "..."
                problems.append(f"rank 0 vs rank {rank} differ in {key} ({detail})")
    if problems:
        raise ValueError(f"EPMoE: the ranks were built with different {what}: " + "; ".join(problems))


def digest(t: torch.Tensor) -> str:
    """A tensor's bytes as 16 hex digits of their sha256 (``EPMoE.verify_replicated`` compares ranks' weights)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``float32``, as the errors name a dtype."""
    return str(dtype).removeprefix("torch.")

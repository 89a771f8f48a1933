"""Collective errors: one rank's failure becomes an error on every rank, before the next collective.

    [local checks and work, may raise] -> [agree: all_reduce(MAX) of int32 [3]] -> [the payload collectives]

A collective call (``EPMoE.forward``, ``rebalance``) first does everything that can fail on one rank
alone (argument checks, routing), then every rank agrees: one ``all_reduce(MAX)`` of three int32s,
``[failed, signature, -signature]``: after it, the second is the largest signature and minus the third
the smallest. When nobody failed and the two are equal, the call goes on; that is the whole cost of
the common path (one tiny collective and its read on the host). Otherwise the ranks exchange their
messages (``all_gather_object``, only then) and every rank raises before any payload collective, so
the group stays in step and the next call works:

- a rank that failed raises its own error, unchanged;
- every other rank raises ``PeerRankError`` naming the failing ranks and quoting their messages;
- ranks that all succeeded but disagree on the signature (what the next collective needs to be equal,
  e.g. the payload row's dtype) raise the same ``ValueError`` listing every rank's signature.

The signature travels as a CRC-32 of its text: two different texts collide with probability 2^-32.
"""

from __future__ import annotations

import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

_MAX_MESSAGE = 500  # characters of a rank's message quoted to the others


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
    rank into the same agreement as a failure, then propagates. After ``agree`` the context does
    nothing more (an error in the collectives themselves is the same on every rank, or a peer is gone
    and the timeout applies). While the current CUDA stream is being captured into a graph
    (``capturing``) both are no-ops and errors stay local: a capture may not sync with the host.
    """

    def __init__(self, group, *, timeout: timedelta | None = None) -> None:
        self.group, self.timeout = group, timeout
        self.device, self.depth, self.agreed, self.capturing = None, 0, False, False

    def on(self, device) -> "CollectiveErrors":
        """Self, ready to enter for one call whose flag lives on ``device`` (the weights' device)."""
        if self.depth == 0:
            self.device, self.agreed = device, False
            self.capturing = _stream_capturing()
        return self

    def agree(self, signature: str = "", what: str = "") -> None:
        """Collective: return when every rank succeeded with the same ``signature``; raise otherwise.
        ``what`` names the signature in the disagreement error."""
        if not self.agreed:
            self.agreed = True
            if not self.capturing:
                _agree(self, None, signature, what)

    def __enter__(self) -> "CollectiveErrors":
        self.depth += 1
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.depth -= 1
        if self.depth == 0 and isinstance(exc, Exception) and not self.agreed:
            self.agreed = True
            if not self.capturing:
                _agree(self, exc, "", "")
        return False  # this rank's own error propagates unchanged


def _stream_capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _agree(ctx: CollectiveErrors, error: Exception | None, signature: str, what: str) -> None:
    code = zlib.crc32(signature.encode()) & 0x7FFFFFFF
    # Filled on the device (three fills): torch.tensor([...], device=cuda) would copy from pageable host
    # memory, which waits for the work queued on the stream (measured: 4 host syncs per EP forward, not 2).
    flags = torch.empty(3, dtype=torch.int32, device=ctx.device)
    flags[0], flags[1], flags[2] = int(error is not None), code, -code
    work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctx.group, async_op=True)
    work.wait() if ctx.timeout is None else work.wait(ctx.timeout)
    any_failed, top, neg_bottom = flags.tolist()  # host sync
    if not any_failed and top == -neg_bottom:
        return
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

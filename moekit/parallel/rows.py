"""Gradients through the row all-to-alls: an all-to-all is a permutation of rows between ranks, so its
transpose is the all-to-all with the send and receive splits swapped. The backward of the dispatch is a
combine of the gradients, and the combine's is a dispatch.

    forward  (unchanged, possibly async): sent [T, *]  --all_to_all(recv_splits <- send_splits)-->  received [U, *]
    backward (here, synchronous):    grad sent [T, *]  <--all_to_all(send_splits <- recv_splits)--  grad received [U, *]

``attach_gradients`` ties received tensors to the tensors they were sent from, after the forward's own
collective has filled them; only floating-point tensors take part (ids travel forward only). Autograd
runs the backward collective on every rank that computed a loss from the output: every rank of the
group must call ``backward`` as often as ``forward`` (the collectives pair up), as in data parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def attach_gradients(sent: tuple[torch.Tensor, ...], received: tuple[torch.Tensor, ...], send_splits: list[int],
                     recv_splits: list[int], group) -> tuple[torch.Tensor, ...]:
    """``received`` (what the forward all-to-all delivered from ``sent`` with these splits), now carrying
    gradients back to ``sent``; returned as is when no gradient is needed."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in sent):
        return received
    return _Attach.apply(send_splits, recv_splits, group, len(sent), *sent, *received)


class _Attach(torch.autograd.Function):
    """forward / setup_context apart (no ctx in forward): what torch.func transforms require of a Function."""

    @staticmethod
    def forward(send_splits, recv_splits, group, count, *tensors):
        return tuple(t.view_as(t) for t in tensors[count:])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        send_splits, recv_splits, group, count, *tensors = inputs
        ctx.splits, ctx.group, ctx.count = (send_splits, recv_splits), group, count
        ctx.specs = [(t.dtype, t.shape[1:], t.device) for t in tensors[:count]]

    @staticmethod
    def backward(ctx, *grads):
        send_splits, recv_splits = ctx.splits
        rows = sum(recv_splits)
        parts = [g if g is not None else torch.zeros((rows, *shape), dtype=dtype, device=device)
                 for g, (dtype, shape, device) in zip(grads, ctx.specs)]  # [U, *] each
        back = _all_to_all(parts, send_splits, recv_splits, ctx.group)  # [T, *] each: the transpose
        return (None, None, None, None, *back, *([None] * len(grads)))


def _all_to_all(tensors, out_splits, in_splits, group) -> list[torch.Tensor]:
    """Rows of every tensor packed as bytes, one ``all_to_all_single``, unpacked in the same dtypes."""
    flat = [t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in tensors]  # [U, width] each
    payload = torch.cat([as_bytes(t) for t in flat], dim=1)  # [U, B]
    received = payload.new_empty((sum(out_splits), payload.shape[1]))  # [T, B]
    dist.all_to_all_single(received, payload, out_splits, in_splits, group=group)
    out, offset = [], 0
    for t, f in zip(tensors, flat):
        width = f.shape[1] * t.dtype.itemsize
        part = view_rows_as(received[:, offset : offset + width], t.dtype)
        out.append(part.reshape(part.shape[0], *t.shape[1:]))
        offset += width
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[T, n] -> [T, n * itemsize] uint8 rows. A column [T, 1] (a gradient expanded from a scalar, k = 1) can pass as
    contiguous with a last stride 0 (a size-1 dim's stride is not compared), which view(uint8) refuses: cloned."""
    t = t.detach().contiguous()
    return (t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)).view(torch.uint8)


def view_rows_as(byte_cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns [U, n * itemsize] of received rows as [U, n] of ``dtype``: a view, or a copy first where the
    offset or the row stride does not allow one (an odd K in bf16, float64 rows behind int32 ids); a clone, as
    contiguous() returns a single row as it is (its row stride not compared)."""
    try:
        return byte_cols.view(dtype)
    except RuntimeError:
        return byte_cols.clone(memory_format=torch.contiguous_format).view(dtype)


def tied_to_received(y: torch.Tensor, x_recv: torch.Tensor, weights_recv: torch.Tensor,
                     experts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The experts' output y [U, K] for the received rows x_recv [U, K], weights_recv [U, k], from the rank's
    ``experts`` weights (w13, w2). Where no received slot ran an expert (no rows; or the padded dispatch's W*C rows
    all skipped: every token on other ranks' experts or on identity experts) a backend returns a fresh tensor outside
    the graph, so this rank's loss would not reach the received tensors and its backward would skip the transposed
    all-to-alls its peers' backward pairs with (they hang, or its loss has no gradient at all), and its experts'
    gradients would be None where an optimizer or a DDP-style all-reduce expects zeros: tied to all of them with
    zeros (one element of each weight: its gradient is the zero tensor of its shape), the same values."""
    if y.requires_grad or not torch.is_grad_enabled():
        return y
    ties = [t.reshape(-1)[:1].sum() for t in experts if t.requires_grad and t.numel()]
    if x_recv.requires_grad or weights_recv.requires_grad:
        ties += [x_recv * 0, weights_recv.sum()]
    return y + sum((t * 0).to(y.dtype) for t in ties) if ties else y  # [U, K]

"""One differentiable row all-to-all: several [R, *] tensors of any dtypes packed as bytes into one
``all_to_all_single``, and the gradients sent back the same way.

    Dispatch:  x [T, K], ids [T, k], weights [T, k] --all_to_all--> [U, K], [U, k], [U, k]
    Backward:  grad x [U, K], grad weights [U, k]  --all_to_all, splits swapped--> [T, K], [T, k]

An all-to-all is a permutation of rows between ranks, so its transpose is the all-to-all with the send
and receive splits swapped: the backward of the dispatch is a combine, and the combine's is a dispatch.
Integer tensors (the local expert ids) travel forward only and get no gradient. Autograd runs the
backward collective on every rank that computed a loss from the output: every rank of the group must
call ``backward`` as often as ``forward`` (the collectives pair up), as in data-parallel training.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def exchange_rows(
    tensors: tuple[torch.Tensor, ...], recv_splits: list[int], send_splits: list[int], group
) -> tuple[torch.Tensor, ...]:
    """Row i of each tensor [T, *] goes to the rank ``send_splits`` places it at; returns the received
    [U, *] tensors (U = sum(recv_splits)) in the same order and dtypes. Collective; differentiable in
    the floating-point tensors."""
    return _RowExchange.apply(recv_splits, send_splits, group, *tensors)


class _RowExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, recv_splits, send_splits, group, *tensors):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        ctx.specs = [(t.dtype, t.shape[1:]) for t in tensors]
        out = _all_to_all(tensors, recv_splits, send_splits, group)
        ctx.mark_non_differentiable(*(o for o in out if not o.is_floating_point()))
        return out

    @staticmethod
    def backward(ctx, *grads):
        recv_splits, send_splits = ctx.splits
        rows = sum(recv_splits)
        floats = [i for i, (dtype, _) in enumerate(ctx.specs) if dtype.is_floating_point]
        sent = [  # [U, *] each; a float output that got no gradient sends zeros
            grads[i] if grads[i] is not None else torch.zeros((rows, *ctx.specs[i][1]), dtype=ctx.specs[i][0],
                                                               device=_device(grads))
            for i in floats
        ]
        back = _all_to_all(sent, send_splits, recv_splits, ctx.group)  # [T, *] each: the transpose
        out = [None] * len(ctx.specs)
        for i, g in zip(floats, back):
            out[i] = g
        return (None, None, None, *out)


def _device(grads) -> torch.device:
    return next(g.device for g in grads if g is not None)


def _all_to_all(tensors, recv_splits, send_splits, group) -> tuple[torch.Tensor, ...]:
    """Pack each row's parts as bytes, one ``all_to_all_single``, unpack (views where aligned)."""
    flat = [t.reshape(t.shape[0], math.prod(t.shape[1:])) for t in tensors]  # [T, width] each
    payload = torch.cat([t.contiguous().view(torch.uint8) for t in flat], dim=1)  # [T, B]
    received = payload.new_empty((sum(recv_splits), payload.shape[1]))  # [U, B]
    dist.all_to_all_single(received, payload, recv_splits, send_splits, group=group)
    out, offset = [], 0
    for t, f in zip(tensors, flat):
        width = f.shape[1] * t.dtype.itemsize
        part = received[:, offset : offset + width]
        try:
            part = part.view(t.dtype)
        except RuntimeError:  # misaligned offset or row stride (an odd K in bf16): copy first
            part = part.contiguous().view(t.dtype)
        out.append(part.reshape(part.shape[0], *t.shape[1:]))
        offset += width
    return tuple(out)

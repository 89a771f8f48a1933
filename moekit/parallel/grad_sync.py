"""One call after backward: a model with ``EPMoE`` layers gets the gradients of one process trained on every rank's
batch, averaged over the ranks as data parallelism (DDP) averages them.

    [EPLB replicas: each expert's slots summed (replica_grads)]
      -> [one flat all_reduce over the EP group: every gradient all ranks hold in full, and which ranks had one]
      (-> [dp_group: the same flat buffer, and each EP layer's routed slots' w13 / w2 gradients, all_reduce over it])
      -> [every gradient / (W * D)]

What "averaged" means: after backward each rank's loss has put into the gradients of the weights it holds in full
(the gate, its bias, a separate shared expert, the fused shared slots, and every parameter of the model around the
layers) its own tokens' share, and into its experts' gradients every rank's tokens' (the all-to-alls' backward). So
the sum over the ranks of the first, and the second as they are, are the gradients of the sum of the ranks' losses;
``sync_grads`` divides both by the ranks W (times D, the data-parallel replicas): the gradient of the ranks' mean
loss, which with equal per-rank batches and a per-rank mean loss is the mean loss over the whole batch, as with
DDP. ``EPMoE``'s aux loss is defined to fit (``moekit.losses.Across``: the mean of the ranks' aux losses is the loss
of the whole batch).

Shapes: W ranks of the EP group, D of ``dp_group``, L routed slots on a rank (+ S fused shared slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moekit.parallel.replica_grads import ReplicaSums, check_grads, sum_replicas


@dataclass(frozen=True)
class GradSync:
    """What one ``sync_grads`` call did on this rank."""

    replicated_experts: int  # experts whose EPLB replicas' gradients were summed here
    flat_values: int  # values in the flat all-reduce of the gradients every rank holds in full
    divisor: int  # W * D: every gradient was divided by it


@dataclass(frozen=True)
class _Piece:
    """One gradient, or a part of one (the fused shared slots of w13 / w2), that every rank holds in full."""

    param: nn.Parameter
    start: int  # first row of param it covers (0, or L for the fused shared slots)


def sync_grads(model: nn.Module, dp_group: dist.ProcessGroup | None = None, agree: bool = True) -> GradSync:
    """Average every gradient of ``model`` over the ranks (the module docstring); collective over the EP group (every
    ``EPMoE`` of the model must share one) and ``dp_group`` (None: none). A gradient that is None on every rank stays
    None; None on some ranks counts as zeros there. A rank whose experts hold no gradient (before backward) raises
    its ValueError, the others ``PeerRankError``, before any collective.

    Host syncs: (1) the agreement (``agree``): one tiny collective read back on the host, which turns a rank's
    missing gradients or a different gradient layout into an error on every rank instead of mismatched collectives
    (a hang, or sums of different tensors); (2) the presence flags, read back only where a gradient is None on this
    rank. ``agree=False`` skips (1) (the local checks still run): a step whose gradients all exist then syncs the host
    nowhere here, as a CUDA-graph-captured step needs; the results are the same, and a rank that does differ is
    not caught (the caller vouches that every rank runs the same model)."""
    from moekit.parallel.layer import EPMoE  # the layer module imports this one

    if not isinstance(agree, bool):
        raise TypeError(f"agree must be a bool (False: no host sync, see sync_grads), got {agree!r}")
    if dp_group is not None and not isinstance(dp_group, dist.ProcessGroup):
        raise TypeError(f"dp_group must be a torch.distributed ProcessGroup (the data-parallel replicas) or None, got "
                        f"{dp_group!r}")
    layers = [m for m in model.modules() if isinstance(m, EPMoE)]
    if not layers:
        raise ValueError("model has no EPMoE layer: sync_grads averages an expert-parallel model's gradients (for a "
                         "model without one use DistributedDataParallel)")
    first = layers[0]
    groups = {id(layer.group) for layer in layers}
    if len(groups) > 1:
        raise ValueError("model's EPMoE layers use different process groups: sync_grads averages over one EP group")
    if not agree:
        plans, pieces = _local_checks(model, layers, dp_group)
    else:
        with first._errors.on(first.w13.device) as agreement:
            plans, pieces = _local_checks(model, layers, dp_group)
            layout = ", ".join(f"{tuple(p.param[p.start:].shape)} {p.param.dtype}" for p in pieces)
            agreement.agree(f"{len(pieces)} gradients: {layout}", what="sync_grads' gradients (the same model?)")
    summed = sum(sum_replicas(layer.w13, layer.w2, plan, layer.rank, layer.group)
                 for layer, plan in zip(layers, plans))
    divisor = first.world_size * (1 if dp_group is None else dist.get_world_size(dp_group))
    flat = _flat(pieces)  # [V + pieces]: the values, then one 1 per piece that has a gradient here
    dist.all_reduce(flat, group=first.group)
    if dp_group is not None:
        dist.all_reduce(flat, group=dp_group)
    with torch.no_grad():
        for layer in layers:
            for w in (layer.w13, layer.w2):
                if w.grad is not None:
                    routed = w.grad[: layer.num_local_experts]  # [L, ...]: a contiguous view (leading rows)
                    if dp_group is not None:
                        dist.all_reduce(routed, group=dp_group)
                    routed.div_(divisor)
        _unflat(flat, pieces, divisor)
    return GradSync(replicated_experts=summed, flat_values=flat.numel() - len(pieces), divisor=divisor)


def _local_checks(model: nn.Module, layers, dp_group) -> tuple[list[ReplicaSums], list[_Piece]]:
    """What this rank checks and plans alone: each layer's replica-sum plan, its experts' gradients, its aux loss's
    batch against ``dp_group`` (``EPTraining.dp_group``), the pieces."""
    plans = [ReplicaSums.build(layer.placement, layer.rank) for layer in layers]
    for i, layer in enumerate(layers):
        c = layer.config
        aux = bool(c.aux_loss_coef or c.seq_aux_loss_coef or c.z_loss_coef)
        if layer.dp_group is not dp_group and (layer.dp_group is not None or aux):
            raise ValueError(f"dp_group must be EPMoE layer {i}'s dp_group (its aux loss's batch spans that group's "
                             f"replicas; set layer.dp_group = dp_group before the forward), got {dp_group!r} against "
                             f"{layer.dp_group!r}")
        check_grads(layer.w13, layer.w2, layer.rank, f" of EPMoE layer {i}")
    return plans, _pieces(model, layers)


def _pieces(model: nn.Module, layers) -> list[_Piece]:
    """The gradients every rank holds in full, in the model's parameter order: every trainable parameter but the
    EP layers' routed experts (their fused shared slots, rows L.., included)."""
    experts = {id(w): layer.num_local_experts for layer in layers for w in (layer.w13, layer.w2)}
    pieces = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        start = experts.get(id(param), 0)
        if start < param.shape[0] or id(param) not in experts:
            pieces.append(_Piece(param, start))
    return pieces


def _flat(pieces: list[_Piece]) -> torch.Tensor:
    """The pieces' gradients (zeros where None) in one buffer of the widest float (float32 at least), then the
    presence flags."""
    dtype = torch.float32
    for p in pieces:
        dtype = torch.promote_types(dtype, p.param.dtype)
    device = pieces[0].param.device if pieces else torch.device("cpu")
    parts = [p.param.grad[p.start:].reshape(-1).to(dtype) if p.param.grad is not None
             else torch.zeros(p.param[p.start:].numel(), dtype=dtype, device=device) for p in pieces]
    flags = torch.tensor([float(p.param.grad is not None) for p in pieces], dtype=dtype, device=device)
    return torch.cat([*parts, flags])


def _unflat(flat: torch.Tensor, pieces: list[_Piece], divisor: int) -> None:
    """Each piece's gradient := its summed values / divisor, in its dtype; left None where no rank had one. The
    presence flags are read back to the host only where a gradient is None here (a rank that has one knows the sum
    is present): a step whose gradients all exist syncs no more than its collectives (CUDA-graph capturable)."""
    offset, missing = 0, any(p.param.grad is None for p in pieces)
    flags = flat[flat.numel() - len(pieces):].tolist() if missing else [True] * len(pieces)
    for p, present in zip(pieces, flags):
        n = p.param[p.start:].numel()
        if present:
            if p.param.grad is None:
                p.param.grad = torch.zeros_like(p.param)
            p.param.grad[p.start:].copy_((flat[offset: offset + n] / divisor).view_as(p.param[p.start:]))
        offset += n


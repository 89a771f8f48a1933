"""Expert weights under a placement: a rank's slice of full weights, and moving weights between ranks
when the placement changes (EPLB's rebalance).

Shapes: E logical experts, L = num_local_experts(rank) physical slots on a rank, S fused shared slots
(kept on every rank, after the L routed slots), [..] = one expert's weight shape ([2N, K] or [K, N]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moekit.parallel.placement import Placement


def take_weights(ep, moe) -> None:
    """``ep`` (this rank's ``EPMoE``) takes the full ``moe``'s weights: the gate (and its bias), the correction bias,
    the shared expert and its gate, a hash layer's table (``tid2eid``) copied; the routed experts sliced by
    ``ep.placement`` (``shard_experts``)."""
    with torch.no_grad():
        ep.gate.load_state_dict(moe.gate.state_dict())  # the weight, and the bias of a router_bias config
        for name in ("e_score_correction_bias", "tid2eid", "shared_w13", "shared_w2"):
            if getattr(moe, name, None) is not None:
                getattr(ep, name).copy_(getattr(moe, name))
        ep.w13.copy_(shard_experts(moe.w13, ep.placement, ep.rank))
        ep.w2.copy_(shard_experts(moe.w2, ep.placement, ep.rank))
        if ep.shared_gate is not None:
            ep.shared_gate.weight.copy_(moe.shared_gate.weight)


def shard_experts(weight: torch.Tensor, placement: Placement, rank: int) -> torch.Tensor:
    """weight [E(+S), ..] -> [L(+S), ..]: the rows of ``rank``'s experts in local order, then the S
    fused shared-slot rows (every rank keeps those)."""
    num_experts = placement.num_experts
    if not isinstance(weight, torch.Tensor):  # a QuantizedWeight (EPMoE.from_moe of a quantized MoE): float only
        raise ValueError(f"weight is quantized ({weight.scheme}): EPMoE shards float experts; shard the float layer, "
                         f"then quantize: EPMoE.from_moe(moe).quantize_({weight.scheme!r})")
    if weight.shape[0] < num_experts:
        raise ValueError(f"weight must have at least num_experts={num_experts} rows, got shape {tuple(weight.shape)}")
    index = torch.tensor(placement.slots[rank] + list(range(num_experts, weight.shape[0])), dtype=torch.long,
                         device=weight.device)
    return weight.index_select(0, index)


@dataclass
class MovedExperts:
    """One weight after ``move_experts``: this rank's rows under the new placement."""

    weight: torch.Tensor  # [L_new(+S), ..]; the new placement's slots in local order, then the S shared rows
    received: int  # slots whose rows came over the network (the rest were already here)


def move_experts(weight: torch.Tensor, old: Placement, new: Placement, rank: int, group=None) -> MovedExperts:
    """weight [L_old(+S), ..] under ``old`` -> [L_new(+S), ..] under ``new``, and the slots received.

    A slot whose expert this rank already holds is copied locally; every other slot is received from
    one rank that holds it under ``old`` (spread over the replicas), in one ``all_to_all_single``.
    Collective: every rank of ``group`` calls it with the same ``old`` and ``new``; needs no host sync
    beyond the placements, which every rank already knows.
    """
    if (old.num_experts, old.world_size) != (new.num_experts, new.world_size):
        raise ValueError(
            f"new placement must keep num_experts={old.num_experts} and world_size={old.world_size}, got "
            f"{new.num_experts} and {new.world_size}"
        )
    world_size = old.world_size
    num_local_old = old.num_local_experts(rank)
    old_local = {e: i for i, e in enumerate(old.slots[rank])}

    def source(dst: int, expert: int) -> int:
        holders = old.replicas(expert)
        return dst if dst in holders else holders[(dst + expert) % len(holders)]

    sends = [[e for e in new.slots[dst] if dst != rank and source(dst, e) == rank] for dst in range(world_size)]
    recvs = [[e for e in new.slots[rank] if src != rank and source(rank, e) == src] for src in range(world_size)]
    tail = weight.shape[1:]
    send_rows = [old_local[e] for dst_list in sends for e in dst_list]
    send_buf = weight.index_select(0, torch.tensor(send_rows, dtype=torch.long, device=weight.device)).contiguous()
    recv_buf = weight.new_empty((sum(len(r) for r in recvs), *tail))
    dist.all_to_all_single(recv_buf, send_buf, [len(r) for r in recvs], [len(s) for s in sends], group=group)

    received, offset = {}, 0
    for src_list in recvs:
        for e in src_list:
            received[e] = recv_buf[offset]
            offset += 1
    rows = [weight[old_local[e]] if e in old_local else received[e] for e in new.slots[rank]]
    shared_rows = list(weight[num_local_old:])
    if not rows and not shared_rows:
        return MovedExperts(weight=weight.new_empty((0, *tail)), received=0)
    return MovedExperts(weight=torch.stack(rows + shared_rows), received=len(received))

"""Shared-expert slots: a shared MLP split into S routed-width experts, appended to every token's
routing so it runs in the same grouped GEMM as the routed experts.

    Route -> Capacity (opt-in) -> [Shared slots] -> Group -> Experts -> Combine

Shapes: M tokens, E routed experts, k routed slots, S = shared slots (ids E..E+S-1).
"""

from __future__ import annotations

import torch

from moekit.activations import apply_glu, as_spec
from moekit.config import MoEConfig
from moekit.routing.route import Routing


def append_shared_slots(routing: Routing, config: MoEConfig, shared_gate_logits: torch.Tensor | None = None) -> Routing:
    """Append the S shared-expert slots (ids E..E+S-1) to every token.

    The weight is 1, or ``sigmoid(shared_gate_logits)`` [M, 1] for a gated (Qwen2-MoE) shared expert, times
    ``config.shared_weight`` (0.5 where the shared expert is averaged in: Cohere2-MoE); the router's own
    ``routing.shared_weights`` [M, S] where it gives them (Inkling).
    SGLang writes the shared weight as sum(routed weights) / routed_scaling_factor because it scales the
    whole output afterwards; moekit scales the routed weights themselves, so the same shared output
    needs weight exactly 1.
    """
    topk_ids, weights, num_tokens = routing.topk_ids, routing.topk_weights, routing.num_tokens
    slots = config.num_shared_slots
    if slots == 0:
        raise ValueError(
            f"fuse_shared needs shared_expert_intermediate_size ({config.shared_expert_intermediate_size}) to be a "
            f"multiple of moe_intermediate_size ({config.moe_intermediate_size})"
        )
    device = topk_ids.device
    shared_ids = torch.arange(config.num_experts, config.num_experts + slots, device=device, dtype=torch.int32)
    shared_ids = shared_ids.expand(num_tokens, slots)  # [M, S]
    if routing.shared_weights is not None:
        shared_w = routing.shared_weights  # [M, S]
    elif config.shared_expert_gate:
        if shared_gate_logits is None or shared_gate_logits.shape != (num_tokens, 1):
            got = None if shared_gate_logits is None else tuple(shared_gate_logits.shape)
            raise ValueError(f"shared_gate_logits must have shape [M={num_tokens}, 1] for a gated shared expert, got "
                             f"{got}")
        shared_w = torch.sigmoid(shared_gate_logits.to(weights.dtype)).expand(num_tokens, slots)  # [M, S]
        if config.shared_weight != 1.0:
            shared_w = shared_w * config.shared_weight
    else:
        # [M, S]; the routed weights' dtype
        shared_w = torch.full((num_tokens, slots), config.shared_weight, device=device, dtype=weights.dtype)
    return Routing(
        topk_ids=torch.cat([topk_ids, shared_ids], dim=1),
        topk_weights=torch.cat([weights, shared_w], dim=1),
        masked_tokens=routing.masked_tokens,
    )


def shared_mlp(x2d: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, gate: torch.nn.Module | None,
               config: MoEConfig, slot_weights: torch.Tensor | None = None) -> torch.Tensor:
    """The separate (unfused) shared MLP: x2d [M, K], w13 [2SN, K], w2 [K, SN] -> [M, K], scaled by
    sigmoid(gate(x2d)) for a gated (Qwen2-MoE) one and by ``config.shared_weight`` (Cohere2-MoE's average), with
    ``config.shared_mlp_activation`` (the experts' unless ``shared_activation`` is set: HY-V4's plain silu);
    ``slot_weights`` [M, S] (Inkling's router) scale each slot's N activations before the down projection."""
    h = apply_glu(x2d @ w13.t(), config.shared_mlp_activation)  # [M, SN]
    if slot_weights is not None:
        num_tokens, slots = slot_weights.shape
        per_slot = h.view(num_tokens, slots, h.shape[1] // slots)  # [M, S, N]; M may be 0
        h = (per_slot * slot_weights.unsqueeze(-1).to(h.dtype)).view(num_tokens, h.shape[1])
    y = h @ w2.t()  # [M, K]
    if gate is not None:
        y = torch.sigmoid(gate(x2d)) * y
    return y if config.shared_weight == 1.0 else y * config.shared_weight


def fused_shared(shared_w13: torch.Tensor, shared_w2: torch.Tensor, activation,
                 slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The separate shared MLP's weights as ``slots`` routed-width experts (``unfused_shared``'s inverse):
    shared_w13 [2SN, K] -> slot_w13 [S, 2N, K]; shared_w2 [K, SN] -> slot_w2 [S, K, N] (a view). Slot s holds units
    sN..sN + N - 1: their gate rows then their up rows, or, for an interleaved ``activation`` (row 2i gate i, 2i + 1
    up i), the 2N rows holding them as they are."""
    n = shared_w2.shape[1] // slots
    if as_spec(activation).interleaved:
        slot_w13 = shared_w13.view(slots, 2 * n, -1)  # [S, 2N, K]
    else:
        gate_rows, up_rows = shared_w13.view(2, slots, n, -1).unbind(0)  # [S, N, K] each
        slot_w13 = torch.cat([gate_rows, up_rows], dim=1)  # [S, 2N, K]
    return slot_w13, shared_w2.view(-1, slots, n).transpose(0, 1)


def unfused_shared(slot_w13: torch.Tensor, slot_w2: torch.Tensor, activation) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused shared slots back as the separate MLP's weights: slot_w13 [S, 2N, K] -> shared_w13 [2SN, K];
    slot_w2 [S, K, N] -> shared_w2 [K, SN]. Each slot's gate rows then its up rows become all gate rows, then all up
    rows; for an interleaved ``activation`` (an ``ActivationSpec`` like gpt-oss's: row 2i gate i, 2i + 1 up i, in a
    slot as in the shared MLP) the slots' rows are stacked as they are. Inverse of ``fused_shared``; the same
    function (``shared_mlp``)."""
    if as_spec(activation).interleaved:
        shared_w13 = slot_w13.flatten(0, 1)  # [2SN, K]
    else:
        gate_rows, up_rows = slot_w13.split(slot_w2.shape[2], dim=1)  # [S, N, K] each
        shared_w13 = torch.cat([gate_rows.flatten(0, 1), up_rows.flatten(0, 1)])  # [2SN, K]
    return shared_w13, torch.cat(list(slot_w2), dim=1)  # [K, SN]


def shared_rows_detached(bias: torch.Tensor, slots: int) -> torch.Tensor:
    """An expert bias [E + S, ...] whose last ``slots`` rows (a fused layer's shared slots: zero, the shared MLP has no
    bias) carry no gradient, so training leaves them zero, as the un-fused layer's shared MLP (and OffloadedMoE's
    copy of it) has none; the same values."""
    return torch.cat([bias[:-slots], bias[-slots:].detach()]) if bias.requires_grad else bias

"""``moekit train --ep N --spare-slots S --rebalance-every K``: EPLB in the training loop, the optimizer's state moved
with the experts.

    start: every MoE layer an EPMoE over EPLB's placement of even loads with S replica slots ((E + S) / N a rank)
    every K steps, after the optimizer step: rebalance(S) on the loads tracked since the last one -> a new placement
      -> the weights moved (in place: the same Parameters) -> each optimizer state tensor of w13 / w2 moved alike

Why the state moves: AdamW's ``exp_avg`` / ``exp_avg_sq`` are per row of w13 / w2, and a rebalance copies other
experts' weights into a rank's slots. Without the move a slot would carry another expert's moments and the run would
leave the contiguous one's curve. A new replica takes its source slot's state exactly: the replicas' gradients are
bit-identical after ``sync_grads`` (its replica sums), so their states are. The slots a rank holds never change in
number ((E + S) a multiple of N, checked by ``TrainSettings``), so the optimizer keeps its Parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from moekit.parallel import EPMoE, Placement, contiguous_placement, eplb_placement
from moekit.parallel.weights import move_experts


def initial_placement(num_experts: int, world_size: int, spare_slots: int) -> Placement:
    """Contiguous without spare slots, else EPLB's placement of even loads with ``spare_slots`` replicas."""
    if spare_slots == 0:
        return contiguous_placement(num_experts, world_size)
    return eplb_placement([1.0] * num_experts, world_size, spare_slots)


def rebalance_(model: nn.Module, optimizer: torch.optim.Optimizer, spare_slots: int) -> int:
    """Every ``EPMoE`` of ``model`` rebalanced on its tracked loads (``EPMoE.rebalance``), the optimizer's state of
    its w13 / w2 moved with the weights; returns the layers whose placement changed. Collective (every rank)."""
    changed = 0
    for layer in (m for m in model.modules() if isinstance(m, EPMoE)):
        old, params = layer.placement, (layer.w13, layer.w2)
        report = layer.rebalance(num_redundant=spare_slots)
        if report.placement == old:
            continue
        if any(p is not q for p, q in zip(params, (layer.w13, layer.w2))):
            raise RuntimeError("rebalance reallocated w13 / w2: the optimizer holds the old Parameters")
        changed += 1
        for param in params:
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == param.shape:  # per-row state: moved as rows
                    with torch.no_grad():
                        value.copy_(move_experts(value, old, report.placement, layer.rank, layer.group).weight)
    return changed

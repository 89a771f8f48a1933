"""``moekit train --ep N --spare-slots S --rebalance-every K``: EPLB in the training loop, the optimizer's state moved
with the experts.

    start: every MoE layer an EPMoE over EPLB's placement of even loads with S replica slots (P = E + S slots: P // N a
      rank, one more on P % N of them)
    every K steps, after the optimizer step: rebalance(S) on the loads tracked since the last one -> a new placement
      -> the weights moved -> each optimizer state tensor of w13 / w2 moved alike (-> a rank whose slot count changed:
      its new w13 / w2 Parameters put in the optimizer in place of the old, with the moved state)

Why the state moves: AdamW's ``exp_avg`` / ``exp_avg_sq`` are per row of w13 / w2, and a rebalance copies other
experts' weights into a rank's slots. Without the move a slot would carry another expert's moments and the run would
leave the one-process curve. A new replica takes its source slot's state exactly: the replicas' gradients are
bit-identical after ``sync_grads`` (its replica sums), so their states are. When P is not a multiple of N, EPLB may
give the extra slot to other ranks than before: ``EPMoE.apply_placement`` then makes new w13 / w2 Parameters of the new
row count, and ``rebalance_`` swaps them into the optimizer's param groups and state (scalar state such as AdamW's
``step`` carried over as it is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moekit.parallel import EPMoE, Placement, contiguous_placement, eplb_placement
from moekit.parallel.weights import move_experts


@dataclass(frozen=True)
class RebalanceSummary:
    """What ``rebalance_`` did on this rank."""

    changed: int  # MoE layers whose placement changed (the same on every rank)
    reallocated: int  # of those, layers where this rank's slot count changed: w13 / w2 swapped in the optimizer


def initial_placement(num_experts: int, world_size: int, spare_slots: int) -> Placement:
    """Contiguous without spare slots, else EPLB's placement of even loads with ``spare_slots`` replicas."""
    if spare_slots == 0:
        return contiguous_placement(num_experts, world_size)
    return eplb_placement([1.0] * num_experts, world_size, spare_slots)


def rebalance_(model: nn.Module, optimizer: torch.optim.Optimizer, spare_slots: int) -> RebalanceSummary:
    """Every ``EPMoE`` of ``model`` rebalanced on its tracked loads (``EPMoE.rebalance``), the optimizer's state of
    its w13 / w2 moved with the weights (and new Parameters swapped in where the slot count changed). Collective."""
    changed = reallocated = 0
    for layer in (m for m in model.modules() if isinstance(m, EPMoE)):
        old, params = layer.placement, (layer.w13, layer.w2)
        report = layer.rebalance(num_redundant=spare_slots)
        if report.placement == old:
            continue
        changed += 1
        reallocated += layer.w13 is not params[0]
        for param, new_param in zip(params, (layer.w13, layer.w2)):
            _move_state(optimizer, param, new_param, old, report.placement, layer)
    return RebalanceSummary(changed, reallocated)


def _move_state(optimizer: torch.optim.Optimizer, param: nn.Parameter, new_param: nn.Parameter, old: Placement,
                new: Placement, layer: EPMoE) -> None:
    """``param``'s per-row state moved from ``old`` to ``new`` as its rows were (collective: every rank moves the same
    state keys, in the same order); ``new_param`` takes ``param``'s place in the optimizer when it is another one."""
    state = optimizer.state.get(param, {})
    moved = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape:  # per-row state: moved as rows
            with torch.no_grad():
                moved[key] = move_experts(value, old, new, layer.rank, layer.group).weight
        else:
            moved[key] = value
    if new_param is param:
        with torch.no_grad():
            for key, value in moved.items():
                if value is not state[key]:
                    state[key].copy_(value)  # the same storage: the optimizer's tensors stay its own
        return
    for group in optimizer.param_groups:
        group["params"] = [new_param if p is param else p for p in group["params"]]
    optimizer.state.pop(param, None)
    if moved:
        optimizer.state[new_param] = moved

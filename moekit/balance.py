"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3): after each step, move every
expert's selection bias towards balance.

    [Route: top-k of scores + e_score_correction_bias] -> counts per expert -> this update -> the next step

Shapes: E routed experts.

The pattern in a training loop (one ``ExpertCounts`` per MoE layer; update every step or every few)::

    counts = ExpertCounts(moe.config.num_experts)
    for step, batch in enumerate(data):
        res = moe(x, return_stats=True)              # MoEStats.counts [E]: this forward's assignments
        counts.add(res.stats.counts)
        ...loss.backward(); optimizer.step()
        update_correction_bias_(moe, counts.take(), rate=1e-3, group=ep_group)  # group: sum over ranks

The bias only changes which experts are selected (``moekit.routing.route``), never the weights, so it
needs no gradient and no optimizer; it lives in the ``e_score_correction_bias`` buffer
(``MoEConfig(use_correction_bias=True)``), softmax or sigmoid scoring alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class ExpertCounts:
    """Assignments per routed expert summed over forwards since the last ``take`` (no host sync)."""

    def __init__(self, num_experts: int) -> None:
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        self.num_experts = num_experts
        self.total: torch.Tensor | None = None  # [E] float64 once something was added; None = nothing yet

    def add(self, counts: torch.Tensor) -> None:
        """Add one forward's counts [E] (``MoEStats.counts``)."""
        counts = _check_counts(counts, self.num_experts).to(torch.float64)
        self.total = counts.clone() if self.total is None else self.total + counts.to(self.total.device)

    def take(self) -> torch.Tensor:
        """The sum [E] float64 since the last take (zeros when nothing was added), and reset."""
        total = torch.zeros(self.num_experts, dtype=torch.float64) if self.total is None else self.total
        self.total = None
        return total


@torch.no_grad()
def update_correction_bias_(
    moe: nn.Module,
    counts: torch.Tensor,
    rate: float = 1e-3,
    center: bool = True,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``moe.e_score_correction_bias += delta``, delta = rate * sign(mean(counts) - counts): overloaded
    experts go down, underloaded ones up, by ``rate`` each (DeepSeek-V3's gamma, 1e-3).

    ``center``: subtract delta's mean first (torchtitan's variant; the paper does not centre), so a
    centred bias stays centred and does not drift as a whole (a common shift changes no selection).
    ``group``: a process group to sum ``counts`` over first (``all_reduce``, collective: every rank of it
    calls this with its own counts); None = these counts alone. For the world, pass
    ``torch.distributed.group.WORLD``. Returns the delta [E] (the bias dtype) that was added."""
    bias = getattr(moe, "e_score_correction_bias", None)
    if not isinstance(bias, torch.Tensor):
        raise ValueError("moe has no e_score_correction_bias: build it with MoEConfig(use_correction_bias=True)")
    counts = _check_counts(counts, bias.numel()).to(device=bias.device, dtype=torch.float64)
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < float("inf")):
        raise ValueError(f"rate must be a positive finite number, got {rate!r}")
    if group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    delta = rate * torch.sign(counts.mean() - counts)  # [E]
    if center:
        delta = delta - delta.mean()
    delta = delta.to(bias.dtype)
    bias.add_(delta)
    return delta


def _check_counts(counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor) or counts.shape != (num_experts,):
        got = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"counts must be a tensor of shape [num_experts={num_experts}], got {got}")
    return counts

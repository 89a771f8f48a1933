"""Auxiliary-loss-free load balancing (Wang et al. 2024; DeepSeek-V3): after each step, move every
expert's selection bias towards balance.

    [Route: top-k of scores + e_score_correction_bias] -> counts per expert -> this update -> the next step

Shapes: E routed experts, Z identity experts (LongCat-Flash; its bias spans E + Z).

The pattern in a training loop (one ``ExpertCounts`` per MoE layer; update every step or every few)::

    counts = ExpertCounts(moe.config.choice_width)   # E, or E + Z with identity experts
    for step, batch in enumerate(data):
        res = moe(x, return_stats=True)              # MoEStats.choice_counts [E(+Z)]: this forward's assignments
        counts.add(res.stats.choice_counts)
        ...loss.backward(); optimizer.step()
        update_correction_bias_(moe, counts.take(), rate=1e-3)  # an EPMoE: summed over its group

The bias only changes which experts are selected (``moekit.routing.route``), never the weights, so it
needs no gradient and no optimizer; it lives in the ``e_score_correction_bias`` buffer
(``MoEConfig(use_correction_bias=True)``), softmax or sigmoid scoring alike.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


class ExpertCounts:
    """Assignments per routed expert (and identity expert: ``MoEStats.choice_counts``) summed over forwards since
    the last ``take`` (no host sync)."""

    def __init__(self, num_experts: int) -> None:
        if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        self.num_experts = num_experts
        self.total: torch.Tensor | None = None  # [E] float64 once something was added; None = nothing yet

    def add(self, counts: torch.Tensor) -> None:
        """Add one forward's counts [E(+Z)] (``MoEStats.choice_counts``)."""
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
    center: bool | None = None,
    group: dist.ProcessGroup | None = None,
    routed_per_token: float | None = None,
) -> torch.Tensor:
    """``moe.e_score_correction_bias += delta``, delta = ``correction_delta`` of ``counts`` [E(+Z)] (the bias's
    width: ``MoEStats.choice_counts``): overloaded experts go down, underloaded ones up, by ``rate`` each
    (DeepSeek-V3's gamma, 1e-3).

    ``center`` (None: True without identity experts): subtract delta's mean first (torchtitan's variant; the paper
    does not centre), so a centred bias stays centred and does not drift as a whole (a common shift changes no
    selection). With identity experts a common shift of the routed experts' biases is the budget control, so
    centring is refused. ``routed_per_token``: LongCat-Flash's K_e (``correction_delta``).
    ``group``: a process group to sum ``counts`` over first (``all_reduce``, collective: every rank of it
    calls this with its own counts); None = the layer's ``batch_total`` where it has one (an ``EPMoE``: its
    counts are its rank's tokens', so they are summed over its group, and its ``dp_group`` where set, and every
    rank's bias moves alike, as one layer's on all the tokens), else these counts alone. Returns the delta [E(+Z)]
    (the bias dtype) that was added."""
    bias = getattr(moe, "e_score_correction_bias", None)
    if not isinstance(bias, torch.Tensor):
        raise ValueError("moe has no e_score_correction_bias: build it with MoEConfig(use_correction_bias=True)")
    config = getattr(moe, "config", None)
    identity = getattr(config, "num_identity_experts", 0)
    width = bias.numel()
    what = "num_experts" if not identity else "num_experts + num_identity_experts (MoEStats.choice_counts)"
    counts = _check_counts(counts, width, what).to(device=bias.device, dtype=torch.float64)
    top_k = config.top_k if identity else 1  # read only with identity experts
    _rule(rate, center, width - identity, identity, top_k, routed_per_token)  # before the collective
    if group is not None:
        counts = counts.clone()
        dist.all_reduce(counts, group=group)
    elif callable(getattr(moe, "batch_total", None)):  # an EPMoE: every rank's tokens of the batch
        counts = moe.batch_total(counts)
    delta = correction_delta(counts, width - identity, top_k, rate, center, routed_per_token).to(bias.dtype)
    bias.add_(delta)
    return delta


def correction_delta(counts: torch.Tensor, num_experts: int, top_k: int, rate: float, center: bool | None = None,
                     routed_per_token: float | None = None) -> torch.Tensor:
    """The bias update of assignment ``counts`` [E + Z] (float; Z >= 0 identity experts after the E routed ones)
    -> delta [E + Z], the counts' dtype.

    Z = 0 (DeepSeek-V3): delta_i = rate * sign(mean(counts) - counts_i), its mean taken off when ``center`` (None:
    True). Z > 0 (LongCat-Flash's zero-computation experts): its report's budget rule moves the E routed experts'
    biases by mu * (K_e / (k * E) - c_i / (k * T)) (T tokens, k * T = sum(counts), K_e = ``routed_per_token``, the
    routed experts a token should run; default k * E / (E + Z), ``MoEConfig.routed_slots_per_token``) and never the
    identity experts' (transformers' LongCat router keeps their bias entries, over E + Z, for the choice only);
    moekit moves them by the sign of that gap times ``rate`` (DeepSeek's step, whatever the counts' scale: a
    routed expert above its share goes down by rate), identity entries by 0, uncentred (a common shift of the
    routed biases is what moves tokens between routed and identity experts). With Z = 0 the target is the mean:
    the two rules are one."""
    identity = counts.numel() - num_experts
    center, budget = _rule(rate, center, num_experts, identity, top_k, routed_per_token)
    if not identity:
        delta = rate * torch.sign(counts.mean() - counts)  # [E]
        return delta - delta.mean() if center else delta
    total = counts.sum()  # [] k * T
    share = counts[:num_experts] / total.clamp(min=1)  # [E]; c_i / (k * T)
    step = torch.where(total > 0, rate * torch.sign(budget / (top_k * num_experts) - share), 0.0)  # no host sync
    return torch.cat([step, torch.zeros_like(counts[num_experts:])])  # [E + Z]; identity entries stay 0


def _rule(rate, center, num_experts: int, identity: int, top_k: int, routed_per_token) -> tuple[bool, float]:
    """The checked arguments of ``correction_delta``: (center, K_e), or an error naming the bad one."""
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate < float("inf")):
        raise ValueError(f"rate must be a positive finite number, got {rate!r}")
    if center is None:
        center = identity == 0
    if identity and center:
        raise ValueError("center=True would undo the budget control of identity experts (num_identity_experts > 0): "
                         "pass center=None or False")
    if routed_per_token is not None and not identity:
        raise ValueError("routed_per_token is the budget of identity experts: give it with num_identity_experts > 0")
    budget = top_k * num_experts / (num_experts + identity) if routed_per_token is None else routed_per_token
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= top_k:
        raise ValueError(f"routed_per_token must be in (0, top_k={top_k}], got {routed_per_token!r}")
    return bool(center), float(budget)


def _check_counts(counts: torch.Tensor, num_experts: int, what: str = "num_experts") -> torch.Tensor:
    if not isinstance(counts, torch.Tensor) or counts.shape != (num_experts,):
        got = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        raise ValueError(f"counts must be a tensor of shape [{what}={num_experts}], got {got}")
    return counts


@contextlib.contextmanager
def correction_bias_kept(moe: nn.Module):
    """Around a cast of ``moe`` (``nn.Module._apply``: ``.to(torch.bfloat16)``, ``.half()``, ``.double()``): its
    ``e_score_correction_bias`` keeps float32 and its bits, as the layer builds it whatever its dtype, and only moves
    to the new device. The bias decides which experts win by small differences (DeepSeek-V3's sit near a common
    offset): rounded to bf16 with the weights, it chose other experts than the same layer built in bf16."""
    bias = moe._buffers.get("e_score_correction_bias")
    yield
    cast = moe._buffers.get("e_score_correction_bias")
    if bias is not None and cast is not None and bias.dtype == torch.float32 and cast.dtype != torch.float32:
        moe._buffers["e_score_correction_bias"] = bias.to(cast.device)

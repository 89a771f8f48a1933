"""Training losses of the router: load balance (Switch/GShard and DeepSeek-V3's sequence-wise form) and
the router z-loss (ST-MoE).

    [Gate: logits [M, E]] -> [Route: topk_ids [M, k]] -> these losses -> added to the task loss

Shapes: M tokens, E routed experts, Z identity experts, S router-weighted shared slots, k = top_k, B sequences,
T tokens per sequence (M = B*T).

Every loss is a 0-dim float32 tensor (float64 for float64 logits), differentiable through the logits
only: which experts were selected (``topk_ids``) carries no gradient, as in every reference
implementation. Ids outside [0, E) (moekit's -1 for a dropped or skipped slot, fused shared slots
E..E+S-1) are not counted as assignments. No function syncs with the host.

Left-out tokens: a token whose ``token_mask`` entry is 0 (padding) and a token with no live expert (every logit
-inf: the router's ``nonfinite="mask"`` gave it all-zero weights) count nowhere: not in an expert's assignments,
its probability mass, the z-loss's mean nor the token count that divides them. So a loss over some live tokens is
the loss of those tokens alone, and one over none (an all-masked batch, an empty one) is 0, with a zero gradient,
never NaN. A NaN logit stays NaN (it is no mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from moekit.config import SCORINGS
from moekit.routing.route import router_log_scores, soft_capped


@dataclass(frozen=True)
class Across:
    """Several ranks' batches as one batch (expert parallelism): ``total`` sums a tensor over the ranks (an
    ``all_reduce`` of a copy, no autograd), ``ranks`` is W. ``configured_aux_loss`` then returns this rank's part
    times W: the mean over the ranks of their parts is the loss of all their tokens as one batch (what a
    data-parallel average of the ranks' losses trains on)."""

    total: Callable[[torch.Tensor], torch.Tensor]
    ranks: int


def configured_aux_loss(config, logits: torch.Tensor, ids: torch.Tensor, seq_len: int,
                        across: Across | None = None) -> torch.Tensor | None:
    """A ``MoEConfig``'s sum of coefficient x loss over one forward's logits [M, E(+Z|S)] and chosen ids [M, k]
    (``MoEOutput.aux_loss``), None when its three coefficients are 0; the sequence-wise loss takes ``seq_len``
    tokens as a sequence. The losses read the logits as the router scores them (soft-capped: Laguna's, which
    transformers' balance loss reads too), over the columns it chooses from (``choice_columns``). ``across``:
    the counts that divide (assignments per expert, live tokens, live sequences) summed over the ranks first
    (one collective, also with no rows here), the rank's part scaled by W (``Across``)."""
    c = config
    if not (c.aux_loss_coef or c.seq_aux_loss_coef or c.z_loss_coef):
        return None
    logits = choice_columns(_capped(logits, c), c)  # [M, E(+Z)]
    if c.nonfinite == "mask":  # as the router: a NaN or +inf logit is a masked expert, as -inf is
        logits = logits.masked_fill(~torch.isfinite(logits), float("-inf"))
    width = c.choice_width
    total = logits.new_zeros((), dtype=torch.promote_types(logits.dtype, torch.float32))
    if logits.shape[0] == 0 and across is None:
        return total
    logits = _check_logits(logits, width)
    live = _live_tokens(logits, None)
    counts, prob_sum, tokens = _balance_parts(live, ids, width)  # [E], [E], []
    seq_sum, seqs = _sequence_parts(live, ids, width, seq_len, c.scoring) if c.seq_aux_loss_coef else (total, total)
    local = torch.cat([counts, tokens[None], seqs[None]]).detach()  # [E + 2]
    ranks, glob = (1, local) if across is None else (across.ranks, across.total(local))
    glob_tokens, glob_seqs = _at_least_one(glob[width]), _at_least_one(glob[width + 1])
    if c.aux_loss_coef:
        f = glob[:width] / glob_tokens  # [E]
        total = total + c.aux_loss_coef * (width * torch.sum(f * (prob_sum * ranks / glob_tokens)))
    if c.seq_aux_loss_coef:
        total = total + c.seq_aux_loss_coef * (ranks * seq_sum / glob_seqs)
    if c.z_loss_coef:
        total = total + c.z_loss_coef * (ranks * _z_sum(live) / glob_tokens)
    return total


def _capped(logits: torch.Tensor, config) -> torch.Tensor:
    """``soft_capped``, a non-finite logit kept as it is: the cap would make a masked expert's -inf a live -c (the
    router masks it: ``nonfinite="mask"``), a NaN stays NaN as without a cap."""
    capped = soft_capped(logits, config)
    return capped if capped is logits else torch.where(torch.isfinite(logits), capped, logits)


def choice_columns(logits: torch.Tensor, config) -> torch.Tensor:
    """The router logits [M, E(+Z|S)] the balance and z losses read: the E + Z columns the router chooses k of
    (LongCat-Flash's identity experts are chosen as experts, so they count); never Inkling's S shared-slot columns
    (``shared_expert_combine="router"``), which only weight the always-on shared experts: the router Inkling's
    model records as its router logits is the routed part alone (transformers' ``InklingTopkRouter`` returns
    ``router_logits[..., :-n_shared_experts]``). A view, no copy."""
    width = config.choice_width
    return logits if logits.shape[-1] == width else logits[..., :width]


def load_balancing_loss(
    router_logits: torch.Tensor,  # [M, E]
    topk_ids: torch.Tensor,  # [M, k]
    num_experts: int,
    token_mask: torch.Tensor | None = None,  # [M] bool or 0/1; False/0 = padding, left out
) -> torch.Tensor:
    """Switch Transformer / GShard: ``E * sum_e f_e * P_e``.

    f_e = assignments to expert e / tokens (so ``sum_e f_e = k`` when nothing is dropped), P_e = mean
    over tokens of softmax(router_logits)[:, e]. Equal to transformers' ``load_balancing_loss_func``
    (Mixtral, Qwen-MoE) for one layer when ``topk_ids`` is the top-k of the softmax, with and without
    its ``attention_mask`` (``token_mask`` here, flattened to [M]). Uniform routing gives k; all tokens
    on the same k experts give k * E (softmax concentrated on them) at most."""
    logits = _check_logits(router_logits, num_experts)
    counts, prob_sum, tokens = _balance_parts(_live_tokens(logits, _check_mask(token_mask, logits)), topk_ids,
                                              num_experts)  # [E], [E], []
    tokens = _at_least_one(tokens)
    return num_experts * torch.sum((counts / tokens) * (prob_sum / tokens))


def _balance_parts(live: _LiveTokens, topk_ids: torch.Tensor, num_experts: int):
    """The balance loss's sums over the live tokens: assignments [E], softmax mass [E], live tokens []."""
    counts = assignments_per_expert(topk_ids, num_experts, live.logits, live.weight)  # [E]
    prob_sum = (torch.softmax(live.logits, dim=-1) * live.weight[:, None]).sum(0)  # [E]
    return counts, prob_sum, live.weight.sum()


def sequence_balance_loss(
    router_logits: torch.Tensor,  # [B*T, E] or [B, T, E]
    topk_ids: torch.Tensor,  # [B*T, k] or [B, T, k]
    num_experts: int,
    seq_len: int,  # T: tokens per sequence; rows of the flat forms are sequence-major (row = b*T + t)
    *,
    scoring: str = "sigmoid",
    alpha: float = 1.0,
    token_mask: torch.Tensor | None = None,  # [B*T] or [B, T] bool or 0/1; False/0 = padding, left out
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (paper eqs. 17-20), averaged over the B
    sequences: ``alpha * sum_e f_e * P_e`` per sequence, with

    - f_e = E / (k * T) * (tokens of the sequence that selected expert e): 1 for every expert when the
      sequence's assignments are spread evenly;
    - P_e = mean over the sequence's tokens of s'_e = s_e / sum_j s_j, s = sigmoid(logits) (``scoring=
      "sigmoid"``, DeepSeek-V3), sqrt(softplus(logits)) (``"sqrtsoftplus"``, DeepSeek-V4) or softmax(logits)
      (``"softmax"``, where s' = s).

    ``alpha`` is the paper's balance factor (1e-4 in DeepSeek-V3); ``MoEConfig.seq_aux_loss_coef``
    plays that role in ``MoE`` (which calls this with alpha=1). Uniform routing gives alpha. Left-out tokens (the
    module docstring) shrink their sequence's T; a sequence with none live is left out of the mean over B."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() not in (2, 3):
        raise ValueError(f"router_logits must be [B*T, E] or [B, T, E], got {_describe(router_logits)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != router_logits.dim():
        raise ValueError(f"topk_ids must be [B*T, k] or [B, T, k] like router_logits, got {_describe(topk_ids)}")
    logits = _check_logits(router_logits.reshape(-1, router_logits.shape[-1]), num_experts)  # [M, E]
    ids = topk_ids.reshape(-1, topk_ids.shape[-1])  # [M, k]
    if logits.shape[0] % seq_len:
        raise ValueError(f"router_logits must hold whole sequences of seq_len={seq_len} tokens, got {logits.shape[0]} "
                         f"rows")
    seq_sum, seqs = _sequence_parts(_live_tokens(logits, _check_mask(token_mask, logits)), ids, num_experts, seq_len,
                                    scoring)
    return alpha * seq_sum / _at_least_one(seqs)


def _sequence_parts(live: _LiveTokens, ids: torch.Tensor, num_experts: int, seq_len: int, scoring: str):
    """The sequence-wise loss summed over the sequences [], and the sequences with a live token []."""
    logits = live.logits
    if not logits.shape[0]:  # an EP rank without tokens (a 2-D x of 0 rows is a sequence of 0)
        return logits.new_zeros(()), logits.new_zeros(())
    num_seqs, top_k = logits.shape[0] // seq_len, ids.shape[1]
    # [M, E] s' = s / sum(s), 0 on a left-out token: a softmax of the log-scores, finite where every s underflows
    normed = torch.softmax(router_log_scores(live.logits, scoring), dim=-1) * live.weight[:, None]
    weight = live.weight.view(num_seqs, seq_len)  # [B, T]
    tokens = _at_least_one(weight.sum(1))[:, None]  # [B, 1]; the sequence's live T
    p = normed.view(num_seqs, seq_len, num_experts).sum(1) / tokens  # [B, E]
    selected = one_hot_assignments(ids, num_experts, logits) * live.weight[:, None]  # [M, E]; 1 where it chose e
    f = selected.view(num_seqs, seq_len, num_experts).sum(1) * (num_experts / top_k) / tokens  # [B, E]
    return (f * p).sum(-1).sum(), (weight.sum(1) > 0).to(logits.dtype).sum()


def z_loss(router_logits: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2 (over unmasked tokens when
    ``token_mask`` [M] is given). Keeps the logits small, which keeps the softmax out of bf16 trouble."""
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a floating-point tensor [M, E], got {_describe(router_logits)}")
    logits = router_logits.to(torch.promote_types(router_logits.dtype, torch.float32))
    live = _live_tokens(logits, _check_mask(token_mask, logits))
    return _z_sum(live) / _at_least_one(live.weight.sum())


def _z_sum(live: _LiveTokens) -> torch.Tensor:
    """logsumexp(logits)^2 summed over the live tokens []."""
    return (torch.logsumexp(live.logits, dim=-1).square() * live.weight).sum()


def assignments_per_expert(
    topk_ids: torch.Tensor, num_experts: int, like: torch.Tensor, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[E] float (``like``'s dtype): slots routed to each expert, ids outside [0, E) left out; each
    token's slots weighted by ``token_mask`` [M] when given. No host sync (no bincount)."""
    selected = one_hot_assignments(topk_ids, num_experts, like)  # [M, E]
    return selected.sum(0) if token_mask is None else (selected * token_mask[:, None]).sum(0)


def one_hot_assignments(topk_ids: torch.Tensor, num_experts: int, like: torch.Tensor) -> torch.Tensor:
    """[M, E] float: the number of the token's slots that chose expert e (0 or 1 for distinct ids)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.shape[0] != like.shape[0]:
        raise ValueError(f"topk_ids must have shape [M={like.shape[0]}, k], got {_describe(topk_ids)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_experts)  # [M, k]
    out = torch.zeros(ids.shape[0], num_experts + 1, dtype=like.dtype, device=like.device)  # column E: not counted
    out.scatter_add_(1, torch.where(valid, ids, num_experts), torch.ones_like(ids, dtype=like.dtype))
    return out[:, :num_experts]


@dataclass(frozen=True)
class _LiveTokens:
    logits: torch.Tensor  # [M, E]; a token with no live expert's row at 0 (finite softmax, no NaN gradient)
    weight: torch.Tensor  # [M] logits' dtype; token_mask (1 without one), 0 where no expert is live


def _live_tokens(logits: torch.Tensor, mask: torch.Tensor | None) -> _LiveTokens:
    """The tokens a loss counts (the module docstring): a row of logits [M, E] all -inf has no live expert."""
    alive = (logits > float("-inf")).any(-1)  # [M] bool; a NaN counts as live (it stays NaN)
    weight = alive.to(logits.dtype) if mask is None else torch.where(alive, mask, 0.0)  # [M]
    return _LiveTokens(logits=torch.where(alive[:, None], logits, 0.0), weight=weight)


def _at_least_one(count: torch.Tensor) -> torch.Tensor:
    """A count of tokens (or sequences) as a divisor: 1 where it is 0, whose numerators are 0 then."""
    return torch.where(count > 0, count, 1.0)


def _check_logits(router_logits: torch.Tensor, num_experts: int) -> torch.Tensor:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not isinstance(router_logits, torch.Tensor) or router_logits.dim() != 2 or not router_logits.is_floating_point():
        raise ValueError(f"router_logits must be a floating-point tensor [M, E], got {_describe(router_logits)}")
    if router_logits.shape[1] != num_experts:
        raise ValueError(f"router_logits must have shape [M, num_experts={num_experts}], got "
                         f"{tuple(router_logits.shape)}")
    return router_logits.to(torch.promote_types(router_logits.dtype, torch.float32))  # [M, E]


def _check_mask(token_mask: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
    if token_mask is None:
        return None
    if not isinstance(token_mask, torch.Tensor) or token_mask.numel() != logits.shape[0]:
        raise ValueError(f"token_mask must have M={logits.shape[0]} entries (one per token), got "
                         f"{_describe(token_mask)}")
    return token_mask.reshape(-1).to(device=logits.device, dtype=logits.dtype)  # [M]


def _describe(t) -> str:
    return f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__

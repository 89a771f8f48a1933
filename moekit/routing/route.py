"""Routing: router logits -> which k experts each token uses, and with what weight.

    [Route: score -> top-k -> weights] -> Capacity (opt-in) -> Shared slots -> Group -> Experts -> Combine

Shapes: M tokens, E routed experts, k = top_k, G = n_group, S = shared slots.

Tie rule: when two experts (or two groups) score exactly the same, the lower id wins. Selection is a
stable descending sort, so the rule holds on every device and in every torch version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.config import MoEConfig


@dataclass
class Routing:
    """Which experts each token is sent to, and the weight its output is scaled by."""

    topk_ids: torch.Tensor  # [M, k(+S)] int32; expert of each slot, in descending score order; shared slots last; -1 = skipped
    topk_weights: torch.Tensor  # [M, k(+S)] float32; weight of each slot; 0 where the id is -1

    @property
    def num_tokens(self) -> int:
        return self.topk_ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]


def route(
    router_logits: torch.Tensor,
    config: MoEConfig,
    correction_bias: torch.Tensor | None = None,
) -> Routing:
    """Score, select and weight experts as the model's reference implementation does.

    - softmax scoring (Mixtral, Qwen): probabilities over all E experts; with ``renormalize`` the chosen
      weights are re-scaled to sum to 1, otherwise they are the chosen experts' probabilities.
    - sigmoid scoring (DeepSeek-V3): independent gates. ``correction_bias`` [E] shifts the scores used
      for *selection* only; weights come from the unbiased scores.
    - grouped top-k (``n_group`` > 1): a group scores the sum of its top-2 biased scores when a bias is
      given, its max otherwise; only the best ``topk_group`` groups can be chosen from.
    - renormalisation is computed as a softmax over the chosen experts' log-scores, which equals
      w / sum(w) and stays finite when every score underflows (no 0/0).
    - ``routed_scaling_factor`` multiplies the routed weights.

    The result holds the k routed slots only; ``append_shared_slots`` adds a fused shared expert's.

    NaN or infinite logits raise unless ``config.nonfinite`` is ``"mask"`` (then such an expert scores
    lowest for selection and gets weight 0 if still chosen). On the CPU the error is a ``ValueError``
    naming the bad rows; on a GPU it is a device-side assert, so the path never syncs with the host.
    """
    logits = _check_logits(router_logits, config)
    bias = _check_bias(correction_bias, config, logits.device)
    if config.nonfinite == "mask":
        finite = torch.isfinite(logits)
        # The most negative float scores ~0 under softmax and sigmoid, so a masked expert takes no
        # probability mass from the others and only wins a slot when fewer than k experts are finite.
        logits = logits.masked_fill(~finite, torch.finfo(torch.float32).min)
    else:
        finite = None

    scores = torch.softmax(logits, dim=-1) if config.scoring == "softmax" else torch.sigmoid(logits)  # [M, E]
    choice = scores if bias is None else scores + bias  # [M, E]
    if finite is not None:
        choice = choice.masked_fill(~finite, float("-inf"))
    if config.n_group > 1:
        choice = _mask_unselected_groups(choice, config, biased=bias is not None)
    topk_ids = _topk_lower_id_wins(choice, config.top_k)  # [M, k] int64

    weights = _weights(logits, scores, topk_ids, config)  # [M, k] float32
    if finite is not None:
        weights = weights * finite.gather(1, topk_ids)
    return Routing(topk_ids=topk_ids.to(torch.int32), topk_weights=weights)


def _check_logits(router_logits: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2 or router_logits.shape[1] != config.num_experts:
        raise ValueError(
            f"router_logits must have shape [M, num_experts={config.num_experts}], got {tuple(router_logits.shape)}"
        )
    if not router_logits.is_floating_point():
        raise TypeError(f"router_logits must be a floating-point tensor, got {router_logits.dtype}")
    logits = router_logits.float()  # [M, E]
    if config.nonfinite != "raise" or logits.numel() == 0:
        return logits
    all_finite = torch.isfinite(logits).all()
    if logits.device.type != "cpu" or torch.compiler.is_compiling():
        # A device-side assert: no host sync on the GPU path, so it stays CUDA-graph capturable and
        # torch.compile(fullgraph=True) traces it.
        torch._assert_async(all_finite, "router_logits contains NaN or infinite values")
    elif not bool(all_finite):
        bad = (~torch.isfinite(logits)).any(dim=1).nonzero()[:5, 0].tolist()
        raise ValueError(
            f"router_logits contains NaN or infinite values (first bad token rows: {bad}); "
            "pass MoEConfig(nonfinite='mask') to mask those experts instead"
        )
    return logits


def _check_bias(bias: torch.Tensor | None, config: MoEConfig, device: torch.device) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (config.num_experts,):
        raise ValueError(f"correction_bias must have shape [num_experts={config.num_experts}], got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"correction_bias must be on {device} like router_logits, got {bias.device}")
    return bias.float()


def _topk_lower_id_wins(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores per row, ties broken towards the lower index."""
    # A stable descending sort keeps equal scores in index order; topk makes no such promise.
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]  # [M, k]


def _mask_unselected_groups(choice: torch.Tensor, config: MoEConfig, biased: bool) -> torch.Tensor:
    num_tokens, per_group = choice.shape[0], config.num_experts // config.n_group
    grouped = choice.view(num_tokens, config.n_group, per_group)  # [M, G, E/G]
    if biased and per_group >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [M, G]
    else:
        group_scores = grouped.max(dim=-1).values  # [M, G]
    keep = _topk_lower_id_wins(group_scores, config.topk_group)  # [M, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # [M, G]
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, config.num_experts)  # [M, E]
    return choice.masked_fill(~expert_mask, float("-inf"))


def _weights(logits: torch.Tensor, scores: torch.Tensor, topk_ids: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    if config.renormalize:
        # softmax over the chosen log-scores == w_i / sum_j w_j, without underflow to 0/0.
        chosen_logits = logits.gather(1, topk_ids)  # [M, k]
        log_scores = chosen_logits if config.scoring == "softmax" else torch.nn.functional.logsigmoid(chosen_logits)
        weights = torch.softmax(log_scores, dim=-1)
    else:
        weights = scores.gather(1, topk_ids)  # [M, k]
    if config.routed_scaling_factor != 1.0:
        weights = weights * config.routed_scaling_factor
    return weights.float()

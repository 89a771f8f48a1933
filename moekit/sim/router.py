"""A synthetic router with one skew knob, routed through ``moekit.route``.

    [tokens x] -> [router weight W] -> logits -> moekit.route -> (topk_ids, topk_weights)

Shapes: M tokens, E experts, D = E content features, F = D + 1 router inputs (content + a constant).

The skew knob s in [0, 1], precisely:

    x_t = [g_t, 1],            g_t ~ N(0, I_D) drawn per token (D = E)
    W   = [(1 - s)·Q ; s·u]    Q [D, E] a random orthogonal matrix, u [E] the popularity row
    logits_t = x_t @ W = (1 - s)·(g_t @ Q) + s·u

``u[e] = -ln(rank[e])`` with ``rank`` a seeded random permutation of 1..E (Zipf popularity: expert of
rank r is e^{-u} = r times less popular than the favourite, in logit units). Because Q is orthogonal,
``g_t @ Q`` is again i.i.d. N(0, 1), so

- s = 0: every expert is chosen by a token with probability exactly k/E (balanced in expectation);
- 0 < s < 1: the ranking is that of ``g_t @ Q + (s / (1 - s))·u``: popularity weighs s/(1-s) standard
  deviations of content per nat; s = 0.5 weighs them equally;
- s = 1: the content term vanishes and every token picks the same k most popular experts (collapse).

The popularity enters through the router weight's row for the constant input (every token shares it,
as real hidden states share a mean direction), so training W can undo it (``moekit.sim.balance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.config import MoEConfig
from moekit.routing import Routing, route
from moekit.sim import streams


@dataclass
class SyntheticRouter:
    """A router weight and the config it routes with; ``weight`` may be trained (aux-loss balancing)."""

    config: MoEConfig  # E, k, softmax scoring, renormalised weights
    weight: torch.Tensor  # [F, E] float32; rows 0..D-1 content, row D popularity (for the constant input)
    popularity: torch.Tensor  # [E] float32; u = -ln(rank), 0 for the favourite expert

    @property
    def num_features(self) -> int:
        return self.weight.shape[0]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, F] -> router logits [M, E]."""
        return x @ self.weight

    def route(self, x: torch.Tensor, correction_bias: torch.Tensor | None = None) -> Routing:
        """Route tokens x [M, F] through ``moekit.route`` (optionally with a selection-only bias [E])."""
        return route(self.logits(x), self.config, correction_bias)


def router_config(num_experts: int, top_k: int) -> MoEConfig:
    """The simulated layer's routing: softmax over E experts, top-k, renormalised (Mixtral-style).

    The expert width fields are placeholders: routing reads only E, k and the scoring settings.
    """
    return MoEConfig(hidden_size=num_experts + 1, moe_intermediate_size=1, num_experts=num_experts, top_k=top_k)


def make_router(num_experts: int, top_k: int, skew: float, seed: int) -> SyntheticRouter:
    """The synthetic router for ``skew`` in [0, 1] (see the module docstring), drawn from ``seed``."""
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must be in [0, 1], got {skew}")
    gen = streams.generator(seed, streams.ROUTER)
    q, r = torch.linalg.qr(torch.randn(num_experts, num_experts, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # sign fix: Haar-distributed orthogonal matrix
    rank = torch.randperm(num_experts, generator=gen) + 1  # [E]; 1 = most popular
    popularity = -torch.log(rank.double())  # [E]
    weight = torch.cat([(1.0 - skew) * q, skew * popularity[None, :]], dim=0).float()  # [F, E]
    return SyntheticRouter(router_config(num_experts, top_k), weight, popularity.float())


def draw_tokens(num_tokens: int, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """Token representations x [M, F]: D = E standard normal content features and the constant 1."""
    g = torch.randn(num_tokens, num_experts, generator=gen)  # [M, D]
    return torch.cat([g, torch.ones(num_tokens, 1)], dim=1)  # [M, F]

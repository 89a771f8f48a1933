"""A synthetic router with one skew knob, routed through ``moekit.route``.

    [tokens x] -> [router weight W] -> logits -> moekit.route -> (topk_ids, topk_weights)

Shapes: M tokens, E experts, W router columns (E; E + Z identity experts or E + S shared slots with a config's
router options), D = W content features, F = D + 1 router inputs (content + a constant).

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

A ``MoEConfig`` given to ``make_router`` routes with its own rule (any router option ``moekit.MoE`` runs: groups,
the correction bias, LongCat-Flash's identity experts, Inkling's router-weighted shared slots, ...) through the same
``moekit.route``; the knob then spreads over its W router columns as it does over E (an identity expert or a
shared slot's column has a popularity rank like an expert's), so its routing is the layer's on the same gate
weights (``weight`` transposed) and tokens.
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

    config: MoEConfig  # E, k and the routing rule (``router_config``'s: softmax, renormalised)
    weight: torch.Tensor  # [F, W] float32; rows 0..D-1 content, row D popularity (for the constant input)
    popularity: torch.Tensor  # [W] float32; u = -ln(rank), 0 for the favourite column

    @property
    def num_features(self) -> int:
        return self.weight.shape[0]

    @property
    def width(self) -> int:
        """W = D: the router's columns (``config.router_width``), the tokens' content features."""
        return self.weight.shape[1]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, F] -> router logits [M, W]."""
        return x @ self.weight

    def route(self, x: torch.Tensor, correction_bias: torch.Tensor | None = None) -> Routing:
        """Route tokens x [M, F] through ``moekit.route`` (optionally with a selection-only bias [E(+Z)])."""
        return route(self.logits(x), self.config, correction_bias)


def router_config(num_experts: int, top_k: int) -> MoEConfig:
    """The simulated layer's routing: softmax over E experts, top-k, renormalised (Mixtral-style).

    The expert width fields are placeholders: routing reads only E, k and the scoring settings.
    """
    return MoEConfig(hidden_size=num_experts + 1, moe_intermediate_size=1, num_experts=num_experts, top_k=top_k)


def make_router(num_experts: int, top_k: int, skew: float, seed: int,
                config: MoEConfig | None = None) -> SyntheticRouter:
    """The synthetic router for ``skew`` in [0, 1] (see the module docstring), drawn from ``seed``; it routes with
    ``config`` (its num_experts and top_k must be these) or, None, ``router_config``'s rule."""
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must be in [0, 1], got {skew}")
    config = router_config(num_experts, top_k) if config is None else config
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig or None, got {type(config).__name__}")
    if (config.num_experts, config.top_k) != (num_experts, top_k):
        raise ValueError(f"config routes num_experts={config.num_experts}, top_k={config.top_k}; the simulator was "
                         f"asked for experts={num_experts}, top_k={top_k}")
    width = config.router_width  # W
    gen = streams.generator(seed, streams.ROUTER)
    q, r = torch.linalg.qr(torch.randn(width, width, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))  # sign fix: Haar-distributed orthogonal matrix
    rank = torch.randperm(width, generator=gen) + 1  # [W]; 1 = most popular
    popularity = -torch.log(rank.double())  # [W]
    weight = torch.cat([(1.0 - skew) * q, skew * popularity[None, :]], dim=0).float()  # [F, W]
    return SyntheticRouter(config, weight, popularity.float())


def draw_tokens(num_tokens: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Token representations x [M, F]: D = W (``SyntheticRouter.width``; E without router options) standard normal
    content features and the constant 1."""
    g = torch.randn(num_tokens, width, generator=gen)  # [M, D]
    return torch.cat([g, torch.ones(num_tokens, 1)], dim=1)  # [M, F]

"""Load balancing, for real: train the router (auxiliary loss) or steer selection (DeepSeek's bias).

    [synthetic router] -> (a) aux-loss: W <- Adam(W, grad of E·Σ_i f_i·P_i), fresh batches
                       -> (b) bias:     b_i += γ·sign(mean load - load_i), one update per batch

Shapes: M tokens per batch, E experts, W router columns, C = E (+ Z identity experts) chosen from, F router inputs.

(a) Switch Transformer / GShard load-balancing loss: f_i is the fraction of the batch's assignments that
went to expert i (from the discrete top-k, no gradient) and P_i the mean softmax probability of expert i
(differentiable). E·Σ f_i·P_i is 1 when routing is uniform and grows with skew. A synthetic router has no
task loss, so the router weight is trained on this loss alone: the result is what the regulariser can
do, bounded by ``steps``.

(b) Auxiliary-loss-free balancing (Wang et al. 2024, DeepSeek-V3): a per-expert bias added to the scores
for *selection only* (``moekit.route``'s ``correction_bias``); after each batch it moves by γ towards
balance. The simulated router scores with a softmax (DeepSeek-V3 uses sigmoids), so the bias lives on
the probability scale; γ = 1e-3 over 200 batches moves it up to 0.2, enough for skews up to ~0.9. It cannot split
identical tokens: at skew 1 every token has the same scores, so every token still picks the same k experts, just
different ones.

With a config's router options both read the C columns the router chooses from (``moekit.losses.choice_columns``:
never Inkling's shared-slot columns) and count the identity experts apart from the routed ones: the bias moves by
``moekit.balance.correction_delta`` (LongCat-Flash's budget rule by its sign; DeepSeek's without identity experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.balance import correction_delta
from moekit.losses import choice_columns
from moekit.routing import route
from moekit.sim import streams
from moekit.sim.router import SyntheticRouter, draw_tokens

AUX_LEARNING_RATE = 0.05  # Adam; flattens skew 0.55 to the noise floor of a 128-token batch in 100 steps
BIAS_GAMMA = 1e-3  # DeepSeek-V3's bias update speed
BATCH_TOKENS = 256  # tokens per training step / bias-update batch, fixed so cost does not grow with M


@dataclass
class BalanceOutcome:
    """What balancing produced: a (possibly retrained) router and a selection bias, and the steps taken."""

    router: SyntheticRouter  # the trained router for aux-loss, the input router otherwise
    correction_bias: torch.Tensor | None  # [C] float32 for the bias method, None otherwise
    steps: int  # optimizer steps (aux-loss) or bias updates (bias) actually taken


def expert_loads(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] int64 from topk_ids [M, k]; ids outside [0, E) are not counted."""
    ids = topk_ids.reshape(-1).long()
    ids = ids[(ids >= 0) & (ids < num_experts)]
    return torch.bincount(ids, minlength=num_experts)


def warm_up() -> None:
    """Pay once what the first aux-loss run would: ``torch.optim.Adam``'s constructor imports
    torch._dynamo (2.2 s and 900 modules on the development machine, once per process)."""
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])


def train_aux_loss(router: SyntheticRouter, steps: int, seed: int) -> BalanceOutcome:
    """Train the router weight for ``steps`` Adam steps on the load-balancing loss, each on a fresh
    batch of ``BATCH_TOKENS`` tokens from the same distribution as the evaluation batch."""
    config = router.config
    width = config.choice_width  # C
    weight = router.weight.clone().requires_grad_(True)  # [F, W]
    optimizer = torch.optim.Adam([weight], lr=AUX_LEARNING_RATE)
    gen = streams.generator(seed, streams.AUX_TRAIN)
    for _ in range(steps):
        x = draw_tokens(BATCH_TOKENS, router.width, gen)  # [M, F]
        logits = x @ weight  # [M, W]
        topk_ids = route(logits.detach(), config).topk_ids  # [M, k]; selection has no gradient
        f = expert_loads(topk_ids, width).float() / topk_ids.numel()  # [C], sums to 1
        p = torch.softmax(choice_columns(logits, config), dim=-1).mean(dim=0)  # [C], sums to 1
        loss = width * (f * p).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return BalanceOutcome(SyntheticRouter(router.config, weight.detach(), router.popularity), None, steps)


def update_bias(router: SyntheticRouter, batches: int, seed: int) -> BalanceOutcome:
    """Route ``batches`` fresh batches of ``BATCH_TOKENS`` tokens, after each moving the selection bias
    by γ·sign(mean load - load_i), uncentred (with identity experts: ``correction_delta``'s budget rule)."""
    config = router.config
    bias = torch.zeros(config.choice_width)  # [C]
    gen = streams.generator(seed, streams.BIAS_BATCHES)
    for _ in range(batches):
        x = draw_tokens(BATCH_TOKENS, router.width, gen)  # [M, F]
        loads = expert_loads(router.route(x, bias).topk_ids, config.choice_width).float()  # [C]
        bias += correction_delta(loads, config.num_experts, config.top_k, BIAS_GAMMA, center=False)
    return BalanceOutcome(router, bias, batches)

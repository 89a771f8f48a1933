"""The routing weights' gradients with every scoring (softmax, sigmoid, DeepSeek-V4's sqrt(softplus)) and every
renormalisation (none, the exact ratio, + renorm_eps, max(sum, renorm_clamp)), at ordinary rows and at the edges:
rows where the eps or the clamp decides the weights, and logits at -104 and -200, where float32's softplus is
subnormal or 0.

- float64: ``torch.autograd.gradcheck`` of ``route``'s weights (finite differences against autograd);
- float32 (the layer's router): autograd's gradient finite and within float32's rounding of the float64 formula's
  analytic gradient, written here from the families' definitions (not moekit's code);
- the same for ``hash_route`` (DeepSeek-V4's hash layers) and the sequence-wise balance loss, which score with
  sqrt(softplus) too.

Shapes: M rows (tokens), E experts, k = top_k.
"""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoEConfig, route
from moekit.losses import sequence_balance_loss
from moekit.routing.hash_route import hash_route

E, K = 6, 2
# a float64 router's weights: the formula's to float64 rounding, where the eps or the clamp decides too (route read
# them as log(c) rounded to float32, c (1 + d) with |d| <= |log c| 2^-24: 2.7e-6 at 1e-20, 1.2e-8 at 1.5; fuzz seeds
# 171 and 176 of 31ea2592's draws, float64 layers with renorm_clamp 1.5, 1.19e-8 off against 1e-10)
FLOAT64_WEIGHTS = 1e-12
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
RENORMS = {"none": dict(renormalize=False), "exact": {}, "eps": dict(renorm_eps=1e-20), "eps6": dict(renorm_eps=1e-6),
           "clamp": dict(renorm_clamp=1e-12), "clamp06": dict(renorm_clamp=0.6)}


def config(scoring: str, renorm: str, **extra) -> MoEConfig:
    return MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=E, top_k=K, scoring=scoring,
                     **RENORMS[renorm], **extra)


def _spread(centre: float, g: torch.Generator) -> torch.Tensor:
    """A row [E] of distinct logits around ``centre`` (at least 0.05 apart: finite differences never reorder them)."""
    steps = torch.randperm(E, generator=g).double() * 0.3
    return centre + steps + torch.rand(E, generator=g, dtype=torch.float64) * 0.1


def edge_rows(scoring: str) -> torch.Tensor:
    """[M, E] float64: ordinary rows; rows whose chosen scores sum near 1e-20 and 1e-6 (the eps decides: sigmoid
    e^x, sqrt(softplus) e^(x/2)); all logits near -104 and -200; one logit at 0.5 and the rest at -200."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(E, generator=g, dtype=torch.float64) * 2 for _ in range(3)]
    per_score = 1.0 if scoring == "sigmoid" else 2.0  # log score = x / per_score below ~-30
    rows += [_spread(c * per_score, g) for c in (-46.0, -14.0)] if scoring != "softmax" else []
    rows += [_spread(-104.0, g), _spread(-200.0, g)]
    mixed = _spread(-200.0, g)
    mixed[3] = 0.5
    return torch.stack(rows + [mixed])


def score64(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The family's scores [M, E] in float64, differentiable everywhere: softmax, sigmoid, sqrt(log(1 + e^x)) as
    exp(log(log1p(e^x)) / 2), whose log is x itself below -30 (to 1e-13)."""
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return 1 / (1 + torch.exp(-logits))
    low = logits < -30
    log_sp = torch.where(low, logits, torch.log(torch.log1p(torch.exp(torch.where(low, 0.0, logits)))))
    return torch.exp(log_sp / 2)


def weights64(logits: torch.Tensor, ids: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """[M, k] the family's weights of the chosen ``ids``: scores, renormalised by sum, sum + eps or max(sum, c)."""
    w = score64(logits, cfg.scoring).gather(1, ids.long())
    if not cfg.renormalize:
        return w
    total = w.sum(-1, keepdim=True)
    if cfg.renorm_eps:
        return w / (total + cfg.renorm_eps)
    return w / torch.clamp(total, min=cfg.renorm_clamp) if cfg.renorm_clamp else w / total


def _projection(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def _grad(fn, logits: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    leaf = logits.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad((fn(leaf).double() * r).sum(), leaf)
    return g.double()


def assert_close_rows(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Finite, and each row within ``tol`` of the reference relative to that row's largest entry, floored at 1% of
    the largest entry of all rows: a row's gradient far below the others is a difference of larger rounded terms (a
    weight s / (s + s') near 1 or exactly 1/2, whose true gradient is ~0), measured against the terms' scale (as the
    layer fuzzer's FLOOR)."""
    assert torch.isfinite(got).all(), got
    scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=0.01 * want.abs().max().item())
    err = ((got - want) / scale.clamp(min=1e-300)).abs().max().item()
    assert err < tol, (err, got, want)


@pytest.mark.parametrize("renorm", list(RENORMS))
@pytest.mark.parametrize("scoring", SCORINGS)
def test_route_weights_pass_gradcheck_in_float64(scoring, renorm):
    cfg = config(scoring, renorm)
    logits = edge_rows(scoring).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: route(t, cfg).topk_weights, (logits,), eps=1e-6, atol=1e-8,
                                    fast_mode=True)
    ids = route(logits, cfg).topk_ids
    want = weights64(logits.detach(), ids, cfg)
    assert_close_rows(route(logits, cfg).topk_weights.detach(), want, FLOAT64_WEIGHTS)  # the values: the family's


@pytest.mark.parametrize("renorm", list(RENORMS))
@pytest.mark.parametrize("scoring", SCORINGS)
def test_route_float32_gradients_are_the_float64_formulas(scoring, renorm):
    """No NaN at -104 / -200, and each row's gradient the formula's to float32 rounding, for the experts float32
    chooses (its scores at -104 / -200 underflow to ties at 0: the lower ids, where float64 tells them apart)."""
    cfg = config(scoring, renorm)
    logits = edge_rows(scoring)
    ids = route(logits.float(), cfg).topk_ids
    r = _projection(ids.shape)
    got = _grad(lambda t: route(t, cfg).topk_weights, logits.float(), r)
    want = _grad(lambda t: weights64(t, ids, cfg), logits.float().double(), r)
    assert_close_rows(got, want, 2e-5)


def test_route_gradients_with_a_bias_that_chooses_low_scores():
    """Softmax with the correction bias choosing experts whose scores sum near the eps or below the clamp (the one way
    a softmax row reaches them): float64 gradcheck and float32 against the formula."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, E, generator=g, dtype=torch.float64)
    logits[:, 0] = torch.tensor([10.0, 30.0, 46.0, 60.0])  # the others' softmax mass ~e^-gap
    bias = torch.tensor([0.0, 2.0, 2.0, 0.0, 0.0, 0.0])  # experts 1 and 2 chosen
    for renorm in ("eps", "clamp", "clamp06"):
        cfg = config("softmax", renorm, use_correction_bias=True)
        leaf = logits.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda t: route(t, cfg, bias).topk_weights, (leaf,), eps=1e-6, atol=1e-8,
                                        fast_mode=True)
        ids = route(logits.float(), cfg, bias.float()).topk_ids
        assert ids[:, 0].tolist() == [1] * 4
        r = _projection(ids.shape)
        got = _grad(lambda t: route(t, cfg, bias.float()).topk_weights, logits.float(), r)
        want = _grad(lambda t: weights64(t, ids, cfg), logits.float().double(), r)
        assert_close_rows(got, want, 2e-5)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_hash_route_gradients_at_the_edges(scoring, renormalize):
    """DeepSeek-V4's hash router: the table's experts' scores / (sum + 1e-20): float64 gradcheck; float32 finite at
    every row (the unchosen logits' gradient too: 0), and the formula's where the table's experts score normal floats
    (logits above -87): below, float32's scores are subnormal or 0 (its rounding, as transformers' float32 router's,
    kept by an unrenormalised row and sigmoid); renormalised, sqrt(softplus) is e^(x/2) there (session 51: a row at
    -104 weighs the formula's 3e-3, not 0), the formula's down to -174 (e^(x/2) itself subnormal below)."""
    cfg = MoEConfig(hidden_size=4, moe_intermediate_size=4, num_experts=E, top_k=K, scoring=scoring,
                    renormalize=renormalize, hash_table_size=3)
    table = torch.tensor([[0, 1], [3, 5], [2, 2]])
    logits = edge_rows(scoring)
    tokens = torch.arange(logits.shape[0]) % 3
    ids = table[tokens]
    leaf = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: hash_route(t, tokens, table, cfg).topk_weights, (leaf,), eps=1e-6,
                                    atol=1e-8, fast_mode=True)
    r = _projection(ids.shape)
    got = _grad(lambda t: hash_route(t, tokens, table, cfg).topk_weights, logits.float(), r)

    def formula(t):
        w = score64(t, scoring).gather(1, ids)
        return w / (w.sum(-1, keepdim=True) + 1e-20) if renormalize else w

    floor = -170.0 if renormalize and scoring == "sqrtsoftplus" else -87.0  # e^(x/2) normal, else softplus normal
    normal = (logits.gather(1, ids) > floor).all(dim=1)  # [M] rows whose chosen float32 scores are normal
    assert torch.isfinite(got).all() and 2 <= normal.sum() < len(normal)
    assert_close_rows(got[normal], _grad(formula, logits.float().double(), r)[normal], 2e-5)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_sequence_balance_loss_gradients_at_the_edges(scoring):
    """DeepSeek-V3 / V4's sequence-wise loss sum_e (E / (k T)) c_e mean_t(s_te / sum_j s_tj) over one sequence of the
    edge rows: float32's gradient finite and the float64 formula's."""
    logits = edge_rows(scoring)
    ids = torch.topk(logits, K, dim=-1).indices
    counts = torch.zeros(E, dtype=torch.float64).index_add_(0, ids.flatten(), torch.ones(ids.numel(),
                                                                                         dtype=torch.float64))
    m = logits.shape[0]

    def formula(t):
        s = score64(t, scoring)
        return (counts * E / (K * m) * (s / s.sum(-1, keepdim=True)).mean(0)).sum()

    def loss(t):
        return sequence_balance_loss(t, ids, E, seq_len=m, scoring=scoring)

    got = _grad(loss, logits.float(), torch.ones((), dtype=torch.float64))
    want = _grad(formula, logits.float().double(), torch.ones((), dtype=torch.float64))
    assert_close_rows(got, want, 2e-5)
    leaf = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(loss, (leaf,), eps=1e-6, atol=1e-8, fast_mode=True)
    assert math.isclose(loss(logits).item(), formula(logits).item(), rel_tol=1e-12)

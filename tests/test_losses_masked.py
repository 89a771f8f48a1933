"""moekit.losses with tokens left out: a token_mask of 0 (padding) and a token with no live expert (every logit
-inf, as the router's nonfinite="mask" leaves it). Each loss must equal the same loss over the live tokens alone,
written out here as float64 loops over the finite logits, and an all-masked batch must give 0 with a zero gradient
(it gave NaN: 0 / 0 tokens, softmax and logsumexp over nothing), eager and under torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

from moekit import MoEConfig
from moekit.losses import configured_aux_loss, load_balancing_loss, sequence_balance_loss, z_loss

E, K_TOP, T = 6, 2, 5
NEG = float("-inf")


def _case(seed=0):
    """Logits [2T, E] float64 (two sequences of T) with masked experts, token 3 with none live, and its ids."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2 * T, E, generator=g, dtype=torch.float64) * 2
    logits[1, 2] = NEG
    logits[6, :3] = NEG
    logits[3] = NEG  # no live expert
    ids = torch.topk(logits, K_TOP, dim=-1).indices  # token 3 takes 0, 1 at weight 0, as the router does
    ids[3] = torch.tensor([0, 1])
    return logits, ids


def _live(logits, mask):
    """Rows kept by a float64 loop: mask 1 and some finite logit."""
    return [t for t in range(logits.shape[0])
            if (mask is None or mask[t]) and any(math.isfinite(v) for v in logits[t].tolist())]


def _probs(row, scoring):
    live = [(e, v) for e, v in enumerate(row) if math.isfinite(v)]
    if scoring == "softmax":
        z = sum(math.exp(v) for _, v in live)
        return {e: math.exp(v) / z for e, v in live}
    s = {e: 1 / (1 + math.exp(-v)) for e, v in live}
    return {e: p / sum(s.values()) for e, p in s.items()}


def _balance_loop(logits, ids, mask=None):
    rows = _live(logits, mask)
    if not rows:
        return 0.0
    total = 0.0
    for e in range(E):
        f = sum(1 for t in rows for j in range(ids.shape[1]) if int(ids[t, j]) == e) / len(rows)
        p = sum(_probs(logits[t].tolist(), "softmax").get(e, 0.0) for t in rows) / len(rows)
        total += f * p
    return E * total


def _z_loop(logits, mask=None):
    rows = _live(logits, mask)
    lse = [math.log(sum(math.exp(v) for v in logits[t].tolist() if math.isfinite(v))) for t in rows]
    return sum(v * v for v in lse) / len(rows) if rows else 0.0


def _sequence_loop(logits, ids, scoring, mask=None):
    losses = []
    for b in range(logits.shape[0] // T):
        rows = [t for t in _live(logits, mask) if b * T <= t < (b + 1) * T]
        if not rows:
            continue
        total = 0.0
        for e in range(E):
            f = E / (K_TOP * len(rows)) * sum(1 for t in rows if e in ids[t].tolist())
            p = sum(_probs(logits[t].tolist(), scoring).get(e, 0.0) for t in rows) / len(rows)
            total += f * p
        losses.append(total)
    return sum(losses) / len(losses) if losses else 0.0


MASKS = {
    "none": None,
    "padding": torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 1, 0]),
    "one sequence padded": torch.tensor([1] * T + [0] * T, dtype=torch.bool),
    "all": torch.zeros(2 * T, dtype=torch.bool),
}


def _losses(logits, ids, mask):
    """name -> (moekit's loss, the float64 loop's)."""
    return {
        "balance": (load_balancing_loss(logits, ids, E, mask), _balance_loop(logits, ids, mask)),
        "z": (z_loss(logits, mask), _z_loop(logits, mask)),
        **{f"sequence {s}": (sequence_balance_loss(logits, ids, E, T, scoring=s, token_mask=mask),
                             _sequence_loop(logits, ids, s, mask)) for s in ("softmax", "sigmoid")},
    }


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_left_out_tokens_count_nowhere(mask_name):
    logits, ids = _case()
    logits.requires_grad_(True)
    for name, (got, want) in _losses(logits, ids, MASKS[mask_name]).items():
        assert torch.isfinite(got), name
        assert got.item() == pytest.approx(want, rel=1e-12, abs=1e-15), name
        (grad,) = torch.autograd.grad(got, logits)
        assert torch.isfinite(grad).all(), name
        assert (grad[3] == 0).all(), name  # the token with no live expert
        if MASKS[mask_name] is not None:
            assert (grad[~MASKS[mask_name].bool()] == 0).all(), name


def test_an_all_masked_batch_gives_zero_and_a_zero_gradient():
    logits = torch.full((2 * T, E), NEG, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(2 * T, K_TOP, dtype=torch.long)
    for name, (got, want) in _losses(logits, ids, None).items():
        assert want == 0.0 and got.item() == 0.0, name
        (grad,) = torch.autograd.grad(got, logits)
        assert (grad == 0).all(), name
    empty = torch.zeros(0, E, requires_grad=True)
    none = torch.zeros(0, K_TOP, dtype=torch.long)
    assert load_balancing_loss(empty, none, E).item() == 0.0 and z_loss(empty).item() == 0.0


@pytest.mark.parametrize("mask_name", ["padding", "all"])
def test_the_losses_compile_to_the_same_values(mask_name):
    """fullgraph=True: the left-out tokens cost no host read (no data-dependent branch)."""
    logits, ids = _case(seed=3)
    mask = MASKS[mask_name]

    def all_losses(lg, m):
        return torch.stack([load_balancing_loss(lg, ids, E, m), z_loss(lg, m),
                            sequence_balance_loss(lg, ids, E, T, scoring="sigmoid", token_mask=m)])

    compiled = torch.compile(all_losses, fullgraph=True, backend="aot_eager")
    for lg in (logits, torch.full_like(logits, NEG)):
        want = torch.tensor([_balance_loop(lg, ids, mask), _z_loop(lg, mask),
                             _sequence_loop(lg, ids, "sigmoid", mask)], dtype=torch.float64)
        torch.testing.assert_close(compiled(lg, mask), want, rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(all_losses(lg, mask), want, rtol=1e-12, atol=1e-15)


def test_the_layers_sum_masks_a_nan_logit_as_the_router_does():
    """configured_aux_loss with nonfinite="mask": a NaN or +inf logit is a masked expert (the router masks it: weight
    0, never chosen over a live one), so the losses read it as -inf; a token of only such logits is left out."""
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=E, top_k=K_TOP, nonfinite="mask",
                    aux_loss_coef=1.0, z_loss_coef=0.5, seq_aux_loss_coef=0.25)
    logits, ids = _case(seed=5)
    odd = logits.clone()
    odd[1, 2], odd[6, 0] = float("nan"), float("inf")
    odd[3] = torch.tensor([float("nan"), NEG, float("inf"), NEG, NEG, float("nan")])
    want = (_balance_loop(logits, ids) + 0.5 * _z_loop(logits)
            + 0.25 * _sequence_loop(logits, ids, cfg.scoring))
    got = configured_aux_loss(cfg, odd, ids, seq_len=T)
    assert got.item() == pytest.approx(want, rel=1e-12)
    everything_masked = configured_aux_loss(cfg, torch.full_like(odd, float("nan")), ids, seq_len=T)
    assert everything_masked.item() == 0.0
    raising = configured_aux_loss(cfg.replace(nonfinite="raise"), odd, ids, seq_len=T)
    assert torch.isnan(raising)  # no mask asked for: a NaN stays visible (the router raises on it first)

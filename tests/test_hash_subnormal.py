"""The hash routers at subnormal sqrt(softplus) scores (session 51): in float32 softplus(x) is subnormal for logits
between -87.3 and -103.9 and 0 below, so sqrt(softplus) keeps 2-20 bits or none, and a hash row whose table experts all
sit there, renormalised by + 1e-20, weighed 0 where the formula gives ~3e-3. Renormalised, ``hash_route`` and the fused
hash kernel (interpreted) now take e^(x/2) there: against a float64 formula at logits -80 .. -110; at ordinary logits
the bits of before (sqrt(softplus), computed here); unrenormalised, transformers' rounding (the decision: the docs
promise the weights of ``DeepseekV4HashRouter``'s float32 router, and such a weight is within 1e-19 of the formula).
The top-k router renormalises from log-scores and is the formula's there already (held here too)."""

from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoEConfig, route
from moekit.routing.hash_route import hash_route

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards

E, K, V = 8, 2, 6
HASH = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=E, top_k=K, scoring="sqrtsoftplus",
                 hash_table_size=V, renorm_eps=1e-20)
TABLE = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 6], [3, 3]])


@pytest.fixture(scope="module")
def hash_fused():
    with interpreted("moekit.routing", "moekit.routing.hash_fused") as module:
        yield module


def _sqrt_softplus64(v: float) -> float:
    """sqrt(log(1 + e^v)) in float64 (e^v normal down to -708)."""
    return math.sqrt(v + math.log1p(math.exp(-v)) if v > 0 else math.log1p(math.exp(v)))


def _weights64(logits: torch.Tensor, tokens: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """[M, k] float64: the table's experts' scores, / (their sum + 1e-20) when renormalised, a loop over tokens."""
    out = []
    for row, t in zip(logits.double().tolist(), tokens.tolist()):
        s = [_sqrt_softplus64(row[e]) for e in TABLE[t].tolist()]
        total = sum(s) + 1e-20 if renormalize else 1.0
        out.append([v / total for v in s])
    return torch.tensor(out, dtype=torch.float64)


def _subnormal_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """logits [12, E] float32 whose table experts sit between -80 and -110 (a row each of -80, -87, -90, ... -110;
    the two experts of a row 0.5 apart, token 5's the same expert twice), and their token ids."""
    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([-80.0, -87.0, -88.0, -90.0, -95.0, -100.0, -103.0, -104.0, -105.0, -107.0, -110.0, -96.0])
    logits = levels[:, None] + torch.rand(12, E, generator=g) * 0.5  # [12, E]
    return logits, torch.arange(12) % V


def _ordinary_rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, E, generator=g) * 4, torch.randint(0, V, (16,), generator=g)


def test_renormalised_hash_route_is_the_formula_at_subnormal_scores():
    logits, tokens = _subnormal_rows()
    got = hash_route(logits, tokens, TABLE, HASH).topk_weights
    want = _weights64(logits, tokens, True)
    assert (want[7:11] > 1e-4).all()  # rows at -104 .. -107: the formula gives 1e-4 .. 3e-3, rounding 0
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_ordinary_logits_keep_their_bits_and_unrenormalised_rows_transformers_rounding():
    """Above -87 the renormalised weights are sqrt(softplus)'s / (sum + 1e-20) bit for bit (session 50's ops, here);
    unrenormalised, every row keeps sqrt(softplus)'s float32 bits, the subnormal ones too."""
    logits, tokens = _ordinary_rows()
    chosen = TABLE[tokens]  # [M, k]
    s = torch.nn.functional.softplus(logits).sqrt().gather(1, chosen)
    assert torch.equal(hash_route(logits, tokens, TABLE, HASH).topk_weights, s / (s.sum(-1, keepdim=True) + 1e-20))
    plain = HASH.replace(renormalize=False)
    for logits, tokens in (_ordinary_rows(), _subnormal_rows()):
        s = torch.nn.functional.softplus(logits).sqrt().gather(1, TABLE[tokens])
        assert torch.equal(hash_route(logits, tokens, TABLE, plain).topk_weights, s)
    logits, tokens = _subnormal_rows()
    got = hash_route(logits, tokens, TABLE, plain).topk_weights.double()
    assert (got - _weights64(logits, tokens, False)).abs().max() < 1e-19  # the rounding weighs nothing


def test_the_fused_hash_kernel_at_subnormal_and_ordinary_scores(hash_fused):
    router = hash_fused.FusedHashRouter(HASH)
    for logits, tokens in (_subnormal_rows(), _ordinary_rows()):
        got = router(logits, tokens, TABLE).topk_weights
        torch.testing.assert_close(got.double(), _weights64(logits, tokens, True), rtol=1e-5, atol=0)
        torch.testing.assert_close(got, hash_route(logits, tokens, TABLE, HASH).topk_weights, rtol=2e-6, atol=0)
    plain = hash_fused.FusedHashRouter(HASH.replace(renormalize=False))
    logits, tokens = _subnormal_rows()
    s = torch.nn.functional.softplus(logits).sqrt().gather(1, TABLE[tokens])  # the rounding, as hash_route keeps it
    # numpy's subnormal exp (the interpreter's) is not torch's at -104: equal within the 1e-19 the rounding weighs
    torch.testing.assert_close(plain(logits, tokens, TABLE).topk_weights, s, rtol=2e-6, atol=1e-19)


def test_the_top_k_router_weighs_by_the_formula_there_already():
    """``route`` renormalises from log-scores: its chosen experts weigh the formula's. (It chooses them by the float32
    scores, transformers' rounding, as transformers' top-k does: at -104 and below they tie at 0, the lower id wins.)"""
    cfg = HASH.replace(hash_table_size=None)
    logits, _ = _subnormal_rows()
    got = route(logits, cfg)
    s = torch.tensor([[_sqrt_softplus64(v) for v in row] for row in logits.double().tolist()], dtype=torch.float64)
    chosen = s.gather(1, got.topk_ids.long())
    want = chosen / (chosen.sum(-1, keepdim=True) + 1e-20)
    torch.testing.assert_close(got.topk_weights.double(), want, rtol=1e-5, atol=0)

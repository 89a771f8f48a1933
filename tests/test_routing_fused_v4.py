"""DeepSeek-V4's sqrt(softplus) scoring in the fused router (session 48, ``RouterMath.sqrt_softplus``), on the CPU under
Triton's interpreter (TRITON_INTERPRET=1).

Chain: the kernel against ``loop_route``, a float64 per-token loop written here (scores sqrt(log(1 + e^x)), the bias
for the choice only, grouped top-k where a config has groups, weights from the unbiased scores, renormalised or not,
routed scaling), and against ``route`` (its torch twin); softplus at large positive and negative logits against
float64 and against torch's ``F.softplus`` (its threshold 20); a V4 layer on the fused path (the one gate + router
launch, the decode fast path) against the torch-routed layer; a tiny transformers DeepSeek-V4 block (built offline)
through ``backend="triton"`` and the fused router against transformers' output. GPU figures:
``benchmarks/v4r48_device_check.py``.

Shapes: M tokens, E experts, k experts a token.
"""

from __future__ import annotations

import math

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig, route
from moekit.activations import ActivationSpec

triton = pytest.importorskip("triton")
# numpy on the branches tl.where discards (log of 0 where softplus underflows), transformers' deprecations
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module", autouse=True)
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module, \
            interpreted("moekit.experts", "moekit.experts.triton"):
        yield module


V4 = dict(hidden_size=16, moe_intermediate_size=8, num_experts=16, top_k=4, scoring="sqrtsoftplus",
          use_correction_bias=True, routed_scaling_factor=1.5)
# name -> fields over V4: V4 itself (no groups), and what the kernel does with the scoring elsewhere
CASES = {
    "v4": {},
    "v4_not_renormalised": dict(renormalize=False),
    "grouped_top2": dict(n_group=4, topk_group=2),  # with the bias: a group scores its top-2 sum
    "grouped_max_unbiased": dict(n_group=4, topk_group=2, use_correction_bias=False, routed_scaling_factor=1.0),
}


def _sqrt_softplus(x: float) -> float:
    """sqrt(log(1 + e^x)) in float64, without overflow: x + log1p(e^-x) above 0."""
    return math.sqrt(x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x)))


def loop_route(logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None):
    """float64, one token at a time: ids [M, k] (best first, the lower id on a tie) and weights [M, k]."""
    size, all_ids, all_weights = cfg.num_experts // cfg.n_group, [], []
    for row in logits.double().tolist():
        s = [_sqrt_softplus(v) for v in row]
        choice = [v + (0.0 if bias is None else float(bias[e])) for e, v in enumerate(s)]
        kept = set(range(cfg.n_group))
        if cfg.n_group > 1:
            top2 = bias is not None
            score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2 if top2 else 1])
                     for g in range(cfg.n_group)]
            kept = set(sorted(range(cfg.n_group), key=lambda g: (-score[g], g))[: cfg.topk_group])
        ids = sorted((e for e in range(cfg.num_experts) if e // size in kept), key=lambda e: (-choice[e], e))
        ids = ids[: cfg.top_k]
        total = sum(s[e] for e in ids) if cfg.renormalize else 1.0
        all_ids.append(ids)
        all_weights.append([s[e] / total * cfg.routed_scaling_factor for e in ids])
    return torch.tensor(all_ids, dtype=torch.int32), torch.tensor(all_weights, dtype=torch.float64)


def _problem(cfg: MoEConfig, m: int, seed: int):
    """logits [M, E] x 4 (some far below 0, where softplus is e^x), a bias [E] large enough to change choices."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, cfg.num_experts, generator=g) * 4
    bias = torch.randn(cfg.num_experts, generator=g) * 0.5 if cfg.use_correction_bias else None
    return logits, bias


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("m", [1, 9])
def test_matches_a_float64_loop_and_route(fused, name, m):
    cfg = MoEConfig(**dict(V4, **CASES[name]))
    assert fused.computes(cfg) and fused.fused_router(cfg, torch.device("cuda")) is not None
    logits, bias = _problem(cfg, m, seed=m)
    got = fused.FusedRouter(cfg)(logits, bias)
    ids, weights = loop_route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, ids)
    torch.testing.assert_close(got.topk_weights.double(), weights, rtol=2e-6, atol=1e-12)
    want = route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-12)


def test_the_bias_and_the_scoring_change_the_routing(fused):
    """The inputs above tell the bias and the scoring apart: without the bias, or with sigmoid scores, other ids or
    weights (else the comparisons above would not test them)."""
    cfg = MoEConfig(**V4)
    logits, bias = _problem(cfg, 9, seed=9)
    got = fused.FusedRouter(cfg)(logits, bias)
    unbiased = fused.FusedRouter(cfg)(logits, None)
    sigmoid = fused.FusedRouter(cfg.replace(scoring="sigmoid"))(logits, bias)
    assert not torch.equal(got.topk_ids, unbiased.topk_ids)
    assert not torch.allclose(got.topk_weights, sigmoid.topk_weights)


EXTREMES = [-200.0, -110.0, -103.0, -100.0, -90.0, -50.0, -17.0, -1e-3, 0.0, 1e-3, 15.0, 19.99, 20.0, 20.01, 89.0,
            1e4]  # E = 16: softplus underflowing to 0, denormal, e^x, around 0, its threshold 20, where e^x overflows


@pytest.mark.parametrize("renormalize", [False, True])
def test_softplus_at_large_positive_and_negative_logits(fused, renormalize):
    """All 16 experts chosen (k = E), so every score comes back: against float64 and torch's F.softplus(x).sqrt()
    (threshold 20: x itself above it; 0 below about -104, where e^x underflows), to fp32 rounding (denormals: their
    ulp); renormalised, the scores over their sum (the ones that underflow weigh 0)."""
    cfg = MoEConfig(**dict(V4, top_k=16, use_correction_bias=False, routed_scaling_factor=1.0,
                           renormalize=renormalize))
    logits = torch.tensor([EXTREMES, [-v for v in EXTREMES]])  # [2, 16]
    got = fused.FusedRouter(cfg)(logits)
    weights = got.topk_weights.gather(1, got.topk_ids.long().argsort(1))  # [2, E] back in expert order
    exact = torch.tensor([[_sqrt_softplus(v) for v in row] for row in logits.tolist()], dtype=torch.float64)
    torch_fp32 = torch.nn.functional.softplus(logits).sqrt()  # [2, E]
    if renormalize:
        exact, torch_fp32 = exact / exact.sum(1, keepdim=True), torch_fp32 / torch_fp32.sum(1, keepdim=True)
    torch.testing.assert_close(weights.double(), exact, rtol=2e-6, atol=1e-23)
    # torch's CPU kernel flushes some of e^x's denormals: at -103 its score is 0, the kernel's 3.7e-23 (float64 4.2e-23)
    torch.testing.assert_close(weights, torch_fp32, rtol=2e-6, atol=5e-23)
    # best first: the logits' order (ascending in row 0, descending in row 1), but -200 and -110 both score 0 in fp32
    # and tie: the lower id first (route's rule; route itself on the CPU also ties -103 at 0, above)
    order = list(range(15, 1, -1)) + [0, 1]
    assert got.topk_ids.tolist() == [order, list(range(16))]
    if not renormalize:
        assert weights[0, 15] == 100.0 and weights[0, 0] == 0.0 and 0 < weights[0, 2] < 1e-22  # 1e4, -200, -103


def test_masked_experts_as_route(fused):
    cfg = MoEConfig(**V4, nonfinite="mask")
    logits, bias = _problem(cfg, 6, seed=6)
    logits[1, 3], logits[2, :7], logits[3] = float("nan"), float("inf"), float("-inf")
    got, want = fused.FusedRouter(cfg)(logits, bias), route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, want.topk_ids) and int(got.masked_tokens) == int(want.masked_tokens) == 1
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=2e-6, atol=1e-12)


def _v4_layer(router: str, fuse_shared: bool = True) -> MoE:
    """DeepSeek-V4's top-k layer in small: sqrtsoftplus, the bias, scaling 1.5, the clamped SwiGLU, a shared MLP."""
    cfg = MoEConfig(**dict(V4, hidden_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                           activation=ActivationSpec(name="silu", limit=2.0)))
    torch.manual_seed(0)
    layer = MoE(cfg, backend="triton", router=router, fuse_shared=fuse_shared, dtype=torch.float32).eval()
    layer.e_score_correction_bias.copy_(torch.randn(cfg.num_experts) * 0.5)
    return layer


@pytest.mark.parametrize("m", [1, 3])
def test_v4_layer_fast_path_equals_the_slow_path(fused, m):
    """``router="fused"``: the one gate + router launch and a kept decode entry; its repeated call equals its first
    bit for bit, and the layer routed in torch (the full forward, before session 48) within fp32 rounding (float32:
    in bf16 the two gates' logits differ in their last bit, enough to swap two experts 4e-4 apart here)."""
    from _helpers import rel_l2

    layer, slow = _v4_layer("fused"), _v4_layer("torch")
    assert layer._fused_router is not None and slow._fused_router is None
    x = torch.randn(m, 40, generator=torch.Generator().manual_seed(1)) * 4
    with torch.no_grad():
        first, served, want = layer(x), layer(x), slow(x)
    assert layer._gate_route is not None and layer._decode._entries[m].bound is not None  # the one launch, kept
    assert torch.equal(first, served)
    assert rel_l2(served, want) < 1e-5 and rel_l2(want, torch.zeros_like(want) + want.mean()) > 0.5


def test_a_transformers_deepseek_v4_block_through_triton(fused):
    """A tiny DeepSeek-V4 built offline by transformers (random weights, its top-k layer 1): the block swapped for a
    ``MoE`` on ``backend="triton"`` with the fused router (decode, M = 1: the fast path's second call too) and at 14
    tokens, against the block's own output; the clamps bite at this x."""
    from test_hf_deepseek_v4 import _blocks, _model

    import moekit.hf as moekit_hf

    block = _blocks(_model(torch.float32, swiglu_limit=3.0, routed_scaling_factor=2.5, num_experts_per_tok=3))[1]
    moe = moekit_hf.moe_from_hf(block, backend="triton", fuse_shared=True)
    moe.router = "fused"
    assert moe._fused_router is not None and moe.config.scoring == "sqrtsoftplus"
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.randn(6, generator=torch.Generator().manual_seed(3)))
        moe.e_score_correction_bias.copy_(block.gate.e_score_correction_bias)
        for shape in [(1, 1, 32), (1, 1, 32), (2, 7, 32)]:
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]), dtype=torch.float32) * 20
            want = block(x)
            assert (moe(x) - want).norm() / want.norm() < 1e-5

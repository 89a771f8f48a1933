"""ERNIE-4.5-MoE's w / clamp(sum(w), min=moe_norm_min) (``MoEConfig.renorm_clamp``) in the fused routers (session 49,
``ern49``): the fused router, the one gate + route launch (both its kernels) and an ERNIE ``MoE`` layer, on the CPU
under Triton's interpreter, against transformers' ``Ernie4_5_MoeTopKRouter`` built offline, a float64 loop and
``route`` (``test_routing_renorm_clamp``'s builders: ordinary rows, then rows whose chosen softmax scores sum to
2e-11, 3e-12, 4e-13, 2e-17 and 1e-43). ``router="auto"`` takes the fused router for it on CUDA since a GPU checked
the kernels (session 50: ``benchmarks/ern49_device_check.py``, every line PASS on an H100).

Shapes: M tokens (rows), E experts, k experts a token.
"""

from __future__ import annotations

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoE, MoEConfig, route
from test_routing_renorm_clamp import E, TOP_K, _float64, _hf_config, _rel, _rows, _transformers

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning", "ignore::FutureWarning")

# the rows whose chosen sum is below 1e-12 (gaps 30, 40, 100): route's factor below 1 (at seeds 0 and 1 the bias
# chooses experts 1..k on every gap row)
CLAMPED = slice(6, None)
ULP = 2.0 ** -23


@pytest.fixture(scope="module")
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module:
        import moekit.routing.gate_route as gate_route
        from moekit.routing.workspace import RouteWorkspace

        yield module, gate_route, RouteWorkspace


def _ernie() -> MoEConfig:
    cfg = MoEConfig.from_hf_config(_hf_config())
    assert cfg.renorm_clamp == 1e-12 and cfg.scoring == "softmax" and cfg.renormalize
    return cfg


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of each weight's own float32 ulp (want's; 0 where both are 0)."""
    scale = torch.where(want == 0, 1.0, want.abs().double()) * ULP
    return ((got.double() - want.double()).abs() / scale).max().item()


def _check(got_ids, got_weights, logits, bias, cfg):
    """transformers' ids; route's weights within 2 ulps (interpreted, numpy's exp against torch's: ~1 ulp with or
    without the clamp); the float64 loop's and transformers' (where its scores are normal floats) within 2e-5; the
    clamp active."""
    ids, weights = _transformers(logits, bias)
    assert torch.equal(got_ids.long(), ids)
    ref = route(logits, cfg, bias)
    assert torch.equal(got_ids, ref.topk_ids.to(got_ids.dtype))
    assert _ulps(got_weights, ref.topk_weights) <= 2.0
    want = _float64(logits, ids, cfg.renorm_clamp)
    assert _rel(got_weights, want) < 2e-5
    assert _rel(got_weights[:-1], weights[:-1].double()) < 2e-5
    assert got_weights[CLAMPED].double().sum(-1).max() < 0.5  # the scores / 1e-12, not a sum of 1


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_router_against_transformers_route_and_float64(fused, seed):
    module = fused[0]
    cfg = _ernie()
    logits, bias = _rows(seed)
    got = module.route_fused(logits, cfg, bias)
    _check(got.topk_ids, got.topk_weights, logits, bias, cfg)


def test_rows_whose_softmax_sum_is_spread(fused):
    """Every unchosen expert at the gap (the row's softmax sum over e^(x - max) is ~12, not ~1): the floor reads the
    row's logsumexp, not its max alone; against transformers and the float64 loop."""
    module = fused[0]
    cfg = _ernie()
    _, bias = _rows(0)
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(6)) / 10
    logits[:, 0] += 30.0
    logits[:, TOP_K + 1:] += torch.tensor([27.0, 30.0, 35.0, 40.0])[:, None]
    got = module.route_fused(logits, cfg, bias)
    ids, weights = _transformers(logits, bias)
    assert torch.equal(got.topk_ids.long(), ids) and set(ids.flatten().tolist()) == set(range(1, TOP_K + 1))
    want = _float64(logits, ids, cfg.renorm_clamp)
    assert want.sum(-1).max() < 0.5  # every row below the floor
    assert _rel(got.topk_weights, want) < 2e-5
    assert _rel(got.topk_weights, weights.double()) < 2e-5
    assert _ulps(got.topk_weights, route(logits, cfg, bias).topk_weights) <= 2.0


def test_the_clamp_changes_only_the_rows_below_it(fused):
    """The kernel without the clamp (renorm_clamp 0: the default's code) sums to 1 on every row; with it, the rows
    above the floor keep those bits and the rows below differ by more than half (so the tests above can fail)."""
    module = fused[0]
    cfg = _ernie()
    logits, bias = _rows(0)
    with_clamp = module.route_fused(logits, cfg, bias).topk_weights
    without = module.route_fused(logits, cfg.replace(renorm_clamp=0.0), bias).topk_weights
    assert torch.equal(with_clamp[:6], without[:6])
    assert _rel(without[CLAMPED], with_clamp[CLAMPED].double()) > 0.5


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
def test_other_scorings_agree_with_route(fused, scoring):
    """The floor on log S = top + log T alone (no logsumexp): route's factor, rows of logits shifted down to -35
    (sigmoid) or -70 (sqrt(softplus)) so that the chosen scores' sum falls below a clamp of 1e-11 on some rows and
    not on others."""
    module = fused[0]
    cfg = MoEConfig(hidden_size=E, moe_intermediate_size=8, num_experts=E, top_k=TOP_K, scoring=scoring,
                    renormalize=True, renorm_clamp=1e-11)
    shift = 5.0 if scoring == "sigmoid" else 10.0
    logits = torch.randn(8, E, generator=torch.Generator().manual_seed(3)) - torch.arange(8.0)[:, None] * shift
    got = module.route_fused(logits, cfg, None)
    ref = route(logits, cfg, None)
    assert torch.equal(got.topk_ids, ref.topk_ids)
    sums = ref.topk_weights.double().sum(-1)
    assert (sums < 0.5).any() and ((sums - 1.0).abs() < 1e-6).any()  # rows below the floor and above it
    above = (route(logits, cfg.replace(renorm_clamp=0.0), None).topk_weights == ref.topk_weights).all(-1)  # factor 1
    plain = module.route_fused(logits, cfg.replace(renorm_clamp=0.0), None).topk_weights
    assert torch.equal(got.topk_weights[above], plain[above]) and not torch.equal(got.topk_weights, plain)
    assert _ulps(got.topk_weights, ref.topk_weights) <= 2.0


@pytest.mark.parametrize("rows", [9, 5])  # 9: the tensor-core gate (> 8 rows); 5: the one-program gate + route
def test_gate_and_route_in_one_launch(fused, rows):
    """gate_route computes the clamp too: x the ERNIE rows and W the identity (x @ W^T = x exactly)."""
    module, gate_route, workspace = fused
    cfg = _ernie()
    logits, bias = _rows(1)
    take = torch.cat([logits[:rows - 3], logits[CLAMPED]]) if rows < len(logits) else logits  # keep the clamped rows
    got, plain = (gate_route.gate_route(module.FusedRouter(c), take, torch.eye(E), None, bias, None, False,
                                        workspace().get(take, E, TOP_K, take.dtype))
                  for c in (cfg, cfg.replace(renorm_clamp=0.0)))
    assert got is not None and plain is not None, "gate_route handed this call back"
    ids, weights = _transformers(take, bias)
    assert torch.equal(got.topk_ids.long(), ids)
    ref = route(take, cfg, bias)
    above = rows - 3 if rows < len(logits) else 6
    assert torch.equal(got.topk_weights[:above], plain.topk_weights[:above])  # the kernel without the clamp's bits
    assert _ulps(got.topk_weights, ref.topk_weights) <= 2.0
    assert _rel(got.topk_weights, _float64(take, ids, cfg.renorm_clamp)) < 2e-5


def test_fused_and_auto_take_it_on_cuda(fused):
    """``router="fused"`` and ``"auto"`` on CUDA take ERNIE's config (the device check is ``fused_router``'s only CUDA
    condition, Triton imports here); an ERNIE ``MoE`` on the fused router (interpreted) routes as the fused router and
    ``route`` do, the clamped rows included."""
    module = fused[0]
    cfg = _ernie()
    assert module.computes(cfg) and module.fused_router(cfg, "cuda", "fused") is not None
    assert module.fused_router(cfg, "cuda", "auto") is not None
    layer = MoE(cfg, router="fused").eval()
    assert layer._fused_router is not None
    logits, bias = _rows(0)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.eye(E))
        layer.e_score_correction_bias.copy_(bias)
        got = layer.route_tokens(logits).routing
    want = route(logits, cfg, bias)
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert torch.equal(got.topk_weights, module.route_fused(logits, cfg, bias).topk_weights)
    assert _ulps(got.topk_weights, want.topk_weights) <= 2.0 and got.topk_weights[CLAMPED].sum(-1).max() < 0.5

"""Routers at extreme logits (session 49, ``MoEConfig.renorm_eps``): each transformers family's renormalisation, on
rows whose chosen logits sit at -20, -50, -104 or -200 (or one chosen expert finite, the rest underflowing), in
moekit's torch router and its fused Triton router (and the one gate + route launch, both its kernels) on the CPU under
Triton's interpreter.

References, independent of moekit: transformers' own routers built offline from small configs (the gate weight
the identity, so the hidden state is the logits row), and ``family_weights``, a float64 loop written here (the
family's scores at the chosen experts, divided by their sum + eps, times the scaling). The families, one a formula:
DeepSeek-V3 (sigmoid, groups, bias, / (sum + 1e-20), x scaling), DeepSeek-V4's top-k router (sqrt(softplus),
/ (sum + 1e-20)), Mistral-4 (softmax top-k in groups, / (sum + 1e-20)), LFM2-MoE (sigmoid, / (sum + 1e-6)) and
Laguna (sigmoid, / sum alone: 0/0 = NaN in transformers where every chosen score underflows; moekit gives the exact
ratio there, as documented in ``route``).

Shapes: M tokens (rows), E experts, k experts a token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from _triton_helpers import interpreted
from moekit import MoEConfig, route

triton = pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning", "ignore::FutureWarning")

E, K_TOP = 16, 4
BASES = (None, -20.0, -50.0, -104.0, -200.0, "mixed")  # None: ordinary N(0, 1) logits; mixed: one expert at 0.5
ORDINARY = 0  # the row index of the ordinary row


@pytest.fixture(scope="module")
def fused():
    with interpreted("moekit.routing", "moekit.routing.fused") as module:
        import moekit.routing.gate_route as gate_route
        from moekit.routing.workspace import RouteWorkspace

        yield module, gate_route, RouteWorkspace


def extreme_rows(seed: int, rows_each: int = 2) -> torch.Tensor:
    """[len(BASES) * rows_each, E] float32 logits: each base plus N(0, 1) noise (the mixed rows: -200 plus noise, one
    expert at 0.5)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for base in BASES:
        for _ in range(rows_each):
            noise = torch.randn(E, generator=g)
            if base is None:
                out.append(noise)
            elif base == "mixed":
                row = noise - 200.0
                row[int(torch.randint(E, (1,), generator=g))] = 0.5
                out.append(row)
            else:
                out.append(noise + base)
    return torch.stack(out)


def _score64(x: float, scoring: str, row: list[float]) -> float:
    if scoring == "sigmoid":
        return 1.0 / (1.0 + math.exp(-x))
    if scoring == "sqrtsoftplus":
        return math.sqrt(math.log1p(math.exp(x)))  # x < 20 here: no overflow
    top = max(row)
    return math.exp(x - top) / sum(math.exp(v - top) for v in row)


def family_weights(logits: torch.Tensor, ids: torch.Tensor, scoring: str, eps: float, scale: float) -> torch.Tensor:
    """float64, a token at a time: the family's weights of the chosen ``ids`` [M, k]: s_i / (sum_j s_j + eps) x scale
    (eps 0: the exact ratio, finite where float64 does not underflow: every row here)."""
    out = []
    for row, chosen in zip(logits.double().tolist(), ids.long().tolist()):
        s = [_score64(row[e], scoring, row) for e in chosen]
        out.append([v / (sum(s) + eps) * scale for v in s])
    return torch.tensor(out, dtype=torch.float64)


@dataclass
class Family:
    """A transformers router built offline with the identity as its gate weight, and moekit's config read from it."""

    name: str
    config: MoEConfig
    bias: torch.Tensor | None  # [E] the correction bias (the choice only)
    hf: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits [M, E] -> (weights, ids) [M, k]
    eps: float  # the family's eps in transformers' modeling file
    hf_float64: bool  # the router runs in the input's dtype (no float32 cast): its float64 run is exact


def _bias(seed: int) -> torch.Tensor:
    return torch.randn(E, generator=torch.Generator().manual_seed(seed)) * 0.05


def _router(cls, hf, bias: torch.Tensor | None, bias_arg: bool = False) -> Callable:
    """transformers' router ``cls(hf)`` with the identity gate and ``bias`` in its correction-bias buffer (or passed to
    its forward where ``bias_arg``: LFM2's block holds it) -> logits [M, E] -> (weights, ids), run in the logits'
    dtype (``.to``: a router that casts to float32 itself still does)."""
    router = cls(hf)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        if bias is not None and not bias_arg:
            router.e_score_correction_bias.copy_(bias)

    def run(x):
        args = (x, bias.to(x.dtype)) if bias_arg else (x,)
        _, w, i = router.to(x.dtype)(*args)
        return w, i

    return run


def _deepseek_v3() -> Family:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K_TOP, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=8)
    bias = _bias(1)
    return Family("deepseek_v3", MoEConfig.from_hf_config(hf), bias, _router(DeepseekV3TopkRouter, hf, bias), 1e-20,
                  False)


def _deepseek_v4() -> Family:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    hf = DeepseekV4Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K_TOP, routed_scaling_factor=1.5,
                          moe_intermediate_size=8)
    bias = _bias(2)
    return Family("deepseek_v4", MoEConfig.from_hf_config(hf), bias, _router(DeepseekV4TopKRouter, hf, bias), 1e-20,
                  True)


def _mistral4() -> Family:
    from transformers import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    hf = Mistral4Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K_TOP, n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=1.25, moe_intermediate_size=8)
    return Family("mistral4", MoEConfig.from_hf_config(hf), None, _router(Mistral4TopkRouter, hf, None), 1e-20, True)


def _lfm2_moe() -> Family:
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeTopKRouter

    hf = Lfm2MoeConfig(hidden_size=E, num_experts=E, num_experts_per_tok=K_TOP, norm_topk_prob=True,
                       use_expert_bias=True, routed_scaling_factor=1.0, moe_intermediate_size=8)
    bias = _bias(3)
    return Family("lfm2_moe", MoEConfig.from_hf_config(hf), bias, _router(Lfm2MoeTopKRouter, hf, bias, True), 1e-6,
                  True)


def _laguna() -> Family:
    from transformers import LagunaConfig
    from transformers.models.laguna.modeling_laguna import LagunaTopKRouter

    hf = LagunaConfig(hidden_size=E, num_experts=E, num_experts_per_tok=K_TOP, moe_intermediate_size=8,
                      shared_expert_intermediate_size=8)
    bias = _bias(4)
    return Family("laguna", MoEConfig.from_hf_config(hf), bias, _router(LagunaTopKRouter, hf, bias), 0.0, False)


FAMILIES = {f.__name__[1:]: f for f in (_deepseek_v3, _deepseek_v4, _mistral4, _lfm2_moe, _laguna)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]()


def _by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, weights) [M, k] in ascending id order: transformers' top-k order is not moekit's (best first)."""
    order = ids.long().sort(dim=-1)
    return order.values, weights.gather(1, order.indices)


def test_configs_read_the_family_eps(family):
    """from_hf_config reads each family's eps from its model type (the modeling file's constant)."""
    assert family.config.renorm_eps == family.eps and family.config.renormalize


def test_torch_router_against_transformers_and_float64(family):
    """route: the ids transformers chooses; the weights within float32 rounding of the float64 loop at every row;
    against transformers' float32 router where its scores are normal floats (rows at -20, -50, ordinary, mixed),
    and its float64 run everywhere where the router has no float32 cast (V4, Mistral-4, LFM2)."""
    x = extreme_rows(seed=11)
    cfg = family.config
    got = route(x, cfg, family.bias)
    w_hf, i_hf = family.hf(x)
    ids, weights = _by_id(got.topk_ids, got.topk_weights)
    ids_hf, w_hf = _by_id(i_hf, w_hf.detach())
    # a softmax row whose other experts underflow to 0 ties them (Mistral-4's mixed rows): transformers' topk takes
    # any of them, moekit the lower ids; weight 0 either way, so those rows compare their weights in value order
    tied = (got.topk_weights == 0).any(dim=-1) if cfg.scoring == "softmax" else torch.zeros(len(x), dtype=torch.bool)
    assert torch.equal(ids[~tied], ids_hf[~tied])
    ref = family_weights(x, ids, cfg.scoring, family.eps, cfg.routed_scaling_factor)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights.double(), ref, rtol=2e-5, atol=1e-30)
    normal = torch.tensor([b is None or b == "mixed" or b > -80 for b in BASES for _ in range(2)])
    torch.testing.assert_close(_in_value_order(weights, tied)[normal], _in_value_order(w_hf, tied)[normal],
                               rtol=2e-5, atol=1e-30)
    if family.hf_float64:
        w64, i64 = family.hf(x.double())
        ids64, w64 = _by_id(i64, w64.detach())
        assert torch.equal(ids[~tied], ids64[~tied])
        torch.testing.assert_close(_in_value_order(weights.double(), tied), _in_value_order(w64, tied), rtol=2e-5,
                                   atol=1e-30)


def _in_value_order(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weights [M, k] with the ``rows`` [M] bool sorted by value (the others as they are)."""
    return torch.where(rows[:, None], weights.sort(-1).values, weights)


def test_weights_at_all_underflowing_rows(family):
    """Every chosen logit below -104 (-200 + noise): transformers' float32 scores are 0. With eps its weights are
    0 (0 / eps), moekit's the exact w / eps (sigmoid: ~e^-200 / eps, 0 in float32; sqrt(softplus): ~e^-100 / eps,
    ~4e-24: the float64 loop's, above); without eps (Laguna) transformers gives 0/0 = NaN and
    moekit the exact ratio w / sum(w) (a softmax over the log-scores), summing to the scaling."""
    x = extreme_rows(seed=12)[8:10]  # the two rows at -200
    got = route(x, family.config, family.bias)
    w_hf, _ = family.hf(x)
    if family.config.scoring == "softmax":  # softmax is shift-invariant: ordinary weights, no underflow
        torch.testing.assert_close(got.topk_weights.sum(-1), torch.full((2,), family.config.routed_scaling_factor))
    elif family.eps:
        assert torch.equal(w_hf.detach(), torch.zeros_like(w_hf)) and float(got.topk_weights.abs().max()) < 1e-22
    else:
        assert torch.isnan(w_hf).all()
        torch.testing.assert_close(got.topk_weights.sum(-1), torch.full((2,), family.config.routed_scaling_factor))


def test_ordinary_rows_bit_equal_to_the_exact_ratio(family):
    """On ordinary rows S = sum(w) > 2^24 eps, so S / (S + eps) is exactly 1.0 in float32: the weights are the ones of
    renorm_eps=0 (moekit's weights before session 49) bit for bit; LFM2's 1e-6 is not below rounding there (its
    weights are 1e-6 relative smaller: transformers', checked above)."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(64, E, generator=g) * 3
    exact = family.config.replace(renorm_eps=0.0)
    got, before = route(x, family.config, family.bias), route(x, exact, family.bias)
    assert torch.equal(got.topk_ids, before.topk_ids)
    if family.eps < 1e-12:
        assert torch.equal(got.topk_weights, before.topk_weights)
    else:
        assert not torch.equal(got.topk_weights, before.topk_weights)
        ratio = got.topk_weights.sum(-1) / before.topk_weights.sum(-1)
        s = route(x, exact.replace(renormalize=False, routed_scaling_factor=1.0), family.bias).topk_weights.sum(-1)
        torch.testing.assert_close(ratio, s / (s + family.eps), rtol=1e-6, atol=0)


def test_fused_router_against_route_and_float64(family, fused):
    """The fused kernel (interpreted) on the same rows: route's ids, its weights within the interpreter's exp / log
    rounding, the float64 loop's; with eps, on ordinary rows bit-equal to the kernel without it."""
    module = fused[0]
    x = extreme_rows(seed=14)
    cfg = family.config
    got = module.route_fused(x, cfg, family.bias)
    ref = route(x, cfg, family.bias)
    assert torch.equal(got.topk_ids, ref.topk_ids)
    assert torch.isfinite(got.topk_weights).all()
    torch.testing.assert_close(got.topk_weights, ref.topk_weights, rtol=2e-5, atol=1e-30)
    ids, weights = _by_id(got.topk_ids, got.topk_weights)
    loop = family_weights(x, ids, cfg.scoring, family.eps, cfg.routed_scaling_factor)
    torch.testing.assert_close(weights.double(), loop, rtol=2e-5, atol=1e-30)
    if family.eps < 1e-12:
        plain = torch.randn(32, E, generator=torch.Generator().manual_seed(15)) * 3
        with_eps = module.route_fused(plain, cfg, family.bias)
        without = module.route_fused(plain, cfg.replace(renorm_eps=0.0), family.bias)
        assert torch.equal(with_eps.topk_weights, without.topk_weights)


@pytest.mark.parametrize("rows", [6, 12])  # 6: the one-program gate + route kernel; 12: the tensor-core gate (> 8)
def test_gate_and_route_in_one_launch(fused, rows):
    """gate_route (both its kernels) computes the eps too: DeepSeek-V3's config, x the extreme rows and W the identity
    (x @ W^T = x exactly), against route on the same logits and the float64 loop."""
    module, gate_route, workspace = fused
    fam = _deepseek_v3()
    x = extreme_rows(seed=16)[:rows]
    w = torch.eye(E)
    router = module.FusedRouter(fam.config)
    buffers = workspace().get(x, E, K_TOP, x.dtype)
    got = gate_route.gate_route(router, x, w, None, fam.bias, None, False, buffers)
    assert got is not None, "gate_route handed this call back"
    assert torch.equal(buffers.logits, x)
    ref = route(x, fam.config, fam.bias)
    assert torch.equal(got.topk_ids, ref.topk_ids)
    torch.testing.assert_close(got.topk_weights, ref.topk_weights, rtol=2e-5, atol=1e-30)
    ids, weights = _by_id(got.topk_ids, got.topk_weights)
    loop = family_weights(x, ids, "sigmoid", 1e-20, fam.config.routed_scaling_factor)
    torch.testing.assert_close(weights.double(), loop, rtol=2e-5, atol=1e-30)


def test_sqrt_softplus_no_nan_without_eps():
    """Session 48's NaN: sqrt(softplus) below -104 underflows to 0, its log to -inf, the softmax over the k to 0/0.
    The log-score is now x itself where softplus is subnormal or 0, so a hand-built config (renorm_eps 0) gives the
    exact ratio there: the float64 loop's."""
    cfg = MoEConfig(hidden_size=E, moe_intermediate_size=8, num_experts=E, top_k=K_TOP, scoring="sqrtsoftplus")
    x = extreme_rows(seed=17)
    got = route(x, cfg)
    assert torch.isfinite(got.topk_weights).all()
    ids, weights = _by_id(got.topk_ids, got.topk_weights)
    torch.testing.assert_close(weights.double(), family_weights(x, ids, "sqrtsoftplus", 0.0, 1.0), rtol=2e-5,
                               atol=1e-44)  # the mixed rows: weights e^-100 of the finite one, subnormal in float32


def test_renorm_eps_checked():
    """A bad renorm_eps names itself; Inkling's router-weighted shared slots (exact in transformers) refuse one."""
    base = dict(hidden_size=E, moe_intermediate_size=8, num_experts=E, top_k=K_TOP)
    for bad in (-1e-20, float("inf"), float("nan"), True, "1e-20"):
        with pytest.raises(ValueError, match="renorm_eps"):
            MoEConfig(**base, renorm_eps=bad)
    with pytest.raises(ValueError, match="renorm_eps"):
        MoEConfig(**base, scoring="sigmoid", shared_expert_intermediate_size=8, shared_expert_combine="router",
                  renorm_eps=1e-20)


def test_route_with_eps_compiles_into_one_graph():
    """``renorm_log_eps`` (log eps, a constant of the config) ran ``.item()`` on a tensor inside every traced torch
    router with an eps: a graph break a layer in each compiled decode step under no_grad, as generate runs (the tiny
    DeepSeek-V3 of ``bench --hf`` through moekit_blocks: 33 graphs a step). It is a constant of the trace now: one
    graph and no break in dynamo's counters (``fullgraph=True`` hid the break: it traced the ``.item()`` through),
    and the compiled routing equals eager's bit for bit."""
    from torch._dynamo.utils import counters

    cfg = _deepseek_v3().config
    logits = extreme_rows(7)  # [12, E]
    bias = _bias(7)
    assert cfg.renorm_eps == 1e-20
    for grad in (False, True):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(lambda x: route(x, cfg, bias), backend="eager")
        with torch.set_grad_enabled(grad):
            got, want = compiled(logits), route(logits, cfg, bias)
        assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
        assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_weights, want.topk_weights)
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_renorm_log_eps_is_the_float64_log_rounded_to_the_router_dtype(dtype):
    """``renorm_log_eps`` in Python floats against torch's float64 log cast to float32, over eps from 1e-300 to 10:
    equal bit for bit. A float64 router keeps the float64 log, within one float64 ulp of torch's (its vectorised log
    on an AVX-512 CPU rounds eps = 1.0513564901511017 one ulp from libm's)."""
    from moekit.routing.router_math import renorm_log_eps

    wide = torch.promote_types(dtype, torch.float32)
    for eps in torch.logspace(-300, 1, 4001, dtype=torch.float64).tolist() + [1.0, 1e-20, 1e-6, 0.5]:
        expected = torch.tensor(eps, dtype=torch.float64).log().to(wide).item()
        if wide == torch.float64:
            assert abs(renorm_log_eps(eps, dtype) - expected) <= math.ulp(expected), eps
        else:
            assert renorm_log_eps(eps, dtype) == expected, eps

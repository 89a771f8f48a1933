"""The MoE module: against a dense FFN, a per-token loop, and a hand count of drops."""

import pytest
import torch
import torch.nn.functional as F

from _helpers import experts_loop
from moekit import MoEConfig
from moekit.layer import MoE

BACKENDS = ["reference", "grouped_mm"]


def moe_per_token(moe, x):
    """float64: gate, route with the lesson's formulas, and run each chosen expert for each token."""
    cfg = moe.config
    x = x.double()
    logits = x @ moe.gate.weight.double().t()
    ids, weights = [], []
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t], 0) if cfg.scoring == "softmax" else torch.sigmoid(logits[t])
        top = sorted(range(cfg.num_experts), key=lambda e: (-float(probs[e]), e))[: cfg.top_k]
        ids.append(top)
        weights.append(probs[top] / probs[top].sum() if cfg.renormalize else probs[top])
    return experts_loop(x, moe.w13, moe.w2, torch.tensor(ids), torch.stack(weights))  # ids, weights [M, k]


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_expert_equals_dense_ffn(backend):
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=24, num_experts=1, top_k=1)
    moe = MoE(cfg, backend=backend)
    x = torch.randn(2, 7, 16)
    w13, w2 = moe.w13[0], moe.w2[0]
    dense = (F.silu(x @ w13[:24].t()) * (x @ w13[24:].t())) @ w2.t()
    torch.testing.assert_close(moe(x), dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_module_matches_per_token_loop(backend, renormalize):
    torch.manual_seed(0)
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=6, top_k=2, renormalize=renormalize)
    moe = MoE(cfg, backend=backend)
    x = torch.randn(11, 16)
    with torch.no_grad():
        torch.testing.assert_close(moe(x).double(), moe_per_token(moe, x), rtol=1e-5, atol=1e-6)


def test_shared_expert_fused_equals_separate():
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, scoring="sigmoid",
                    n_group=2, topk_group=1, use_correction_bias=True, routed_scaling_factor=2.5,
                    shared_expert_intermediate_size=16)
    fused, separate = MoE(cfg), MoE(cfg, fuse_shared=False)
    assert fused.fuse_shared and fused.w13.shape[0] == 10 and separate.w13.shape[0] == 8
    with torch.no_grad():
        separate.gate.weight.copy_(fused.gate.weight)
        fused.e_score_correction_bias.normal_()
        separate.e_score_correction_bias.copy_(fused.e_score_correction_bias)
        separate.w13.copy_(fused.w13[:8])
        separate.w2.copy_(fused.w2[:8])
        # the shared MLP of width 16 is the two width-8 slots side by side
        separate.shared_w13.copy_(torch.cat([fused.w13[8:, :8].reshape(16, 16), fused.w13[8:, 8:].reshape(16, 16)]))
        separate.shared_w2.copy_(torch.cat([fused.w2[8], fused.w2[9]], dim=1))
        x = torch.randn(13, 16)
        torch.testing.assert_close(fused(x), separate(x), rtol=1e-5, atol=1e-6)


def test_stats_count_assignments_and_drops_exactly():
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=8, num_experts=4, top_k=2)
    moe = MoE(cfg, capacity_factor=1.0)
    x = torch.rand(32, 8) + 0.1  # positive rows: expert 0's logit 5*sum(x) > 0 = every other logit
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[0] = 5.0
        stats = moe(x, return_stats=True).stats
    # capacity ceil(1.0 * 32 * 2 / 4) = 16. First choices: all 32 on expert 0, 16 kept. Second choices:
    # experts 1-3 tie at logit 0, the lower id wins, so all 32 go to expert 1, 16 kept. 32 dropped by hand.
    assert stats.dropped == 32
    assert stats.counts.tolist() == [16, 16, 0, 0]
    assert stats.experts_touched == 2 and stats.num_tokens == 32
    dropless = MoE(cfg)
    dropless.load_state_dict(moe.state_dict())
    dropless_stats = dropless(x, return_stats=True).stats
    assert dropless_stats.dropped == 0 and dropless_stats.counts.tolist() == [32, 32, 0, 0]


def test_empty_batch_and_bad_shape():
    moe = MoE(MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2))
    assert moe(torch.zeros(0, 8)).shape == (0, 8)
    grouped = MoE(MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=8, top_k=2, scoring="sigmoid",
                            n_group=4, topk_group=2, use_correction_bias=True, shared_expert_intermediate_size=4))
    assert grouped(torch.zeros(2, 0, 8), return_stats=True).out.shape == (2, 0, 8)
    with pytest.raises(ValueError, match="last dim hidden_size=8"):
        moe(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        MoE(moe.config, capacity_factor=0)
    with pytest.raises(ValueError, match="drop_policy must be"):
        MoE(moe.config, capacity_factor=1.0, drop_policy="random")


def test_backend_is_resolved_outside_forward():
    moe = MoE(MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2), backend="reference")
    assert moe.resolved_backend() == "reference"
    moe.backend = "auto"
    assert moe.resolved_backend() == "grouped_mm" and moe._experts_fn.__name__ == "experts_grouped_mm"
    moe.to(torch.float64)  # a move re-resolves for the new device
    assert (moe._experts_fn.__name__ == "experts_grouped_mm"
            and moe(torch.randn(3, 8, dtype=torch.float64)).dtype == torch.float64)
    with pytest.raises(ValueError, match="backend must be one of"):
        moe.backend = "cutlass"


COMPILE_TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


@pytest.mark.parametrize("dtype", list(COMPILE_TOLERANCE))
def test_compile_fullgraph_cpu_default_equals_eager(dtype):
    """The CPU default (grouped_mm) traces whole in every dtype: torch's fake _grouped_mm accepts bf16
    only, so the compiled path must never meet it. Gradients too (aot_eager traces the backward)."""
    torch.manual_seed(3)
    cfg = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, scoring="sigmoid", n_group=2,
                    topk_group=1, use_correction_bias=True, shared_expert_intermediate_size=8)
    moe = MoE(cfg, dtype=dtype)
    assert moe.resolved_backend() == "grouped_mm"
    x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    eager = moe(x)
    eager_grads = torch.autograd.grad(eager.float().square().sum(), [x, moe.w13, moe.w2])
    torch._dynamo.reset()
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    compiled_grads = torch.autograd.grad(compiled.float().square().sum(), [x, moe.w13, moe.w2])
    rtol, atol = COMPILE_TOLERANCE[dtype]
    torch.testing.assert_close(compiled, eager, rtol=rtol, atol=atol)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_return_stats_compiles_with_one_graph_break_and_fullgraph_says_why():
    """Training under torch.compile reads aux_loss from return_stats=True: the stats (host ints) stay outside the
    graph as one break, the aux loss and its gradient equal eager's; fullgraph=True refuses it naming return_stats."""
    torch.manual_seed(4)
    moe = MoE(MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8, top_k=2, aux_loss_coef=0.01,
                        z_loss_coef=0.001), capacity_factor=1.0)
    x = torch.randn(2, 6, 16)
    eager = moe(x, return_stats=True)
    (want,) = torch.autograd.grad(eager.aux_loss, [moe.gate.weight])
    torch._dynamo.reset()
    explained = torch._dynamo.explain(moe)(x, return_stats=True)
    assert explained.graph_break_count == 1 and "return_stats" in explained.break_reasons[0].reason
    torch._dynamo.reset()
    got = torch.compile(moe, backend="aot_eager")(x, return_stats=True)
    torch.testing.assert_close(got.aux_loss, eager.aux_loss)
    torch.testing.assert_close(torch.autograd.grad(got.aux_loss, [moe.gate.weight])[0], want)
    assert got.stats.dropped == eager.stats.dropped > 0 and torch.equal(got.stats.counts, eager.stats.counts)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"return_stats=True\) reads its MoEStats on the host"):
        torch.compile(moe, fullgraph=True, backend="aot_eager")(x, return_stats=True)
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_layer_under_bf16_autocast_takes_a_bf16_input(backend):
    """Mixed precision: a float32 layer after an autocast op gets a bf16 x. Its experts run in bf16 on the float32
    weights cast as autocast casts a matmul's (it refused the pair); out and the float32 weights' gradients against a
    float64 loop over the bf16-rounded x and weights, routed by the bf16 gate as autocast runs it."""
    torch.manual_seed(5)
    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, top_k=2), backend=backend)
    x = torch.randn(6, 32).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = moe(x, return_stats=True)
    assert res.out.dtype == torch.bfloat16 and res.router_logits.dtype == torch.bfloat16
    weights, ids = torch.topk(torch.softmax(res.router_logits.detach().double(), -1), 2)  # the layer's own routing
    w13, w2 = (w.detach().bfloat16().double().requires_grad_() for w in (moe.w13, moe.w2))
    want = experts_loop(x, w13, w2, ids, weights / weights.sum(-1, keepdim=True))
    assert (res.out.double() - want).norm() / want.norm() < 1e-2
    res.out.float().square().sum().backward()
    want.square().sum().backward()
    for param, ref in ((moe.w13, w13), (moe.w2, w2)):
        assert param.grad.dtype == torch.float32 and (param.grad - ref.grad).norm() / ref.grad.norm() < 1.5e-2


def test_dropless_routing_allocates_no_drop_count_and_never_shares_one():
    moe = MoE(MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2))
    with torch.no_grad():
        routed = moe.route_tokens(torch.randn(3, 8))
    assert routed.dropped_count is None
    first = routed.dropped
    first.add_(5)  # a caller's mutation stays in its own tensor
    assert int(routed.dropped) == 0 and routed.dropped.dtype == torch.int64
    capped = MoE(moe.config, capacity_factor=0.5)
    with torch.no_grad():
        assert int(capped.route_tokens(torch.randn(8, 8)).dropped) > 0


def test_forward_rechecks_expert_args_when_weights_or_x_change(monkeypatch):
    """Later forwards skip check_experts_args only while the weights, their shapes and x's dtype and device
    are those of a call that passed it: each change below must still raise, naming the argument."""
    import moekit.experts as experts

    calls = []
    real_check = experts.check_experts_args
    monkeypatch.setattr(experts, "check_experts_args", lambda *a, **kw: calls.append(1) or real_check(*a, **kw))
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2)
    moe = MoE(cfg, backend="grouped_mm")
    x = torch.randn(3, 8)
    with torch.no_grad():  # bit-equal outputs: the same (autograd-free) path on every call
        _recheck_steps(moe, x, calls)


def _recheck_steps(moe, x, calls):
    first = moe(x)
    assert torch.equal(moe(x), first) and len(calls) == 1  # the second call skips the check: same output
    torch.testing.assert_close(first, moe_per_token(moe, x).float(), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="share a dtype"):
        moe(x.double())  # the gate casts x to its dtype; the experts get float64 x against float32 weights
    good = moe.w2
    moe.w2 = torch.nn.Parameter(torch.randn(4, 8, 5))  # N=5 against w13's 2N=8
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe(x)
    moe.w2 = good
    assert torch.equal(moe(x), first)
    good.data = torch.randn(4, 8, 3)  # same Parameter object, another shape
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe(x)


def test_forward_rechecks_a_replaced_expert_bias():
    cfg = MoEConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4, top_k=2, expert_bias=True)
    moe = MoE(cfg, backend="grouped_mm")
    x = torch.randn(3, 8)
    with torch.no_grad():
        moe(x)
        moe.b2 = torch.nn.Parameter(torch.zeros(4, 8, dtype=torch.float64))
        with pytest.raises(TypeError, match="b2 must have x's dtype"):
            moe(x)
        moe.b2 = torch.nn.Parameter(torch.zeros(4, 7))
        with pytest.raises(ValueError, match="b2 must have shape"):
            moe(x)


def test_repr_says_dtype_quantization_and_the_backend_auto_runs():
    """``print(moe)`` after ``quantize_`` is how a user checks it took: the repr names the experts' dtype and
    scheme and what "auto" resolved to (it showed neither)."""
    cfg = MoEConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, top_k=2)
    moe = MoE(cfg, dtype=torch.bfloat16)
    text = repr(moe)
    assert "dtype=bfloat16, quant=None" in text and f"backend=auto ({moe.resolved_backend()})," in text
    moe.quantize_("int8_w8a16")
    assert "dtype=bfloat16, quant=int8_w8a16" in repr(moe)
    shared = MoE(cfg.replace(shared_expert_intermediate_size=32), backend="reference", fuse_shared=False)
    assert "shared=32 (separate), dtype=float32, quant=None, backend=reference, router" in repr(shared)

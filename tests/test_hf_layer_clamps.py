"""Per-layer SwiGLU clamps (Step-3.7, Bailing-Hybrid): each MoE layer served with its own limit, clamped after the
activation, against the transformers model built offline (random weights, two MoE layers with different limits)."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402  (registers "moekit")
from moekit import MoE, MoEConfig  # noqa: E402
from moekit.activations import ActivationSpec, apply_glu  # noqa: E402
from moekit.hf.variants import build_plan  # noqa: E402

LIMITS, SHARED_LIMITS = [3.0, 5.0], [2.0, 0.0]  # layer 1's shared MLP unclamped (0 means none)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _step_model() -> torch.nn.Module:
    cfg = transformers.Step3p7TextConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, share_expert_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        vocab_size=97, sliding_window=8, layer_types=["full_attention"] * 2, mlp_layer_types=["sparse", "sparse"],
        swiglu_limits=LIMITS, swiglu_limits_shared=SHARED_LIMITS)
    torch.manual_seed(0)
    model = transformers.Step3p7TextModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        for layer in model.layers:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
            layer.post_attention_layernorm.weight.fill_(30.0)  # the MLPs' inputs ~30x: past every clamp
    return model


def _bailing_block(layer: int) -> torch.nn.Module:
    cfg = transformers.BailingHybridConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, num_shared_experts=1, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=97, layer_types=["full_attention"] * 2, mlp_layer_types=["sparse"] * 2,
        expert_swiglu_limit_list=LIMITS, share_expert_swiglu_limit_list=SHARED_LIMITS)
    torch.manual_seed(1)
    block = transformers.models.bailing_hybrid.modeling_bailing_hybrid.BailingHybridMoE(cfg, layer).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block


def _glu_loop(h: torch.Tensor, limit: float | None) -> torch.Tensor:
    """The float64 definition, written apart from moekit: min(silu(gate), L) * clamp(up, -L, L)."""
    gate, up = h.double().chunk(2, dim=-1)
    act = F.silu(gate)
    if limit is None:
        return act * up
    return torch.minimum(act, torch.tensor(limit, dtype=torch.float64)) * up.clamp(-limit, limit)


def test_the_spec_clamps_after_the_activation():
    h = torch.randn(64, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 30
    after = ActivationSpec("silu", limit=3.0, limit_after_act=True)
    assert torch.equal(apply_glu(h, after), _glu_loop(h, 3.0))
    assert rel_l2(apply_glu(h, ActivationSpec("silu", limit=3.0)), _glu_loop(h, 3.0)) > 1e-3  # a different function
    with pytest.raises(ValueError, match="limit_after_act needs a limit"):
        ActivationSpec("silu", limit_after_act=True)


def test_the_config_reads_each_layers_clamp_and_refuses_without_a_layer():
    cfg = _step_model().config
    with pytest.raises(ValueError, match=r"differ .*pass layer=i"):
        MoEConfig.from_hf_config(cfg)
    for i in range(2):
        config = MoEConfig.from_hf_config(cfg, layer=i)
        assert config == MoEConfig.from_hf_config(cfg.to_dict(), layer=i)
        assert config.activation == ActivationSpec("silu", limit=LIMITS[i], limit_after_act=True)
        shared = ActivationSpec("silu", limit=SHARED_LIMITS[i], limit_after_act=True) if SHARED_LIMITS[i] else "silu"
        assert config.shared_mlp_activation == shared
    same = cfg.to_dict() | {"swiglu_limits": [4.0, 4.0], "swiglu_limits_shared": [0, 0]}
    assert MoEConfig.from_hf_config(same).activation == ActivationSpec("silu", limit=4.0, limit_after_act=True)
    assert MoEConfig.from_hf_config(cfg, layer="typical").activation.limit == LIMITS[0]  # a tie: the earliest layer
    three = cfg.to_dict() | {"num_hidden_layers": 3, "mlp_layer_types": ["sparse"] * 3, "swiglu_limits": [3, 5, 5],
                             "swiglu_limits_shared": [0, 0, 0]}
    assert MoEConfig.from_hf_config(three, layer="typical").activation.limit == 5.0  # what most MoE layers clamp at
    for layer, err in ((2, ValueError), (-1, ValueError), (True, TypeError), ("most", TypeError)):
        with pytest.raises(err, match="layer"):
            MoEConfig.from_hf_config(cfg, layer=layer)
    dense = cfg.to_dict() | {"mlp_layer_types": ["dense", "sparse"]}
    with pytest.raises(ValueError, match="layer 0 is a 'dense'"):
        MoEConfig.from_hf_config(dense, layer=0)
    assert MoEConfig.from_hf_config(dense).activation.limit == LIMITS[1]  # only the MoE layers must agree


def _block_reference(block, x: torch.Tensor, limit, shared_limit) -> torch.Tensor:
    """The Step-3.7 block in float64, a per-token loop: sigmoid scores (+ bias for the choice), top-k, renormalised."""
    x = x.double().reshape(-1, x.shape[-1])
    logits = x @ block.gate.weight.double().t()
    scores = logits.sigmoid()
    choice = (scores + block.gate.e_score_correction_bias.double()).topk(2, dim=-1).indices
    w13, w2 = block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    mlp = block.shared_experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        weights = scores[t, choice[t]] / scores[t, choice[t]].sum()
        for e, w in zip(choice[t].tolist(), weights):
            out[t] += w * block.routed_scaling_factor * (w2[e] @ _glu_loop(w13[e] @ x[t], limit))
        h = torch.cat([mlp.gate_proj.weight.double() @ x[t], mlp.up_proj.weight.double() @ x[t]])
        out[t] += mlp.down_proj.weight.double() @ _glu_loop(h, shared_limit)
    return out


def test_each_step_block_becomes_a_layer_with_its_own_clamp():
    """moe_from_hf on layer i: layer i's limit (experts and shared MLP) from the block's modules; the layer equals
    the transformers block and a float64 loop at x * 30; the config read with layer=i builds the same layer."""
    model = _step_model()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2)) * 30
    for i, layer in enumerate(model.layers):
        block = layer.mlp
        assert build_plan(block.experts).activation == ActivationSpec("silu", limit=LIMITS[i], limit_after_act=True)
        moe = moekit_hf.moe_from_hf(block)
        read = MoEConfig.from_hf_config(model.config, layer=i)
        assert moe.config == read.replace(num_moe_layers=moe.config.num_moe_layers)
        assert moe.resolved_backend() == "grouped_mm"
        with torch.no_grad():
            want = block(x)
            assert rel_l2(moe(x), want) < 1e-5
            assert rel_l2(want.reshape(-1, 32), _block_reference(block, x, LIMITS[i], SHARED_LIMITS[i] or None)) < 1e-5
            other = MoE(moe.config.replace(activation=ActivationSpec("silu", limit=LIMITS[1 - i],
                                                                       limit_after_act=True)), backend="reference")
            other.load_state_dict(moe.state_dict())
            assert rel_l2(other(x), want) > 1e-3  # the other layer's clamp: the test can fail


def test_an_infinite_limit_is_no_clamp():
    """transformers 5.17's Step-3.7 holds ``limit = float("inf")`` on its unclamped layers' experts and shared MLP
    (``Step3p7Experts(config, swiglu_limit=None)``; the MLP's ``0 or float("inf")``) and clamps with it: a no-op.
    moekit refused the infinite limit, so ``use_moekit_blocks`` left those blocks on transformers' own loop (session
    50: Step-3.7's compiled decode through moekit_blocks slower than its eager one). Read as no clamp: the plan and
    the layer unclamped, every block swapped, each equal to the float64 loop without a clamp, not to the clamped one."""
    model = _step_model()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5)) * 30
    for layer in model.layers:
        layer.mlp.experts.limit = layer.mlp.shared_experts.limit = float("inf")  # as 5.17 builds an unclamped layer
    for i, layer in enumerate(model.layers):
        block = layer.mlp
        assert build_plan(block.experts).activation == "silu"
        moe = moekit_hf.moe_from_hf(block)
        assert moe.config.activation == "silu" and moe.config.shared_activation in (None, "silu")
        with torch.no_grad():
            want = _block_reference(block, x, None, None)
            assert rel_l2(moe(x).reshape(-1, 32), want) < 1e-5
            assert rel_l2(block(x).reshape(-1, 32), want) < 1e-5
            assert rel_l2(_block_reference(block, x, LIMITS[i], None), want) > 1e-3  # the clamp bites at x * 30
    report = moekit_hf.use_moekit_blocks(model)
    assert len(report.swapped) == 2 and report.left == ()


def eager_and_moekit(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last hidden state with transformers' "eager" experts, then with "moekit"'s; the model left on "moekit")."""
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = model(ids).last_hidden_state
        model.set_experts_implementation("moekit")
        return want, model(ids).last_hidden_state


def test_the_whole_model_through_moekit_blocks_and_the_experts_implementation():
    model = _step_model()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    want, got = eager_and_moekit(model, ids)
    assert rel_l2(got, want) < 1e-5
    with torch.no_grad():
        plans = [layer.mlp.experts._moekit_plan for layer in model.layers]
        assert [p.activation.limit for p in plans] == LIMITS and all(p.fused for p in plans)
        report = moekit_hf.use_moekit_blocks(model)
        assert len(report.swapped) == 2
        assert rel_l2(model(ids).last_hidden_state, want) < 1e-5


def test_bailing_hybrid_blocks_take_their_own_clamp():
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(4)) * 30
    for i in range(2):
        block = _bailing_block(i)
        moe = moekit_hf.moe_from_hf(block)
        assert moe.config.activation == ActivationSpec("silu", limit=LIMITS[i], limit_after_act=True)
        with torch.no_grad():
            assert rel_l2(moe(x), block(x)) < 1e-5


def test_compiled_on_the_cpu_equals_eager():
    """Under torch.compile such a layer runs the CPU op (``moekit::cpu_experts``, whose schema carries
    limit_after_act since session 48) and computes what it computes eagerly."""
    config = MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2,
                       activation=ActivationSpec("silu", limit=1.0, limit_after_act=True))
    torch.manual_seed(0)
    moe = MoE(config).eval()
    x = torch.randn(5, 16) * 30
    with torch.no_grad():
        assert rel_l2(torch.compile(moe)(x), moe(x)) < 1e-5

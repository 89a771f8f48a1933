"""transformers' fine-grained fp8 experts (``FineGrainedFP8Config``), built offline on the CPU: a tiny
Qwen3-MoE whose experts module transformers swaps for its ``FP8Experts``, filled with transformers' own
fp8 quantizer, read by ``moekit.quant.hf.fp8_experts_weights`` without a copy, and run through moekit's
fp8 recipe against transformers' eager experts on the original weights."""

from __future__ import annotations

import types

import pytest
import torch
from _quant_refs import rel_l2

import moekit.quant as Q

transformers = pytest.importorskip("transformers")
fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
from moekit.quant.hf import fp8_experts_weights, quantized_experts_weights  # noqa: E402


def _fp8_qwen3_moe():
    """(the MoE block, the original float experts' weights): transformers' FP8Experts holding transformers'
    own quantization of them (it quantizes only block-divisible shapes: K, N multiples of 128)."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    block = model.model.layers[0].mlp
    original = {name: p.detach().clone() for name, p in block.experts.named_parameters()}
    qc = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    fp8.replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=qc)
    experts = block.experts.to_empty(device="cpu")
    quantizer = fp8.Fp8Quantize(types.SimpleNamespace(quantization_config=qc))
    for name in ("gate_up_proj", "down_proj"):
        for key, value in quantizer.convert({name: original[name]}).items():
            getattr(experts, key).data.copy_(value)
    assert all(getattr(experts, n).dtype == torch.float8_e4m3fn for n in ("gate_up_proj", "down_proj"))
    return block, original


def test_fp8_experts_are_read_as_they_are():
    block, original = _fp8_qwen3_moe()
    experts = block.experts
    assert type(experts).__name__ == "FP8Experts"
    w13, w2 = fp8_experts_weights(experts)
    assert quantized_experts_weights(experts)[1].scale.data_ptr() == experts.down_proj_scale_inv.data_ptr()
    assert w13.scheme == w2.scheme == "fp8_block" and w13.block_shape == (128, 128)
    assert w13.shape == (4, 512, 256) and w2.shape == (4, 256, 256) and w2.scale.shape == (4, 2, 2)
    assert w13.q.data_ptr() == experts.gate_up_proj.data_ptr()  # not requantized, not copied
    assert torch.equal(w2.scale, experts.down_proj_scale_inv)
    for got, name in ((w13, "gate_up_proj"), (w2, "down_proj")):
        assert rel_l2(got.dequantize(), original[name]) < 0.03  # the fp8 rounding only
        ours = Q.quantize(original[name], "fp8_block")
        assert rel_l2(ours.dequantize(), got.dequantize()) < 1e-3  # moekit's quantizer agrees with transformers'


def test_fp8_experts_run_moekit_recipe_close_to_the_float_experts():
    block, original = _fp8_qwen3_moe()
    w13, w2 = fp8_experts_weights(block.experts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 256, generator=gen)
    ids = torch.randint(0, 4, (16, 2), generator=gen)
    weights = torch.rand(16, 2, generator=gen)
    float_experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(block.experts.config)
    float_experts.load_state_dict(original)
    float_experts.config._experts_implementation = "eager"
    with torch.no_grad():
        expected = float_experts(x, ids, weights)
    got = Q.experts_fp8_block_reference(x, w13, w2, ids, weights)
    print(f"FP8Experts through moekit fp8_block vs float experts: rel L2 {rel_l2(got, expected):.4%}")
    assert rel_l2(got, expected) < 0.09  # fp8 w8a8 error, not a layout mistake (that would be ~100%)


def test_non_fp8_experts_are_refused():
    with pytest.raises(TypeError, match="FP8Experts"):
        fp8_experts_weights(torch.nn.Linear(2, 2))
    float_block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(
        transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=2))
    assert quantized_experts_weights(float_block) is None


def triton_fp8_block(monkeypatch, tokens: int, seed: int):
    """(the fp8 MoE block with its experts through "moekit" on the triton backend, x [1, tokens, 256])."""
    import moekit.experts
    import moekit.hf as moekit_hf

    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "triton")
    monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
    block, _ = _fp8_qwen3_moe()
    block.experts.config._experts_implementation = "moekit"
    return block, torch.randn(1, tokens, 256, generator=torch.Generator().manual_seed(seed))


def test_moekit_runs_transformers_fp8_experts_as_they_are():
    """set_experts_implementation("moekit") on FineGrainedFP8Config's FP8Experts: moekit's fp8 recipe on
    the module's own e4m3 tensors (not dequantized, not requantized), and moe_from_hf keeps them fp8."""
    import moekit.hf  # noqa: F401  (registers "moekit" in both experts interfaces)
    from moekit.hf import moe_from_hf

    block, original = _fp8_qwen3_moe()
    experts = block.experts
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(12, 256, generator=gen)
    ids = torch.randint(0, 4, (12, 2), generator=gen)
    weights = torch.rand(12, 2, generator=gen)
    experts.config._experts_implementation = "moekit"
    with torch.no_grad():
        got = experts(x, ids, weights)
    w13, w2 = fp8_experts_weights(experts)
    assert rel_l2(got, Q.experts_fp8_block_reference(x, w13, w2, ids, weights)) < 1e-6
    moe = moe_from_hf(block, backend="reference")
    assert moe.quant_scheme == "fp8_block" and moe.w13.q.data_ptr() == experts.gate_up_proj.data_ptr()
    with torch.no_grad():  # transformers' router, then the fp8 experts through "moekit" (its own fp8 path needs
        block_out = block(x[None])  # the `kernels` package, absent on a CPU machine)
        block_out = block_out[0] if isinstance(block_out, tuple) else block_out
        assert rel_l2(moe(x[None]), block_out) < 1e-5


def test_moekit_fp8_experts_compile_fullgraph(monkeypatch):
    """FP8Experts through "moekit" trace whole under torch.compile(fullgraph=True) on the triton backend (the
    GPU's path, interpreted here: conftest) and equal their eager selves: a traced call wraps the module's fp8
    tensors anew instead of comparing their data pointers with the cached wrap's (which broke the graph in
    every layer)."""
    pytest.importorskip("triton")
    block, x = triton_fp8_block(monkeypatch, tokens=5, seed=4)
    with torch.no_grad():
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(x)
    eager, compiled = (out[0] if isinstance(out, tuple) else out for out in (eager, compiled))
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)

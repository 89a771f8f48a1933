"""transformers parity, offline: tiny models built from configs with random weights (no hub)."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.hf as moekit_hf  # noqa: E402  (registers the "moekit" experts implementation)
from moekit import MoEConfig  # noqa: E402


def qwen3(norm_topk_prob):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(cfg)


def deepseek_v3():
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1,
        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers[1:]:  # a nonzero bias, and a router sharp enough for the bias to matter
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
            layer.mlp.gate.weight.normal_(0, 0.3, generator=g)
    return model


def qwen2():
    cfg = transformers.Qwen2MoeConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2,
    )
    return transformers.Qwen2MoeForCausalLM(cfg)


MODELS = {
    "qwen3-norm": (lambda: qwen3(True), 0),
    "qwen3-no-norm": (lambda: qwen3(False), 0),
    "mixtral": (mixtral, 0),
    "deepseek-v3": (deepseek_v3, 1),
    "qwen2-moe": (qwen2, 0),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fuse_shared", [False, True])
def test_moe_from_hf_equals_block(name, fuse_shared):
    torch.manual_seed(0)
    build, layer = MODELS[name]
    model = build().eval()
    block = model.model.layers[layer].mlp
    moe = moekit_hf.moe_from_hf(block, fuse_shared=fuse_shared)
    x = torch.randn(3, 5, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), block(x), rtol=1e-5, atol=1e-6)
    if not fuse_shared:  # routed weights are shared, not copied
        assert moe.w13 is block.experts.gate_up_proj and moe.gate.weight is block.gate.weight


@pytest.mark.parametrize("name", list(MODELS))
def test_whole_model_logits_with_moekit_experts(name, monkeypatch):
    torch.manual_seed(1)
    model = MODELS[name][0]().eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        eager = model(ids).logits
        calls = []
        original = moekit_hf.call_backend
        monkeypatch.setattr(moekit_hf, "call_backend", lambda *a, **k: calls.append(1) or original(*a, **k))
        model.set_experts_implementation("moekit")
        ours = model(ids).logits
    assert calls, "the moekit implementation was not called"
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)


def _qwen3_on_triton(monkeypatch, seed: int):
    """``qwen3(True)`` (eval, weights drawn after ``torch.manual_seed(seed)``) on the "moekit" experts with
    ``HF_BACKEND`` "triton" and the resolved backends emptied, so its first forward resolves the backend (skipped
    without Triton)."""
    pytest.importorskip("triton")
    import moekit.experts

    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "triton")
    monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
    torch.manual_seed(seed)
    model = qwen3(True).eval()
    model.set_experts_implementation("moekit")
    return model


def test_moekit_experts_compile_fullgraph(monkeypatch):
    """A transformers block on the "moekit" experts traces whole under torch.compile(fullgraph=True):
    the backend is resolved (imports and all) on the first eager call, and the compiled call only
    meets the cache. The triton backend runs here under TRITON_INTERPRET=1 (conftest)."""
    import moekit.experts

    model = _qwen3_on_triton(monkeypatch, seed=2)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.no_grad():
        eager = block(x)
        assert ("triton", "cpu") in moekit.experts._RESOLVED
        compiled = torch.compile(block, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_a_bad_hf_backend_names_the_setting(monkeypatch):
    """HF_BACKEND is a module setting, read at the first forward: its error names it (it said only "backend")."""
    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "trition")
    model = qwen3(True).eval()
    model.set_experts_implementation("moekit")
    with torch.no_grad(), pytest.raises(ValueError, match="moekit.hf.HF_BACKEND = 'trition': backend must be one of"):
        model(torch.randint(0, 97, (1, 4)))


def test_compiled_triton_experts_trace_only_the_op(monkeypatch):
    """Under torch.compile the "moekit" experts on the triton backend trace its custom op and nothing of the
    backend's eager path (a traced branch is Python dynamo guards on every compiled call): with that path
    made to fail, a whole model still compiles fullgraph, calls ``moekit::triton_experts_infer`` (no_grad: the
    inference twin of ``moekit::triton_experts``) once per layer and
    equals its eager self bit for bit (the same kernels; eager folds the k-sum into the down GEMM in the same
    order). A misfit shape or dtype still raises the argument check's error while tracing."""
    model = _qwen3_on_triton(monkeypatch, seed=5)
    import moekit.experts.triton as triton_experts

    ids = torch.randint(0, 97, (1, 4))
    ops = []

    def recorder(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def eager_only(*args, **kwargs):
        raise AssertionError("the eager path was traced")

    with torch.no_grad():
        eager = model(ids).logits
        for name in ("run_fast", "_unchecked"):
            monkeypatch.setattr(triton_experts, name, eager_only)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=recorder)(ids).logits
        assert ops.count("moekit.triton_experts_infer") == model.config.num_hidden_layers
        assert not any("moekit.triton_experts." in op or op == "moekit.triton_experts" for op in ops)
        assert torch.equal(compiled, eager)
        experts = model.model.layers[0].mlp.experts
        x = torch.randn(3, model.config.hidden_size)
        # dynamo reports the raise it traced as its Unsupported error, quoting the message
        with pytest.raises(Exception, match="topk_weights must have the shape of topk_ids"):
            torch._dynamo.reset()
            torch.compile(experts, fullgraph=True, backend="eager")(x, torch.zeros(3, 3, dtype=torch.long),
                                                                    torch.ones(3, 2))
        with pytest.raises(Exception, match="must share a dtype"):  # e.g. bf16 activations on fp32 weights
            torch._dynamo.reset()
            torch.compile(experts, fullgraph=True, backend="eager")(x.bfloat16(), torch.zeros(3, 2, dtype=torch.long),
                                                                    torch.ones(3, 2))


def test_from_hf_config_reads_objects_and_dicts():
    v3 = MoEConfig.from_hf_config(transformers.DeepseekV3Config())
    assert (v3.num_experts, v3.top_k, v3.n_group, v3.topk_group, v3.scoring) == (256, 8, 8, 4, "sigmoid")
    assert v3.use_correction_bias and v3.routed_scaling_factor == 2.5 and v3.num_shared_slots == 1
    assert MoEConfig.from_hf_config(transformers.DeepseekV3Config().to_dict()) == v3
    q2 = MoEConfig.from_hf_config(transformers.Qwen2MoeConfig())
    assert q2.shared_expert_gate and q2.shared_expert_intermediate_size == 5632 and q2.num_shared_slots == 4
    mx = MoEConfig.from_hf_config(transformers.MixtralConfig())
    assert (mx.num_experts, mx.top_k, mx.moe_intermediate_size, mx.renormalize) == (8, 2, 14336, True)
    v2 = MoEConfig.from_hf_config(transformers.DeepseekV2Config(num_experts_per_tok=6))
    assert v2.scoring == "softmax" and v2.n_group == 1 and not v2.use_correction_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_moekit_experts_compile_fullgraph_cpu_default(dtype):
    """A whole Qwen3-MoE model on the "moekit" experts with the CPU default backend (grouped_mm)
    compiles with fullgraph in every dtype and equals its eager self."""
    assert moekit_hf.HF_BACKEND == "auto"
    torch.manual_seed(4)
    model = qwen3(True).to(dtype).eval()
    model.set_experts_implementation("moekit")
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        eager = model(ids).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(compiled, eager, rtol=tol, atol=tol)


def test_bench_hf_runs_gpt_oss_width_model(tmp_path):
    """``moekit bench --hf --hf-model gpt-oss-20b`` (tiny widths on the CPU): the fused clamped-SwiGLU path
    with biases runs eager and compiled, and its logits equal eager's."""
    import json

    from moekit.cli import main

    argv = ["bench", "--hf", "--tiny", "--device", "cpu", "--hf-model", "gpt-oss-20b", "--hf-impls", "moekit",
            "--layers", "1", "--decode-tokens", "2", "--out", str(tmp_path)]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu-hf-*.json")
    rows = {(r["impl"], r["mode"]): r for r in json.loads(path.read_text())["rows"]}
    for mode in ("eager", "compiled"):
        assert rows[("moekit", mode)]["logits_rel_err_vs_eager"] < 1e-5, rows[("moekit", mode)]["errors"]


def test_compiled_cpu_model_runs_the_moekit_cpu_loop():
    """Without gradients the compiled CPU model calls ``moekit::cpu_experts`` once per MoE layer (the eager
    packed loop, opaque; no grouped GEMM traced): a whole forward and static-cache generate, both fullgraph,
    give transformers' own eager experts' logits and greedy tokens."""
    from transformers import CompileConfig

    def recorder(ops: list):  # a function: generate deep-copies its config, and a copied function is itself
        def backend(gm, example_inputs, **options):  # generate passes its CompileConfig's mode
            ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward
        return backend

    torch.manual_seed(8)
    model = qwen3(True).eval()
    ids = torch.randint(0, 97, (1, 6))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = model(ids).logits
        want_tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, disable_compile=True)
        model.set_experts_implementation("moekit")
        eager = model(ids).logits
        torch._dynamo.reset()
        forward, steps = [], []
        got = torch.compile(model, fullgraph=True, backend=recorder(forward))(ids).logits
        torch._dynamo.reset()
        config = CompileConfig(fullgraph=True, backend=recorder(steps))
        config._compile_all_devices = True  # generate compiles only on accelerators unless asked (its own tests do)
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static",
                                compile_config=config)
    for ops in (forward, steps):
        assert sum("moekit.cpu_experts" in op for op in ops) == model.config.num_hidden_layers
        assert not any("group_gemm" in op for op in ops)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
    assert torch.equal(tokens, want_tokens)

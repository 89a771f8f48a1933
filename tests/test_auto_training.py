"""``backend="auto"`` by what a call does (``moekit.experts.auto_train``): a call that records gradients trains on the
backend its kind's training rule names, every other call stays on the inference pick.

On the CPU "auto" is grouped_mm for every call; these tests give it CUDA's order (the triton backend first, run by
Triton's interpreter here) so that it resolves to the dispatcher, and state the rules themselves. Which backend ran is
seen through the backend registry the dispatcher resolves from (``auto_train.get_backend``), mocked to record each
call's backend name, and through the results: gradients and outputs bit-equal to those of the backend named."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

import moekit.experts  # noqa: E402
import moekit.experts.auto_train as auto_train  # noqa: E402
from moekit.activations import ActivationSpec  # noqa: E402
from moekit.config import MoEConfig  # noqa: E402
from moekit.experts.auto_train import TrainingRule  # noqa: E402
from moekit.layer import MoE  # noqa: E402

CONFIG = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2)
GPT_OSS = MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, expert_bias=True,
                    activation=ActivationSpec("silu", interleaved=True, alpha=1.702, limit=0.6, up_shift=1.0))


@pytest.fixture
def ran(monkeypatch) -> list:
    """"auto" with CUDA's preference order on the CPU, a fresh resolution, and the backend name of every call the
    dispatcher makes (the registry it resolves from, wrapped)."""
    calls = []
    real = moekit.experts.get_backend

    def recorded(name):
        fn = real(name)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not torch.compiler.is_compiling():  # a traced append: dynamo would guard the list's length
                calls.append(name)
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(moekit.experts, "_AUTO_ORDER_OTHER", ("triton", "grouped_mm", "reference"))
    monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
    monkeypatch.setattr(auto_train, "_DISPATCHERS", {})
    monkeypatch.setattr(auto_train, "get_backend", recorded)
    return calls


def rules(monkeypatch, *table: TrainingRule) -> None:
    monkeypatch.setattr(auto_train, "TRAINING_RULES", tuple(table))


def layers(config: MoEConfig, *backends: str, seed: int = 0) -> dict:
    """backend -> a MoE of ``config`` on it, all with the same weights."""
    torch.manual_seed(seed)
    first = MoE(config, backend=backends[0])
    out = {backends[0]: first}
    for name in backends[1:]:
        out[name] = MoE(config, backend=name)
        out[name].load_state_dict(first.state_dict())
    return out


def train_step(layer: MoE, x: torch.Tensor, run=None) -> tuple:
    """out and the gradients of x and every parameter of ``layer`` after (out * dout).sum().backward(), out from
    ``run`` (default: ``layer``; a compiled layer)."""
    layer.zero_grad()
    x = x.detach().requires_grad_()
    out = (layer if run is None else run)(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


def assert_same_step(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys() and len(a[2]) >= 3
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


def test_a_training_call_takes_its_rule_and_inference_stays(ran, monkeypatch):
    rules(monkeypatch, TrainingRule("plain", "grouped_mm"))
    m = layers(CONFIG, "auto", "grouped_mm", "triton")
    x = torch.randn(10, 32)
    got = train_step(m["auto"], x)
    assert ran == ["grouped_mm"]
    assert_same_step(got, train_step(m["grouped_mm"], x))
    assert not torch.equal(got[1], train_step(m["triton"], x)[1])  # the two backends' gradients tell apart here
    ran.clear()
    with torch.no_grad():
        out = m["auto"](x)
    assert ran == ["triton"]
    assert torch.equal(out, m["triton"](x))


def test_grad_mode_with_nothing_to_differentiate_is_inference(ran, monkeypatch):
    """Grad mode on but no tensor requires grad (frozen layer, plain x): triton; x alone requiring grad: training."""
    rules(monkeypatch, TrainingRule("plain", "grouped_mm"))
    layer = layers(CONFIG, "auto")["auto"].requires_grad_(False)
    x = torch.randn(6, 32)
    layer(x)
    assert ran == ["triton"]
    layer(x.requires_grad_())
    assert ran == ["triton", "grouped_mm"]


def test_rules_by_kind_tokens_and_width(ran, monkeypatch):
    """A rule applies to its kind only (gpt-oss's biases and clamped SwiGLU are a variant), from its token count on,
    up to its expert width; the last rule that matches wins."""
    rules(monkeypatch, TrainingRule("variant", "grouped_mm"), TrainingRule("plain", "grouped_mm", from_tokens=16),
          TrainingRule("plain", "triton", from_tokens=32, max_width=16))
    plain = layers(CONFIG, "auto")["auto"]  # N = 16
    wide = layers(MoEConfig(hidden_size=32, moe_intermediate_size=24, num_experts=4, top_k=2), "auto")["auto"]
    variant = layers(GPT_OSS, "auto")["auto"]
    for layer, m, want in ((plain, 8, "triton"), (plain, 16, "grouped_mm"), (plain, 40, "triton"),
                           (wide, 16, "grouped_mm"), (wide, 40, "grouped_mm"), (variant, 8, "grouped_mm"),
                           (variant, 40, "grouped_mm")):
        ran.clear()
        train_step(layer, torch.randn(m, 32))
        assert ran == [want], (layer.config.moe_intermediate_size, layer.config.expert_bias, m)


def test_a_variant_trains_as_its_rule_says_with_that_backends_gradients(ran, monkeypatch):
    """gpt-oss's layer (router bias too) on each rule: gradients bit-equal to the named backend's own layer."""
    x = torch.randn(12, 32) * 4  # the clamp bites
    for backend in ("grouped_mm", "triton"):
        rules(monkeypatch, TrainingRule("variant", backend))
        monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
        m = layers(GPT_OSS, "auto", backend, seed=3)
        ran.clear()
        got = train_step(m["auto"], x)
        assert ran == [backend]
        assert_same_step(got, train_step(m[backend], x))


def test_stats_name_the_layout_of_the_backend_that_ran(ran, monkeypatch):
    rules(monkeypatch, TrainingRule("plain", "grouped_mm"))
    layer = layers(CONFIG, "auto")["auto"]
    x = torch.randn(8, 32)
    assert layer(x, return_stats=True).stats.layout == layers(CONFIG, "grouped_mm")["grouped_mm"](
        x, return_stats=True).stats.layout
    with torch.no_grad():
        assert layer(x, return_stats=True).stats.layout == "block_aligned"  # triton's


def test_backend_options_keep_auto_on_its_inference_pick(ran, monkeypatch):
    from moekit.experts.triton_launch import LaunchOptions

    rules(monkeypatch, TrainingRule("plain", "grouped_mm"))
    layer = MoE(CONFIG, backend="auto", backend_options={"options": LaunchOptions(lean_launch=False)})
    train_step(layer, torch.randn(5, 32))
    assert ran == ["triton"]


def test_the_rules_refuse_an_unknown_kind_or_count():
    with pytest.raises(ValueError, match="kind must be one of"):
        TrainingRule("fp8", "grouped_mm")
    with pytest.raises(ValueError, match="from_tokens must be an int >= 0"):
        TrainingRule("plain", "grouped_mm", from_tokens=-1)
    with pytest.raises(ValueError, match="max_width must be an int >= 1 or None"):
        TrainingRule("plain", "grouped_mm", max_width=0)


def test_no_rule_off_the_inference_pick_resolves_to_it(ran, monkeypatch):
    """Rules that name only the inference pick leave "auto" the plain triton function (nothing in front of it)."""
    rules(monkeypatch, TrainingRule("plain", "triton"))
    fn = moekit.experts.backend_fn("auto", "cpu")
    assert auto_train.auto_choice_of(fn) is None and fn.__wrapped__ is moekit.experts.get_backend("triton")


@pytest.mark.parametrize("train_on", ["grouped_mm", "triton"])
def test_compiled_training_steps_do_not_recompile(ran, monkeypatch, train_on):
    """A compiled layer's training steps with "auto": traced once (grad mode and requires_grad are guarded as
    before), into a graph with the triton op only where the rule names triton; each step's gradients those of the
    eager layer on the rule's backend."""
    torch._dynamo.reset()
    rules(monkeypatch, TrainingRule("plain", train_on))
    m = layers(CONFIG, "auto", train_on, seed=4)
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled = torch.compile(m["auto"], fullgraph=True, backend=recorder)
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        got = train_step(m["auto"], x, compiled)
        want = train_step(m[train_on], x)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1
    assert any("triton_experts" in op for op in graphs[0]) == (train_on == "triton")


def test_hf_experts_train_and_compile_by_the_rule(ran, monkeypatch):
    """transformers' Qwen3-MoE on the "moekit" experts with HF_BACKEND "auto": a training step runs grouped_mm (the
    rule), gradients equal to HF_BACKEND "grouped_mm"'s; compiled, the training steps trace once without the triton
    op and a no-grad call traces the triton inference op."""
    transformers = pytest.importorskip("transformers")
    import moekit.hf as moekit_hf  # its import resolves HF_BACKEND: the rules below are built anew

    rules(monkeypatch, TrainingRule("plain", "grouped_mm"))
    monkeypatch.setattr(moekit.experts, "_RESOLVED", {})
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=8, num_experts_per_tok=3)
    torch.manual_seed(6)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.set_experts_implementation("moekit")
    block = model.model.layers[0].mlp
    x = torch.randn(2, 5, 32)

    def grads(run) -> dict:
        block.zero_grad()
        out = run(x)
        (out[0] if isinstance(out, tuple) else out).square().sum().backward()
        return {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}

    got = grads(block)
    assert ran == ["grouped_mm"]
    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "grouped_mm")
    want = grads(block)
    assert got.keys() == want.keys() and len(got) >= 3
    for name in got:
        assert torch.equal(got[name], want[name]), name
    monkeypatch.setattr(moekit_hf, "HF_BACKEND", "auto")
    torch._dynamo.reset()
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled = torch.compile(block, fullgraph=True, backend=recorder)
    for _ in range(3):
        compiled_grads = grads(compiled)
    assert len(graphs) == 1 and not any("triton_experts" in op for op in graphs[0])
    for name in want:
        torch.testing.assert_close(compiled_grads[name], want[name], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        compiled(x)
    assert len(graphs) == 2 and any("triton_experts_infer" in op for op in graphs[1])


def test_a_keep_rule_trains_on_the_kept_triton_path(ran, monkeypatch):
    """A plain rule with ``keep``: a training call runs ``experts_triton_kept`` (the gate-up product kept; spied),
    its gradients within float32 rounding of triton's recomputing step; the stats name triton's layout; a no-grad
    call stays on triton; keep is refused off triton's plain kind."""
    import moekit.experts.triton_backward as tb

    kept_calls, real = [], tb.experts_triton_kept
    monkeypatch.setattr(tb, "experts_triton_kept", lambda *a, **kw: (kept_calls.append(1), real(*a, **kw))[1])
    rules(monkeypatch, TrainingRule("plain", "grouped_mm"), TrainingRule("plain", "triton", from_tokens=8, keep=True))
    m = layers(CONFIG, "auto", "triton")
    x = torch.randn(9, 32)
    got, want = train_step(m["auto"], x), train_step(m["triton"], x)
    assert kept_calls == [1] and ran == []  # the kept function is not a registered backend
    assert (got[1] - want[1]).norm() <= 1e-5 * want[1].norm()
    for name in want[2]:
        assert (got[2][name] - want[2][name]).norm() <= 1e-5 * want[2][name].norm(), name
    assert m["auto"](x, return_stats=True).stats.layout == "block_aligned"  # a training call: kept again
    train_step(m["auto"], torch.randn(5, 32))  # under the keep rule's 8 tokens: grouped_mm
    assert kept_calls == [1, 1] and ran == ["grouped_mm"]
    with torch.no_grad():
        m["auto"](x)
    assert ran == ["grouped_mm", "triton"] and kept_calls == [1, 1]
    for kind, backend in (("plain", "grouped_mm"), ("variant", "triton")):
        with pytest.raises(ValueError, match="keep=True applies to backend 'triton' with kind 'plain'"):
            TrainingRule(kind, backend, keep=True)

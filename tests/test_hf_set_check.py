"""``set_experts_implementation("moekit")`` on a model transformers never dispatches to moekit warns, naming the
model class (it was accepted in silence and the model's own forward ran); on a MoE model it says nothing and moekit
serves every experts call."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is part of the test extras")

import moekit.hf as moekit_hf  # noqa: E402  (registers the "moekit" experts implementation)

IDS = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, intermediate_size=16)).eval()


def _qwen3_moe():
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                                      num_experts_per_tok=3)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _counting_calls(monkeypatch) -> list:
    """Every call moekit's backend gets through ``call_backend`` (the hf forward's one way in) is recorded."""
    calls = []
    original = moekit_hf.call_backend

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(moekit_hf, "call_backend", counted)
    return calls


@pytest.mark.parametrize("asked", ["moekit", {"": "moekit"}])
def test_a_dense_model_warns_naming_its_class(monkeypatch, asked):
    model = _llama()
    calls = _counting_calls(monkeypatch)
    with torch.no_grad():
        before = model(IDS).logits
    with pytest.warns(UserWarning, match=r"set_experts_implementation\('moekit'\): LlamaForCausalLM has no experts "
                                         r"module .*: moekit is never called"):
        model.set_experts_implementation(asked)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before)
    assert calls == []  # true: moekit was not called


def test_a_moe_model_says_nothing_and_moekit_serves_it(monkeypatch):
    model = _qwen3_moe()
    calls = _counting_calls(monkeypatch)
    with torch.no_grad():
        eager = model(IDS).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.set_experts_implementation("moekit")
        with torch.no_grad():
            got = model(IDS).logits
    assert len(calls) == 1 and calls[0] == (6, 32)  # the one MoE layer's experts, every token
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _llama().set_experts_implementation("eager")  # another implementation: none of moekit's business


def test_prepare_on_a_model_moekit_never_serves_says_so():
    """``prepare(model)`` built no plan and returned [] in silence on a dense model (session 53), where
    ``set_experts_implementation`` and ``use_moekit_blocks`` warn; on a MoE model it warns nothing."""
    with pytest.warns(UserWarning, match=r"prepare: LlamaForCausalLM has no experts module .*: no plan built"):
        assert moekit_hf.prepare(_llama()) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(moekit_hf.prepare(_qwen3_moe())) == 1


def test_wrapping_again_wraps_nothing():
    """What a second registration (a re-import) would do: the method stays the one wrapper, one warning a call."""
    from moekit.hf.set_check import wrap_set_experts_implementation

    wrapped = transformers.PreTrainedModel.set_experts_implementation
    wrap_set_experts_implementation()
    assert transformers.PreTrainedModel.set_experts_implementation is wrapped
    with pytest.warns(UserWarning) as record:
        _llama().set_experts_implementation("moekit")
    assert len(record) == 1


def test_a_model_compiled_right_after_set_experts_implementation_traces_the_fused_path(monkeypatch):
    """Session 51: the README's order, ``set_experts_implementation("moekit")`` then ``torch.compile(model,
    fullgraph=True)``, traced the composed path (the plan cannot be probed while tracing) without a word: correct but
    not fused, unless ``prepare(model)`` or an eager forward came first. set_experts_implementation now builds the
    plans (Qwen3-MoE's SiLU: fused); a model on the meta device is left to its first call (nothing to probe yet)."""
    from moekit.hf.variants import PLAN_ATTR

    model = _qwen3_moe()
    composed = []
    original = moekit_hf.run_composed
    monkeypatch.setattr(moekit_hf, "run_composed", lambda *a, **k: composed.append(1) or original(*a, **k))
    with torch.no_grad():
        eager = model(IDS).logits
    model.set_experts_implementation("moekit")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(IDS).logits
    plans = [vars(m).get(PLAN_ATTR) for m in model.modules() if moekit_hf.is_interface_experts(m)]
    assert len(plans) == 1 and plans[0] is not None and plans[0].fused and not composed  # traced the fused call
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    with torch.device("meta"):
        empty = _qwen3_moe()
    empty.set_experts_implementation("moekit")
    assert not [m for m in empty.modules() if PLAN_ATTR in vars(m)]


def test_from_pretrained_with_the_moekit_implementation_builds_the_plans_too(monkeypatch, tmp_path):
    """``from_pretrained(path, experts_implementation="moekit")`` sets the implementation without
    set_experts_implementation (transformers reads the kwarg into the config): compiled right after, it traced the
    composed path too. Loading now builds the plans (and a load with another implementation builds none)."""
    from moekit.hf.variants import PLAN_ATTR

    _qwen3_moe().save_pretrained(tmp_path)
    cls = transformers.Qwen3MoeForCausalLM
    plain = cls.from_pretrained(tmp_path, experts_implementation="eager").eval()
    assert not [m for m in plain.modules() if PLAN_ATTR in vars(m)]
    with torch.no_grad():
        eager = plain(IDS).logits
    model = cls.from_pretrained(tmp_path, experts_implementation="moekit").eval()
    composed = []
    original = moekit_hf.run_composed
    monkeypatch.setattr(moekit_hf, "run_composed", lambda *a, **k: composed.append(1) or original(*a, **k))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend="eager")(IDS).logits
    plans = [vars(m).get(PLAN_ATTR) for m in model.modules() if moekit_hf.is_interface_experts(m)]
    assert plans and all(p is not None and p.fused for p in plans) and not composed
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["config", "from_config"])
def test_a_model_built_from_a_config_naming_moekit_builds_the_plans(monkeypatch, how):
    """A config that names ``"moekit"`` itself (``Qwen3MoeConfig(experts_implementation="moekit")`` then the model
    class, or ``AutoModelForCausalLM.from_config(config, experts_implementation="moekit")``) sets the implementation
    without set_experts_implementation or from_pretrained: compiled right after, it traced the composed path unless
    ``prepare(model)`` came first. Building the model (transformers' ``post_init``) now builds the plans."""
    from moekit.hf.variants import PLAN_ATTR

    with torch.no_grad():
        eager = _qwen3_moe()(IDS).logits
    torch.manual_seed(0)
    arguments = dict(**COMMON, intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3)
    if how == "config":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**arguments,
                                                                              experts_implementation="moekit"))
    else:
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**arguments),
                                                              experts_implementation="moekit")
    assert model.get_experts_implementation()[""] == "moekit"
    composed = []
    original = moekit_hf.run_composed
    monkeypatch.setattr(moekit_hf, "run_composed", lambda *a, **k: composed.append(1) or original(*a, **k))
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model.eval(), fullgraph=True, backend="eager")(IDS).logits
    plans = [vars(m).get(PLAN_ATTR) for m in model.modules() if moekit_hf.is_interface_experts(m)]
    assert len(plans) == 1 and plans[0] is not None and plans[0].fused and not composed
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)  # the same seed: the same weights
    torch.manual_seed(0)
    plain = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**arguments))  # no plans without it
    assert not [m for m in plain.modules() if PLAN_ATTR in vars(m)]

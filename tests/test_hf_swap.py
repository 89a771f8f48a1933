"""``moekit.hf.use_moekit_blocks`` on tiny transformers models built offline (random weights): each swapped
model against its unswapped twin (logits, router logits and the aux loss, gradients), the state_dict /
save_pretrained round trip, generate, torch.compile, moves, pickling, restore, fp8 experts. Every family's
block, swapped or left with its reason: tests/test_hf_swap_walk.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

import moekit.hf as moekit_hf  # noqa: E402
from moekit.hf.swap import set_blocks_active  # noqa: E402

from _helpers import rel_l2  # noqa: E402
import _hf_tiny_models as tiny  # noqa: E402
from _swap_helpers import count_moe_calls, swaps  # noqa: E402

IDS = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))




@pytest.mark.parametrize("name", list(tiny.MODELS))
def test_swapped_model_equals_its_twin(name):
    """fp32 logits < 1e-5 through moekit's layers (Phi-MoE's sparsemixer as at inference); state_dict keys and the
    parameters unchanged."""
    model, _ = tiny.build(name)
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    with torch.no_grad():
        want = model(IDS).logits
    report = moekit_hf.use_moekit_blocks(model)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    calls = count_moe_calls(model)
    with torch.no_grad():
        got = model(IDS).logits
    assert len(report.swapped) == len(calls) > 0 and not report.left
    assert rel_l2(got, want) < 1e-5


@pytest.mark.parametrize("family", list(tiny.BLOCKS))
def test_more_routers_and_shared_experts(family):
    """Jamba, MiniMax, MiniMax-M2, ERNIE-4.5 (a shared expert), Hunyuan (a shared MLP), Kimi-Linear: a model
    holding one block, swapped; the block's output and its return type kept."""
    holder = torch.nn.ModuleDict({"mlp": tiny.build_block(family)})
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = holder["mlp"](x)
    report = moekit_hf.use_moekit_blocks(holder)
    assert [b.path for b in report.swapped] == ["mlp"] and report.copied_bytes == 0
    with torch.no_grad():
        got = holder["mlp"](x)
    assert isinstance(got, tuple) == isinstance(want, tuple)
    first = (lambda o: o[0] if isinstance(o, tuple) else o)
    assert rel_l2(first(got), first(want)) < 1e-5


def test_tuple_block_and_transposed_views():
    """gpt-oss's block returns (out, router scores): kept a 2-tuple (out, None); its transposed experts are
    read as strided views of the block's storage (nothing copied), so an in-place update is seen."""
    model, _ = tiny.build("gpt_oss")
    report = moekit_hf.use_moekit_blocks(model)
    experts = model.model.layers[0].mlp.experts
    moe = swaps(model)[0].moe
    assert report.swapped[0].tuple_len == 2 and report.copied_bytes == 0
    assert moe.w13.data_ptr() == experts.gate_up_proj.data_ptr() and moe.w13.shape == (6, 32, 32)
    with pytest.raises(ValueError, match="transposed must be 'copy' or 'view'"):
        moekit_hf.moe_from_hf(model.model.layers[0].mlp, transposed="views")
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        out, scores = model.model.layers[0].mlp(x)
        assert scores is None and out.shape == x.shape
        experts.down_proj.mul_(2)  # an optimizer step's kind of update
        twin = copy.deepcopy(model)
        moekit_hf.restore_blocks(twin)
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5


def test_fused_shared_expert_is_a_copy_that_follows_updates():
    """fuse_shared=True copies Qwen3-Next's shared expert into routed slots (the report's bytes): equal logits,
    re-copied after an in-place update of the block's weights; under autograd the block's own forward."""
    model, _ = tiny.build("qwen3_next")
    report = moekit_hf.use_moekit_blocks(model, fuse_shared=True)
    moe = swaps(model)[0].moe
    assert moe.fuse_shared and report.swapped[0].copied_bytes == 4 * (moe.w13.numel() + moe.w2.numel())
    twin = copy.deepcopy(model)
    moekit_hf.restore_blocks(twin)
    with torch.no_grad():
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5
        for m in (model, twin):
            m.model.layers[0].mlp.shared_expert.down_proj.weight.mul_(3)
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5 and swaps(model)[0].moe is not moe
    calls = count_moe_calls(model)
    model(IDS).logits.sum().backward()
    assert not calls and model.model.layers[0].mlp.shared_expert.down_proj.weight.grad is not None


@pytest.mark.parametrize("name", ["olmoe", "gpt_oss"])
def test_router_logits_and_aux_loss(name):
    """output_router_logits=True: transformers' hooks on the router record, the loss and the aux loss equal."""
    model, _ = tiny.build(name)
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    with torch.no_grad():
        want = twin(IDS, labels=IDS, output_router_logits=True)
        got = model(IDS, labels=IDS, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 2
    for a, b in zip(got.router_logits, want.router_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["olmoe", "qwen3_next", "glm4_moe", "gpt_oss"])
def test_gradients_reach_the_blocks_parameters(name):
    """Training: a swapped model's gradients (through moekit's layer, or gpt-oss's own forward: its experts are
    views the gradients would not reach) equal the twin's on every Parameter, within fp32 rounding."""
    model, _ = tiny.build(name)
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    calls = count_moe_calls(model)
    for m in (model, twin):
        m.train()
        m(IDS, labels=IDS).loss.backward()
    assert bool(calls) == (name != "gpt_oss")
    for (pname, p), q in zip(model.named_parameters(), twin.parameters()):
        if q.grad is None:
            assert p.grad is None, pname
        else:
            assert rel_l2(p.grad, q.grad) < 1e-4, pname


def test_router_jitter_in_training_runs_the_blocks_own_forward():
    """Mixtral's block with router_jitter_noise > 0 scales its input by uniform noise in training (router and experts
    see it); moekit's layer has no such step, so the block's own forward runs there: the same RNG draws give the
    twin's logits. In eval mode there is no noise and moekit's layer runs."""
    cfg = transformers.MixtralConfig(**tiny.COMMON, intermediate_size=16, num_hidden_layers=2, num_local_experts=6,
                                     num_experts_per_tok=2, router_jitter_noise=0.5)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    calls = count_moe_calls(model)
    for m in (model, twin):
        m.train()
    with torch.no_grad():
        torch.manual_seed(1)
        got = model(IDS).logits
        torch.manual_seed(1)
        want = twin(IDS).logits
        assert not calls and torch.equal(got, want)
        model.eval(), twin.eval()
        assert rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5 and calls


def test_save_pretrained_round_trip(tmp_path):
    """The swapped model saves the checkpoint the unswapped one does and loads it back."""
    model, _ = tiny.build("qwen3_next")
    with torch.no_grad():
        want = model(IDS).logits
    moekit_hf.use_moekit_blocks(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert list(loaded.state_dict()) == list(model.state_dict())
    moekit_hf.use_moekit_blocks(loaded)
    with torch.no_grad():
        assert rel_l2(loaded(IDS).logits, want) < 1e-5
        loaded.load_state_dict(model.state_dict())


def test_generate_and_compile():
    """Greedy generate gives the twin's tokens; torch.compile(model) traces moekit's forward."""
    model, _ = tiny.build("olmoe")
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        assert torch.equal(model.generate(IDS[:1], **kwargs), twin.generate(IDS[:1], **kwargs))
        torch._dynamo.reset()
        calls = count_moe_calls(model)
        got = torch.compile(model, backend="eager")(IDS).logits
        assert calls and rel_l2(got, twin(IDS).logits) < 1e-5


def test_moves_pickles_restores_and_is_idempotent():
    model, _ = tiny.build("glm4_moe")
    twin = copy.deepcopy(model)
    first = moekit_hf.use_moekit_blocks(model)
    moe = swaps(model)[0].moe
    assert moekit_hf.use_moekit_blocks(model) == first and swaps(model)[0].moe is moe  # kept, not rebuilt
    model.to(torch.bfloat16)
    twin.to(torch.bfloat16)
    assert swaps(model)[0].moe is not moe and swaps(model)[0].moe.w13.dtype == torch.bfloat16
    with torch.no_grad():
        want = twin(IDS).logits
        assert rel_l2(model(IDS).logits, want) < 2e-2
        buf = io.BytesIO()
        torch.save(model, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
        assert len(swaps(loaded)) == 1 and torch.equal(loaded(IDS).logits, model(IDS).logits)
        assert set_blocks_active(model, False) == 1 and torch.equal(model(IDS).logits, want)
        assert moekit_hf.restore_blocks(model) == 1 and not swaps(model)
        assert type(model.model.layers[1].mlp) is type(twin.model.layers[1].mlp)
        assert torch.equal(model(IDS).logits, want)


def test_a_model_without_moe_blocks_warns():
    """A dense model, or a decoder layer's sub-module handed in by mistake: nothing to swap, and a warning says so
    (the call returned an empty report in silence); the model is left as it was."""
    model, _ = tiny.build("glm4_moe")
    experts = model.model.layers[1].mlp.experts  # the experts alone: no router beside them
    with pytest.warns(UserWarning, match="Glm4MoeExperts has no MoE block .*: nothing swapped"):
        report = moekit_hf.use_moekit_blocks(experts)
    assert report.swapped == () and report.left == () and not swaps(model)


@pytest.mark.parametrize(("call", "error", "said"), [
    # a backend typo left every block on its own forward with the reason in report.left alone, no error or warning
    (lambda m: moekit_hf.use_moekit_blocks(m, backend="cuda"), ValueError,
     r"^backend must be one of \['reference', .*\] or 'auto', got 'cuda'$"),
    (lambda m: moekit_hf.use_moekit_blocks(m, quant="int8_w8a16", keep_float="no"), TypeError,
     "^keep_float must be a bool, got 'no'$"),  # a truthy string kept the float experts
    # None read .modules() and raised AttributeError
    (lambda m: moekit_hf.use_moekit_blocks(None), TypeError, "^model must be a torch.nn.Module, got NoneType$"),
    (lambda m: moekit_hf.restore_blocks(None), TypeError, "^model must be a torch.nn.Module, got NoneType$"),
    (lambda m: moekit_hf.prepare(None), TypeError, "^model must be a torch.nn.Module, got NoneType$"),
    (lambda m: moekit_hf.offload_experts(None, 1 << 20, device="cpu"), TypeError,
     "^model must be a torch.nn.Module, got NoneType$"),
])
def test_bad_arguments_are_refused_before_any_block_changes(call, error, said):
    model, _ = tiny.build("glm4_moe")
    with pytest.raises(error, match=said):
        call(model)
    assert not swaps(model)


def test_fp8_experts_stay_fp8():
    """FineGrainedFP8Config's FP8Experts: the MoE reads them as they are (fp8_block, nothing copied); logits
    equal each block's plain moekit MoE."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    model = tiny.fp8_qwen3_moe()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:
        layer.mlp = moekit_hf.moe_from_hf(layer.mlp)
    report = moekit_hf.use_moekit_blocks(model)
    assert len(report.swapped) == 2 and report.copied_bytes == 0
    assert all(s.moe.quant_scheme == "fp8_block" for s in swaps(model))
    with torch.no_grad():
        assert rel_l2(model(ids).logits, reference(ids).logits) < 1e-5


def test_quant_on_fp8_experts_warns_that_blocks_stay_unquantized():
    """quant= asks for moekit's quantized experts; blocks that cannot have them (fp8 experts are not requantized)
    stay on their own forward, said in a warning naming the scheme, the count and the first reason."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    model = tiny.fp8_qwen3_moe()
    with pytest.warns(UserWarning, match=r"quant='int8_w8a16'\): 2 of 2 MoE blocks left .*already quantized"):
        report = moekit_hf.use_moekit_blocks(model, quant="int8_w8a16")
    assert report.swapped == () and [b.path for b in report.left] == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_functional_call_substitutes_the_weights():
    """torch.func.functional_call's tensors replace the block's Parameters for the call: the block's own forward
    runs on them (the MoE holds the originals), as in the twin."""
    model, _ = tiny.build("olmoe")
    twin = copy.deepcopy(model)
    moekit_hf.use_moekit_blocks(model)
    scaled = {n: p.detach() * 1.5 for n, p in model.named_parameters()}
    with torch.no_grad():
        got = torch.func.functional_call(model, scaled, (IDS,)).logits
        want = torch.func.functional_call(twin, scaled, (IDS,)).logits
        assert torch.equal(got, want) and rel_l2(model(IDS).logits, twin(IDS).logits) < 1e-5

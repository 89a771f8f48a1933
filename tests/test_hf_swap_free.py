"""``use_moekit_blocks(model, quant=scheme, keep_float=False)``: the swapped blocks free their float experts. Tiny
Qwen3-MoE / Mixtral / gpt-oss / DeepSeek-V3 models (random weights, offline configs) against the same model swapped
with keep_float=True: bit-identical outputs; the model's parameter + buffer bytes drop by the float experts' bytes
less the quantized ones', both computed here from the config and each scheme's layout; the float storages die; every
path that needs them raises; state_dict, deepcopy, torch.save, casts, compile, generate and restore_blocks.

Shapes: E experts, K hidden, N expert width, L MoE layers; w13 [E, 2N, K], w2 [E, K, N]."""

from __future__ import annotations

import copy
import gc
import io
import math
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import moe_from_hf, restore_blocks, use_moekit_blocks  # noqa: E402
from moekit.hf.swap import set_blocks_active  # noqa: E402
from moekit.hf.swap_free import FloatExpertsFreedError  # noqa: E402

from _helpers import rel_l2  # noqa: E402
from _swap_helpers import count_moe_calls, swaps  # noqa: E402

SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4", "fp8_block")
FAMILIES = ("qwen3", "mixtral", "gpt-oss-20b", "deepseek-v3")
IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))  # [B, L] within every vocabulary


def _model(name: str, seed: int = 0):
    """A 2-layer tiny model in float32, eval mode; DeepSeek-V3's first layer dense, its MoE with a shared expert."""
    if name != "deepseek-v3":
        return build_model(hf_config(name, 2, tiny=True), torch.float32, torch.device("cpu"), seed=seed)
    cfg = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    return build_model(cfg, torch.float32, torch.device("cpu"), seed=seed)


def _shape(model) -> tuple[int, int, int, int]:
    """(E, K, N, L) read from the model's transformers config."""
    cfg = model.config
    experts = next(getattr(cfg, n) for n in ("num_local_experts", "num_experts", "n_routed_experts") if hasattr(cfg, n))
    width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    dense = getattr(cfg, "first_k_dense_replace", 0) or 0
    return experts, cfg.hidden_size, width, cfg.num_hidden_layers - dense


def _quant_bytes(scheme: str, e: int, r: int, c: int) -> int:
    """Bytes of a [E, R, C] weight quantized along C, from each scheme's layout (moekit/quant/*.py's docs): int8 one
    byte a weight and a float32 scale a row; int4 two weights a byte, a float32 scale and a uint8 zero per 128-group;
    mxfp4 two a byte and an e8m0 byte per 32; fp8 one a byte and a float32 scale per 128 x 128 block."""
    if scheme == "int8_w8a16":
        return e * r * c + 4 * e * r
    if scheme == "int4_w4a16":
        return e * r * math.ceil(c / 2) + 5 * e * r * math.ceil(c / 128)
    if scheme == "mxfp4":
        return e * r * math.ceil(c / 2) + e * r * math.ceil(c / 32)
    return e * r * c + 4 * e * math.ceil(r / 128) * math.ceil(c / 128)


def _bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _logits(model, ids: torch.Tensor = IDS, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def _pair(name: str, scheme: str):
    """(kept, freed): the same model swapped with keep_float=True and with keep_float=False, and the latter's report."""
    kept, freed = _model(name), _model(name)
    use_moekit_blocks(kept, quant=scheme)
    return kept, freed, use_moekit_blocks(freed, quant=scheme, keep_float=False)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", FAMILIES)
def test_freed_blocks_compute_as_kept_ones_and_the_model_shrinks_by_the_float_experts(name, scheme):
    kept, freed = _model(name), _model(name)
    before = _bytes(freed)
    use_moekit_blocks(kept, quant=scheme)
    report = use_moekit_blocks(freed, quant=scheme, keep_float=False)
    e, k, n, layers = _shape(freed)
    float_bytes = layers * e * 3 * n * k * 4  # w13 + w2 in float32
    quant_bytes = layers * (_quant_bytes(scheme, e, 2 * n, k) + _quant_bytes(scheme, e, k, n))
    assert len(report.swapped) == layers and not report.left
    assert before - _bytes(freed) == float_bytes - quant_bytes
    assert report.freed_bytes == float_bytes and report.quant_bytes == quant_bytes
    assert _bytes(kept) == before  # keep_float=True: the quantized copies are the MoE's, outside the model
    calls = count_moe_calls(freed)
    assert torch.equal(_logits(freed), _logits(kept)) and len(calls) == layers
    names = {n for n, _ in freed.named_parameters()}
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss-20b"])
def test_the_float_storages_are_freed(name):
    model = _model(name)
    blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "down_proj")]
    refs = [weakref.ref(getattr(b.experts, p)) for b in blocks for p in ("gate_up_proj", "down_proj")]
    del blocks
    use_moekit_blocks(model, quant="int4_w4a16")  # kept first: freeing later must not requantize or keep them
    moes = [s.moe for s in swaps(model)]
    use_moekit_blocks(model, quant="int4_w4a16", keep_float=False)
    _logits(model)  # caches of a forward hold no float expert either
    gc.collect()
    assert len(refs) == 4 and all(r() is None for r in refs)
    assert [s.moe for s in swaps(model)] == moes  # the quantized MoEs kept, not rebuilt


def test_paths_that_need_the_float_experts_raise_naming_keep_float():
    model = _model("qwen3")
    with pytest.raises(ValueError, match="keep_float=False .* pass quant=<scheme> with it"):
        use_moekit_blocks(model, keep_float=False)
    use_moekit_blocks(model, quant="int8_w8a16", keep_float=False)
    want = _logits(model)
    for options in (dict(quant="int4_w4a16", keep_float=False), dict(quant="int8_w8a16", backend="reference",
                                                                    keep_float=False), dict(quant="int8_w8a16")):
        with pytest.raises(FloatExpertsFreedError, match="keep_float=False"):
            use_moekit_blocks(model, **options)
    with pytest.raises(FloatExpertsFreedError, match=r"keep_float=False.*set_blocks_active\(model, False\)"):
        set_blocks_active(model, False)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 3, model.config.hidden_size)  # [B, S, K]
    with pytest.raises(FloatExpertsFreedError, match="keep_float=False.*arguments beyond the hidden states"):
        block(x, None)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(FloatExpertsFreedError, match="keep_float=False.*substituted Parameters"):
        torch.func.functional_call(model, params, (IDS,))
    with pytest.raises(TypeError, match="keep_float=False"):
        moe_from_hf(block)
    assert torch.equal(_logits(model), want)  # nothing changed by the refused calls
    assert use_moekit_blocks(model, quant="int8_w8a16", keep_float=False).freed_bytes > 0  # the same: kept


def test_router_logits_are_recorded_by_moekit_layer():
    kept, freed, _ = _pair("mixtral", "int4_w4a16")
    with torch.no_grad():
        got = freed(IDS, output_router_logits=True)
        float_forward = kept(IDS, output_router_logits=True)  # keep_float=True: the blocks' own (float) forward
    assert torch.equal(got.logits, _logits(freed))  # recording changed nothing: moekit's layer computed it
    assert len(got.router_logits) == 2 and torch.equal(got.router_logits[0], float_forward.router_logits[0])
    assert got.aux_loss is not None and torch.isfinite(got.aux_loss)


@pytest.mark.parametrize(("name", "scheme"), [("qwen3", "int4_w4a16"), ("gpt-oss-20b", "mxfp4"),
                                              ("deepseek-v3", "fp8_block")])
def test_state_dict_round_trip_and_strict_loading(name, scheme):
    _, source, _ = _pair(name, scheme)
    state = source.state_dict()
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in state)
    assert sum(k.endswith("experts.gate_up_proj_q") for k in state) == _shape(source)[3]
    target = _model(name, seed=1)
    use_moekit_blocks(target, quant=scheme, keep_float=False)
    _logits(target)  # its own quantized weights ran first: nothing of them may stay
    assert not torch.equal(_logits(target), _logits(source))
    target.load_state_dict(state)
    assert torch.equal(_logits(target), _logits(source))
    assigned = _model(name, seed=2)
    use_moekit_blocks(assigned, quant=scheme, keep_float=False)
    assigned.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
    assert torch.equal(_logits(assigned), _logits(source))
    with pytest.raises(RuntimeError, match=r"(?s)Missing key\(s\).*experts\.gate_up_proj.*Unexpected key\(s\).*"
                                           r"experts\.gate_up_proj_q"):
        _model(name).load_state_dict(state)


def test_deepcopy_save_and_load_keep_the_blocks_freed():
    _, model, _ = _pair("gpt-oss-20b", "int4_w4a16")
    want = _logits(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for twin in (copy.deepcopy(model), loaded):
        assert torch.equal(_logits(twin), want) and _bytes(twin) == _bytes(model)
        assert all(s.freed is not None for s in swaps(twin))
        twin_q = twin.model.layers[0].mlp.experts.gate_up_proj_q
        assert twin_q.data_ptr() != model.model.layers[0].mlp.experts.gate_up_proj_q.data_ptr()
        assert swaps(twin)[0].moe.w13.q is twin_q  # the copy's MoE reads the copy's buffers


def test_a_cast_moves_the_quantized_experts_without_requantizing():
    _, model, _ = _pair("qwen3", "int8_w8a16")
    want = _logits(model)
    experts = model.model.layers[0].mlp.experts
    q, scale = experts.gate_up_proj_q.clone(), experts.gate_up_proj_scale.clone()
    model.to(torch.float16)
    assert experts.gate_up_proj_q.dtype == torch.int8 and experts.gate_up_proj_scale.dtype == torch.float32
    assert torch.equal(experts.gate_up_proj_q, q) and torch.equal(experts.gate_up_proj_scale, scale)
    (swap, _) = swaps(model)
    assert swap.moe.w13.dtype == torch.float16 and swap.moe.w13.q is experts.gate_up_proj_q
    got = _logits(model)
    assert got.dtype == torch.float16 and rel_l2(got.double(), want.double()) < 1e-2
    restore_blocks(model)
    assert experts.gate_up_proj.dtype == torch.float16  # restored in the dtype the model was cast to


def test_compiled_and_generate():
    kept, model, _ = _pair("qwen3", "mxfp4")
    want = _logits(model)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # no graph break in a freed block
    assert torch.equal(_logits(compiled), want)
    torch._dynamo.reset()
    with torch.no_grad():
        tokens = model.generate(IDS[:1], max_new_tokens=4, do_sample=False)
        kept_tokens = kept.generate(IDS[:1], max_new_tokens=4, do_sample=False)
    assert tokens.shape == (1, 9) and torch.equal(tokens, kept_tokens)


@pytest.mark.parametrize("name", ["qwen3", "gpt-oss-20b"])
def test_restore_puts_dequantized_float_experts_back(name):
    original = _model(name)
    keys = list(original.state_dict())
    kept, model, _ = _pair(name, "int4_w4a16")
    want = _logits(model)
    moes = [s.moe for s in swaps(model)]
    assert restore_blocks(model) == 2
    assert list(model.state_dict()) == keys and not swaps(model)
    for block, moe in zip([layer.mlp for layer in model.model.layers], moes):
        w13 = block.experts.gate_up_proj
        value = moe.w13.dequantize(torch.float32)  # [E, 2N, K]
        assert w13.requires_grad and torch.equal(w13, value.transpose(1, 2) if name == "gpt-oss-20b" else value)
    assert rel_l2(_logits(model).double(), want.double()) < 1e-5  # their own forward over the dequantized experts

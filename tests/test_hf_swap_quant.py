"""``use_moekit_blocks(model, quant=scheme)``: every swapped block computes with its experts quantized by moekit's
weight-only schemes. A swapped Qwen3 / Mixtral block against a float64 loop over the dequantized weights written here
(softmax router, top-k renormalised, SwiGLU per expert), whole tiny models (gpt-oss's biased, interleaved, clamped
experts too) against the same model run in float64 with the dequantized weights in place of the block's; the block's
float Parameters and state_dict kept; moves requantize; bad schemes name the argument.

Shapes: T tokens, K hidden, N expert width, E experts, k experts a token, V vocabulary."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moekit.bench.hf_models import build_model, hf_config  # noqa: E402
from moekit.hf import use_moekit_blocks  # noqa: E402
from moekit.quant.base import QuantizedWeight  # noqa: E402

from _helpers import rel_l2  # noqa: E402
from _swap_helpers import block_loop64, count_moe_calls, dequantized_float64_logits, swaps  # noqa: E402

SCHEMES = ("int8_w8a16", "int4_w4a16", "mxfp4")
IDS = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))  # [B, L] within the tiny vocabulary


def _tiny(name: str, layers: int = 1):
    return build_model(hf_config(name, layers, tiny=True), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_quantized_block_matches_a_float64_loop_over_its_dequantized_weights(name, scheme):
    model = _tiny(name)
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    float_w13 = block.experts.gate_up_proj.detach().clone()
    report = use_moekit_blocks(model, quant=scheme)
    assert len(report.swapped) == 1 and not report.left
    (swap,) = swaps(model)
    assert isinstance(swap.moe.w13, QuantizedWeight) and swap.moe.quant_scheme == scheme
    assert torch.equal(block.experts.gate_up_proj, float_w13)  # the block keeps its float experts
    w13, w2 = swap.moe.w13.dequantize(torch.float64), swap.moe.w2.dequantize(torch.float64)
    assert 1e-4 < rel_l2(w13, float_w13.double()) < 0.2  # quantized (not the float weights), not scrambled (~1)
    x = torch.randn(6, w13.shape[2], generator=torch.Generator().manual_seed(1))  # [T, K]
    want = block_loop64(x.double(), block.gate.weight.double(), w13, w2, swap.moe.config.top_k)
    with torch.no_grad():
        got = block(x[None])  # [1, T, K]
    got = got[0] if isinstance(got, tuple) else got
    assert rel_l2(got[0].double(), want) < 1e-5
    assert rel_l2(want, block_loop64(x.double(), block.gate.weight.double(), float_w13.double(),
                                    block.experts.down_proj.double(), swap.moe.config.top_k)) > 1e-4


@pytest.mark.parametrize(("name", "scheme"), [("qwen3", "int4_w4a16"), ("mixtral", "int8_w8a16"),
                                              ("gpt-oss-20b", "mxfp4"), ("gpt-oss-20b", "int4_w4a16")])
def test_quantized_model_matches_its_dequantized_float64_twin(name, scheme):
    model = _tiny(name, layers=2)
    with torch.no_grad():
        float_logits = model(IDS).logits
    keys = list(model.state_dict())
    report = use_moekit_blocks(model, quant=scheme)
    assert len(report.swapped) == 2 and not report.left and list(model.state_dict()) == keys
    calls = count_moe_calls(model)
    with torch.no_grad():
        got = model(IDS).logits
    assert len(calls) == 2  # both blocks ran moekit's layer, not their own float forward
    want = dequantized_float64_logits(model, {"input_ids": IDS})
    assert rel_l2(got.double(), want) < 1e-5
    assert rel_l2(float_logits.double(), want) > 1e-4  # the float model differs: the quantization shows


def test_move_requantizes_and_unknown_scheme_names_quant():
    model = _tiny("qwen3")
    use_moekit_blocks(model, quant="int8_w8a16")
    before = swaps(model)[0].moe
    model.to(torch.bfloat16)  # a cast rebuilds the MoE from the block's weights: quantized again, not left float
    after = swaps(model)[0].moe
    assert after is not before and after.quant_scheme == "int8_w8a16"
    assert after.w13.dtype == torch.bfloat16 and after.w13.q.shape == before.w13.q.shape
    use_moekit_blocks(model)  # other options: the float MoE over the block's own Parameters
    (plain,) = swaps(model)
    assert plain.moe.quant_scheme is None and plain.moe.w13 is model.model.layers[0].mlp.experts.gate_up_proj
    with pytest.raises(ValueError, match="quant must be one of .*got 'int3'"):
        use_moekit_blocks(model, quant="int3")
    # quantized and fused shared slots cannot go together: refused, not every shared-expert block left float
    with pytest.raises(ValueError, match="quant='int8_w8a16' with fuse_shared=True"):
        use_moekit_blocks(model, quant="int8_w8a16", fuse_shared=True)

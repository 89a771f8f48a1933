"""``use_moekit_blocks(model, quant=scheme)`` on the path a GPU takes (Triton's interpreter, bf16, the triton backend's
weight-only kernels): each swapped block of a tiny Qwen3 against a float64 loop over its MoE's dequantized weights,
within bf16's rounding and at least twice nearer than the loop over the block's float weights (whose distance is the
quantization's); a greedy generate through the swapped model runs.

Shapes: T tokens, K hidden."""

from __future__ import annotations

import pytest
import torch

from _helpers import rel_l2
from _swap_helpers import block_loop64, eager_and_compiled, swaps
from _triton_helpers import interpreted

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on the branches tl.where discards


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    with interpreted("moekit.experts", "moekit.experts.triton"), \
            interpreted("moekit.experts", "moekit.experts.triton_wo"):
        yield


def _tiny_qwen3_bf16():
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True)  # Qwen3-30B-A3B's (block_loop64 renormalises the top-k)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # weights of N(0, 1/fan_in) (transformers' 0.02 is near the bf16 floor at these widths)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model.to(torch.bfloat16).eval()


@pytest.mark.parametrize("scheme", ["int8_w8a16", "int4_w4a16", "mxfp4"])
def test_quantized_blocks_on_the_triton_backend(scheme):
    import moekit.hf as moekit_hf

    model = _tiny_qwen3_bf16()
    report = moekit_hf.use_moekit_blocks(model, backend="triton", quant=scheme)
    assert len(report.swapped) == 2 and not report.left
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)  # [T, K]
    for swap, layer in zip(swaps(model), model.model.layers):
        block, k = layer.mlp, swap.moe.config.top_k
        assert swap.moe.quant_scheme == scheme and swap.moe.backend == "triton"
        with torch.no_grad():
            got = block(x[None])[0]  # [T, K]
        router = block.gate.weight.double()
        want = block_loop64(x.double(), router, swap.moe.w13.dequantize(torch.float64),
                            swap.moe.w2.dequantize(torch.float64), k)
        assert rel_l2(got, want) < 2e-2  # bf16's rounding of the activations and the output
        unquantized = block_loop64(x.double(), router, block.experts.gate_up_proj.double(),
                                   block.experts.down_proj.double(), k)
        assert rel_l2(unquantized, want) > 2 * rel_l2(got, want)  # int8 ~1e-2, int4 ~0.14, mxfp4 ~0.2 vs ~3.5e-3
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out.shape == (1, 8)


def test_quantized_layer_traces_whole():
    """The swapped block's quantized layer as its compiled forward calls it (``traced_forward``), compiled with
    ``fullgraph=True``: no graph break in the weight-only experts, and the output of its eager call."""
    import moekit.hf as moekit_hf

    model = _tiny_qwen3_bf16()
    moekit_hf.use_moekit_blocks(model, backend="triton", quant="int4_w4a16")
    moe = swaps(model)[0].moe
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # [T, K]
    eager, compiled = eager_and_compiled(moe, x)
    assert rel_l2(compiled, eager) < 1e-2 and rel_l2(eager, torch.zeros_like(eager)) > 0.5

"""A swapped model through an inference server's lifecycle (session 54): a quantized swap that keeps its float experts
follows them when they are updated in place (``load_state_dict``, an in-place op), as the float swap does; a swapped
model moves to the meta device (``model.to("meta")``), lets its layers' memory go, and comes back with ``to_empty`` and
``load_state_dict`` (a swap that freed its float experts too). References: a float64 loop over the block's current
float weights quantized here (not what the swap holds), transformers' own eager experts on the same weights, a weak
reference that must die.

Shapes: T tokens, K hidden, E experts, V vocabulary."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf import FloatExpertsFreedError, use_moekit_blocks  # noqa: E402
from moekit.quant.schemes import quantize  # noqa: E402

from _helpers import rel_l2  # noqa: E402
from _swap_helpers import block_loop64, swaps  # noqa: E402

IDS = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))  # [B, L]


def _qwen3(seed: int):
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=8, num_experts_per_tok=2,
                                      norm_topk_prob=True)  # top-k renormalised, as block_loop64
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits  # [B, L, V]


def _loop_over_quantized_floats(block, x: torch.Tensor, scheme: str) -> torch.Tensor:
    """x [T, K] -> [T, K] float64: the block's router over its float experts as they are now, quantized with
    ``scheme`` here and dequantized (the swap's MoE is not read)."""
    experts = block.experts
    w13 = quantize(experts.gate_up_proj.detach(), scheme).dequantize(torch.float64)  # [E, 2N, K]
    w2 = quantize(experts.down_proj.detach(), scheme).dequantize(torch.float64)  # [E, K, N]
    return block_loop64(x.double(), block.gate.weight.double(), w13, w2, block.gate.top_k)


@pytest.mark.parametrize("update", ["load_state_dict", "in_place"])
def test_quantized_swap_follows_its_float_experts_updated_in_place(update):
    model = _qwen3(0)
    use_moekit_blocks(model, quant="int8_w8a16")
    _logits(model)  # the layers ran (and kept what they keep) on the old weights
    block = model.model.layers[0].mlp
    if update == "load_state_dict":
        model.load_state_dict(_qwen3(7).state_dict())
    else:
        with torch.no_grad():
            block.experts.gate_up_proj.mul_(2.0)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))  # [T, K]
    want = _loop_over_quantized_floats(block, x, "int8_w8a16")
    with torch.no_grad():
        got = block(x[None])[0]  # [T, K]
    assert rel_l2(got.double(), want) < 1e-5  # before session 54: the experts quantized at swap time, rel ~0.4-1
    eager = _qwen3(0)
    eager.load_state_dict(model.state_dict())
    eager.set_experts_implementation("eager")
    assert rel_l2(_logits(model).double(), _logits(eager).double()) < 1e-3  # int8 rounding only


@pytest.mark.parametrize(("quant", "keep_float"), [(None, True), ("int8_w8a16", True), ("int8_w8a16", False)])
def test_meta_move_lets_the_layers_go_and_to_empty_load_comes_back(quant, keep_float):
    model = _qwen3(0)
    use_moekit_blocks(model, quant=quant, keep_float=keep_float)
    _logits(model)
    old = [weakref.ref(swap.moe) for swap in swaps(model)]
    model.to("meta")  # raised moe_from_hf's meta-device error before session 54
    gc.collect()
    assert all(ref() is None for ref in old)  # the MoEs built over the old tensors are gone with them
    if not keep_float:  # nothing of the experts to run the block's own forward with: said so
        with pytest.raises(FloatExpertsFreedError, match="meta device"):
            _logits(model)
    model.to_empty(device="cpu")  # uninitialised memory (NaN possible): nothing quantized yet
    fresh = _qwen3(7)
    use_moekit_blocks(fresh, quant=quant, keep_float=keep_float)
    model.load_state_dict(fresh.state_dict())  # freed: the quantized buffers, as a freed swap's state_dict has them
    for module in model.modules():  # the rotary tables are not in the state_dict: made again, as any meta model needs
        if hasattr(module, "inv_freq"):
            inv_freq, _ = module.compute_default_rope_parameters(module.config)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)
    got = _logits(model)
    assert all(swap.moe is not None for swap in swaps(model))  # built again over the loaded weights
    eager = _qwen3(7)
    eager.set_experts_implementation("eager")
    assert rel_l2(got.double(), _logits(eager).double()) < (1e-6 if quant is None else 1e-3)
    assert torch.equal(got, _logits(fresh))  # the same as a swap of those weights made now, bit for bit

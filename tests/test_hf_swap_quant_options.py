"""``use_moekit_blocks(model, quant=..., quant_options=...)``: the quantizer's options reach every swapped block. A
Qwen3-MoE block swapped with int4_w4a16 at group size 64 against a float64 loop over weights quantized by a
round-to-nearest group-64 quantizer written here (and away from group 128's); swaps kept or rebuilt by their options,
copies and freed blocks keeping them; bad options refused naming the argument. ``moe_from_hf`` of a jittering Mixtral
block in training warns.

Shapes: T tokens, K hidden, N expert width, E experts, R rows, C columns (the reduction dim), g group size."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moekit.hf import FloatExpertsFreedError, moe_from_hf, use_moekit_blocks  # noqa: E402

from _helpers import rel_l2  # noqa: E402
import _hf_tiny_models as tiny  # noqa: E402
from _swap_helpers import block_loop64, swaps  # noqa: E402

INT4 = "int4_w4a16"


def _qwen3():
    """One Qwen3-MoE layer wide enough that group 64 and 128 differ: w13 [E, 2N, K] with K = 256 (4 or 2 groups a
    row), w2 [E, K, N] with N = 128 (2 or 1)."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, intermediate_size=64, moe_intermediate_size=128, num_hidden_layers=1,
                                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    block = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    return model, block


def _int4_rtn(w: torch.Tensor, g: int) -> torch.Tensor:
    """w [E, R, C] float32 (C a multiple of g) -> the dequantized weight [E, R, C] float64 of asymmetric int4 round to
    nearest per group of g columns: lo = min(w, 0), hi = max(w, 0), scale = (hi - lo) / 15 kept in float32, zero =
    round(-lo / scale), code = clamp(round(w / scale) + zero, 0, 15); w ~ (code - zero) * scale."""
    e, r, c = w.shape
    groups = w.reshape(e, r, c // g, g)  # [E, R, G, g]
    lo, hi = groups.amin(-1, keepdim=True).clamp(max=0), groups.amax(-1, keepdim=True).clamp(min=0)  # [E, R, G, 1]
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))  # float32, as stored
    zero = torch.round(-lo / scale).clamp(0, 15)
    code = (torch.round(groups / scale) + zero).clamp(0, 15)
    return ((code.double() - zero.double()) * scale.double()).reshape(e, r, c)


def test_group_64_block_matches_a_float64_loop_over_a_group_64_quantizer():
    model, block = _qwen3()
    w13, w2 = block.experts.gate_up_proj.detach().clone(), block.experts.down_proj.detach().clone()  # float32
    report = use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 64})
    assert len(report.swapped) == 1 and not report.left
    (swap,) = swaps(model)
    assert (swap.moe.w13.group_size, swap.moe.w2.group_size) == (64, 64)
    q13, q2 = _int4_rtn(w13, 64), _int4_rtn(w2, 64)
    assert torch.equal(swap.moe.w13.dequantize(torch.float64), q13)
    assert torch.equal(swap.moe.w2.dequantize(torch.float64), q2)
    x = torch.randn(7, w13.shape[2], generator=torch.Generator().manual_seed(1))  # [T, K]
    router = block.gate.weight.detach().double()
    want = block_loop64(x.double(), router, q13, q2, top_k=2)
    with torch.no_grad():
        got = block(x[None])[0]  # [T, K]
    assert rel_l2(got.double(), want) < 1e-5
    group_128 = block_loop64(x.double(), router, _int4_rtn(w13, 128), _int4_rtn(w2, 128), top_k=2)
    assert rel_l2(group_128, want) > 1e-3  # group 128's weights give another output: the option was applied


def test_a_swap_is_kept_for_its_options_and_rebuilt_for_others():
    model, block = _qwen3()
    use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 64})
    first = swaps(model)[0].moe
    use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 64})
    assert swaps(model)[0].moe is first
    use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 128})  # int4's default: as quant_options=None
    default = swaps(model)[0].moe
    assert default is not first and default.w13.group_size == 128
    use_moekit_blocks(model, quant=INT4)
    assert swaps(model)[0].moe is default
    use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 64, "symmetric": True})
    symmetric = swaps(model)[0].moe
    assert symmetric.w13.group_size == 64 and bool((symmetric.w13.zero == 8).all())
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(2))  # [B, T, K]
    with torch.no_grad():
        want = block(x)
        copied = copy.deepcopy(model)  # pickled and swapped again: with the same options
        (swap,) = swaps(copied)
        assert swap.options == swaps(model)[0].options and swap.moe.w13.group_size == 64
        assert torch.equal(next(m for m in copied.modules() if hasattr(m, "experts"))(x), want)


def test_fp8_block_shape_reaches_the_moe_and_a_list_is_its_tuple():
    model, _ = _qwen3()
    use_moekit_blocks(model, quant="fp8_block", quant_options={"block_shape": [64, 128]})
    moe = swaps(model)[0].moe
    assert moe.w13.block_shape == (64, 128) and tuple(moe.w13.scale.shape) == (6, 256 // 64, 256 // 128)
    use_moekit_blocks(model, quant="fp8_block", quant_options={"block_shape": (64, 128)})
    assert swaps(model)[0].moe is moe
    use_moekit_blocks(model, quant="fp8_block")
    assert swaps(model)[0].moe.w13.block_shape == (128, 128)


def test_a_freed_block_keeps_its_options():
    model, block = _qwen3()
    use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 64}, keep_float=False)
    moe = swaps(model)[0].moe
    assert moe.w13.group_size == 64 and not hasattr(block.experts, "down_proj")
    use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 64}, keep_float=False)
    assert swaps(model)[0].moe is moe
    with pytest.raises(FloatExpertsFreedError, match="other options"):
        use_moekit_blocks(model, quant=INT4, quant_options={"group_size": 32}, keep_float=False)
    copied = copy.deepcopy(model)
    assert swaps(copied)[0].moe.w13.group_size == 64 and swaps(copied)[0].options == swaps(model)[0].options


@pytest.mark.parametrize(("quant", "options", "error", "match"), [
    (INT4, {"group": 64}, ValueError, r"quant_options has \['group'\].*takes \['group_size', 'symmetric'\]"),
    (INT4, {"group_size": 48}, ValueError, r"quant_options for quant='int4_w4a16': group_size must be one of"),
    (INT4, {"symmetric": 1}, TypeError, r"quant_options for quant='int4_w4a16': symmetric must be a bool"),
    ("int8_w8a16", {"group_size": 64}, ValueError, r"quant_options has \['group_size'\].*it takes none"),
    ("fp8_block", {"block_shape": (0, 128)}, ValueError, r"quant_options for quant='fp8_block': block_shape"),
    (None, {"group_size": 64}, ValueError, r"quant_options=\{'group_size': 64\} with quant=None"),
    (INT4, [("group_size", 64)], TypeError, r"quant_options must be a dict"),
])
def test_bad_quant_options_are_refused_before_any_block_changes(quant, options, error, match):
    model, block = _qwen3()
    own = type(block)
    with pytest.raises(error, match=match):
        use_moekit_blocks(model, quant=quant, quant_options=options)
    assert type(block) is own and not swaps(model)


def _mixtral_block(jitter: float):
    cfg = transformers.MixtralConfig(**tiny.COMMON, intermediate_size=16, num_hidden_layers=1, num_local_experts=4,
                                     num_experts_per_tok=2, router_jitter_noise=jitter)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    return model, next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))


def test_moe_from_hf_warns_once_where_a_training_block_jitters_its_input():
    model, block = _mixtral_block(0.5)
    block.train()
    with pytest.warns(UserWarning, match=r"router_jitter_noise=0\.5.*no input jitter") as record:
        moe = moe_from_hf(block)
    assert len(record) == 1 and moe.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block.eval()
        moe_from_hf(block)  # at inference the block does not jitter: nothing to say
        model.train()
        use_moekit_blocks(model)  # the swapped block runs its own forward in training: nothing lost
        _, still = _mixtral_block(0.0)
        moe_from_hf(still.train())

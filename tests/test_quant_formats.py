"""Checkpoint formats: GPTQ and AWQ int32 tensors packed here by hand from their documented orders,
converted once by moekit and compared with a dequantization written here; gpt-oss MXFP4 blocks against
transformers' own dequantizer; DeepSeek-V3 fp8 tensors kept as they are; joining gate/up and experts."""

from __future__ import annotations

import pytest
import torch
from _quant_refs import decode_e2m1, pack_nibbles_by_hand

import moekit.quant as Q

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: nibble i holds column 8p + order[i]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) -> the int32 tensors checkpoints store (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(codes: torch.Tensor, order=range(8)) -> torch.Tensor:
    """codes [A, B] -> words [A/8, B]: word p's nibble i holds row 8p + order[i]."""
    words = torch.zeros(codes.shape[0] // 8, codes.shape[1], dtype=torch.int64)
    for i, row in enumerate(order):
        words += codes[row::8].long() << (4 * i)
    return _to_int32(words)


def _pack_cols(codes: torch.Tensor, order=range(8)) -> torch.Tensor:
    """codes [A, B] -> words [A, B/8]: word p's nibble i holds column 8p + order[i]."""
    return _pack_rows(codes.t().contiguous(), order).t().contiguous()


def _int4_problem(k, n, g, seed, zero_low=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)  # [in, out], the checkpoints' orientation
    zeros = torch.randint(zero_low, 16, (k // g, n), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) + 0.5).half()
    dense = (codes - zeros.repeat_interleave(g, 0)).double() * scales.double().repeat_interleave(g, 0)  # [in, out]
    return codes, zeros, scales, dense.t()  # moekit's logical [R=out, C=in]


@pytest.mark.parametrize("version", [1, 2])
def test_gptq_converts_to_the_int4_layout(version):
    k, n, g = 256, 48, 64
    codes, zeros, scales, dense = _int4_problem(k, n, g, seed=version, zero_low=1 if version == 1 else 0)
    stored = zeros - 1 if version == 1 else zeros  # GPTQ v1 writes zero - 1
    qw = Q.from_gptq(_pack_rows(codes), _pack_cols(stored), scales, group_size=g, gptq_version=version,
                     g_idx=torch.arange(k) // g)
    assert qw.scheme == "int4_w4a16" and qw.shape == (1, n, k) and qw.group_size == g
    assert torch.equal(qw.dequantize(torch.float64)[0], dense)


def test_awq_converts_to_the_int4_layout_and_differs_from_gptq():
    k, n, g = 128, 64, 32
    codes, zeros, scales, dense = _int4_problem(k, n, g, seed=5)
    qweight, qzeros = _pack_cols(codes, AWQ_PACK_ORDER), _pack_cols(zeros, AWQ_PACK_ORDER)
    qw = Q.from_awq(qweight, qzeros, scales, group_size=g)
    assert torch.equal(qw.dequantize(torch.float64)[0], dense)
    naive = Q.from_awq(_pack_cols(codes), _pack_cols(zeros), scales, group_size=g)  # sequential order
    assert not torch.equal(naive.dequantize(torch.float64)[0], dense)  # the order matters, and is AWQ's


def test_int4_experts_from_stacked_and_per_expert_checkpoints():
    k, n, g = 128, 32, 128
    parts = [_int4_problem(k, n, g, seed=s) for s in range(3)]
    per_expert = [Q.from_gptq(_pack_rows(c), _pack_cols(z), s, group_size=g, gptq_version=2) for c, z, s, _ in parts]
    stacked = Q.from_gptq(torch.stack([_pack_rows(c) for c, *_ in parts]),
                          torch.stack([_pack_cols(z) for _, z, *_ in parts]),
                          torch.stack([s for _, _, s, _ in parts]), group_size=g, gptq_version=2)
    expected = torch.stack([d for *_, d in parts])
    assert torch.equal(Q.stack_experts(per_expert).dequantize(torch.float64), expected)
    assert torch.equal(stacked.dequantize(torch.float64), expected)
    w13 = Q.cat_rows(per_expert[0], per_expert[1])
    assert torch.equal(w13.dequantize(torch.float64)[0], torch.cat([expected[0], expected[1]]))


def test_int4_checkpoint_refusals():
    codes, zeros, scales, _ = _int4_problem(256, 16, 128, seed=0)
    qweight, qzeros = _pack_rows(codes), _pack_cols(zeros)
    with pytest.raises(ValueError, match="act-order"):
        Q.from_gptq(qweight, qzeros, scales, group_size=128, g_idx=torch.arange(256).flip(0) // 128)
    with pytest.raises(ValueError, match="group_size must be one of"):
        Q.from_gptq(qweight, qzeros, scales, group_size=-1)
    with pytest.raises(TypeError, match="must be int32"):
        Q.from_awq(qweight.long(), qzeros, scales, group_size=128)
    with pytest.raises(ValueError, match="scales and qzeros must unpack"):
        Q.from_gptq(qweight, qzeros, scales, group_size=64)


def test_gpt_oss_blocks_are_the_mxfp4_layout_and_match_transformers():
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    e, r, c = 2, 6, 96
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (e, r, c), generator=gen)
    scales = torch.randint(118, 132, (e, r, c // 32), generator=gen).to(torch.uint8)
    blocks = pack_nibbles_by_hand(codes).view(e, r, c // 32, 16)
    qw = Q.from_gpt_oss_mxfp4(blocks, scales)
    expected = decode_e2m1(codes) * 2.0 ** (scales.double().repeat_interleave(32, 2) - 127)
    assert qw.shape == (e, r, c) and torch.equal(qw.dequantize(torch.float64), expected)
    assert qw.q.data_ptr() == blocks.data_ptr()  # the checkpoint's bytes, not a copy
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, C, R], transposed
    assert torch.equal(qw.dequantize(), theirs.transpose(1, 2))


def test_gpt_oss_state_dict_entries():
    from moekit.quant.hf import gpt_oss_experts_weights

    e, n, k = 2, 64, 96
    sd = {"model.layers.0.mlp.experts.gate_up_proj_blocks": torch.zeros(e, 2 * n, k // 32, 16, dtype=torch.uint8),
          "model.layers.0.mlp.experts.gate_up_proj_scales": torch.full((e, 2 * n, k // 32), 127, dtype=torch.uint8),
          "model.layers.0.mlp.experts.gate_up_proj_bias": torch.zeros(e, 2 * n),
          "model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(e, k, n // 32, 16, dtype=torch.uint8),
          "model.layers.0.mlp.experts.down_proj_scales": torch.full((e, k, n // 32), 127, dtype=torch.uint8),
          "model.layers.0.mlp.experts.down_proj_bias": torch.zeros(e, k)}
    got = gpt_oss_experts_weights(sd, "model.layers.0.mlp.experts.")
    assert got.w13.shape == (e, 2 * n, k) and got.w2.shape == (e, k, n) and got.b13.shape == (e, 2 * n)
    with pytest.raises(KeyError, match="down_proj_scales"):
        gpt_oss_experts_weights({k2: v for k2, v in sd.items() if "down_proj_scales" not in k2},
                                "model.layers.0.mlp.experts.")


def test_deepseek_fp8_tensors_are_used_as_they_are():
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 200, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)  # one Linear
    scale = torch.rand(2, 2, generator=gen).bfloat16()  # a bf16 weight_scale_inv
    qw = Q.from_deepseek_fp8(weight, scale)
    assert qw.q.data_ptr() == weight.data_ptr() and qw.scale.dtype == torch.float32
    expected = weight.double() * scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :200]
    assert torch.equal(qw.dequantize(torch.float64)[0], expected)
    up = Q.from_deepseek_fp8(weight, scale * 2)
    w13 = Q.cat_rows(qw, up)
    assert w13.shape == (1, 512, 200) and torch.equal(w13.dequantize()[0, 256:], up.dequantize()[0])
    with pytest.raises(ValueError, match="multiple of the block rows"):
        Q.cat_rows(Q.from_deepseek_fp8(weight[:100], scale[:1]), Q.from_deepseek_fp8(weight[:100], scale[:1]))
    with pytest.raises(TypeError, match="weight_scale_inv must be one of"):
        Q.from_deepseek_fp8(weight, scale.to(torch.int32))


def test_deepseek_fp8_e8m0_scales_widen_exactly():
    weight = torch.ones(128, 256).to(torch.float8_e4m3fn)
    scale = torch.tensor([[125, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2**-2, 2**3
    qw = Q.from_deepseek_fp8(weight, scale)
    assert torch.equal(qw.scale, torch.tensor([[[0.25, 8.0]]]))
    assert torch.equal(qw.dequantize()[0, 0, [0, 127, 128, 255]], torch.tensor([0.25, 0.25, 8.0, 8.0]))

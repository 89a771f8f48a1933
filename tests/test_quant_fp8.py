"""fp8_block, DeepSeek-V3's recipe: the activation quantizer and ``experts_fp8_block_reference`` against a
float64 per-token emulation written here (e4m3 values from the bit format, scales amax/448, weights
decoded from the layout text), through the ``reference`` and ``grouped_mm`` backends too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _quant_refs import e4m3_magnitudes, fake_fp8_rows, nearest, rel_l2

import moekit.quant as Q
from moekit.experts import run_experts

E, K, N = 4, 200, 136  # K and N are not multiples of 128: tail blocks on every GEMM


def _problem(m, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    w13 = torch.randn(E, 2 * N, K, generator=g) * K ** -0.5
    w2 = torch.randn(E, K, N, generator=g) * N ** -0.5
    ids = torch.randint(0, E, (m, 2), generator=g, dtype=torch.int32)
    weights = torch.rand(m, 2, generator=g)
    return x, w13, w2, ids, weights


def _decode_fp8(qw, block_shape=(128, 128)) -> torch.Tensor:
    """w[e, r, c] = q[e, r, c] * scale[e, r // BR, c // BC], float64, from the layout text."""
    (r, c), (br, bc) = qw.q.shape[1:], block_shape
    return qw.q.double() * qw.scale.double()[:, torch.arange(r) // br][:, :, torch.arange(c) // bc]


def _per_token_fp8(x, w13q, w2q, ids, weights, expert_map=None, block_shape=(128, 128)):
    """float64 per (token, slot): quantize x 1 x BC, gate-up, SiLU-and-mul, quantize 1 x BC, down, weight."""
    w13, w2 = _decode_fp8(w13q, block_shape), _decode_fp8(w2q, block_shape)
    bc = block_shape[1]
    out = torch.zeros(x.shape[0], K, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            e = int(expert_map[e]) if expert_map is not None and 0 <= e < len(expert_map) else e
            if not 0 <= e < E:
                continue
            h = fake_fp8_rows(x[t:t + 1], bc) @ w13[e].t()
            a = F.silu(h[:, :N]) * h[:, N:]
            out[t] += float(weights[t, j]) * (fake_fp8_rows(a, bc) @ w2[e].t())[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantizer_is_amax_over_448_and_round_to_nearest(dtype):
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[2, 128:256] = 0  # an all-zero block: its values stay 0
    act = Q.quantize_activations_fp8(x)
    assert act.q.dtype == torch.float8_e4m3fn and act.scale.shape == (7, 3) and act.scale.dtype == torch.float32
    amax = torch.stack([x.double()[:, c:c + 128].abs().amax(dim=1) for c in (0, 128, 256)], dim=1)
    expected_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    torch.testing.assert_close(act.scale.double(), expected_scale, rtol=1e-7, atol=0)
    per_col = act.scale.double()[:, torch.arange(300) // 128]
    target = x.double() / per_col
    rtn = nearest(target, e4m3_magnitudes())  # RTN given moekit's scale
    # every q is a nearest e4m3 value (at an exact tie either neighbour is; float32 may move x/s by 2^-24)
    assert bool(((act.q.double() - target).abs() <= (rtn - target).abs() + 1e-6 * target.abs()).all())
    assert rel_l2(act.dequantize(torch.float64), fake_fp8_rows(x)) < 1e-6
    assert bool((act.dequantize()[2, 128:256] == 0).all())
    assert rel_l2(Q.fake_quantize_activations_fp8(x), x.double()) < 0.05  # e4m3 keeps ~4 significant bits


@pytest.mark.parametrize("m", [1, 9])
def test_fp8_reference_matches_float64_emulation(m):
    x, w13, w2, ids, weights = _problem(m, seed=m)
    w13q, w2q = Q.quantize(w13, "fp8_block"), Q.quantize(w2, "fp8_block")
    expected = _per_token_fp8(x, w13q, w2q, ids, weights)
    got = Q.experts_fp8_block_reference(x, w13q, w2q, ids, weights)
    assert got.dtype == x.dtype and rel_l2(got, expected) < 2e-4
    for backend in ("reference", "grouped_mm"):
        assert rel_l2(run_experts(x, w13q, w2q, ids, weights, backend=backend), expected) < 2e-4, backend


def test_fp8_reference_skips_unmapped_and_out_of_range_ids():
    x, w13, w2, ids, weights = _problem(6, seed=3)
    ids[0, 0], ids[1, 1] = -1, E  # moekit's skip and transformers' EP sentinel
    expert_map = torch.tensor([0, -1, 2, 3])  # expert 1 lives on another rank
    w13q, w2q = Q.quantize(w13, "fp8_block"), Q.quantize(w2, "fp8_block")
    expected = _per_token_fp8(x, w13q, w2q, ids, weights, expert_map)
    got = run_experts(x, w13q, w2q, ids, weights, expert_map=expert_map, backend="reference")
    assert rel_l2(got, expected) < 2e-4


def test_fp8_reference_bf16_activations_and_empty_batch():
    x, w13, w2, ids, weights = _problem(5, seed=4, dtype=torch.bfloat16)
    w13q, w2q = Q.quantize(w13, "fp8_block"), Q.quantize(w2, "fp8_block")
    got = run_experts(x, w13q, w2q, ids, weights, backend="reference")
    assert got.dtype == torch.bfloat16
    assert rel_l2(got, _per_token_fp8(x, w13q, w2q, ids, weights)) < 1e-2  # the bf16 output's rounding
    empty = run_experts(x[:0], w13q, w2q, ids[:0], weights[:0], backend="reference")
    assert empty.shape == (0, K)


def test_activation_quantization_is_part_of_the_recipe():
    """The emulation differs from weight-only fp8 by the activation rounding (a test that the
    activations really are quantized): w8a8 error > weight-only error > 0 vs the float layer."""
    x, w13, w2, ids, weights = _problem(64, seed=5)
    w13q, w2q = Q.quantize(w13, "fp8_block"), Q.quantize(w2, "fp8_block")
    exact = run_experts(x, w13, w2, ids, weights, backend="reference")
    w8a8 = rel_l2(Q.experts_fp8_block_reference(x, w13q, w2q, ids, weights), exact)
    w8 = rel_l2(run_experts(x, w13q.dequantize(), w2q.dequantize(), ids, weights, backend="reference"), exact)
    print(f"fp8_block experts rel L2 vs float: w8a8 {w8a8:.4%}, weight-only {w8:.4%}")
    assert 0 < w8 < w8a8 < 0.1


def test_mixed_or_foreign_weights_are_refused():
    x, w13, w2, ids, weights = _problem(2)
    w13q = Q.quantize(w13, "fp8_block")
    with pytest.raises(TypeError, match="w2 must be a QuantizedWeight"):
        run_experts(x, w13q, w2, ids, weights, backend="reference")
    with pytest.raises(TypeError, match="share a quantization scheme"):
        run_experts(x, w13q, Q.quantize(w2, "int8_w8a16"), ids, weights, backend="reference")
    with pytest.raises(ValueError, match="w2 must have shape"):
        run_experts(x, w13q, Q.quantize(w2[:, :, :64], "fp8_block"), ids, weights, backend="reference")


@pytest.mark.parametrize("block_shape", [(100, 128), (48, 32), (8, 16)])
def test_row_blocks_of_any_height_are_exact(block_shape):
    """block_shape's rows may be any positive int (a tile straddling two row blocks reads a scale per column: the
    Triton kernels' case in test_triton_fp8.py): each block's scale is its amax / 448 (float64 loop over the blocks
    here), and quantize_ on a layer computes the recipe at that shape (the float64 per-token loop, < 2e-4)."""
    from moekit import MoE, MoEConfig

    x, w13, w2, ids, weights = _problem(7, seed=11)
    qw = Q.quantize(w13, "fp8_block", block_shape=block_shape)
    (br, bc), rows = block_shape, w13.shape[1]
    for i in range(-(-rows // br)):
        for j in range(-(-K // bc)):
            amax = w13[:, i * br:(i + 1) * br, j * bc:(j + 1) * bc].double().abs().amax(dim=(1, 2))
            torch.testing.assert_close(qw.scale[:, i, j].double(), amax / 448, rtol=1e-7, atol=0)
    config = MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2)
    moe = MoE(config, backend="grouped_mm")
    with torch.no_grad():
        moe.w13.copy_(w13)
        moe.w2.copy_(w2)
    moe.quantize_("fp8_block", block_shape=block_shape)
    expected = _per_token_fp8(x, moe.w13, moe.w2, ids, weights, block_shape=block_shape)
    for backend in ("reference", "grouped_mm"):
        got = run_experts(x, moe.w13, moe.w2, ids, weights, backend=backend)
        assert rel_l2(got, expected) < 2e-4, backend


@pytest.mark.parametrize("block_shape", [(128, 100), (128, 256), (128, 8), (64, 48)])
def test_reduction_blocks_the_kernels_do_not_run_are_refused_by_name(block_shape):
    """block_shape[1] is the activations' group and the Triton kernels' BLOCK_K: 16, 32, 64 or 128; the rest is
    refused where the weight is made (quantize, quantize_, from_tensors), not at a CUDA call later."""
    from moekit import MoE, MoEConfig

    w = _problem(1)[1]
    match = r"block_shape\[1\] \(the reduction block.*must be one of \(16, 32, 64, 128\), got"
    with pytest.raises(ValueError, match=match):
        Q.quantize(w, "fp8_block", block_shape=block_shape)
    moe = MoE(MoEConfig(hidden_size=K, moe_intermediate_size=N, num_experts=E, top_k=2))
    with pytest.raises(ValueError, match=match):
        moe.quantize_("fp8_block", block_shape=block_shape)
    assert isinstance(moe.w13, torch.nn.Parameter)  # refused before anything changed
    good = Q.quantize(w, "fp8_block", block_shape=(block_shape[0], 128))
    with pytest.raises(ValueError, match=match):
        Q.from_tensors("fp8_block", q=good.q, scale=good.scale, block_shape=block_shape)

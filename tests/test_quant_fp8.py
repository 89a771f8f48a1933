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


def _decode_fp8(qw) -> torch.Tensor:
    """w[e, r, c] = q[e, r, c] * scale[e, r // 128, c // 128], float64, from the layout text."""
    r, c = qw.q.shape[1:]
    return qw.q.double() * qw.scale.double()[:, torch.arange(r) // 128][:, :, torch.arange(c) // 128]


def _per_token_fp8(x, w13q, w2q, ids, weights, expert_map=None):
    """float64 per (token, slot): quantize x 1x128, gate-up, SiLU-and-mul, quantize 1x128, down, weight."""
    w13, w2 = _decode_fp8(w13q), _decode_fp8(w2q)
    out = torch.zeros(x.shape[0], K, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            e = int(expert_map[e]) if expert_map is not None and 0 <= e < len(expert_map) else e
            if not 0 <= e < E:
                continue
            h = fake_fp8_rows(x[t:t + 1]) @ w13[e].t()
            a = F.silu(h[:, :N]) * h[:, N:]
            out[t] += float(weights[t, j]) * (fake_fp8_rows(a) @ w2[e].t())[0]
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

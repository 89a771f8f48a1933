"""moekit.experts.cpu_quant: weight-only quantized experts in the CPU inference loop, each touched expert dequantized
(or run by torch's weight-only kernel) on its worker. Held against the reference backend on the same quantized weights
and a float64 loop (``_helpers.experts_loop``); per-expert dequantization bit-identical to the whole one; workers 1 / 2
bit-identical; the repack cache (int4, mxfp4 as int8); calls that keep their old path (gradients, fp8_block)."""

from dataclasses import dataclass

import pytest
import torch

from _helpers import experts_loop
from moekit.activations import ActivationSpec
from moekit.experts import backend_fn, cpu_packed
from moekit.experts.cpu_packed import ExpertParams, experts_cpu_fused
from moekit.experts.cpu_quant import (
    MX_INT8_SPAN, DequantLinear, Int4PackLinear, Int8PackLinear, QuantKernels, RepackCache, expert_linear,
    int4pack_supported, int8pack_supported, mxfp4_as_int8,
)
from moekit.experts.grouped_mm import experts_grouped_mm
from moekit.quant import quantize
from moekit.quant.emulate import experts_fp8_block_reference

E, N = 6, 32
SCHEMES = [("int8_w8a16", {}), ("int4_w4a16", {"group_size": 32}), ("mxfp4", {})]
DEQUANT = QuantKernels("dequant", "dequant", "dequant")
PACKS = QuantKernels("int8pack", "int4pack", "int8pack")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def problem(scheme, options, hidden=96, tokens=9, top_k=2, dtype=torch.float32, seed=0, gated=True):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, (2 if gated else 1) * N, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(E, hidden, N, generator=g) * N**-0.5
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :top_k].int()  # [M, k], distinct per token
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=1)
    return x, quantize(w13, scheme, **options), quantize(w2, scheme, **options), ids, weights


def loop64(x, q13, q2, ids, weights, spec=ActivationSpec("silu"), b13=None, b2=None, expert_map=None):
    """``_helpers.experts_loop`` (float64, one (token, slot) at a time) on the weights dequantized in float64."""
    w13, w2 = q13.dequantize(torch.float64), q2.dequantize(torch.float64)
    glu = None if spec == ActivationSpec("silu") else spec  # None: torch's silu(gate) * up
    return experts_loop(x, w13, w2, ids, weights, expert_map, b13=b13, b2=b2, spec=glu)


@dataclass
class LoopRuns:
    """One bf16 problem (40 tokens, K = 96, seed 21) through ``experts_cpu_fused`` and the float64 loop."""

    want: torch.Tensor  # [M, K] float64: ``loop64``
    got: torch.Tensor  # [M, K] bf16: the kernels under test on 2 workers
    one: torch.Tensor  # the same kernels on 1 worker
    other: torch.Tensor  # the kernels compared with, on 2 workers


def bf16_loop_runs(scheme, options, quant: QuantKernels, other: QuantKernels) -> LoopRuns:
    x, q13, q2, ids, weights = problem(scheme, options, 96, tokens=40, dtype=torch.bfloat16, seed=21)
    ex = ExpertParams(q13, q2, None, None, ActivationSpec("silu"))
    with torch.no_grad():
        runs = [experts_cpu_fused(x, ex, ids, weights, None, None, workers=workers, quant=kernels)
                for workers, kernels in ((2, quant), (1, quant), (2, other))]
    return LoopRuns(loop64(x, q13, q2, ids, weights), *runs)


def rel_err(got, want):
    assert not got.isnan().any()
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def bits(t):
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def fused(x, q13, q2, ids, weights, kernels, workers=1, **kw):
    ex = ExpertParams(q13, q2, kw.get("b13"), kw.get("b2"), kw.get("spec", ActivationSpec("silu")))
    return experts_cpu_fused(x, ex, ids, weights, kw.get("expert_map"), None, workers=workers, quant=kernels)


@pytest.mark.parametrize("scheme, options", SCHEMES + [("int4_w4a16", {"group_size": 128, "symmetric": True})])
@pytest.mark.parametrize("cols", [96, 77, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_expert_is_bit_identical_to_the_whole(scheme, options, cols, dtype):
    w = quantize(torch.randn(3, 40, cols, generator=torch.Generator().manual_seed(cols)), scheme, **options)
    whole = w.dequantize(dtype)
    for expert in range(3):
        for rows in (slice(None), slice(5, 17), slice(39, 40), slice(3, 3)):
            one = w.dequantize_expert(expert, dtype, rows)
            assert one.shape == whole[expert, rows].shape and one.dtype == dtype
            assert torch.equal(bits(one), bits(whole[expert, rows]))


@pytest.mark.parametrize("scheme, options", SCHEMES)
@pytest.mark.parametrize("hidden", [96, 77])  # 77: int4 / mxfp4 group tails, int8pack / int4pack fall back
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_loop_matches_reference_and_float64_loop_with_biases_and_expert_map(scheme, options, hidden, dtype,
                                                                                  monkeypatch):
    x, q13, q2, _, weights = problem(scheme, options, hidden, dtype=dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, hidden, generator=g)
    expert_map = torch.tensor([2, -1, 0, 3, 1, -1, 5, 4])  # 8 global ids onto 6 local experts
    ids = torch.randint(0, 8, weights.shape, generator=g).int()
    want = loop64(x, q13, q2, ids, weights, b13=b13, b2=b2, expert_map=expert_map)
    ref = backend_fn("reference", x.device)(x, q13, q2, ids, weights, b13=b13, b2=b2, expert_map=expert_map)
    monkeypatch.setattr(type(q13), "dequantize", lambda *a, **k: pytest.fail("dequantized every expert"))
    with torch.no_grad():
        got = experts_grouped_mm(x, q13, q2, ids, weights, b13=b13, b2=b2, expert_map=expert_map)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, want) < TOL[dtype] and rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("scheme, options", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequant_kernel_has_the_bits_of_the_dense_loop_on_dequantized_weights(scheme, options, dtype):
    x, q13, q2, ids, weights = problem(scheme, options, hidden=2048, tokens=3, dtype=dtype)  # 2048: 64-row tiles
    with torch.no_grad():
        # the dense loop with oneDNN for every expert (auto may take BLAS for few-row experts: blas_plain_rows)
        dense = experts_grouped_mm(x, q13.dequantize(dtype), q2.dequantize(dtype), ids, weights,
                                   cpu_gemm="onednn_packed_split")
        got = fused(x, q13, q2, ids, weights, DEQUANT, workers=2).to(dtype)
    assert torch.equal(got, dense)


@pytest.mark.parametrize("scheme, options", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [DEQUANT, PACKS, QuantKernels()], ids=["dequant", "packs", "auto"])
def test_workers_1_and_2_give_the_same_bits(scheme, options, dtype, kernels):
    x, q13, q2, ids, weights = problem(scheme, options, tokens=17, dtype=dtype, seed=3)
    with torch.no_grad():
        one = fused(x, q13, q2, ids, weights, kernels, workers=1)
        two = fused(x, q13, q2, ids, weights, kernels, workers=2)
    assert torch.equal(one, two)
    assert rel_err(one, loop64(x, q13, q2, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("tokens", [0, 1])
@pytest.mark.parametrize("scheme, options", SCHEMES)
def test_no_tokens_and_one_token(scheme, options, tokens):
    x, q13, q2, ids, weights = problem(scheme, options, tokens=tokens, seed=4)
    with torch.no_grad():
        got = experts_grouped_mm(x, q13, q2, ids, weights)
    assert got.shape == (tokens, 96)
    if tokens:
        assert rel_err(got, loop64(x, q13, q2, ids, weights)) < 1e-5


@pytest.mark.parametrize("spec", [ActivationSpec("silu", interleaved=True, alpha=1.702, limit=7.0, up_shift=1.0),
                                  ActivationSpec("gelu"), ActivationSpec("relu2", gated=False)],
                         ids=["gpt_oss", "gelu", "relu2_ungated"])
@pytest.mark.parametrize("scheme, options", SCHEMES)
def test_other_activations(scheme, options, spec):
    x, q13, q2, ids, weights = problem(scheme, options, seed=5, gated=spec.gated)
    with torch.no_grad():
        got = experts_grouped_mm(x, q13, q2, ids, weights, activation=spec)
    assert rel_err(got, loop64(x, q13, q2, ids, weights, spec)) < 1e-5


def test_gradients_and_fp8_block_keep_their_paths():
    x, q13, q2, ids, weights = problem("int4_w4a16", {"group_size": 32}, seed=6)
    x.requires_grad_(True)
    out = experts_grouped_mm(x, q13, q2, ids, weights)  # run_quantized: the dense path on the whole dequantize
    out.sum().backward()
    assert x.grad is not None and rel_err(out.detach(), loop64(x.detach(), q13, q2, ids, weights)) < 1e-5
    x, f13, f2, ids, weights = problem("fp8_block", {"block_shape": (32, 32)}, hidden=64, seed=7)
    with torch.no_grad():
        got = experts_grouped_mm(x, f13, f2, ids, weights)
    assert torch.equal(got, experts_fp8_block_reference(x, f13, f2, ids, weights))


@pytest.mark.skipif(not (int8pack_supported(torch.bfloat16) and int4pack_supported(torch.bfloat16)),
                    reason="this torch has no CPU int8pack / int4pack kernels for bfloat16")
def test_pack_kernels_are_taken_where_the_shapes_fit_else_dequant():
    _, q13, q2, _, _ = problem("int4_w4a16", {"group_size": 32}, hidden=77)  # w2 has 77 rows: not a multiple of 16
    cache = RepackCache(budget_bytes=1 << 30)
    assert isinstance(expert_linear(q13, 0, torch.bfloat16, PACKS, cache), Int4PackLinear)
    assert isinstance(expert_linear(q2, 0, torch.bfloat16, PACKS, cache), DequantLinear)
    assert isinstance(expert_linear(q13, 0, torch.float32, QuantKernels(), cache, rows=16), DequantLinear)  # auto
    _, p13, p2, _, _ = problem("int8_w8a16", {}, hidden=77)  # w13 reads 77 columns: not a multiple of 16
    assert isinstance(expert_linear(p13, 0, torch.bfloat16, PACKS, cache), DequantLinear)
    assert not isinstance(expert_linear(p2, 0, torch.bfloat16, PACKS, cache), DequantLinear)


@pytest.mark.skipif(not int4pack_supported(torch.float32), reason="this torch has no CPU int4pack kernel")
def test_int4_repack_cache_reuses_rebuilds_and_respects_its_budget():
    _, q13, _, _, _ = problem("int4_w4a16", {"group_size": 32})
    cache = RepackCache(budget_bytes=1 << 30)
    first = cache.get(q13, 1, torch.float32, "int4pack")
    assert cache.get(q13, 1, torch.float32, "int4pack") is first  # bytes: codes [R, C/2] + (scale, zero) [G, R, 2]
    assert cache.used_bytes() == first.packed.numel() + 4 * first.scale_zeros.numel() == 64 * 48 + 4 * 3 * 64 * 2
    q13.q[1, 0, 0] ^= 0x11  # an in-place change: the version counter moves, the entry is rebuilt
    assert cache.get(q13, 1, torch.float32, "int4pack") is not first
    assert RepackCache(budget_bytes=0).get(q13, 1, torch.float32, "int4pack") is None
    with torch.inference_mode():
        _, i13, _, _, _ = problem("int4_w4a16", {"group_size": 32})
    assert cache.get(i13, 0, torch.float32, "int4pack") is None  # no version counter to watch
    cache.clear()
    assert cache.used_bytes() == 0
    cpu_packed.clear_packed_weights()
    assert cpu_packed.repack_cache().used_bytes() == 0


def test_quant_kernels_reject_a_kernel_of_another_scheme():
    with pytest.raises(ValueError, match="mxfp4 kernel"):
        QuantKernels(mxfp4="int4pack")


def test_mxfp4_as_int8_holds_the_same_values_or_declines():
    w = quantize(torch.randn(2, 48, 96, generator=torch.Generator().manual_seed(8)), "mxfp4")
    as_int8 = mxfp4_as_int8(w, 1, torch.bfloat16)
    assert isinstance(as_int8, Int8PackLinear) and as_int8.q.dtype == torch.int8 and as_int8.q.abs().max() <= 96
    assert torch.equal(as_int8.q.double() * as_int8.scale.double()[:, None], w.dequantize(torch.float64)[1])
    spread = w.scale.clone()
    spread[1, 0, 0] = spread[1, 0, 1] + MX_INT8_SPAN + 1  # one row's blocks 4 binades apart: no exact int8 form
    wide = type(w)(q=w.q, scale=spread, cols=w.cols, dtype=w.dtype)
    assert mxfp4_as_int8(wide, 1, torch.bfloat16) is None and mxfp4_as_int8(wide, 0, torch.bfloat16) is not None
    if int8pack_supported(torch.bfloat16):
        assert isinstance(expert_linear(wide, 1, torch.bfloat16, QuantKernels(), RepackCache(1 << 30)), DequantLinear)
        assert isinstance(expert_linear(w, 1, torch.bfloat16, QuantKernels(), RepackCache(1 << 30)), Int8PackLinear)


@pytest.mark.parametrize("scheme, options", SCHEMES)
def test_bf16_loop_without_a_onednn_linear_multiplies_on_blas(scheme, options, monkeypatch):
    """A CPU whose oneDNN has no bf16 linear (AVX2 only: ``onednn_linear`` None) still runs weight-only experts in
    the per-expert loop, their linears on torch's BLAS with the float32 biases added before the one rounding (the
    dequantizing linear called a None ``linear`` there: TypeError), equal to the float64 loop; no expert dequantized
    whole."""
    from moekit.experts import cpu_phased, grouped_mm

    for module in (cpu_packed, cpu_phased, grouped_mm):
        monkeypatch.setattr(module, "onednn_linear", lambda dtype: None)
    x, q13, q2, ids, weights = problem(scheme, options, hidden=2048, tokens=5, dtype=torch.bfloat16, seed=4)
    g = torch.Generator().manual_seed(5)
    b13, b2 = torch.randn(E, 2 * N, generator=g), torch.randn(E, 2048, generator=g)
    want = loop64(x, q13, q2, ids, weights, b13=b13, b2=b2)
    monkeypatch.setattr(type(q13), "dequantize", lambda *a, **k: pytest.fail("dequantized every expert"))
    with torch.no_grad():
        got = experts_grouped_mm(x, q13, q2, ids, weights, b13=b13, b2=b2)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < TOL[torch.bfloat16]

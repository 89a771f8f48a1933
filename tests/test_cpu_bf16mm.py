"""moekit.experts.cpu_bf16mm: bf16 activations on an expert's int8 form converted to bf16, through oneDNN's bf16 GEMM.
mxfp4 (a power-of-two scale a row) is the float64 product rounded once (within the GEMM's float32 sums); int8
(any scale) within two roundings; int4 (a weight rounded to bf16) as close to float64 as torch's int4pack. The
kernel in the CPU loop against the float64 loop; where "bf16mm" resolves."""

import pytest
import torch

from moekit.experts.cpu_bf16mm import Bf16CodesLinear, Bf16GroupsLinear
from moekit.experts.cpu_packed import onednn_linear
from moekit.experts.cpu_int8mm import Int8MMLinear
from moekit.experts.cpu_quant import (
    MXFP4_BF16MM_MIN_ROWS, DequantLinear, QuantKernels, RepackCache, expert_linear,
    int4pack_supported,
)
from moekit.quant import quantize
from test_cpu_quant import bf16_loop_runs, rel_err

LINEAR = onednn_linear(torch.bfloat16)
pytestmark = pytest.mark.skipif(LINEAR is None, reason="this torch has no oneDNN bf16 linear")
U = 2.0**-24
BF16MM = QuantKernels("bf16mm", "bf16mm", "bf16mm")


def one_expert(scheme, rows=48, cols=256, seed=0, **options):
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(2, rows, cols, generator=g) * cols**-0.5, scheme, **options)
    a = torch.randn(9, cols, generator=g).to(torch.bfloat16)
    a[0, 0] *= 300  # an outlier
    bias = torch.randn(rows, generator=g).to(torch.bfloat16)
    return w, a, bias


def within_one_rounding(got, exact, abs_sum, cols):
    """|got - exact| <= half a bf16 unit of the larger + the float32 sums' error bound ((C + 1) U times the sum of
    the terms' magnitudes ``abs_sum``)."""
    ulp = 2.0 ** (torch.frexp(torch.maximum(exact.abs(), got.double().abs()))[1] - 8).double()
    return bool(torch.all((got.double() - exact).abs() <= ulp / 2 + (cols + 1) * U * abs_sum))


def test_mxfp4_is_the_float64_product_rounded_once():
    w, a, bias = one_expert("mxfp4")
    linear = expert_linear(w, 1, torch.bfloat16, BF16MM, RepackCache(1 << 30), rows=9)
    assert isinstance(linear, Bf16CodesLinear) and linear.pow2
    w64 = w.dequantize(torch.float64)[1]
    for b in (None, bias):
        got = linear(a, b, LINEAR)
        exact = a.double() @ w64.t() + (0 if b is None else b.double())
        abs_sum = a.double().abs() @ w64.abs().t() + (0 if b is None else b.double().abs())  # [m, R]
        assert got.dtype == torch.bfloat16 and got.shape == (9, 48)
        assert within_one_rounding(got, exact, abs_sum, a.shape[1])


def test_int8_is_within_two_roundings_and_int4_as_close_as_int4pack():
    w, a, bias = one_expert("int8_w8a16")
    linear = expert_linear(w, 1, torch.bfloat16, BF16MM, RepackCache(1 << 30))
    assert isinstance(linear, Bf16CodesLinear) and not linear.pow2
    exact = a.double() @ w.dequantize(torch.float64)[1].t() + bias.double()
    assert rel_err(linear(a, bias, LINEAR), exact) < 2 * 2**-8
    w, a, bias = one_expert("int4_w4a16", group_size=32, cols=250)  # an odd last group
    cache = RepackCache(1 << 30)
    linear = expert_linear(w, 1, torch.bfloat16, BF16MM, cache)
    assert isinstance(linear, Bf16GroupsLinear)
    exact = a.double() @ w.dequantize(torch.float64)[1].t() + bias.double()
    got = linear(a, bias, LINEAR)
    assert got.shape == (9, 48) and rel_err(got, exact) < 2**-8
    if int4pack_supported(torch.bfloat16):
        pack = expert_linear(w, 1, torch.bfloat16, QuantKernels(int4_w4a16="int4pack"), cache)
        assert rel_err(got, exact) <= 1.25 * rel_err(pack(a, bias, LINEAR), exact)


@pytest.mark.parametrize("scheme, options", [("int8_w8a16", {}), ("mxfp4", {}), ("int4_w4a16", {"group_size": 32})])
def test_loop_on_bf16mm_matches_the_float64_loop_on_any_worker_count(scheme, options):
    runs = bf16_loop_runs(scheme, options, BF16MM, QuantKernels("int8mm", "int8mm", "int8mm"))  # other: int8mm
    assert torch.equal(runs.got, runs.one)
    limit = 1.05 if scheme == "mxfp4" else 1.6  # mxfp4: one rounding as int8mm's; int8 / int4: a second
    err = rel_err(runs.got, runs.want)
    assert err < 1e-2 and err <= rel_err(runs.other, runs.want) * limit


def test_bf16mm_is_for_bf16_only_and_declines_without_the_int8_form():
    w, _, _ = one_expert("mxfp4")
    assert QuantKernels(mxfp4="bf16mm").resolve("mxfp4", torch.float32) == "dequant"
    assert QuantKernels(mxfp4="bf16mm").resolve("mxfp4", torch.bfloat16) == "bf16mm"
    assert isinstance(expert_linear(w, 0, torch.bfloat16, BF16MM, RepackCache(0)), DequantLinear)  # past the budget


def test_auto_takes_bf16mm_for_mxfp4_experts_of_many_rows_never_for_int8_or_int4():
    auto, cache = QuantKernels(), RepackCache(1 << 30)
    mx, _, _ = one_expert("mxfp4")
    assert isinstance(expert_linear(mx, 0, torch.bfloat16, auto, cache, rows=MXFP4_BF16MM_MIN_ROWS), Bf16CodesLinear)
    assert isinstance(expert_linear(mx, 0, torch.bfloat16, auto, cache, rows=MXFP4_BF16MM_MIN_ROWS - 1), Int8MMLinear)
    i4, _, _ = one_expert("int4_w4a16", group_size=32)
    assert not isinstance(expert_linear(i4, 0, torch.bfloat16, auto, cache, rows=4096), Bf16GroupsLinear)
    i8, _, _ = one_expert("int8_w8a16")
    assert isinstance(expert_linear(i8, 0, torch.bfloat16, auto, cache, rows=4096), Int8MMLinear)
    assert isinstance(expert_linear(mx, 0, torch.float32, auto, cache, rows=4096), Int8MMLinear)  # float32: int8mm

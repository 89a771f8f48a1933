"""moekit.experts.cpu_int8mm: float32 / bf16 activations as int8 digits through ``torch._int_mm`` on int8 / mxfp4
expert codes. The digits rebuild a exactly (or within 2**-30 / 2**-22 of its row's largest element); the linear and the
CPU loop are held against float64 loops written here, and against the dequantized path's own error."""

import pytest
import torch

from moekit.activations import ActivationSpec
from moekit.experts.cpu_int8mm import (
    BF16_LIMBS, LIMBS, MAX_COLS, Int8GroupsLinear, Int8MMLinear, _compiled, _int8mm, _int8mm_groups, int8_limbs,
    int8mm_linear, int8mm_supported,
)
from moekit.experts.cpu_packed import ExpertParams, experts_cpu_fused
from moekit.experts.cpu_quant import (
    BF16_INT8MM_MIN_ROWS, INT4_INT8MM_MAX_ROWS, DequantLinear, Int4PackLinear, Int8PackLinear, QuantKernels,
    RepackCache, expert_linear, int4_as_int8,
)
from moekit.quant import quantize
from test_cpu_quant import E, PACKS, bf16_loop_runs, loop64, problem, rel_err

pytestmark = pytest.mark.skipif(not int8mm_supported(), reason="this torch has no CPU torch._int_mm")
INT8MM = QuantKernels(int8_w8a16="int8mm", int4_w4a16="int8mm", mxfp4="int8mm")
DEQUANT = QuantKernels("dequant", "dequant", "dequant")


def digits_value(a, count=LIMBS):
    """float64 [m, C]: what ``int8_limbs(a)`` (``count`` digits a row) stands for, summed here digit by digit."""
    limbs = int8_limbs(a)
    m = a.shape[0]
    digits = limbs.digits.view(count, m, a.shape[1]).double()
    return sum(digits[i] * 256.0**i for i in range(count)) / limbs.inverse_unit


def test_digits_rebuild_a_row_exactly_or_within_2_to_the_minus_30_of_its_largest():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(6, 300, generator=g) + 0.5  # every element within 2**2 of the row's largest: exact
    a[:, ::2] *= -1
    a[1] *= 1e-30  # tiny and huge rows: the unit follows each row
    a[2] *= 1e30
    a[3, 7] = 1e6  # one outlier: a small element is off by at most half a unit, 2**-30 of the largest
    a[4] = 0
    a[5, 3], a[5, 4] = 1 - 2**-24, -(1 - 2**-24)  # the largest magnitudes below a power of two: the top digit
    got = digits_value(a)
    exact = torch.tensor([0, 1, 2, 4, 5])
    assert torch.equal(got[exact], a[exact].double())
    assert 0 < (got[3] - a[3].double()).abs().max() <= 2.0**-30 * 1e6
    digits = int8_limbs(a).digits
    assert digits.dtype == torch.int8 and digits.shape == (LIMBS * 6, 300)


def test_bf16_digits_rebuild_a_row_exactly_within_2_to_the_14_of_its_largest():
    g = torch.Generator().manual_seed(1)
    a = (torch.rand(5, 200, generator=g) + 1) * 2.0 ** torch.randint(-13, 1, (5, 200), generator=g)  # 2**-13 .. 2
    a[:, 1::3] *= -1
    a[1] *= 2.0**-120  # tiny and huge rows: the unit follows each row
    a[2] *= 2.0**100
    a[3, 5] = 2.0**15  # an outlier: elements below 2**1 are off by at most half a unit, 2**-22 of it
    a[4, 3], a[4, 4] = 2 - 2**-7, -(2 - 2**-7)  # the largest bf16 magnitudes below a power of two: the top digit
    a = a.to(torch.bfloat16)
    got = digits_value(a, BF16_LIMBS)
    exact = torch.tensor([0, 1, 2, 4])
    assert torch.equal(got[exact], a[exact].double())
    assert 0 < (got[3] - a[3].double()).abs().max() <= 2.0**-22 * 2.0**16
    assert int8_limbs(a).digits.shape == (BF16_LIMBS * 5, 200)


def test_non_finite_rows_have_no_digits():
    a = torch.ones(3, 4)
    a[1, 2] = float("nan")
    assert int8_limbs(a) is None
    a[1, 2] = float("-inf")
    assert int8_limbs(a) is None


@pytest.mark.parametrize("m, cols, rows", [(1, 2048, 48), (7, 77, 5), (33, 96, 40), (2, 1, 3)])
def test_linear_is_closer_to_float64_than_the_dequantized_float32_path(m, cols, rows):
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
    scale = torch.rand(rows, generator=g) * 1e-2
    bias = torch.randn(rows, generator=g)
    a = torch.randn(m, cols, generator=g)
    a[0, 0] *= 1000  # an outlier
    want = a.double() @ (q.double() * scale.double()[:, None]).t() + bias.double()
    got = int8mm_linear(a, q, scale, bias)
    dequant = a @ (q.float() * scale[:, None]).t() + bias
    assert got.dtype == torch.float32 and got.shape == (m, rows)
    assert rel_err(got, want) < 1e-7 and rel_err(got, want) <= rel_err(dequant, want) * 1.5 + 1e-9


def test_linear_propagates_inf_and_nan_as_float32_does_and_takes_empty_shapes():
    q = torch.tensor([[1, -2], [3, 4]], dtype=torch.int8)
    scale = torch.tensor([0.5, 0.25])
    a = torch.tensor([[1.0, 2.0], [float("inf"), 1.0]])
    want = a @ (q.float() * scale[:, None]).t()
    torch.testing.assert_close(int8mm_linear(a, q, scale), want, equal_nan=True)
    assert int8mm_linear(torch.empty(0, 2), q, scale).shape == (0, 2)
    assert torch.equal(int8mm_linear(torch.ones(3, 0), torch.empty(2, 0, dtype=torch.int8), scale), torch.zeros(3, 2))


@pytest.mark.parametrize("scheme, options", [("int8_w8a16", {}), ("mxfp4", {}), ("int4_w4a16", {"group_size": 32})])
@pytest.mark.parametrize("hidden", [96, 77])
def test_loop_matches_the_float64_loop_with_biases_and_expert_map(scheme, options, hidden):
    x, q13, q2, _, weights = problem(scheme, options, hidden, seed=11)
    g = torch.Generator().manual_seed(12)
    b13, b2 = torch.randn(E, 64, generator=g), torch.randn(E, hidden, generator=g)
    expert_map = torch.tensor([2, -1, 0, 3, 1, -1, 5, 4])
    ids = torch.randint(0, 8, weights.shape, generator=g).int()
    want = loop64(x, q13, q2, ids, weights, b13=b13, b2=b2, expert_map=expert_map)
    ex = ExpertParams(q13, q2, b13, b2, ActivationSpec("silu"))
    with torch.no_grad():
        got = experts_cpu_fused(x, ex, ids, weights, expert_map, None, workers=2, quant=INT8MM)
        dequant = experts_cpu_fused(x, ex, ids, weights, expert_map, None, workers=2, quant=DEQUANT)
        one = experts_cpu_fused(x, ex, ids, weights, expert_map, None, workers=1, quant=INT8MM)
    assert torch.equal(got, one)  # each expert on one thread, combined in expert order
    assert rel_err(got, want) < 1e-6 and rel_err(got, want) <= rel_err(dequant, want) * 1.5


def test_expert_linear_takes_int8mm_for_float32_and_bf16_only_and_where_the_codes_fit():
    _, q13, _, _, _ = problem("int8_w8a16", {}, 96)
    cache = RepackCache(1 << 30)
    linear = expert_linear(q13, 2, torch.float32, INT8MM, cache)
    assert isinstance(linear, Int8MMLinear) and linear.q.data_ptr() == q13.q[2].data_ptr()  # the codes as stored
    assert isinstance(expert_linear(q13, 2, torch.float16, INT8MM, cache), DequantLinear)
    _, m13, _, _, _ = problem("mxfp4", {}, 96)
    as_int8 = expert_linear(m13, 1, torch.float32, INT8MM, cache)
    assert isinstance(as_int8, Int8MMLinear) and cache.used_bytes() > 0  # mxfp4's int8 form, cached
    assert expert_linear(m13, 1, torch.float32, INT8MM, cache) is not as_int8
    assert expert_linear(m13, 1, torch.float32, INT8MM, cache).q is as_int8.q
    _, i13, _, _, _ = problem("int4_w4a16", {"group_size": 32}, 96)
    assert isinstance(expert_linear(i13, 0, torch.float32, INT8MM, cache), Int8GroupsLinear)  # its int8 form, cached
    assert expert_linear(i13, 0, torch.float32, INT8MM, cache) is expert_linear(i13, 0, torch.float32, INT8MM, cache)
    auto, few = QuantKernels(), INT4_INT8MM_MAX_ROWS  # float32 int4: int8mm below that many rows, then dequant
    assert isinstance(expert_linear(i13, 0, torch.float32, auto, cache, rows=few - 1), Int8GroupsLinear)
    assert isinstance(expert_linear(i13, 0, torch.float32, auto, cache, rows=few), DequantLinear)
    wide = quantize(torch.randn(1, 4, MAX_COLS + 1), "int8_w8a16")  # int32 partial sums could overflow
    assert isinstance(expert_linear(wide, 0, torch.float32, INT8MM, cache), DequantLinear)


def test_the_scripted_body_and_the_python_one_give_the_same_bits():
    """Where this torch cannot script it, the plain function runs: the two must agree bit for bit."""
    g = torch.Generator().manual_seed(13)
    q = torch.randint(-127, 128, (24, 80), dtype=torch.int8, generator=g)
    scale, bias = torch.rand(24, generator=g), torch.randn(24, generator=g)
    a = torch.randn(5, 80, generator=g)
    assert torch.equal(_compiled()[0](a, q, scale, bias), _int8mm(a, q, scale, bias))
    assert torch.equal(int8mm_linear(a, q, scale), _int8mm(a, q, scale, None))


@pytest.mark.parametrize("cols, group_size, m", [(96, 32, 3), (77, 32, 1), (2048, 128, 5), (130, 64, 33), (1, 32, 2)])
def test_int4_groups_are_closer_to_float64_than_dequant(cols, group_size, m):
    g = torch.Generator().manual_seed(cols)
    w = quantize(torch.randn(2, 40, cols, generator=g), "int4_w4a16", group_size=group_size)
    linear = int4_as_int8(w, 1, torch.float32)
    assert isinstance(linear, Int8GroupsLinear) and linear.codes.dtype == torch.int8
    assert linear.codes.abs().max() <= 15 and linear.codes.shape == (40, -(-cols // group_size) * group_size)
    a = torch.randn(m, cols, generator=g)
    a[0, 0] *= 300
    bias = torch.randn(40, generator=g)
    want = a.double() @ w.dequantize(torch.float64)[1].t() + bias.double()
    got = linear(a, bias, None)
    dequant = a @ w.dequantize(torch.float32)[1].t() + bias
    assert got.shape == (m, 40) and rel_err(got, want) < 1e-7 and rel_err(got, want) <= rel_err(dequant, want) * 1.5
    python = _int8mm_groups(a, linear.codes, linear.scale, bias, group_size)
    assert torch.equal(got, python)  # scripted and plain: the same bits


@pytest.mark.parametrize("m, cols, rows", [(1, 2048, 48), (9, 77, 32), (33, 96, 40), (2, 1, 3)])
def test_bf16_linear_is_the_float64_product_rounded_once_to_float32_then_bf16(m, cols, rows):
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
    scale, bias = torch.rand(rows, generator=g) * 1e-2, torch.randn(rows, generator=g).to(torch.bfloat16)
    # bf16 elements within 2**14 of their row's largest: every digit exact, so the sums are
    a = ((torch.rand(m, cols, generator=g) + 1) * 2.0 ** torch.randint(-12, 2, (m, cols), generator=g))
    a = (a * torch.randint(0, 2, (m, cols), generator=g).mul(2).sub(1)).to(torch.bfloat16)
    exact = a.double() @ (q.double() * scale.double()[:, None]).t()
    want = (exact.float() + bias.float()).to(torch.bfloat16)
    got = int8mm_linear(a, q, scale, bias)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(_compiled()[0](a, q, scale, bias, BF16_LIMBS), _int8mm(a, q, scale, bias, BF16_LIMBS))


@pytest.mark.parametrize("scheme, options", [("int8_w8a16", {}), ("mxfp4", {}), ("int4_w4a16", {"group_size": 32})])
def test_bf16_loop_on_int8mm_is_closer_to_float64_than_torch_kernels(scheme, options):
    runs = bf16_loop_runs(scheme, options, INT8MM, PACKS)  # other: torch's int8 / int4 packed kernels
    assert torch.equal(runs.got, runs.one)
    err = rel_err(runs.got, runs.want)
    assert err < 1e-2 and err <= rel_err(runs.other, runs.want) * 1.1


def test_bf16_auto_takes_int8mm_for_experts_of_many_rows():
    cache, auto, many = RepackCache(1 << 30), QuantKernels(), BF16_INT8MM_MIN_ROWS
    _, q13, _, _, _ = problem("int8_w8a16", {}, 96)
    assert isinstance(expert_linear(q13, 2, torch.bfloat16, auto, cache, rows=many), Int8MMLinear)
    assert isinstance(expert_linear(q13, 2, torch.bfloat16, auto, cache, rows=many - 1), Int8PackLinear)
    _, m13, _, _, _ = problem("mxfp4", {}, 96)
    assert isinstance(expert_linear(m13, 1, torch.bfloat16, auto, cache, rows=many), Int8MMLinear)
    assert isinstance(expert_linear(m13, 1, torch.bfloat16, auto, cache, rows=1), Int8PackLinear)
    assert expert_linear(m13, 1, torch.bfloat16, auto, cache, rows=many).q is expert_linear(
        m13, 1, torch.bfloat16, auto, cache, rows=1).q  # one cached int8 form for both kernels
    _, i13, _, _, _ = problem("int4_w4a16", {"group_size": 32}, 96)  # int4: torch's kernel at any rows
    assert isinstance(expert_linear(i13, 0, torch.bfloat16, auto, cache, rows=4 * many), Int4PackLinear)
    assert isinstance(expert_linear(i13, 0, torch.float16, auto, cache, rows=many), DequantLinear)

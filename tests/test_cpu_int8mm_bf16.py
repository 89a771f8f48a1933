"""moekit.experts.cpu_int8mm_bf16: bf16 activations as three int8 digits made in float32, the integer GEMM's exact
partial sums combined in float32. The digits against a float64 rebuild; the combine within its proven bound of
the exact integer sum; the linear against the float64 product (and the float64 path's bits, but for rare roundings);
rows too small for a float32 unit on the float64 path."""

import pytest
import torch

from moekit.experts.cpu_int8mm import _compiled, _int8mm, _int8mm_bf16, _row_amax, int8mm_linear, int8mm_supported
from moekit.experts.cpu_int8mm_bf16 import COMBINE_ULPS, MIN_AMAX, bf16_digits, combine_f32, int8mm_bf16

pytestmark = pytest.mark.skipif(not int8mm_supported(), reason="this torch has no CPU torch._int_mm")
U = 2.0**-24  # float32's unit roundoff


def bf16_rows(m, cols, g, spread=12):
    """[m, C] bf16, signed, magnitudes over 2**spread binades (all within 2**14 of the row's largest: exact)."""
    a = (torch.rand(m, cols, generator=g) + 1) * 2.0 ** torch.randint(-spread, 2, (m, cols), generator=g)
    return (a * torch.randint(0, 2, (m, cols), generator=g).mul(2).sub(1)).to(torch.bfloat16)


@pytest.mark.parametrize("spread", [12, 30])
def test_digits_rebuild_each_element_exactly_or_within_half_a_unit(spread):
    g = torch.Generator().manual_seed(spread)
    a = bf16_rows(5, 300, g, spread)
    a[1] = 0  # an all-zero row: zero digits
    a[2, 7], a[2, 8] = 2 - 2**-7, -(2 - 2**-7)  # the largest bf16 magnitudes below a power of two: the top digit
    digits, inverse_unit = bf16_digits(a, _row_amax(a, 2))
    assert digits.dtype == torch.int8 and digits.shape == (15, 300)
    d = digits.view(3, 5, 300).double()
    value = (d[0] + 256 * d[1] + 65536 * d[2]) / inverse_unit.double()  # [m, C] float64
    a64, unit = a.double(), 1 / inverse_unit.double()
    assert torch.all((value - a64).abs() <= unit / 2)
    big = a64.abs() * 2.0**14 >= a64.abs().amax(dim=1, keepdim=True)
    assert torch.equal(value[big], a64[big]) and torch.all(value[1] == 0)


def test_the_float32_combine_stays_within_its_bound_of_the_exact_sum():
    """|combine - (P0 + 256 P1 + 65536 P2) scale u| <= COMBINE_ULPS + 1 units of float32 times the terms' sum
    (the extra one: the scale's rounding), at the largest partial sums a 2048-column GEMM can make, of both signs."""
    g = torch.Generator().manual_seed(3)
    m, rows, top = 7, 300, 2048 * 128 * 127
    parts = torch.randint(-top, top + 1, (rows, 3 * m), generator=g, dtype=torch.int64)
    parts[:, 2 * m] = -parts[:, m] // 256  # near-cancelling rows: the sum far below its terms
    parts = parts.int()
    scale = torch.rand(rows, generator=g) + 0.5
    inverse_unit = 2.0 ** torch.randint(-20, 20, (m, 1), generator=g).float()
    got = combine_f32(parts, scale, inverse_unit).double()  # [m, R]
    p = parts.double().t().reshape(3, m, rows)
    exact = (p[0] + 256 * p[1] + 65536 * p[2]) * scale.double() / inverse_unit.double()
    terms = (p[0].abs() + 256 * p[1].abs() + 65536 * p[2].abs()) * scale.double() / inverse_unit.double()
    assert torch.all((got - exact).abs() <= (COMBINE_ULPS + 1) * U * terms)


@pytest.mark.parametrize("m, cols, rows", [(1, 2048, 48), (9, 77, 32), (33, 96, 40), (32, 2048, 96)])
def test_linear_is_the_float64_product_rounded_to_bf16_but_for_rare_ties(m, cols, rows):
    g = torch.Generator().manual_seed(cols + m)
    q = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=g)
    scale, bias = torch.rand(rows, generator=g) * 1e-2, torch.randn(rows, generator=g).to(torch.bfloat16)
    a = bf16_rows(m, cols, g)
    exact = a.double() @ (q.double() * scale.double()[:, None]).t() + bias.double()
    want = exact.float().to(torch.bfloat16)
    got = int8mm_linear(a, q, scale, bias)
    assert got.dtype == torch.bfloat16 and got.is_contiguous() and got.shape == (m, rows)
    digits, inverse_unit = bf16_digits(a, _row_amax(a, 2))  # exact here: the combine's terms bound its error
    d = digits.view(3, m, cols).double().abs()
    terms = (d[0] + 256 * d[1] + 65536 * d[2]) @ (q.double().abs() * scale.double()[:, None]).t() / inverse_unit
    ulp = 2.0 ** (torch.frexp(torch.maximum(exact.abs(), got.double().abs()))[1] - 8).double()  # bf16's
    assert torch.all((got.double() - exact).abs() <= ulp / 2 + (COMBINE_ULPS + 3) * U * (terms + bias.abs()))
    assert int((got != want).sum()) <= max(1, got.numel() // 1000)
    float64_path = _int8mm(a, q, scale, bias, 3)
    assert int((got != float64_path).sum()) <= max(1, got.numel() // 1000)


def test_rows_below_a_float32_unit_take_the_float64_path_and_scripted_equals_python():
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (24, 80), dtype=torch.int8, generator=g)
    scale, bias = torch.rand(24, generator=g), torch.randn(24, generator=g)
    a = bf16_rows(4, 80, g)
    tiny = a.clone()
    tiny[2] *= MIN_AMAX / 8  # largest |a| below MIN_AMAX: no float32 unit
    assert torch.equal(int8mm_linear(tiny, q, scale, bias), _int8mm(tiny, q, scale, bias, 3))
    assert torch.equal(_compiled()[2](a, q, scale, bias), _int8mm_bf16(a, q, scale, bias))
    assert torch.equal(int8mm_linear(a, q, scale, bias), int8mm_bf16(a, q, scale, bias, _row_amax(a, 2)))

"""bf16 activations times int8 weights on torch's integer GEMM with float32 bookkeeping (session 33): the three
digits of ``moekit.experts.cpu_int8mm`` made from float32 bytes, the three exact int32 partial sums combined in
float32 instead of float64.

    a [m, C] bf16 -> per row u = 2**(e - 22) (its largest |a| in [2**(e-1), 2**e)), v = a / u in float32 (exact:
      a power-of-two scaling), n = round(v) int32, |n| < 2**22
      -> n + 128 (1 + 256 + 65536): its low three bytes b[i]; b[i] xor 128 cast to int8 (its low byte) is
         b[i] - 128 = d[i], n = sum_i d[i] 256**i                                             [3, m, C] int8
      -> P[i] = d[i] @ q^T, int32, exact (|P| <= C * 128 * 127 < 2**31)                      [R, 3 m]
      -> a @ (q * scale)^T ~= (P[0] + 256 P[1] + 65536 P[2]) * scale * u in float32, then bf16  [m, R]

The digits carry the same rounding as the float64 path's (an element within 2**14 of its row's largest keeps all
its bits, a smaller one is off by at most half a unit; ties here go to even): the products are exact up to the
combine. The float32 combine rounds each P[i] and each of the two sums once (``COMBINE_ULPS``): its error is at
most 3 * 2**-24 * sum_i 256**i |P[i]| (plus the scale's one rounding), ``tests/test_cpu_int8mm_bf16.py`` holds it;
against the output's bf16 rounding (2**-9) that is ~2**-15 as large where the dot product does not cancel far
below its terms, so the bf16 result almost always has the float64 path's bits (a test counts the differences).

Rows the float32 unit cannot serve (largest |a| below ``MIN_AMAX``, not zero: u would leave float32's range)
take the float64 path (``cpu_int8mm._int8mm``).

Why: one expert [1536, 2048] of Qwen3-30B-A3B at 32 bf16 rows, 1 thread of the 2-core Xeon (session 33): the
float64 path's 1.01 ms spent 0.19 on the digits and 0.26 on the float64 combine (a [m, 3m] x [3m, R] GEMM).

Shapes: m rows of one expert, R output features, C input features.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

BITS = 22  # fixed-point bits of a row, as cpu_int8mm's BF16_LIMBS = 3 digits
BYTE_OFFSET = 128 * (1 + 256 + 65536)  # n + this lies in [0, 2**24): its three bytes less 128 are the digits
BYTE_FLIP = 0x808080  # xor of the three bytes' top bits: b - 128 read as int8
MIN_AMAX = 2.0**-100  # u = 2**(e - 22) stays a float32 normal for rows of at least this largest |a|
COMBINE_ULPS = 3  # float32 roundings of the combine that scale with sum_i 256**i |P[i]| (docstring)


# TorchScript reads no module globals: the scripted functions take the constants as argument defaults
def bf16_digits(a: torch.Tensor, amax: torch.Tensor, bits: int = BITS, offset: int = BYTE_OFFSET, flip: int = BYTE_FLIP,
                min_amax: float = MIN_AMAX) -> Tuple[torch.Tensor, torch.Tensor]:
    """a [m, C] bf16 and its rows' largest |a| [m, 1] (finite, each 0 or >= ``MIN_AMAX``) -> digits [3 m, C] int8
    (limb-major, as ``cpu_int8mm.Int8Limbs``), 1 / u [m, 1] float32."""
    m, cols = a.shape[0], a.shape[1]
    _, exponent = torch.frexp(amax.to(torch.float32).clamp_min(min_amax))  # amax in [2**(e-1), 2**e)
    inverse_unit = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), bits - exponent)  # [m, 1]
    n = torch.mul(a, inverse_unit).round_().to(torch.int32).add_(offset).bitwise_xor_(flip)  # [m, C]
    shifts = torch.arange(0, 24, 8, dtype=torch.int32).view(3, 1, 1)
    digits = (n.unsqueeze(0) >> shifts).to(torch.int8)  # [3, m, C]: the low byte, b[i] - 128 (wraps)
    return digits.view(3 * m, cols), inverse_unit


def combine_f32(parts: torch.Tensor, scale: torch.Tensor, inverse_unit: torch.Tensor) -> torch.Tensor:
    """parts [R, 3 m] int32 (digit i of row j at column i m + j), scale [R] float32, 1 / u [m, 1] -> [m, R] float32:
    (P[0] + 256 P[1] + 65536 P[2]) * scale * u, each step in float32 (module docstring)."""
    m = inverse_unit.shape[0]
    p = parts.t().to(torch.float32)  # [3 m, R]
    sums = p[2 * m:].mul(65536.0).add_(p[m:2 * m], alpha=256.0).add_(p[:m])  # [m, R]
    return sums.mul_(scale).div_(inverse_unit)


def int8mm_bf16(a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                amax: torch.Tensor) -> torch.Tensor:
    """a [m, C] bf16 @ (q [R, C] int8 * scale [R])^T (+ bias [R]) -> [m, R] bf16 for rows whose largest |a| ``amax``
    [m, 1] is finite and 0 or >= ``MIN_AMAX`` (the caller checks). Written for TorchScript."""
    digits, inverse_unit = bf16_digits(a, amax)
    parts = torch._int_mm(q, digits.t())  # [R, 3 m] int32, exact; q as the GEMM's A, read in place
    out = combine_f32(parts, scale, inverse_unit)
    if bias is not None:
        out = out.add_(bias)
    return out.to(torch.bfloat16, memory_format=torch.contiguous_format)  # [m, R] rows: the transposed float32 read

"""float32 activations times int8 weights on torch's integer GEMM (``torch._int_mm``: oneDNN, AMX / VNNI where the CPU
has them), reading the int8 codes as they are stored: one pass over the weight bytes, no dequantized copy.

    a [m, C] float32 -> per row a power of two u (its largest |a| below 2**30 u), n = floor(a / u + 1/2) int64
      -> n's LIMBS bytes as signed digits d[i] (n = sum_i d[i] 256**i exactly, d in [-128, 127])    [LIMBS, m, C]
      -> P[i] = d[i] @ q^T, int32 and exact (|P| <= C * 128 * 127 < 2**31)                        [LIMBS, m, R]
      -> a @ (q * scale)^T ~= (sum_i P[i] 256**i) * u * scale, summed in float64, rounded once     [m, R]

Accuracy: the only rounding before the last is a's to 31-bit fixed point per row (30 bits and a sign): an element
of a row whose largest element is at most 2**6 times its own keeps all its float32 bits; a smaller one is off by at
most half a unit, 2**-30 of its row's largest. The dequantized path instead rounds each weight q * scale to
float32 and accumulates in float32 (``moekit.experts.cpu_quant``'s "dequant"); the test holds both against a float64
loop.

Why it pays: an expert [1536, 2048] at 1 row on 1 core of the 2-core Xeon, ``torch._int_mm`` 0.20 ms, the float32
GEMV on the plain float32 weight 0.44 ms, the dequantized int8 one 1.96 ms; 4 to 16 rows cost the integer GEMM no
more (0.20 ms), 128 rows (32 rows of a) 0.50 ms against float32's 1.93 ms at 32 rows.

Shapes: m rows of one expert, R output features, C input features.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch

LIMBS = 4  # bytes of a's fixed point
# |n| < 2**30: n + _BYTE_OFFSET (2**31 + 2**23 + 2**15 + 2**7) stays in [0, 2**32), whose 4 bytes are the digits
FIXED_BITS = 8 * LIMBS - 2
# |P| <= C * 128 * 127 must stay below 2**31
MAX_COLS = (2**31 - 1) // (128 * 127)
MIN_COLS = 2  # torch 2.13's CPU _int_mm returns wrong sums at C = 1 (R > 1; C = 2..19 and 768, 2048 checked exact)
_BYTE_OFFSET = sum(128 << (8 * i) for i in range(LIMBS))  # + 128 per byte: each byte XOR 0x80 is its signed digit
_ZERO_ROW = 2.0**-149  # an all-zero row's stand-in largest |a| (float32's least): any unit serves it


@dataclass(frozen=True)
class Int8Limbs:
    """a [m, C] as ``LIMBS`` signed int8 digits a row: a ~= sum_i digits[i] * 256**i / inverse_unit."""

    digits: torch.Tensor  # [LIMBS * m, C] int8, limb-major: rows i*m .. i*m+m-1 hold digit i of every row
    inverse_unit: torch.Tensor  # [m, 1] float64, 2**(30 - e) for a row whose largest |a| is in [2**(e-1), 2**e)


@functools.cache
def int8mm_supported() -> bool:
    """Whether this torch runs ``torch._int_mm`` on the CPU, exactly, on a transposed weight view (probed once);
    the digits come from a little-endian byte view."""
    op = getattr(torch, "_int_mm", None)
    if op is None or sys.byteorder != "little":
        return False
    try:
        a = torch.tensor([[127, -128, 3]], dtype=torch.int8).repeat(4, 1)
        q = torch.tensor([[-127, -127, 5], [1, 2, 3]], dtype=torch.int8)  # [R = 2, C = 3]
        return bool(torch.equal(op(a, q.t()), (a.int() @ q.int().t()).int()))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def int8_limbs(a: torch.Tensor) -> Int8Limbs | None:
    """a [m, C] float32 (C >= 1) -> its digits (module docstring); None where a row holds an inf or a NaN. About 25
    torch ops a call, each a few us: at decode (1 row an expert) their count is what the call costs beyond the GEMM."""
    amax = torch.linalg.vector_norm(a, ord=math.inf, dim=1, keepdim=True).to(torch.float64)  # [m, 1] max |a|
    if not math.isfinite(float(amax.sum())):
        return None
    mantissa = torch.frexp(amax.clamp_min_(_ZERO_ROW)).mantissa  # amax = mantissa * 2**e
    inverse_unit = mantissa.div_(amax).mul_(2.0**FIXED_BITS)  # 2**(30 - e), exact
    # floor(a / unit + 1/2) + offset: float64 holds a / unit (|.| < 2**30) exactly, the sum to within 2**-20
    n = torch.mul(a, inverse_unit).add_(_BYTE_OFFSET + 0.5).to(torch.int64)  # [m, C] in [0, 2**32): to() floors
    m, cols = a.shape
    digits = torch.as_strided(n.view(torch.int8), (LIMBS, m, cols), (1, 8 * cols, 8))  # n's low bytes, little-endian
    digits = digits.contiguous().bitwise_xor_(-128)  # byte b -> b - 128 as int8
    return Int8Limbs(digits.view(LIMBS * m, cols), inverse_unit)


_PLACES = torch.tensor([[256.0**i for i in range(LIMBS)]], dtype=torch.float64)  # [1, LIMBS] each digit's place


def int8mm_linear(a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, C] float32 @ (q [R, C] int8 * scale [R] float32)^T (+ bias [R]) -> [m, R] float32 by ``torch._int_mm``
    on a's digits (module docstring). Where a row holds an inf or a NaN (no fixed point), m is 0 or C below
    ``MIN_COLS``, on the float32 weight instead (the float32 path's infinities and NaNs)."""
    m, rows = a.shape[0], q.shape[0]
    limbs = int8_limbs(a) if m and a.shape[1] >= MIN_COLS else None
    if limbs is None:
        out = a @ (q.to(torch.float32) * scale[:, None]).t()  # [m, R]
        return out if bias is None else out.add_(bias)
    parts = torch._int_mm(limbs.digits, q.t())  # [LIMBS * m, R] int32, exact
    exact = torch.mm(_PLACES, parts.view(LIMBS, m * rows).to(torch.float64)).view(m, rows)  # [m, R], exact
    out = exact.mul_(scale.to(torch.float64) / limbs.inverse_unit).to(torch.float32)  # [m, R]: one rounding
    return out if bias is None else out.add_(bias)


@dataclass(frozen=True)
class Int8MMLinear:
    """One expert's a [m, C] float32 @ (q * scale)^T (+ bias) by ``int8mm_linear``: an int8_w8a16 expert's codes as
    stored, or an mxfp4 expert's exact int8 form (``cpu_quant.mxfp4_as_int8``)."""

    q: torch.Tensor  # [R, C] int8
    scale: torch.Tensor  # [R] float32

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        return int8mm_linear(a, self.q, self.scale, bias)

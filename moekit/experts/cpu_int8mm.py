"""float32 or bf16 activations times int8 weights on torch's integer GEMM (``torch._int_mm``: oneDNN, AMX / VNNI where
the CPU has them), reading the int8 codes as they are stored: one pass over the weight bytes, no dequantized copy.

    a [m, C] float32 / bf16 -> per row a power of two u (its largest |a| below 2**B u; B = 8 L - 2 for L limbs: L = 4
      for float32, 3 for bf16), n = floor(a / u + 1/2) int64
      -> n + the byte offset's L bytes less 128: signed digits d[i], n = sum_i d[i] 256**i exactly   [L, m, C]
      -> P[i] = d[i] @ q^T, int32 and exact (|P| <= C * 128 * 127 < 2**31), as q @ d^T            [R, L * m]
      -> a @ (q * scale)^T ~= (sum_i P[i] 256**i) * u * scale, summed in float64, rounded once to float32 (then
         to bf16 for a bf16 a)                                                                      [m, R]
         (float32's top digit products reach 2**55, past float64's 53 bits: the sum is exact to 2**-52 relative,
         far below the rounding that follows)

Accuracy: the only rounding before the last is a's to B-bit fixed point per row: an element of a row whose largest
element is at most 2**6 (float32, 24-bit mantissas in 30 bits) or 2**14 (bf16, 8-bit mantissas in 22 bits) times
its own keeps all its bits; a smaller one is off by at most half a unit, 2**-B of its row's largest. The dequantized
path instead rounds each weight q * scale to x's dtype and accumulates in float32 (``moekit.experts.cpu_quant``'s
"dequant"; torch's int8pack rounds the scale to bf16); the tests hold them against a float64 loop.

Why it pays: an expert [1536, 2048] at 1 row on 1 core of the 2-core Xeon, ``torch._int_mm`` 0.20 ms, the float32
GEMV on the plain float32 weight 0.44 ms, the dequantized int8 one 1.96 ms; 4 to 16 rows cost the integer GEMM no
more (0.20 ms), 128 rows (32 rows of a) 0.50 ms against float32's 1.93 ms at 32 rows. With q as the GEMM's first
operand (out^T = q @ digits^T) oneDNN reorders only the small digits, not the weight: 0.18 ms (w13) and 0.07 ms
(w2 [2048, 768], against 0.13) at 1 row of a. bf16 at 32 rows of a (96 digit rows): 0.37 ms, where the bf16 GEMM on
the packed bf16 weight takes 0.31 and torch's int8pack (``_weight_int8pack_mm``) 6.2 (session 32).

The ~25 torch ops of a call run as one TorchScript function (``torch.jit.script``; the plain function where this
torch cannot script it): as Python they took the GIL back after every op, and two loop workers calling them ran no
faster than one (w13 + w2 of one expert at 1 row: 0.55 ms on 1 thread, 1.02 ms each on 2; scripted 0.45 / 0.49).

Shapes: m rows of one expert, R output features, C input features, L limbs.
"""

from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

LIMBS = 4  # bytes of a float32 a's fixed point
# a bf16 a's: 3 bytes, B = 22 bits, hold every element within 2**14 of its row's largest exactly (8-bit mantissas)
BF16_LIMBS = 3
# |n| < 2**(8 L - 2): n + the byte offset (sum of 128 * 256**i, i < L) stays in [0, 256**L), whose L bytes are the
# digits; float32: 2**31 + 2**23 + 2**15 + 2**7 (``_digits`` sums it)
# |P| <= C * 128 * 127 must stay below 2**31
MAX_COLS = (2**31 - 1) // (128 * 127)
MIN_COLS = 2  # torch 2.13's CPU _int_mm returns wrong sums at C = 1 (R > 1; C = 2..19 and 768, 2048 checked exact)
_ZERO_ROW = 2.0**-149  # an all-zero row's stand-in largest |a| (float32's least): any unit serves it


@dataclass(frozen=True)
class Int8Limbs:
    """a [m, C] as L signed int8 digits a row (``limbs_of``): a ~= sum_i digits[i] * 256**i / inverse_unit."""

    digits: torch.Tensor  # [L * m, C] int8, limb-major: rows i*m .. i*m+m-1 hold digit i of every row
    inverse_unit: torch.Tensor  # [m, 1] float64, 2**(B - e) for a row whose largest |a| is in [2**(e-1), 2**e)


def limbs_of(dtype: torch.dtype) -> int:
    """The digits a row of x in ``dtype`` (float32 or bf16) takes."""
    return BF16_LIMBS if dtype == torch.bfloat16 else LIMBS


# TorchScript reads no module globals: the scripted functions take the constants as argument defaults
def _digits(a: torch.Tensor, amax: torch.Tensor, limbs: int = LIMBS,
            zero_row: float = _ZERO_ROW) -> Tuple[torch.Tensor, torch.Tensor]:
    """a [m, C] float32 / bf16 and its rows' largest |a| [m, 1] (finite) -> digits [L * m, C] int8, 1 / unit [m, 1]."""
    m, cols = a.shape[0], a.shape[1]
    half_offset, place = 0.5, 1.0  # the byte offset + 1/2 (floor(x + 1/2) rounds), 256**L
    for _ in range(limbs):
        half_offset += 128.0 * place
        place *= 256.0
    amax64 = amax.to(torch.float64).clamp_min_(zero_row)
    mantissa, _ = torch.frexp(amax64)  # amax = mantissa * 2**e
    inverse_unit = mantissa.div_(amax64).mul_(place / 4.0)  # 2**(B - e), exact
    # float64 holds a / unit (|.| < 2**B <= 2**30) exactly and the sum to within 2**-20; to(int) floors it (> 0).
    # Three limbs fit int32 (n < 2**24): its shifts took a bf16 row of 2048 half the time of int64's (session 32)
    wide = torch.int64 if limbs > 3 else torch.int32
    n = torch.mul(a, inverse_unit).add_(half_offset).to(wide)  # [m, C] in [0, 256**L)
    shifts = torch.arange(0, 8 * limbs, 8, dtype=wide).view(limbs, 1, 1)
    digits = (n.unsqueeze(0) >> shifts).bitwise_and_(255).sub_(128).to(torch.int8)  # [L, m, C]
    return digits.view(limbs * m, cols), inverse_unit


def _row_amax(a: torch.Tensor, min_cols: int) -> Optional[torch.Tensor]:
    """a [m, C]'s largest |a| a row [m, 1]; None where the digits cannot serve a: no rows, C below ``min_cols``, or a
    row holding an inf or a NaN (no fixed point)."""
    if a.shape[0] == 0 or a.shape[1] < min_cols:
        return None
    amax = a.abs().amax(dim=1, keepdim=True)  # inf or NaN where the row has one
    return amax if bool(torch.isfinite(amax).all()) else None


def _places(m: int, limbs: int) -> torch.Tensor:
    """[m, L * m] float64: row j holds 256**i at column i*m + j (digit i of row j's place): the combine."""
    places = torch.tensor([256.0**i for i in range(limbs)], dtype=torch.float64).view(1, limbs)
    return torch.kron(places, torch.eye(m, dtype=torch.float64))


def int8_limbs(a: torch.Tensor) -> Int8Limbs | None:
    """a [m, C] float32 / bf16 -> its digits (module docstring); None where a has no rows or columns, or a row holds
    an inf or a NaN."""
    amax = _row_amax(a, 1)
    return None if amax is None else Int8Limbs(*_digits(a, amax, limbs_of(a.dtype)))


def _int8mm(a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
            limbs: int = LIMBS, min_cols: int = MIN_COLS) -> torch.Tensor:
    """``int8mm_linear``'s body, written for TorchScript."""
    amax = _row_amax(a, min_cols)
    if amax is not None:
        digits, inverse_unit = _digits(a, amax, limbs)
        parts = torch._int_mm(q, digits.t())  # [R, L * m] int32, exact; q as the GEMM's A, read in place
        sums = torch.mm(_places(a.shape[0], limbs), parts.t().to(torch.float64))  # [m, R], to 2**-52 relative
        out = sums.mul_(scale.to(torch.float64) / inverse_unit).to(torch.float32)  # one rounding
    else:
        out = torch.mm(a, (q.to(torch.float32) * scale[:, None]).to(a.dtype).t())  # [m, R]
    if bias is not None:
        out = out.add_(bias)
    return out.to(a.dtype)  # bf16: the float32 result (bias added) rounded once more


def _int8mm_groups(a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                   group_size: int, limbs: int = LIMBS, min_cols: int = MIN_COLS) -> torch.Tensor:
    """a [m, C] float32 / bf16 @ w^T (+ bias [R]) -> [m, R] in a's dtype for w[r, c] = codes[r, c] * scale[r, c // g]:
    codes [R, G*g] int8 (an int4 code less its group's zero; columns past C any value), scale [R, G] float32. Per
    group, ``torch._int_mm`` on that group's columns (exact int32), its L digit sums combined in float64 (to 2**-52),
    times the group's scale, summed in float64; one rounding to float32 (then bf16). Written for TorchScript."""
    m, rows, groups = a.shape[0], codes.shape[0], scale.shape[1]
    amax = _row_amax(a, min_cols)
    if amax is not None:
        padded = torch.nn.functional.pad(a, [0, groups * group_size - a.shape[1]])  # [m, G*g], zeros
        digits, inverse_unit = _digits(padded, amax, limbs)
        digits_t = digits.t()  # [G*g, L * m]
        places = _places(m, limbs)
        scale64 = scale.to(torch.float64)
        sums = torch.zeros(m, rows, dtype=torch.float64)
        for group in range(groups):
            start = group * group_size
            parts = torch._int_mm(codes.narrow(1, start, group_size), digits_t.narrow(0, start, group_size))
            sums.addcmul_(torch.mm(places, parts.t().to(torch.float64)), scale64[:, group])  # [m, R]
        out = sums.div_(inverse_unit).to(torch.float32)
    else:
        w = codes.to(torch.float32) * scale.repeat_interleave(group_size, dim=1)  # [R, G*g]
        out = torch.mm(a, w[:, :a.shape[1]].to(a.dtype).t())  # [m, R]
    if bias is not None:
        out = out.add_(bias)
    return out.to(a.dtype)


@functools.cache
def _compiled():
    """(``_int8mm``, ``_int8mm_groups``) scripted once (module docstring), else as they are (a torch without
    TorchScript, or one that cannot script them: any error here only costs the speed)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch 2.13 marks torch.jit.script deprecated
            return torch.jit.script(_int8mm), torch.jit.script(_int8mm_groups)
    except Exception:  # noqa: BLE001
        return _int8mm, _int8mm_groups


@functools.cache
def int8mm_supported() -> bool:
    """Whether this torch runs ``torch._int_mm`` on the CPU, exactly, on a transposed operand (probed once, on the
    calling thread, with the scripted body ready)."""
    if getattr(torch, "_int_mm", None) is None or sys.byteorder != "little":
        return False
    try:
        a = torch.tensor([[127, -128, 3]], dtype=torch.int8).repeat(4, 1)
        q = torch.tensor([[-127, -127, 5], [1, 2, 3]], dtype=torch.int8)  # [R = 2, C = 3]
        exact = bool(torch.equal(torch._int_mm(q, a.t()), (q.int() @ a.int().t()).int()))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return exact and _compiled() is not None


def int8mm_linear(a: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, C] float32 / bf16 @ (q [R, C] int8 * scale [R] float32)^T (+ bias [R]) -> [m, R] in a's dtype by
    ``torch._int_mm`` on a's digits (module docstring). Where a row holds an inf or a NaN (no fixed point), m is 0 or
    C below ``MIN_COLS``, on the weight dequantized to a's dtype instead (its infinities and NaNs)."""
    return _compiled()[0](a, q, scale, bias, limbs_of(a.dtype))


@dataclass(frozen=True)
class Int8MMLinear:
    """One expert's a [m, C] float32 / bf16 @ (q * scale)^T (+ bias) by ``int8mm_linear``: an int8_w8a16 expert's
    codes as stored, or an mxfp4 expert's exact int8 form (``cpu_quant.mxfp4_as_int8``)."""

    q: torch.Tensor  # [R, C] int8
    scale: torch.Tensor  # [R] float32

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        return int8mm_linear(a, self.q, self.scale, bias)


@dataclass(frozen=True)
class Int8GroupsLinear:
    """One int4_w4a16 expert's a [m, C] float32 / bf16 @ w^T (+ bias) by ``_int8mm_groups`` on its int8 form
    (``cpu_quant.int4_as_int8``, made once per expert and cached)."""

    codes: torch.Tensor  # [R, G*g] int8: code - zero
    scale: torch.Tensor  # [R, G] float32
    group_size: int

    def __call__(self, a: torch.Tensor, bias: torch.Tensor | None, linear) -> torch.Tensor:
        return _compiled()[1](a, self.codes, self.scale, bias, self.group_size, limbs_of(a.dtype))

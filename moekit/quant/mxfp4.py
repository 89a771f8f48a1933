"""MXFP4 (OCP Microscaling): e2m1 values with one e8m0 power-of-two scale per 32 along the reduction
dim, two values per byte, low nibble first (gpt-oss's experts as they ship). Activations stay in the
model dtype.

e2m1 code: bit 3 the sign, bits 0-2 index the magnitudes E2M1_VALUES. e8m0 scale byte s: factor
2**(s - 127) (255, NaN, is never written).

Shapes: E experts, R rows, C columns (the reduction dim), G = ceil(C/32) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from moekit.quant.base import (
    QuantizedWeight,
    cdiv,
    check_3d,
    check_float_weight,
    check_tensor,
    decode_nibbles,
    pack_nibbles,
    pad_cols,
    unpack_nibbles,
)

MX_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7
# code -> value: bit 3 the sign (code 8 is -0.0, as e2m1_decode gives)
E2M1_CODE_VALUES = (*E2M1_VALUES, *(-v for v in E2M1_VALUES))
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest e2m1 value: 6 = 1.5 * 2**2
E8M0_BIAS = 127


@dataclass(frozen=True, kw_only=True, eq=False, repr=False)
class Mxfp4Weight(QuantizedWeight):
    """Layout ``mxfp4``: q [E, R, ceil(C/2)] uint8 (two e2m1 codes per byte, element 2i low),
    scale [E, R, G] uint8 (e8m0); w[e, r, c] = e2m1(code) * 2**(scale[e, r, c // 32] - 127)."""

    scheme: ClassVar[str] = "mxfp4"
    tensor_dtypes: ClassVar[dict[str, torch.dtype]] = {"q": torch.uint8, "scale": torch.uint8}
    tensor_fields: ClassVar[tuple[str, ...]] = tuple(tensor_dtypes)

    q: torch.Tensor  # [E, R, ceil(C/2)] uint8
    scale: torch.Tensor  # [E, R, ceil(C/32)] uint8, e8m0
    cols: int  # C, the logical reduction dim

    def _check(self) -> None:
        check_3d(self.scheme, "q", self.q)
        if not isinstance(self.cols, int) or isinstance(self.cols, bool) or self.cols < 0:
            raise ValueError(f"{self.scheme}: cols must be an int >= 0, got {self.cols!r}")
        e, r = self.q.shape[:2]
        check_tensor(self.scheme, "q", self.q, self.tensor_dtypes["q"], (e, r, cdiv(self.cols, 2)))
        check_tensor(self.scheme, "scale", self.scale, self.tensor_dtypes["scale"], (e, r, cdiv(self.cols, MX_BLOCK)))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.q.shape[:2], self.cols))

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        values = e2m1_decode(unpack_nibbles(self.q, self.cols), acc)  # [E, R, C]
        exponent = self.scale.to(torch.int32).repeat_interleave(MX_BLOCK, 2)[:, :, : self.cols] - E8M0_BIAS
        return torch.ldexp(values, exponent.to(acc)).to(dtype)

    def _dequantize_expert(self, expert: int, dtype: torch.dtype, rows: slice) -> torch.Tensor:
        """The same product per element: ``torch.ldexp(v, e)`` is v * 2.0**e, here with 2.0**e taken once
        per block [r, G] (exact for every e8m0 byte but 255) and the codes decoded by one byte gather."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scale = self.scale[expert, rows]  # [r, G]
        r, groups = scale.shape
        w = pad_cols(decode_nibbles(self.q[expert, rows], E2M1_CODE_VALUES, acc), MX_BLOCK).view(r, groups, MX_BLOCK)
        factor = torch.pow(2.0, (scale.to(torch.int32) - E8M0_BIAS).to(acc))  # [r, G]
        return w.mul_(factor[:, :, None]).view(r, groups * MX_BLOCK)[:, :self.cols].to(dtype).contiguous()  # [r, C]


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes (uint8 0..15) -> their e2m1 values in ``dtype`` (E2M1_VALUES), computed from the bits: exponent field
    e = bits 1-2, mantissa m = bit 0; e = 0: m / 2 (0, 0.5), else 2^(e-1) (1 + m / 2). No table tensor: building one
    copies it from the host on every call, which a CUDA graph capture refuses (grouped_mm's dequantizing path)."""
    exponent = ((codes >> 1) & 3).to(dtype)
    half_mantissa = (codes & 1).to(dtype) * 0.5
    magnitude = torch.where(exponent == 0, half_mantissa, torch.exp2(exponent - 1) * (1 + half_mantissa))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def e2m1_encode(a: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest (ties to the even code) e2m1 codes (uint8 0..15) of ``a``, saturating at +-6."""
    table = torch.tensor(E2M1_VALUES, dtype=a.dtype, device=a.device)
    mids = (table[1:] + table[:-1]) / 2  # [7] the decision points between neighbouring codes
    mag = a.abs().clamp(max=E2M1_MAX).contiguous()  # bucketize copies (and warns about) strided input: a view's
    code = torch.bucketize(mag, mids)  # a tie goes to the lower code
    tie_to_upper = (mag == mids[code.clamp(max=6)]) & (code % 2 == 1)  # ties to the even code
    code = code + tie_to_upper.long()
    return (code | torch.where(a < 0, 8, 0)).to(torch.uint8)


def quantize_mxfp4(w: torch.Tensor) -> Mxfp4Weight:
    """Block-wise quantization of w [E, R, C], 32 columns per block, each block's values rounded to the
    nearest e2m1 value. Each block tries the two scales round-to-nearest recipes use: OCP's
    2**(floor(log2 amax) - 2) (may clip the top values to 6) and the next power of two (no clipping),
    and keeps the one with the smaller squared error, so it is never worse than either."""
    check_float_weight("mxfp4", w)
    acc = torch.float64 if w.dtype == torch.float64 else torch.float32
    e, r, c = w.shape
    groups = cdiv(c, MX_BLOCK)
    blocks = pad_cols(w.to(acc), MX_BLOCK).reshape(e, r, groups, MX_BLOCK)
    amax = blocks.abs().amax(dim=3)  # [E, R, G]
    # floor(log2(amax)) exactly (frexp: amax = m * 2**e, m in [0.5, 1)), so every device agrees
    low = (torch.frexp(amax).exponent - 1 - E2M1_EMAX).to(acc)  # OCP's shared exponent
    low = torch.where(amax > 0, low, torch.zeros_like(low)).clamp(-E8M0_BIAS, E8M0_BIAS)
    best_err, best_exp, best_codes = None, None, None
    for exponent in (low, (low + 1).clamp(max=E8M0_BIAS)):
        codes = e2m1_encode(torch.ldexp(blocks, -exponent[..., None]))  # [E, R, G, 32]
        err = (torch.ldexp(e2m1_decode(codes, acc), exponent[..., None]) - blocks).square().sum(dim=3)
        if best_err is None:
            best_err, best_exp, best_codes = err, exponent, codes
        else:
            better = err < best_err
            best_exp = torch.where(better, exponent, best_exp)
            best_codes = torch.where(better[..., None], codes, best_codes)
            best_err = torch.minimum(err, best_err)
    codes = best_codes.reshape(e, r, groups * MX_BLOCK)[:, :, :c]
    scale = (best_exp + E8M0_BIAS).to(torch.uint8)
    return Mxfp4Weight(q=pack_nibbles(codes), scale=scale, cols=c, dtype=w.dtype)
